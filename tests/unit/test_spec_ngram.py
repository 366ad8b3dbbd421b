"""N-gram lookup on hand-written token arrays, plus a property: every draft continues an earlier occurrence of
the sequence's suffix."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from specserve.spec.ngram import ngram_lookup


def lookup(tokens: list[int], ngram_min: int = 1, ngram_max: int = 3, k: int = 3) -> list[int]:
    return ngram_lookup(np.array(tokens, dtype=np.int64), ngram_min, ngram_max, k)


def test_longest_suffix_wins() -> None:
    # suffix [2 5 7] occurs at 3 (followed by 1); [5 7] alone also occurs at 0 (followed by 9).
    assert lookup([5, 7, 9, 2, 5, 7, 1, 4, 2, 5, 7]) == [1, 4, 2]


def test_falls_back_to_shorter_ngrams() -> None:
    assert lookup([5, 7, 9, 2, 8, 5, 7]) == [9, 2, 8]


def test_most_recent_occurrence_wins() -> None:
    assert lookup([3, 1, 3, 2, 3], ngram_max=1, k=1) == [2]


def test_no_match_gives_no_draft() -> None:
    assert lookup([1, 2, 3, 4]) == []
    assert lookup([7]) == []


def test_min_ngram_length_is_respected() -> None:
    assert lookup([5, 7, 9, 2, 8, 5, 7], ngram_min=3) == []


def test_continuation_is_cut_at_the_end_of_the_sequence() -> None:
    assert lookup([4, 4, 4], ngram_max=2, k=5) == [4]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=1, max_size=60), st.integers(1, 3), st.integers(0, 2),
       st.integers(1, 6))
def test_draft_continues_an_earlier_occurrence_of_the_suffix(tokens, ngram_min, extra, k) -> None:
    ngram_max = ngram_min + extra
    draft = lookup(tokens, ngram_min, ngram_max, k)
    assert len(draft) <= k
    if not draft:
        # Nothing to find: no suffix of any allowed length occurs earlier.
        for n in range(ngram_min, min(ngram_max, len(tokens) - 1) + 1):
            suffix = tokens[-n:]
            assert all(tokens[i:i + n] != suffix for i in range(len(tokens) - n))
        return
    assert any(tokens[i:i + n] == tokens[-n:] and tokens[i + n:i + n + len(draft)] == draft
               for n in range(ngram_min, ngram_max + 1) for i in range(len(tokens) - n))
