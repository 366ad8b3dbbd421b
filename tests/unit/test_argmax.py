"""greedy_argmax: the sliced argmax equals numpy's argmax (first index of the maximum, NaN the largest) on rows
full of ties, infinities and NaN, for every slice count that divides the row; the engine's samplers route
through it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specserve.layers.argmax import dividing_chunks, greedy_argmax, split_chunks
from specserve.layers.sampler import TokenUniforms, sample_on_device
from specserve.sampling import SamplingParams

# few distinct values, so ties between and inside slices are the common case
VALUES = [float("-inf"), -1.0, 0.0, 2.5, 3.0, float("inf"), float("nan")]


@st.composite
def logits_and_chunks(draw):
    chunks = draw(st.sampled_from([2, 4, 8, 16, 64]))
    width = draw(st.integers(1, 12))
    rows = draw(st.integers(1, 5))
    pool = draw(st.lists(st.sampled_from(VALUES), min_size=1, max_size=4, unique_by=str))
    cells = draw(st.lists(st.sampled_from(pool), min_size=rows * chunks * width, max_size=rows * chunks * width))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
    return torch.tensor(cells, dtype=torch.float32).reshape(rows, chunks * width).to(dtype), chunks


@settings(max_examples=400, deadline=None)
@given(logits_and_chunks())
def test_sliced_argmax_is_numpys_argmax(case):
    logits, chunks = case
    expected = np.argmax(logits.float().numpy(), axis=-1)  # the first maximum; the first NaN where any
    got = greedy_argmax(logits, chunks)
    assert got.dtype == torch.int64
    assert got.tolist() == expected.tolist()


def test_worked_example_and_random_rows():
    row = torch.tensor([[1.0, 7.0, 7.0, 3.0, 7.0, 0.0]])
    assert greedy_argmax(row, 2).tolist() == [1]
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(8, 128256, generator=gen)
    logits[3, 70000] = logits[3, 5] = 99.0  # a tie across slices: the earlier index
    got = greedy_argmax(logits)
    assert split_chunks(8, 128256) == 64
    assert got.tolist() == np.argmax(logits.numpy(), axis=-1).tolist()
    assert got[3].item() == 5


@pytest.mark.parametrize("rows,vocab,chunks", [(1, 128256, 64), (32, 131072, 64), (64, 151936, 64),
                                               (65, 128256, 1), (1, 49152, 1), (1, 128001, 1), (2, 65552, 16)])
def test_split_chunks(rows, vocab, chunks):
    assert split_chunks(rows, vocab) == chunks
    if chunks > 1:
        assert vocab % chunks == 0


def test_bad_chunks_and_empty():
    with pytest.raises(ValueError, match="chunks"):
        greedy_argmax(torch.zeros(1, 10), 3)
    assert greedy_argmax(torch.zeros(0, 128256)).shape == (0,)


def test_sampler_greedy_rows_take_the_sliced_argmax():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 128256, generator=gen)
    logits[1, 120000] = logits[1, 100] = 50.0
    params = [SamplingParams(temperature=0.0)] * 3
    out = sample_on_device(logits, params, [None] * 3, TokenUniforms(0))
    assert out.tolist() == np.argmax(logits.numpy(), axis=-1).tolist()
    assert out[1].item() == 100


@pytest.mark.parametrize("vocab,chunks", [(128256, 64), (49152, 64), (65552, 16), (128001, 1), (96, 32)])
def test_dividing_chunks_is_the_first_count_that_divides(vocab, chunks):
    """The rule's slice count without its row and vocabulary bounds (argmax_gpu.py times SmolLM2's with it)."""
    assert dividing_chunks(vocab) == chunks
