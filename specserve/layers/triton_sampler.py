"""Sampling kernels for CUDA rows: the inverse-CDF draw of ``sampler.draw_tokens`` (``_draw_kernel``) and the
top-k / top-p filter of ``sampler.apply_top_k_top_p`` as one threshold per row (``_threshold_kernel``, at the end).

``draw_tokens``' torch form costs about a dozen launches and two full-width fp64 scans per call: ``cumsum`` in
fp64 and a ``cummax`` (a scan carrying indices) over ``[rows, vocab]``; on an H100 those two alone took 0.6-0.9 ms
of device time for 32 rows of a 128k vocabulary (``benchmarks/sampler_cost.py --profile``), more than a whole
SmolLM2 decode step. Here one program per row reads its row twice and writes one token:

1. the row's total mass, summed in fp64 block by block (``BLOCK`` tokens, a tree sum inside a block, the blocks
   in order), and the last token with positive mass;
2. the same block sums again, in the same order, to find the first block where the running mass exceeds
   ``target = u * total``; then, inside that block only, the fp64 running mass token by token: the token is the
   first with positive mass whose cumulative mass exceeds the target.

So token t is drawn with probability ``probs[t] / total``, zero-mass tokens never, and a target at or past the
total (u within an ulp of 1) takes the last token with mass, as in the torch form. The two forms sum in
different orders, so they agree except where the target lies within a few fp64 ulps of a cumulative mass
boundary (about 1e-16 of the row's mass; the tests compare draws away from such boundaries). Plain sampling
and the speculative verifier (``spec/verify.py``) both draw through ``draw_tokens``, so on one device they use
the same form and a seeded request's tokens stay the same with or without drafts.

Example: probs [0.5, 0, 0.25, 0.25], u = 0.6, BLOCK = 2: total 1.0, target 0.6; block sums 0.5, 0.5: the
running mass passes 0.6 in the second block (0.5 -> 1.0); inside it, 0.5 + 0.25 = 0.75 > 0.6 at token 2.

Triton is imported by this module only; ``sampler.draw_tokens`` imports it lazily on the CUDA path (tests run it
under ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

DRAW_BLOCK = 2048  # tokens per block: a 128k vocabulary is 63 blocks a pass


@triton.jit
def _draw_kernel(
    probs_ptr,  # [num_rows, vocab_size] float32, >= 0, row stride stride_row, tokens contiguous
    u_ptr,  # [num_rows] float64 uniforms in [0, 1)
    out_ptr,  # [num_rows] int64 drawn tokens
    vocab_size, stride_row,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = probs_ptr + row * stride_row
    offs = tl.arange(0, BLOCK)
    # pass 1: the total mass (fp64 block sums, in block order) and the last token with mass
    total = tl.zeros((), dtype=tl.float64)
    last = tl.full((), -1, dtype=tl.int32)
    for start in range(0, vocab_size, BLOCK):
        idx = start + offs
        p = tl.load(base + idx, mask=idx < vocab_size, other=0.0)
        total += tl.sum(p.to(tl.float64), axis=0)
        last = tl.maximum(last, tl.max(tl.where(p > 0, idx, -1), axis=0))
    target = tl.load(u_ptr + row) * total
    # pass 2: the first block whose running mass passes the target (the same sums in the same order as pass 1)
    running = tl.zeros((), dtype=tl.float64)
    before = tl.zeros((), dtype=tl.float64)  # mass before the found block
    found = tl.full((), -1, dtype=tl.int32)  # the found block's first token
    for start in range(0, vocab_size, BLOCK):
        idx = start + offs
        p = tl.load(base + idx, mask=idx < vocab_size, other=0.0)
        s = tl.sum(p.to(tl.float64), axis=0)
        hit = (found < 0) & (running + s > target)
        before = tl.where(hit, running, before)
        found = tl.where(hit, start, found)
        running += s
    # inside the found block: the first token with mass whose cumulative mass passes the target
    start = tl.maximum(found, 0)
    idx = start + offs
    p = tl.load(base + idx, mask=(idx < vocab_size) & (found >= 0), other=0.0)
    cum = before + tl.cumsum(p.to(tl.float64), axis=0)
    first = tl.min(tl.where((cum > target) & (p > 0), idx, vocab_size), axis=0)
    # no such token (the target at or past the total, or the block's in-order sum rounding below its tree sum):
    # the found block's last token with mass, else the row's
    block_last = tl.max(tl.where(p > 0, idx, -1), axis=0)
    token = tl.where(first < vocab_size, first, tl.where(block_last >= 0, block_last, last))
    tl.store(out_ptr + row, tl.minimum(token, last).to(tl.int64))


def draw_tokens_triton(
    probs: torch.Tensor,  # [num_rows, vocab_size] float32, >= 0, each row with positive mass
    uniforms: torch.Tensor,  # [num_rows] float64 in [0, 1), on probs' device
) -> torch.Tensor:  # [num_rows] int64
    """``draw_tokens`` (module docstring) in one launch."""
    num_rows, vocab = probs.shape
    out = torch.empty(num_rows, dtype=torch.int64, device=probs.device)
    if num_rows == 0:
        return out
    if probs.stride(1) != 1:
        probs = probs.contiguous()
    block = min(DRAW_BLOCK, triton.next_power_of_2(max(vocab, 16)))
    _draw_kernel[(num_rows,)](probs, uniforms, out, vocab, probs.stride(0), BLOCK=block,
                              num_warps=8 if block >= 2048 else 4)
    return out


# ---- top-k / top-p as one threshold per row --------------------------------------------------------------------
# Top-k / top-p (nucleus; Holtzman et al., arXiv 1904.09751) keep a prefix of the row sorted by logit, so one
# threshold per row says which tokens stay: z >= tau. ``sampler._filter_thresholds`` hands each row its candidates
# (a top-k of the largest logits, torch.topk) and one program per row finds tau: the k-th candidate (top-k only);
# with top-p, the last candidate whose mass before it (under the softmax over the top-k set, or the whole row) is
# below p, the first always; and when the candidates' mass does not reach p, the smallest float t with
# mass(z > t) < p, by an 8-way search on the floats' order over the whole row (11 passes, each summing per lane
# and reducing once). On an H100, 32 flat rows of 128k: 0.64 ms for the kernel, against 2.0 ms for the 33-pass
# bisection with a reduction per block it replaced (benchmarks/results/sampler_cost_search_h100.json); peaked rows
# end among the candidates. Nothing is read back to the host, so an asynchronous decode step's launch never waits
# for the step before it.
#
# Example: candidates [3.0, 2.0, 1.0, ...] with probabilities [0.6, 0.3, 0.05, ...], p = 0.8: masses before them
# 0, 0.6, 0.9 -> two kept, tau = 2.0; top-k 1 alone -> tau = 3.0.
@triton.jit
def _ordered_key(x):
    """fp32 -> int64 key with the floats' order (-inf lowest; -0.0 just below +0.0)."""
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.int64)


@triton.jit
def _from_key(key):
    """``_ordered_key``'s inverse."""
    bits = key.to(tl.int32)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)


@triton.jit
def _threshold_kernel(
    z_ptr,  # [num_rows, vocab_size] float32 logits over temperature, row stride stride_z, tokens contiguous
    vals_ptr,  # [num_rows, num_cand] float32, each row's num_cand largest of z, descending, row stride stride_v
    k_ptr,  # [num_rows] int64 top-k (vocab_size: none); a row with k < vocab_size has k <= num_cand
    p_ptr,  # [num_rows] float32 top-p (>= 1: none)
    tau_ptr,  # [num_rows] float32 out: the row keeps the tokens with z >= tau
    vocab_size, num_cand, stride_z, stride_v,
    BLOCK: tl.constexpr,
    SPLITS: tl.constexpr,  # threshold probes per pass over the row (a power of two)
    SEARCH_BLOCK: tl.constexpr,  # row tokens a program reads per step of the search
):
    row = tl.program_id(0).to(tl.int64)
    k = tl.load(k_ptr + row)
    p = tl.load(p_ptr + row)
    v_row = vals_ptr + row * stride_v
    z_row = z_ptr + row * stride_z
    offs = tl.arange(0, BLOCK)
    m = tl.load(v_row)  # the row's largest logit
    tau = float("-inf")
    if p >= 1.0:
        if k < vocab_size:  # top-k only: the k-th largest
            tau = tl.load(v_row + k - 1)
    else:
        # the softmax's normaliser (times exp(-m)): over the top-k set (among the candidates), else the whole row
        norm = 0.0
        if k < vocab_size:
            for start in range(0, num_cand, BLOCK):
                idx = start + offs
                v = tl.load(v_row + idx, mask=(idx < num_cand) & (idx < k), other=float("-inf"))
                norm += tl.sum(tl.exp(v - m), axis=0)
        else:
            for start in range(0, vocab_size, BLOCK):
                idx = start + offs
                z = tl.load(z_row + idx, mask=idx < vocab_size, other=float("-inf"))
                norm += tl.sum(tl.exp(z - m), axis=0)
        # the nucleus among the candidates: keep while the mass before a token is below p (the first always)
        carry = 0.0
        kept = 0
        for start in range(0, num_cand, BLOCK):
            idx = start + offs
            inside = (idx < num_cand) & (idx < k)
            prob = tl.exp(tl.load(v_row + idx, mask=inside, other=float("-inf")) - m) / norm
            cum = carry + tl.cumsum(prob, axis=0)
            keep = inside & ((cum - prob < p) | (idx == 0))
            kept += tl.sum(keep.to(tl.int32), axis=0)
            carry = tl.max(cum, axis=0)
        if (k < vocab_size) | (carry >= p):  # the nucleus (or top-k) ends among the candidates
            tau = tl.load(v_row + kept - 1)
        else:
            # it runs past them: the smallest float t with mass(z > t) < p (mass(z > z_j) is the mass before
            # token j), searched on the floats' order with SPLITS probes per pass over the row (the interval of keys
            # shrinks SPLITS + 1 times a pass: 11 passes for 2^32 keys at 8, where bisection took 33); invariant:
            # g(lo) false (all the mass), g(hi) true (none); g is monotone, so the probes' answers are a run of
            # falses then trues and the new interval lies between the last false and the first true
            lo = _ordered_key(tl.full((), float("-inf"), tl.float32))
            hi = _ordered_key(m)
            probe = tl.arange(0, SPLITS)
            search_offs = tl.arange(0, SEARCH_BLOCK)
            while hi - lo > 1:
                keys = lo + (hi - lo) * (probe + 1) // (SPLITS + 1)  # [SPLITS] in [lo, hi), ascending
                t = _from_key(keys)
                # per-lane sums, reduced across the program once a pass (a reduction per block of the row would
                # stall every block on a barrier: the kernel is latency-bound, one program per row)
                acc = tl.zeros((SPLITS, SEARCH_BLOCK), dtype=tl.float32)
                for start in range(0, vocab_size, SEARCH_BLOCK):
                    idx = start + search_offs
                    z = tl.load(z_row + idx, mask=idx < vocab_size, other=float("-inf"))
                    acc += tl.where(z[None, :] > t[:, None], tl.exp(z - m)[None, :], 0.0)
                above = tl.sum(acc, axis=1)
                below = above < p * norm
                hi = tl.min(tl.where(below, keys, hi), axis=0)
                lo = tl.max(tl.where(below, lo, keys), axis=0)
            tau = _from_key(hi)
    tl.store(tau_ptr + row, tau)


THRESHOLD_BLOCK = 1024  # candidates (and row tokens) a program reads per step
THRESHOLD_SPLITS = 8  # probes per pass of a flat row's threshold search
THRESHOLD_SEARCH_BLOCK = 256  # row tokens per step of that search ([SPLITS, SEARCH_BLOCK] sums per program)


def top_k_top_p_thresholds_triton(
    z: torch.Tensor,  # [num_rows, vocab_size] float32 logits over temperature
    vals: torch.Tensor,  # [num_rows, num_cand] float32 the num_cand largest of each row, descending
    top_k: torch.Tensor,  # [num_rows] int64 (vocab_size: none); rows with top_k < vocab_size need top_k <= num_cand
    top_p: torch.Tensor,  # [num_rows] float32 (>= 1: none)
) -> torch.Tensor:  # [num_rows] float32: each row keeps z >= tau (-inf: every token)
    """The thresholds of ``sampler.apply_top_k_top_p`` (see its CUDA path) in one launch."""
    num_rows, vocab = z.shape
    tau = torch.empty(num_rows, dtype=torch.float32, device=z.device)
    if num_rows == 0:
        return tau
    if z.stride(1) != 1:
        z = z.contiguous()
    if vals.stride(1) != 1:
        vals = vals.contiguous()
    _threshold_kernel[(num_rows,)](z, vals, top_k, top_p, tau, vocab, vals.shape[1], z.stride(0), vals.stride(0),
                                   BLOCK=THRESHOLD_BLOCK, SPLITS=THRESHOLD_SPLITS,
                                   SEARCH_BLOCK=THRESHOLD_SEARCH_BLOCK, num_warps=8)
    return tau
