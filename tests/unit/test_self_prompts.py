"""Self-written training prompts (train/self_prompts.py): the filter's rules and counts, and the evaluation-set
n-gram check, on generated text and on the real evaluation files where ../shared/data exists."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specserve.train.data import Conversation, read_conversations
from specserve.train.self_prompts import (
    MARKUP,
    MIN_CHARS,
    SOURCE,
    Decontaminator,
    _normalised,
    eval_texts,
    select,
    write,
)

SHARED_DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"
EVAL_FILES = [SHARED_DATA / "mt_bench/question.jsonl", SHARED_DATA / "humaneval/HumanEval.jsonl.gz",
              SHARED_DATA / "gsm8k/test.jsonl"]
needs_shared_data = pytest.mark.skipif(not all(f.exists() for f in EVAL_FILES),
                                       reason="../shared/data is not present")

WORDS = st.sampled_from(["alpha", "beta", "gamma", "delta", "omega", "sigma", "kappa", "theta", "zeta", "iota"])
TEXTS = st.lists(WORDS, min_size=1, max_size=14).map(" ".join)


@settings(max_examples=200, deadline=None)
@given(evals=st.lists(TEXTS, min_size=1, max_size=5), pick=st.integers(0, 4), before=TEXTS, after=TEXTS,
       n=st.integers(1, 8))
def test_a_text_holding_an_evaluation_prompt_is_contaminated(evals, pick, before, after, n) -> None:
    """Any text that contains a whole evaluation prompt of >= min_words words (inside other words, in other case
    and spacing) is caught, whatever n; every prompt itself is caught, however short."""
    dec = Decontaminator(evals, n=n)
    target = evals[pick % len(evals)]
    assert target in dec and f" {target.upper()}." in dec
    if len(target.split()) >= 4:
        assert f"{before}  {target.upper()}, {after}" in dec


@settings(max_examples=200, deadline=None)
@given(evals=st.lists(TEXTS, min_size=1, max_size=5), text=TEXTS, n=st.integers(1, 8))
def test_contamination_is_exactly_a_shared_n_gram(evals, text, n) -> None:
    """The check is the definition: a shared run of min(n, len) words of an evaluation prompt of >= 4 words, or
    the same word sequence as a whole prompt."""
    def grams(words, k):
        return {tuple(words[i:i + k]) for i in range(len(words) - k + 1)}
    words = text.split()
    expected = any(" ".join(words) == e for e in evals) or any(
        len(e.split()) >= 4 and grams(e.split(), min(n, len(e.split()))) & grams(words, min(n, len(e.split())))
        for e in evals)
    assert (text in Decontaminator(evals, n=n)) == bool(expected)


GENERATED = st.lists(st.tuples(st.one_of(TEXTS, st.sampled_from(["", "hi", "  Beta  alpha gamma ", *MARKUP]),
                                         TEXTS.map(lambda t: t + " <|im_end|>")),
                               st.sampled_from(["stop", "length", None])), max_size=40)


@settings(max_examples=200, deadline=None)
@given(generated=GENERATED, evals=st.lists(TEXTS, max_size=3))
def test_select_keeps_first_clean_unique_requests_and_counts_every_one(generated, evals) -> None:
    dec = Decontaminator(evals)
    kept, stats = select(generated, dec)
    dropped = sum(v for k, v in stats.items() if k not in ("generated", "kept"))
    assert stats["generated"] == len(generated) and stats["kept"] == len(kept) and len(kept) + dropped == len(generated)
    assert len({_normalised(t) for t in kept}) == len(kept)
    for text in kept:
        assert len(text) >= MIN_CHARS and text == text.strip() and not any(m in text for m in MARKUP)
        assert text not in dec
    # kept in generation order, each the first stopped occurrence of its text
    stopped = [t.strip() for t, r in generated if r == "stop"]
    assert [stopped.index(t) for t in kept] == sorted(stopped.index(t) for t in kept)
    firsts = {}
    for t in stopped:
        firsts.setdefault(_normalised(t), t)
    assert all(firsts[_normalised(t)] == t for t in kept)


def test_select_example() -> None:
    generated = [("Write a poem about rain.", "stop"), ("write a poem  about RAIN!", "stop"),
                 ("A run-on text that never ended", "length"), ("Hi", "stop"),
                 ("What is <|im_start|> for?", "stop"),
                 ("How many clips did Natalia sell altogether in April and May?", "stop"),
                 ("Plan a trip to Kyoto.", "stop")]
    kept, stats = select(generated, Decontaminator(["Natalia sold clips to 48 of her friends in April, and then "
                                                    "she sold half as many clips in May. How many clips did Natalia "
                                                    "sell altogether in April and May?"]))
    assert kept == ["Write a poem about rain.", "Plan a trip to Kyoto."]
    assert stats == {"generated": 7, "kept": 2, "cut_at_max_tokens": 1, "too_short": 1, "markup": 1,
                     "duplicate": 1, "contaminated": 1}


def test_written_prompts_read_back_as_conversations(tmp_path) -> None:
    convs = [Conversation(["Plan a trip to Kyoto."], source=SOURCE),
             Conversation(["Write a haiku."], system="Be brief.", source=SOURCE)]
    write(convs, tmp_path / "p.jsonl.gz")
    back = read_conversations(tmp_path / "p.jsonl.gz")
    assert [(c.user_turns, c.system) for c in back] == [(c.user_turns, c.system) for c in convs]
    with gzip.open(tmp_path / "p.jsonl.gz", "rt") as f:
        assert all(json.loads(line)["source"] == SOURCE for line in f)


@needs_shared_data
def test_the_evaluation_sets_prompts_are_all_read_and_caught() -> None:
    texts = eval_texts(EVAL_FILES)
    assert len(texts) == 80 * 2 + 164 + 1319  # MT-Bench turns, HumanEval prompts, GSM8K test questions
    dec = Decontaminator(texts)
    # each prompt, inside other text and with its punctuation and line breaks changed, is still caught
    assert all(f"Some words first: {' '.join(t.replace('?', ' ').split())}; more after." in dec for t in texts
               if len(t.split()) >= 4)
    assert "Compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural" \
           " experiences and must-see attractions." in dec
    assert "Plan a three-day trip to Kyoto for a family with two children." not in dec


def test_eval_texts_reads_any_prompt_format_and_refuses_a_file_without_prompts(tmp_path) -> None:
    (tmp_path / "q.jsonl").write_text(json.dumps({"turns": ["First turn here.", "Second turn here."]}) + "\n"
                                      + json.dumps({"question": "How many apples?", "answer": "3"}) + "\n")
    (tmp_path / "c.json").write_text(json.dumps([{"conversations": [{"from": "human", "value": "Hello there"},
                                                                   {"from": "gpt", "value": "Hi"}]}]))
    (tmp_path / "p.txt").write_text("a plain prompt\n\n")
    assert eval_texts([tmp_path / "q.jsonl", tmp_path / "c.json", tmp_path / "p.txt"]) == [
        "First turn here.", "Second turn here.", "How many apples?", "Hello there", "a plain prompt"]
    (tmp_path / "none.jsonl").write_text(json.dumps({"answer": "3"}) + "\n")
    with pytest.raises(ValueError, match="none.jsonl holds no prompts"):
        eval_texts([tmp_path / "none.jsonl"])


def test_a_wordless_evaluation_prompt_matches_nothing() -> None:
    dec = Decontaminator(["", "?!", "Describe five key principles of evaluation"])
    assert "!!!" not in dec and "" not in dec and "describe FIVE key principles, of evaluation" in dec
