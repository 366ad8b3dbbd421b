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
changes what a request samples from. For greedy requests ``p_j`` is one-hot on the target's argmax, so the rule
reduces to "accept while the draft equals the target's argmax, then emit the target's argmax".

Deterministic drafters (n-gram lookup; the EAGLE-3 and P-EAGLE heads, which draft their argmaxes) have a
one-hot ``q``. For them the chain runs in an equivalent, position-coupled form: with ``u_j`` the request's
uniform for the output position that draft j would fill (``TokenUniforms``: the n-th uniform a request consumes
draws its n-th output token),

    for j in 1..k+1:
        y_j = inverse-CDF draw from p_j with u_j       (what plain sampling would emit at that position)
        if j <= k and y_j == x_j: accept x_j
        else: emit y_j and stop

and the request consumes one uniform per emitted token. It is the same chain in law: x_j is accepted with
probability p_j(x_j) (the one-hot ``u < p_j(x_j)``), and a rejected position emits y_j given y_j != x_j, i.e. a
draw from ``p_j`` with ``x_j`` removed (the one-hot residual); so acceptance rates and output distribution are
the rule's above. And every emitted token is the token plain sampling draws at its position from the same
uniform, whatever the drafts were: a seeded request's output is the same with and without speculation, for
any number of drafts a step (an adaptive cap that follows timings included), up to the rounding in which a
verify forward's logits differ from a decode forward's. A drafter with its own distribution ``q`` (the
draft model) keeps the chain above, whose acceptance ``sum_x min(p, q)`` this coupling would lower, and its output
then depends on its draws.

Rows of ``target_logits`` are packed per request, ``1 + num_draft_tokens`` each:

    drafts = [[a1, a2], [], [c1]]  ->  rows [pa1 pa2 pa3 | pb1 | pc1 pc2],  logit_starts = [0, 3, 4]
"""

from __future__ import annotations

from collections import Counter
from itertools import accumulate

import torch

from specserve.layers.argmax import greedy_argmax
from specserve.layers.sampler import TokenUniforms, draw_tokens, host_to_device, target_probs
from specserve.sampling import SamplingParams


def verify(
    target_logits: torch.Tensor,  # [num_rows, vocab_size] float32, 1 + len(draft_token_ids[i]) rows per request
    logit_starts: list[int],  # [num_requests] first row of each request
    draft_token_ids: list[list[int]],  # [num_requests][num_draft_tokens_i]
    draft_probs: list[torch.Tensor | None],  # [num_requests] each [num_draft_tokens_i, vocab_size] or None (one-hot)
    params: list[SamplingParams],  # [num_requests]
    streams: list[TokenUniforms | None],  # [num_requests] per-request streams; None -> default_stream
    default_stream: TokenUniforms,
) -> list[list[int]]:  # [num_requests] accepted draft tokens + one recovered or bonus token
    out: list[list[int]] = [[] for _ in params]
    greedy = [i for i, p in enumerate(params) if p.greedy]
    if greedy:
        argmax = greedy_argmax(target_logits).tolist()  # [num_rows]
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
    streams: list[TokenUniforms],  # [num_requests]
) -> list[list[int]]:  # [num_requests] accepted drafts + one recovered or bonus token
    """Every sampled request at once: those with one-hot drafts or none take the position-coupled form (module
    docstring; without drafts it is plain sampling's one draw), those with a draft distribution the chain
    (``_verify_chain``).

    The coupled form needs the full inverse-CDF draw only where it emits a token that is not a draft: draft x_j
    equals the draw y_j exactly when ``u_j * total_j`` falls in x_j's interval of the row's cumulative mass,
    ``[mass before x_j, mass before x_j + p_j(x_j))`` (``draw_tokens``' rule; fp64 sums), so the drafts are
    tested with two row sums and one gather, and one row per request (the first rejected, else the bonus) is
    drawn. Two device reads, whatever the number of requests.

    Example: drafts [[a1, a2], [], [c1]], all one-hot -> probs rows [pa1 pa2 pa3 | pb1 | pc1 pc2], uniforms
    peeked [ua1 ua2 ua3 | ub1 | uc1 uc2]; a1 inside its interval, a2 and c1 outside theirs: rows pa2, pb1, pc1 are
    drawn with ua2, ub1, uc1 -> [a1, y] [y'] [y'']; a consumes 2 uniforms, b and c 1 (uc2 draws c's next token)."""
    starts = _offsets([len(d) + 1 for d in drafts])  # each request's first row in probs
    out: list[list[int]] = [[] for _ in drafts]
    chain = [i for i, d in enumerate(drafts) if d and draft_probs[i] is not None]
    coupled = [i for i, d in enumerate(drafts) if not (d and draft_probs[i] is not None)]
    if coupled:
        device = probs.device
        # A stream shared by several requests (the default one) cannot be peeked for each: its requests consume
        # one uniform per row instead, fresh draws all the same, but not one per output position.
        uses = Counter(id(streams[i]) for i in coupled)
        own = {i: uses[id(streams[i])] == 1 for i in coupled}
        uniforms = {i: streams[i].peek(len(drafts[i]) + 1) if own[i]
                    else [streams[i].random() for _ in range(len(drafts[i]) + 1)] for i in coupled}
        accepted = dict.fromkeys(coupled, 0)
        drafted = [i for i in coupled if drafts[i]]
        if drafted:
            rows = host_to_device([starts[i] + j for i in drafted for j in range(len(drafts[i]))], torch.int64,
                                  device)  # [num_drafts]
            ids = host_to_device([t for i in drafted for t in drafts[i]], torch.int64, device)  # [num_drafts]
            p = probs.index_select(0, rows)  # [num_drafts, vocab_size]
            before = torch.arange(p.shape[1], device=device)[None, :] < ids[:, None]  # [num_drafts, vocab_size]
            lo = torch.where(before, p, 0.0).sum(dim=-1, dtype=torch.float64)  # [num_drafts] mass before x_j
            px = p.gather(1, ids[:, None]).squeeze(1).double()  # [num_drafts] p_j(x_j)
            total = p.sum(dim=-1, dtype=torch.float64)  # [num_drafts]
            lo_h, px_h, total_h = torch.stack([lo, px, total]).tolist()
            at = 0
            for i in drafted:
                u, n = uniforms[i], 0
                while n < len(drafts[i]) and lo_h[at + n] <= u[n] * total_h[at + n] < lo_h[at + n] + px_h[at + n]:
                    n += 1
                accepted[i] = n
                at += len(drafts[i])
        final = host_to_device([starts[i] + accepted[i] for i in coupled], torch.int64, device)  # [num_coupled]
        tokens = draw_tokens(probs.index_select(0, final), [uniforms[i][accepted[i]] for i in coupled]).tolist()
        for i, tok in zip(coupled, tokens):
            out[i] = drafts[i][:accepted[i]] + [tok]  # the accepted drafts, then the draw at the next position
            if own[i]:
                streams[i].advance(accepted[i] + 1)
    if chain:
        rows = host_to_device([starts[i] + j for i in chain for j in range(len(drafts[i]) + 1)], torch.int64,
                              probs.device)  # [num_chain_rows]
        for i, toks in zip(chain, _verify_chain(probs.index_select(0, rows), [drafts[i] for i in chain],
                                                [draft_probs[i] for i in chain], [streams[i] for i in chain])):
            out[i] = toks
    return out


def _verify_chain(
    probs: torch.Tensor,  # [sum(num_draft_i + 1), vocab_size] target distributions, packed per request
    drafts: list[list[int]],  # [num_requests][num_draft_i]
    draft_probs: list[torch.Tensor | None],  # [num_requests] each [num_draft_i, vocab_size] or None (one-hot)
    streams: list[TokenUniforms],  # [num_requests]
) -> list[list[int]]:  # [num_requests] accepted drafts + one recovered or bonus token
    """The chain test of the module docstring for these requests at once. Each request takes ``num_draft + 1``
    uniforms of its stream, in the order of these requests: its accept tests, then its recovered or bonus token
    (without drafts, plain sampling's one draw). ``verify`` sends it drafts with a distribution only; it also
    takes one-hot drafts (None), the form ``verify`` used for them before the coupled one, which
    ``benchmarks/verify_cost.py`` times against it. p_j(x_j) and q_j(x_j) of every draft come to the host in one
    read, and every request's final distribution (the residual after a rejection, else the bonus row) is drawn in
    one ``draw_tokens``: two device reads per step, whatever the number of requests.

    Example: drafts [[a1, a2], [], [c1]] -> probs rows [pa1 pa2 pa3 | pb1 | pc1 pc2] (starts 0, 3, 4); with a1
    accepted and a2 rejected, c1 accepted: final rows [pa2 - (a2) | pb1 | pc2], tokens [a1, y] [y] [c1, y]."""
    device = probs.device
    starts = _offsets([len(d) + 1 for d in drafts])  # each request's first row in probs
    uniforms = [[stream.random() for _ in range(len(d) + 1)] for stream, d in zip(streams, drafts)]
    accepted = [0] * len(drafts)
    with_drafts = [i for i, d in enumerate(drafts) if d]
    if with_drafts:
        rows = host_to_device([starts[i] + j for i in with_drafts for j in range(len(drafts[i]))], torch.int64,
                              device)  # [num_drafts]
        ids = host_to_device([t for i in with_drafts for t in drafts[i]], torch.int64, device)  # [num_drafts]
        p_draft = probs.index_select(0, rows).gather(1, ids[:, None]).squeeze(1)  # [num_drafts] p_j(x_j)
        q_draft = torch.cat([torch.ones(len(drafts[i]), device=device, dtype=probs.dtype) if draft_probs[i] is None
                             else draft_probs[i].gather(1, ids[at:at + len(drafts[i]), None]).squeeze(1)
                             for i, at in zip(with_drafts, _offsets([len(drafts[i]) for i in with_drafts]))])
        p_host, q_host = torch.stack([p_draft, q_draft.to(p_draft.dtype)]).tolist()
        at = 0
        for i in with_drafts:
            u, n = uniforms[i], 0
            # u < p / q, written without a division so that q(x) == 0 (impossible for a sampled draft) rejects
            while n < len(drafts[i]) and u[n] * q_host[at + n] < p_host[at + n]:
                n += 1
            accepted[i] = n
            at += len(drafts[i])
    final = probs.index_select(0, host_to_device([starts[i] + n for i, n in enumerate(accepted)], torch.int64,
                                                 device))  # [num_requests, vocab_size] p_{n+1}
    target_rows = final.clone()
    rejected = [i for i, d in enumerate(drafts) if accepted[i] < len(d)]
    one_hot = [i for i in rejected if draft_probs[i] is None]
    if one_hot:  # a deterministic drafter: the residual is p with the rejected draft removed
        final[host_to_device(one_hot, torch.int64, device),
              host_to_device([drafts[i][accepted[i]] for i in one_hot], torch.int64, device)] = 0.0
    sampled_drafts = [i for i in rejected if draft_probs[i] is not None]
    if sampled_drafts:  # a drafter's own distribution q: the residual is max(0, p - q)
        at = host_to_device(sampled_drafts, torch.int64, device)  # [num_rejected]
        q_rows = torch.stack([draft_probs[i][accepted[i]] for i in sampled_drafts]).to(final.dtype)
        final[at] = (final.index_select(0, at) - q_rows).clamp_min(0.0)
    # A rejection implies p(x) < q(x), so some other token has p > q and the residual has mass; the guard
    # only catches float round-off on a distribution that is (numerically) identical to the draft's.
    final = torch.where(final.sum(dim=-1, keepdim=True) > 0, final, target_rows)
    tokens = draw_tokens(final, [uniforms[i][len(d)] for i, d in enumerate(drafts)]).tolist()
    return [d[:n] + [tok] for d, n, tok in zip(drafts, accepted, tokens)]


def _offsets(lengths: list[int]) -> list[int]:
    """[3, 1, 2] -> [0, 3, 4]: where each of consecutive runs of these lengths starts."""
    return list(accumulate(lengths, initial=0))[:-1]
