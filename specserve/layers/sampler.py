"""Token sampling: greedy, temperature, top-k, top-p (nucleus; Holtzman et al., arXiv 1904.09751).

``target_probs`` gives the exact distribution a request samples from after its temperature, top-k and
top-p are applied; the speculative verifier uses the same function, so speculation is lossless with
respect to what plain sampling would do.

Randomness: every sampled request owns a host stream of uniforms (``TokenUniforms``, seeded by the request's
seed or, unseeded, by the engine's seed in arrival order), so a request's draws do not depend on what else
shares its batch. A draw takes one uniform from the stream and inverts the row's cumulative distribution on the
device (``draw_tokens``): the uniforms of a whole batch go over in one copy and every row is drawn in the same few
launches, where one ``torch.multinomial`` per row with its own generator costs launches per row (at 256 sampled
rows that made a SmolLM2 decode step 8x slower than greedy on an H200: ``benchmarks/sampling_gpu.py``).
With plain sampling and with one-hot drafters (n-gram, EAGLE-3, P-EAGLE), the n-th uniform a request consumes
draws its n-th output token, whether plain sampling or the speculative verifier emits it (``spec/verify.py``),
so their drafts do not change seeded output; the draft model draws its own drafts from the request's stream and
is verified by the chain, so its seeded output depends on them.
"""

from __future__ import annotations

import os
import random
from collections import deque
from itertools import islice

import torch

from specserve.layers.argmax import greedy_argmax
from specserve.sampling import SamplingParams

DISABLE_TRITON_SAMPLER_ENV = "SPECSERVE_DISABLE_TRITON_SAMPLER"  # set: CUDA draws take the torch form too


def use_triton_sampler(x: torch.Tensor) -> bool:  # x: [num_rows, vocab_size] logits or probabilities
    """Whether ``x``'s filter and draw take the Triton kernels (``layers/triton_sampler.py``): fp32 on CUDA, and
    ``SPECSERVE_DISABLE_TRITON_SAMPLER`` unset (read at every call)."""
    return x.is_cuda and x.dtype == torch.float32 and not os.environ.get(DISABLE_TRITON_SAMPLER_ENV)


class TokenUniforms:
    """A request's uniforms in [0, 1), in order: ``random()`` consumes the next one, ``peek(n)`` returns the next
    n without consuming them, ``advance(n)`` consumes n. The sequence is ``random.Random(seed)``'s, whatever mix of
    these calls reads it.

    Example: seed s gives u0 u1 u2 u3 ...; peek(3) -> [u0, u1, u2]; advance(2); random() -> u2; peek(1) -> [u3]."""

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)
        self._ahead: deque[float] = deque()  # drawn by peek, not yet consumed

    def random(self) -> float:
        return self._ahead.popleft() if self._ahead else self._rng.random()

    def peek(self, n: int) -> list[float]:
        while len(self._ahead) < n:
            self._ahead.append(self._rng.random())
        return list(islice(self._ahead, n))

    def advance(self, n: int) -> None:
        for _ in range(n):
            self.random()


def host_to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list on ``device``: through pinned memory without a stream sync on CUDA (a pageable copy
    would wait for the work queued before it, e.g. an asynchronous decode step's next step)."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


# Candidates a top-p row is first filtered among (``apply_top_k_top_p``): a partial top-k of this many logits instead
# of sorting the whole vocabulary (on a 2-core CPU, 32 rows of 49,152: 6 ms against 49 ms), with a full sort only
# for the rows whose nucleus does not end among them.
TOP_P_CANDIDATES = 1024


def apply_top_k_top_p(
    logits: torch.Tensor,  # [num_rows, vocab_size] float32, already divided by temperature
    top_k: list[int],  # [num_rows], 0 = disabled
    top_p: list[float],  # [num_rows], 1.0 = disabled
) -> torch.Tensor:  # [num_rows, vocab_size], masked entries set to -inf
    """Keep each row's ``top_k`` largest logits, then the smallest prefix of them (by descending probability
    under the top-k-filtered softmax) whose mass reaches ``top_p``; the top token always stays.

    The rows' filters are applied among the ``c`` largest logits of every row (``torch.topk``), c the largest
    top-k of a top-k-only row and at most ``TOP_P_CANDIDATES`` for a top-p row: a top-p row whose candidates'
    mass reaches its p has its whole nucleus among them (the mass before every later token is larger still), and
    its softmax is normalised over its top-k candidates, or over the whole row without top-k. Rows whose nucleus
    runs past the candidates, and top-p rows whose top-k is wider than them, are filtered on a full sort
    (``_filter_sorted``), as every row was before.

    Example: c = 3, a row's candidate probabilities [0.6, 0.3, 0.05] (tail 0.05): p = 0.8 keeps the first two
    (masses before them 0, 0.6; before the third 0.9 >= 0.8), resolved; p = 0.99 needs the tail: full sort.

    On CUDA (fp32, ``SPECSERVE_DISABLE_TRITON_SAMPLER`` unset) ``_filter_thresholds`` computes the same filter
    without reading anything back to the host (the form here reads which rows are resolved)."""
    vocab, device = logits.shape[-1], logits.device
    k_eff = [kk if 0 < kk < vocab else vocab for kk in top_k]  # a top-k of the vocabulary or more keeps every token
    if all(k == vocab for k in k_eff) and all(p >= 1.0 for p in top_p):
        return logits
    if use_triton_sampler(logits):
        return _filter_thresholds(logits, k_eff, top_p)
    need = [0 if k == vocab and p >= 1.0 else k if p >= 1.0 else min(k, TOP_P_CANDIDATES)
            for k, p in zip(k_eff, top_p)]
    cand = max(need)
    if cand * 4 > vocab:  # no cheaper than sorting every row
        return _filter_sorted(logits, k_eff, top_p)
    vals, idx = logits.topk(cand, dim=-1)  # [rows, cand], descending
    k = host_to_device(k_eff, torch.int64, device)  # [rows]
    p = host_to_device(top_p, logits.dtype, device)  # [rows]
    remove = torch.arange(cand, device=device)[None, :] >= k[:, None]  # [rows, cand] beyond top-k
    # the softmax's normaliser: over the top-k set when it lies among the candidates, else over the whole row
    top_k_lse = vals.masked_fill(remove, float("-inf")).logsumexp(dim=-1)  # [rows]
    lse = torch.where(k <= cand, top_k_lse, logits.logsumexp(dim=-1))  # [rows]
    probs = (vals - lse[:, None]).exp().masked_fill(remove, 0.0)  # [rows, cand]
    running = probs.cumsum(dim=-1)  # [rows, cand]
    remove |= (running - probs >= p[:, None]) & (p[:, None] < 1.0)
    remove[:, 0] = False
    out = torch.full_like(logits, float("-inf")).scatter_(-1, idx, vals.masked_fill(remove, float("-inf")))
    reached = (running[:, -1] >= p).tolist()
    unfiltered = [i for i, n in enumerate(need) if n == 0]
    full = [i for i, (n, k_i, p_i) in enumerate(zip(need, k_eff, top_p))
            if n and p_i < 1.0 and (not reached[i] or cand < k_i < vocab)]
    if unfiltered:
        rows = host_to_device(unfiltered, torch.int64, device)
        out[rows] = logits.index_select(0, rows)
    if full:
        rows = host_to_device(full, torch.int64, device)
        out[rows] = _filter_sorted(logits.index_select(0, rows), [k_eff[i] for i in full], [top_p[i] for i in full])
    return out


def _filter_thresholds(
    logits: torch.Tensor,  # [num_rows, vocab_size] float32 on CUDA, already divided by temperature
    k_eff: list[int],  # [num_rows] top-k, vocab_size = disabled
    top_p: list[float],  # [num_rows], 1.0 = disabled
) -> torch.Tensor:  # [num_rows, vocab_size], masked entries set to -inf
    """``apply_top_k_top_p`` on CUDA, with no host sync: the kept tokens of a row are those at or above one
    threshold, which a Triton kernel finds (``layers/triton_sampler.py``) from the row's candidates (a top-k of
    ``max(k)`` for rows with top-k, ``TOP_P_CANDIDATES`` for rows with top-p only) or, for a nucleus that runs past
    them, by a multi-way search over the row. The same tokens as the sort, except that tokens tied with the last kept
    one are all kept (a sort keeps an arbitrary few of them) and a token whose mass before it is within fp32
    rounding of p can go either way."""
    vocab, device = logits.shape[-1], logits.device
    need = [0 if k == vocab and p >= 1.0 else k if k < vocab else TOP_P_CANDIDATES for k, p in zip(k_eff, top_p)]
    cand = max(need)
    if cand * 4 > vocab:  # no cheaper than sorting every row
        return _filter_sorted(logits, k_eff, top_p)
    from specserve.layers.triton_sampler import top_k_top_p_thresholds_triton  # Triton on the CUDA path only
    vals = logits.topk(cand, dim=-1).values  # [rows, cand], descending
    tau = top_k_top_p_thresholds_triton(logits, vals, host_to_device(k_eff, torch.int64, device),
                                        host_to_device(top_p, torch.float32, device))  # [rows]
    return logits.masked_fill(logits < tau[:, None], float("-inf"))


def _filter_sorted(
    logits: torch.Tensor,  # [num_rows, vocab_size] float32, already divided by temperature
    k_eff: list[int],  # [num_rows] top-k, vocab_size = disabled
    top_p: list[float],  # [num_rows], 1.0 = disabled
) -> torch.Tensor:  # [num_rows, vocab_size], masked entries set to -inf
    """``apply_top_k_top_p`` on a full sort of every row."""
    vocab = logits.shape[-1]
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)  # [rows, vocab]
    device = logits.device
    k = host_to_device(k_eff, torch.int64, device)  # [rows]
    ranks = torch.arange(vocab, device=device)
    remove = ranks[None, :] >= k[:, None]  # beyond top-k
    probs = sorted_logits.masked_fill(remove, float("-inf")).softmax(dim=-1)
    p = host_to_device(top_p, probs.dtype, device)  # [rows]
    # Drop a token when the mass strictly before it already reaches top_p; the top token always stays. Rows
    # without top-p (p >= 1) drop nothing: their fp32 running sum can round up to 1 before the tail.
    mass_before = probs.cumsum(dim=-1) - probs
    remove |= (mass_before >= p[:, None]) & (p[:, None] < 1.0)
    remove[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, sorted_idx, sorted_logits)


def target_probs(
    logits: torch.Tensor,  # [num_rows, vocab_size] float32
    params: list[SamplingParams],  # [num_rows], none greedy
) -> torch.Tensor:  # [num_rows, vocab_size] float32
    temps = host_to_device([p.temperature for p in params], logits.dtype, logits.device)
    scaled = logits / temps[:, None]
    scaled = apply_top_k_top_p(scaled, [p.top_k for p in params], [p.top_p for p in params])
    return scaled.softmax(dim=-1)


def draw_tokens(
    probs: torch.Tensor,  # [num_rows, vocab_size] float32, >= 0, each row with positive mass (need not sum to 1)
    uniforms: list[float],  # [num_rows] in [0, 1), one per row
) -> torch.Tensor:  # [num_rows] int64, on probs' device
    """Inverse-CDF draws: row i's token is the first whose cumulative mass exceeds ``uniforms[i]`` times the
    row's total mass, so token t is drawn with probability ``probs[i, t] / probs[i].sum()``. The cumulative
    sums are fp64 (no drift over a 128k vocabulary). A token of zero mass is never drawn: its cumulative mass
    is set to the running maximum before it (a parallel scan's sum at a zero could differ from its
    predecessor's by an ulp), and the result is clamped to the row's last token with mass.

    On CUDA the draw is one Triton kernel (``layers/triton_sampler.py``: the same rule, fp64 sums in another
    order, so the same token except for a target within a few ulps of a boundary) unless
    ``SPECSERVE_DISABLE_TRITON_SAMPLER`` is set; plain sampling and the verifier both come through here.

    Example: probs [[0.5, 0, 0.25, 0.25]], u 0.6 -> cumulative [0.5 0.5 0.75 1.0], first > 0.6 -> token 2."""
    u = host_to_device(uniforms, torch.float64, probs.device)  # [rows]
    if use_triton_sampler(probs):
        from specserve.layers.triton_sampler import draw_tokens_triton  # Triton is imported on the CUDA path only
        return draw_tokens_triton(probs, u)
    return draw_tokens_reference(probs, u)


def draw_tokens_reference(
    probs: torch.Tensor,  # [num_rows, vocab_size] float32, >= 0, each row with positive mass
    u: torch.Tensor,  # [num_rows] float64 in [0, 1), on probs' device
) -> torch.Tensor:  # [num_rows] int64
    """``draw_tokens`` in torch (any device; the test oracle of the Triton kernel)."""
    cdf = probs.double().cumsum(dim=-1)  # [rows, vocab]
    cdf = cdf.masked_fill(probs <= 0, float("-inf")).cummax(dim=-1).values  # flat at zero mass, monotone
    picked = torch.searchsorted(cdf, u[:, None] * cdf[:, -1:], right=True).squeeze(1)  # [rows]
    last = probs.shape[-1] - 1 - (probs.flip(-1) > 0).float().argmax(dim=-1)  # [rows] last token with mass
    return torch.minimum(picked, last)


def sample(
    logits: torch.Tensor,  # [num_rows, vocab_size] float32
    params: list[SamplingParams],  # [num_rows]
    streams: list[TokenUniforms | None],  # [num_rows] per-request streams; None -> default_stream
    default_stream: TokenUniforms,
) -> list[int]:
    """One token per row, read back to the host (``sample_on_device``'s draws)."""
    return sample_on_device(logits, params, streams, default_stream).tolist()


def sample_on_device(
    logits: torch.Tensor,  # [num_rows, vocab_size] float32
    params: list[SamplingParams],  # [num_rows]
    streams: list[TokenUniforms | None],  # [num_rows] per-request streams; None -> default_stream
    default_stream: TokenUniforms,
    consume: bool = True,
) -> torch.Tensor:  # [num_rows] int64, on logits' device
    """One token per row, left on the device (so that the engine's next asynchronous decode step can take them as
    its input ids before the host has seen them): the argmax of greedy rows, for the others a ``draw_tokens``
    draw from ``target_probs`` with one uniform of the row's stream, as the verifier draws for a request
    without drafts. ``consume=False`` peeks the rows' own streams instead (the caller advances each by one once
    the step can no longer fail); rows on the default stream consume theirs either way."""
    out = greedy_argmax(logits)  # [num_rows]
    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    if not random_rows:
        return out
    rows = host_to_device(random_rows, torch.int64, logits.device)  # [num_random]
    probs = target_probs(logits.index_select(0, rows), [params[i] for i in random_rows])
    uniforms = [default_stream.random() if streams[i] is None else streams[i].random() if consume
                else streams[i].peek(1)[0] for i in random_rows]
    out[rows] = draw_tokens(probs, uniforms)
    return out
