"""Sampler: the top-k / top-p filtered distribution matches a direct reference; draws follow it."""

from __future__ import annotations

import random

import numpy as np
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from specserve.layers.sampler import (
    TOP_P_CANDIDATES,
    _filter_sorted,
    apply_top_k_top_p,
    draw_tokens,
    sample,
    target_probs,
)
from specserve.sampling import SamplingParams
from tests.rounding import unexplained_differences


def reference_probs(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    z = logits.astype(np.float64) / temperature
    order = np.argsort(-z, kind="stable")
    keep = np.zeros_like(z, dtype=bool)
    k = top_k if top_k > 0 else len(z)
    kept = order[:k]
    p = np.exp(z[kept] - z[kept].max())
    p /= p.sum()
    mass = 0.0
    for tok, pi in zip(kept, p):
        if mass >= top_p:
            break
        keep[tok] = True
        mass += pi
    out = np.where(keep, np.exp(z - z.max()), 0.0)
    return out / out.sum()


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 10_000), temperature=st.floats(0.2, 2.0), top_k=st.integers(0, 80),
       top_p=st.floats(0.05, 1.0))
def test_filtered_distribution_matches_reference(seed, temperature, top_k, top_p) -> None:
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(seed)) * 3
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    got = target_probs(logits, [params])[0].double().numpy()
    want = reference_probs(logits[0].numpy(), temperature, top_k, top_p)
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_draws_follow_the_filtered_distribution() -> None:
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -1.0]])
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=4)
    probs = target_probs(logits, [params])[0]
    stream = random.Random(0)
    n = 8_000
    counts = np.bincount([sample(logits, [params], [stream], stream)[0] for _ in range(n)], minlength=6)
    tv = 0.5 * np.abs(counts / n - probs.numpy()).sum()
    assert tv < 0.03, tv
    assert counts[4] == counts[5] == 0  # outside top-k 4


def test_greedy_rows_take_argmax() -> None:
    logits = torch.tensor([[0.1, 3.0, 0.2], [5.0, 0.0, 0.0]])
    assert sample(logits, [SamplingParams(temperature=0.0)] * 2, [None, None], random.Random(0)) == [1, 0]


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), temperature=st.sampled_from([5e-324, 1e-300, 1e-45, 1e-40, 1e-38, 1e-20, 9.9e-6]))
def test_a_tiny_temperature_samples_the_argmax(seed, temperature) -> None:
    # Dividing fp32 logits by such a temperature overflows (1e-40 is a denormal, 5e-324 is 0 in fp32); the
    # request is greedy instead of drawing the vocabulary's last token from NaN probabilities.
    logits = torch.randn(3, 64, generator=torch.Generator().manual_seed(seed)) * 4
    params = SamplingParams(temperature=temperature, top_p=0.9, top_k=20)
    assert params.greedy
    got = sample(logits, [params] * 3, [random.Random(seed)] * 3, random.Random(0))
    assert got == logits.argmax(dim=-1).tolist()


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), rows=st.integers(1, 5), vocab=st.integers(2, 40), zero_every=st.integers(2, 5))
def test_draw_tokens_inverts_the_cumulative_distribution(seed, rows, vocab, zero_every) -> None:
    """``draw_tokens`` picks the first token whose cumulative mass exceeds u x the row's total (rows need not
    be normalised), and never a token of zero mass, also at u -> 1 and u = 0."""
    gen = torch.Generator().manual_seed(seed)
    probs = torch.rand(rows, vocab, generator=gen) * 3
    probs[:, ::zero_every] = 0.0  # zero-mass tokens, the first and (sometimes) the last included
    probs[:, 1] += 0.5  # every row keeps some mass
    rng = random.Random(seed)
    for uniforms in ([rng.random() for _ in range(rows)], [0.0] * rows, [1.0 - 2**-53] * rows):
        got = draw_tokens(probs, uniforms).tolist()
        for row, (u, tok) in enumerate(zip(uniforms, got)):
            p = probs[row].double()
            cdf = p.cumsum(0)
            assert p[tok] > 0
            want = int((cdf > u * cdf[-1]).nonzero()[0]) if (cdf > u * cdf[-1]).any() else int(p.nonzero()[-1])
            assert tok == want


def test_draws_with_one_uniform_per_row_follow_each_rows_distribution() -> None:
    """A batch of rows drawn at once: each row's draws follow its own (unnormalised) distribution."""
    probs = torch.tensor([[0.0, 2.0, 1.0, 1.0], [3.0, 0.0, 0.0, 1.0]])
    rng = random.Random(3)
    n = 6_000
    drawn = np.array([draw_tokens(probs, [rng.random(), rng.random()]).tolist() for _ in range(n)])  # [n, 2]
    for row in range(2):
        freq = np.bincount(drawn[:, row], minlength=4) / n
        np.testing.assert_allclose(freq, (probs[row] / probs[row].sum()).numpy(), atol=0.025)


def test_a_row_without_top_p_keeps_its_tail_beside_rows_with_it() -> None:
    """A row's distribution does not depend on its batch: beside a top-p row, a row without top-p keeps the
    tokens its float32 running sum passes 1.0 before (here every token after the dominant one)."""
    logits = torch.zeros(2, 50)
    logits[:, 0] = 30.0  # p0 rounds to 1.0 in float32; the others are ~1e-13 each
    plain, nucleus = SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_p=0.5)
    alone = target_probs(logits[:1], [plain])
    beside = target_probs(logits, [plain, nucleus])
    assert torch.equal(beside[0], alone[0]) and bool((alone[0, 1:] > 0).all())
    assert int((beside[1] > 0).sum()) == 1  # the top-p row keeps its top token only


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), vocab=st.integers(2, 300),
       rows=st.lists(st.tuples(st.sampled_from([0, 3, "vocab-1", "vocab", "vocab+1", 2**63 - 1]),
                               st.sampled_from([1.0, 0.5])), min_size=1, max_size=5))
@example(seed=0, vocab=50, rows=[("vocab", 1.0)])
@example(seed=0, vocab=50, rows=[(2**63 - 1, 1.0), (3, 0.5)])
def test_a_top_k_of_the_vocabulary_or_more_filters_nothing(seed, vocab, rows) -> None:
    """A top-k at or above the vocabulary size (the API accepts any positive top_k, as vLLM does) keeps every
    token, alone or beside filtered rows: the row comes out as with top-k off. (Once a batch of such rows with
    top_p = 1 asked torch.topk for 0 candidates and failed the whole engine step.)"""
    sizes = {"vocab-1": vocab - 1, "vocab": vocab, "vocab+1": vocab + 1}
    top_k = [sizes.get(k, k) for k, _ in rows]
    top_p = [p for _, p in rows]
    logits = torch.randn(len(rows), vocab, generator=torch.Generator().manual_seed(seed)) * 3
    got = apply_top_k_top_p(logits, top_k, top_p)
    kept = torch.isfinite(got)
    for r, (k, p) in enumerate(zip(top_k, top_p)):  # against the fp64 reference with top-k off (k >= vocab) or on
        wanted = torch.from_numpy(reference_probs(logits[r].numpy(), 1.0, k if k < vocab else 0, p) > 0)
        k_eff = k if 0 < k < vocab else vocab
        assert unexplained_differences(logits[r], kept[r], wanted, k_eff, p) == [], (r, k, p)
        assert torch.equal(got[r][kept[r]], logits[r][kept[r]])  # kept logits pass through unchanged


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), rows=st.lists(st.tuples(st.sampled_from([0, 1, 7, 64, 1500, 5000]),
                                                            st.sampled_from([1.0, 0.5, 0.9, 0.99, 0.999999]),
                                                            st.sampled_from([0.3, 2.0, 8.0])),
                                                  min_size=1, max_size=6))
@example(seed=0, rows=[(0, 0.999999, 8.0)])  # the nucleus edge inside fp32 rounding of p
def test_candidate_filtering_equals_the_full_sort(seed, rows) -> None:
    """Top-k / top-p among a partial top-k of candidates keeps exactly the tokens a full sort keeps, for rows of
    every kind in one batch: unfiltered, top-k only (within the candidates), top-p resolved among the
    candidates, and those that fall back to the sort (a flat row whose nucleus is wider than the candidates, a
    top-k wider than them under top-p, p rounding to 1). A token may differ only where fp32 rounding of the mass
    before it (within 3e-6 of p) or a tie at the edge decides (e.g. seed 0, one row (0, 0.999999, 8.0))."""
    vocab = 16 * TOP_P_CANDIDATES
    gen = torch.Generator().manual_seed(seed)
    logits = torch.cat([torch.randn(1, vocab, generator=gen) * scale for _, _, scale in rows])
    top_k, top_p = [k for k, _, _ in rows], [p for _, p, _ in rows]
    k_eff = [k if k else vocab for k in top_k]
    got = apply_top_k_top_p(logits, top_k, top_p)
    want = _filter_sorted(logits, k_eff, top_p)
    kept, wanted = torch.isfinite(got), torch.isfinite(want)
    for r in range(len(rows)):  # the two sum the nucleus's fp32 mass in different orders
        assert unexplained_differences(logits[r], kept[r], wanted[r], k_eff[r], top_p[r]) == [], (r, rows[r])
    both = kept & wanted
    assert torch.equal(got[both], logits[both])  # kept logits pass through unchanged
