"""The inverse-CDF draw of ``sampler.draw_tokens`` as one Triton kernel, for CUDA rows.

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
