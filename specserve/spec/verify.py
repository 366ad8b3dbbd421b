"""The one verifier every proposer shares: chain rejection sampling (Leviathan, Kalman and Matias,
"Fast Inference from Transformers via Speculative Decoding", arXiv 2211.17192; Chen et al. 2302.01318).

For one request with drafts ``x_1..x_k`` drawn from draft distributions ``q_1..q_k`` and target distributions
``p_1..p_{k+1}`` (``p_j`` is the target's distribution for position j given the prefix and ``x_1..x_{j-1}``,
after the request's temperature, top-k and top-p, exactly as plain sampling would draw from it):

    for j in 1..k:
        draw u ~ U[0, 1)
        if u < p_j(x_j) / q_j(x_j):  accept x_j                       (accepted token)
        else: emit y ~ norm(max(0, p_j - q_j)) and stop                 (recovered token)
    if all k were accepted: emit y ~ p_{k+1}                             (bonus token)

Each emitted token is then distributed exactly as ``p`` (the theorem of the paper), so speculation never
changes what a request samples from. A deterministic drafter (n-gram lookup, greedy draft heads) is a
one-hot ``q``: the test becomes ``u < p_j(x_j)`` and the residual is ``p_j`` with ``x_j`` removed.
For greedy requests ``p_j`` is one-hot on the target's argmax, so the rule reduces to "accept while the
draft equals the target's argmax, then emit the target's argmax".

Rows of ``target_logits`` are packed per request, ``1 + num_draft_tokens`` each:

    drafts = [[a1, a2], [], [c1]]  ->  rows [pa1 pa2 pa3 | pb1 | pc1 pc2],  logit_starts = [0, 3, 4]
"""

from __future__ import annotations

import random
from itertools import accumulate

import torch

from specserve.layers.sampler import draw_tokens, host_to_device, target_probs
from specserve.sampling import SamplingParams


def verify(
    target_logits: torch.Tensor,  # [num_rows, vocab_size] float32, 1 + len(draft_token_ids[i]) rows per request
    logit_starts: list[int],  # [num_requests] first row of each request
    draft_token_ids: list[list[int]],  # [num_requests][num_draft_tokens_i]
    draft_probs: list[torch.Tensor | None],  # [num_requests] each [num_draft_tokens_i, vocab_size] or None (one-hot)
    params: list[SamplingParams],  # [num_requests]
    streams: list[random.Random | None],  # [num_requests] per-request streams; None -> default_stream
    default_stream: random.Random,
) -> list[list[int]]:  # [num_requests] accepted draft tokens + one recovered or bonus token
    out: list[list[int]] = [[] for _ in params]
    greedy = [i for i, p in enumerate(params) if p.greedy]
    if greedy:
        argmax = target_logits.argmax(dim=-1).tolist()  # [num_rows]
        for i in greedy:
            start, drafts = logit_starts[i], draft_token_ids[i]
            n = 0
            while n < len(drafts) and drafts[n] == argmax[start + n]:
                n += 1
            out[i] = drafts[:n] + [argmax[start + n]]
    random_ = [i for i, p in enumerate(params) if not p.greedy]
    if random_:
        rows = torch.cat([torch.arange(logit_starts[i], logit_starts[i] + len(draft_token_ids[i]) + 1)
                          for i in random_]).to(target_logits.device)
        row_params = [params[i] for i in random_ for _ in range(len(draft_token_ids[i]) + 1)]
        probs = target_probs(target_logits[rows], row_params)  # [num_random_rows, vocab_size]
        emitted = _verify_sampled(probs, [draft_token_ids[i] for i in random_], [draft_probs[i] for i in random_],
                                  [streams[i] or default_stream for i in random_])
        for i, toks in zip(random_, emitted):
            out[i] = toks
    return out


def _verify_sampled(
    probs: torch.Tensor,  # [sum(num_draft_i + 1), vocab_size] target distributions, packed per request
    drafts: list[list[int]],  # [num_requests][num_draft_i]
    draft_probs: list[torch.Tensor | None],  # [num_requests] each [num_draft_i, vocab_size] or None (one-hot)
    streams: list[random.Random],  # [num_requests]
) -> list[list[int]]:  # [num_requests] accepted drafts + one recovered or bonus token
    """The chain test for every sampled request at once, on the device, with one read back to the host (the
    accepted counts and the drawn tokens together). Each request takes ``num_draft + 1`` uniforms of its
    stream, in request order: its accept tests, then its recovered or bonus token (without drafts, plain
    sampling's one draw). The tests compare ``u * q_j(x_j) < p_j(x_j)`` in float64, the very operation the host
    would do on these floats; a request accepts its leading run of passed tests.

    Example: drafts [[a1, a2], [], [c1]] -> probs rows [pa1 pa2 pa3 | pb1 | pc1 pc2] (starts 0, 3, 4); padded
    to 2 tests per request, rows [[0, 1], [3, 3], [4, 4]] with valid [[1, 1], [0, 0], [1, 0]]; with a1
    accepted and a2 rejected, c1 accepted: passed [[1, 0], [0, 0], [1, 0]], accepted counts [1, 0, 1], final
    rows 0 + 1, 3 + 0, 4 + 1 = [pa2 - (a2) | pb1 | pc2], tokens [a1, y] [y] [c1, y]."""
    device, num = probs.device, len(drafts)
    lens = [len(d) for d in drafts]
    width = max(lens)
    starts = _offsets([n + 1 for n in lens])  # each request's first row in probs
    uniforms = [[stream.random() for _ in range(n + 1)] for stream, n in zip(streams, lens)]
    final_rows = host_to_device(starts, torch.int64, device)  # [num] the bonus row if nothing is rejected
    accepted = torch.zeros(num, dtype=torch.int64, device=device)  # [num]
    if width:
        # per request and test j < width: the row of draft j, its token, and whether it exists
        ints = host_to_device([starts[i] + min(j, max(n - 1, 0)) for i, n in enumerate(lens) for j in range(width)]
                              + [d[j] if j < len(d) else 0 for d in drafts for j in range(width)]
                              + [j < n for n in lens for j in range(width)], torch.int64, device)
        rows, ids, valid = ints.view(3, num, width)  # each [num, width]
        u = host_to_device([us[j] if j < n else 0.0 for us, n in zip(uniforms, lens) for j in range(width)],
                           torch.float64, device).view(num, width)
        p = probs[rows.flatten(), ids.flatten()].view(num, width)  # [num, width] p_j(x_j)
        q = torch.ones_like(p)  # [num, width] q_j(x_j): 1 for a one-hot (deterministic) draft
        sampled_q = [i for i, dp in enumerate(draft_probs) if dp is not None and lens[i]]
        if sampled_q:
            q_all = torch.cat([draft_probs[i] for i in sampled_q]).to(p.dtype)  # [sum(num_draft_i), vocab_size]
            q_offsets = _offsets([lens[i] for i in sampled_q])
            at = host_to_device(sampled_q, torch.int64, device)
            q_rows = host_to_device([o + j for i, o in zip(sampled_q, q_offsets) for j in range(width)],
                                    torch.int64, device).view(len(sampled_q), width).clamp_max(q_all.shape[0] - 1)
            q[at] = q_all[q_rows, ids[at]]
        passed = (u * q.double() < p.double()) & valid.bool()  # [num, width]
        accepted = passed.long().cumprod(dim=1).sum(dim=1)  # [num] leading passed tests
        final_rows = final_rows + accepted
    final = probs.index_select(0, final_rows)  # [num_requests, vocab_size] p_{n+1}
    target_rows = final.clone()
    lens_t = host_to_device(lens, torch.int64, device)
    rejected = accepted < lens_t  # [num]
    if width:
        one_hot = host_to_device([dp is None for dp in draft_probs], torch.bool, device)
        drafted = ids.gather(1, accepted.clamp_max(width - 1)[:, None])  # [num, 1] the rejected draft, if any
        # a deterministic drafter: the residual is p with the rejected draft removed
        final.scatter_(1, drafted, torch.where((rejected & one_hot)[:, None], 0.0, final.gather(1, drafted)))
        if sampled_q:  # a drafter's own distribution q: the residual is max(0, p - q)
            q_at = q_rows.gather(1, accepted[at].clamp_max(width - 1)[:, None]).squeeze(1)  # [len(sampled_q)]
            residual = (final[at] - q_all[q_at].to(final.dtype)).clamp_min(0.0)
            final[at] = torch.where(rejected[at][:, None], residual, final[at])
    # A rejection implies p(x) < q(x), so some other token has p > q and the residual has mass; the guard
    # only catches float round-off on a distribution that is (numerically) identical to the draft's.
    final = torch.where(final.sum(dim=-1, keepdim=True) > 0, final, target_rows)
    tokens = draw_tokens(final, [us[n] for us, n in zip(uniforms, lens)])  # [num]
    counts, drawn = torch.stack([accepted, tokens]).tolist()  # the one read back
    return [d[:n] + [tok] for d, n, tok in zip(drafts, counts, drawn)]


def _offsets(lengths: list[int]) -> list[int]:
    """[3, 1, 2] -> [0, 3, 4]: where each of consecutive runs of these lengths starts."""
    return list(accumulate(lengths, initial=0))[:-1]
