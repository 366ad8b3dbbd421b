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

import torch

from specserve.layers.sampler import draw_tokens, target_probs
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
        offset = 0
        for i in random_:
            num_draft = len(draft_token_ids[i])
            req_probs = probs[offset:offset + num_draft + 1]  # [num_draft + 1, vocab_size]
            offset += num_draft + 1
            out[i] = _verify_random(req_probs, draft_token_ids[i], draft_probs[i], streams[i] or default_stream)
    return out


def _verify_random(
    probs: torch.Tensor,  # [num_draft + 1, vocab_size] target distributions
    drafts: list[int],  # [num_draft]
    draft_probs: torch.Tensor | None,  # [num_draft, vocab_size] or None (one-hot)
    stream: random.Random,
) -> list[int]:
    """The chain test for one request: ``num_draft`` uniforms of its stream for the accept tests, then one more
    for the recovered or bonus token (``draw_tokens``; without drafts that is plain sampling's one draw)."""
    num_draft = len(drafts)
    if num_draft == 0:
        return [int(draw_tokens(probs[:1], [stream.random()])[0])]
    device = probs.device
    draft_ids = torch.tensor(drafts, dtype=torch.int64, device=device)  # [num_draft]
    p_draft = probs[:-1].gather(1, draft_ids[:, None]).squeeze(1)  # [num_draft] p_j(x_j)
    if draft_probs is None:
        q_draft = torch.ones_like(p_draft)
    else:
        q_draft = draft_probs.gather(1, draft_ids[:, None]).squeeze(1)  # [num_draft] q_j(x_j)
    p_host, q_host = torch.stack([p_draft, q_draft]).tolist()
    u = [stream.random() for _ in range(num_draft)]
    # u < p / q, written without a division so that q(x) == 0 (impossible for a sampled draft) rejects.
    n = 0
    while n < num_draft and u[n] * q_host[n] < p_host[n]:
        n += 1
    if n == num_draft:
        return drafts + [int(draw_tokens(probs[n:n + 1], [stream.random()])[0])]
    if draft_probs is None:
        residual = probs[n].clone()
        residual[drafts[n]] = 0.0
    else:
        residual = (probs[n] - draft_probs[n]).clamp_min_(0.0)
    # A rejection implies p(x) < q(x), so some other token has p > q and the residual has mass; the guard
    # only catches float round-off on a distribution that is (numerically) identical to the draft's.
    if float(residual.sum()) <= 0.0:
        residual = probs[n]
    return drafts[:n] + [int(draw_tokens(residual[None], [stream.random()])[0])]
