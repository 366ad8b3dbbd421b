"""Task prompts (train/task_prompts.py): our instruction templates around passages of the permitted sources.
Built from small files in the real sources' formats; the real-data checks run where ../shared/data exists."""

from __future__ import annotations

import collections
import json
import re
from pathlib import Path

import pytest

from specserve.train import task_prompts as tp
from specserve.train.data import read_conversations

SHARED_DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"
needs_shared_data = pytest.mark.skipif(not (SHARED_DATA / "mt_bench").is_dir(),
                                       reason="../shared/data is not present")

WIKI = ("George Berkeley (1685-1753) was an Irish bishop. He argued that things exist only as perceived. "
        "His Treatise appeared in 1710 in Dublin.")
SCIENCE = ("Passive transport occurs when a substance passes through the cell membrane without energy. It moves "
           "from high to low concentration. Salt in water is an example.")
NEWS = "LONDON, England -- A young actor turned 18 on Monday and gained access to a fortune. He plans no party."
PLOT = "Two hundred years in the future, a police team travels to a mining camp on Mars and finds it deserted."


def _fake_sources(root: Path) -> Path:
    """One row per source in the formats of the T0 templates and the WMT file."""
    t0 = root / "t0_sum_qa"
    t0.mkdir(parents=True)
    rows = {
        "adversarial_qa_dbert_based_on.jsonl":
            f"Extract the answer to the question from the following context.\nQuestion: who?\nContext: {WIKI}\n",
        "quoref_Guess_Title_For_Context.jsonl":
            f"Given the below context:\n\n{WIKI} More.\n\nGuess a valid title for it!\n",
        "ropes_background_new_situation_answer.jsonl":
            f"I can use this background: {SCIENCE}\n\nNow, I have a new situation: two cups.\n\nAnswer: which?",
        "cnn_dailymail_3_0_0_write_an_outline.jsonl": f"Can you write an outline?\n\nArticle: {NEWS}\n",
        "duorc_SelfRC_title_generation.jsonl": f"Suggest a movie title for the following movie plot: {PLOT}\n",
    }
    for name, prompt in rows.items():
        (t0 / name).write_text(json.dumps({"prompt": prompt, "completion": "x"}) + "\n")
    wmt = root / "wmt_ende_opennmt"
    wmt.mkdir()
    (wmt / "src-train.en.txt").write_text(
        "It is not acceptable that Parliament &apos;s prerogative should be made null and void .\n"
        "Too short .\n"
        "The committee met in Brussels on Tuesday to discuss the budget for the coming year .\n")
    return root


def test_passages_and_sentences_are_cut_from_each_format(tmp_path) -> None:
    root = _fake_sources(tmp_path)
    passages = tp.load_passages(root)
    assert passages["wiki"] == sorted([WIKI, WIKI + " More."])
    assert passages["science"] == [SCIENCE]
    assert passages["news"] == [NEWS]
    assert passages["plot"] == [PLOT]
    assert tp.load_sentences(root) == [
        "It is not acceptable that Parliament's prerogative should be made null and void.",
        "The committee met in Brussels on Tuesday to discuss the budget for the coming year."]


def test_build_is_balanced_seeded_distinct_and_reads_back(tmp_path) -> None:
    root = _fake_sources(tmp_path)
    records = tp.build(root, n=36, seed=3)
    assert records == tp.build(root, n=36, seed=3)
    assert records != tp.build(root, n=36, seed=4)
    firsts = [r["conversations"][0]["value"] for r in records]
    assert len(set(firsts)) == len(firsts) == 36
    counts = collections.Counter(r["source"].split(":")[1] for r in records)
    assert set(counts) == set(tp.TEMPLATES) and max(counts.values()) - min(counts.values()) <= 1
    contents = [WIKI, WIKI + " More.", SCIENCE, NEWS, PLOT, *tp.load_sentences(root)]
    for r in records:
        first = r["conversations"][0]["value"]
        # every first turn is one of our templates around content that comes from the sources
        assert any(re.fullmatch(re.escape(t).replace(re.escape("{text}"), "(.+)"), first, re.S)
                   for ts in tp.TEMPLATES.values() for t, _ in ts), first
        assert any(piece in c for c in contents
                   for piece in [first.split("\n\n")[-1].strip('"'), first.split(": ", 1)[-1].strip('"')]), first
        assert all(t["value"] in tp.FOLLOW_UPS for t in r["conversations"][1:])
        assert len(r["conversations"]) <= 2
    follow = sum(len(r["conversations"]) == 2 for r in records) / len(records)
    assert 0.3 < follow < 0.7
    path = tmp_path / "tasks" / "task_prompts.jsonl.gz"
    tp.write(records, path)
    conversations = read_conversations(path, max_turns=8)
    assert [c.user_turns for c in conversations] == [[t["value"] for t in r["conversations"]] for r in records]
    assert all(not c.answers for c in conversations)


def test_build_names_a_folder_without_sources(tmp_path) -> None:
    (tmp_path / "t0_sum_qa").mkdir()
    (tmp_path / "wmt_ende_opennmt").mkdir()
    (tmp_path / "wmt_ende_opennmt" / "src-train.en.txt").write_text("")
    with pytest.raises(ValueError, match="no passages or sentences"):
        tp.build(tmp_path, n=5)


@needs_shared_data
def test_real_sources_give_every_category_and_share_no_wording_with_mt_bench() -> None:
    records = tp.build(SHARED_DATA, n=600)
    assert len(records) == 600
    assert set(collections.Counter(r["source"].split(":")[1] for r in records)) == set(tp.TEMPLATES)
    # decontamination: no 6-word run of our templates or follow-ups appears in an MT-Bench question
    def grams(text: str, n: int = 6) -> set[tuple[str, ...]]:
        words = re.findall(r"[a-z0-9']+", text.lower())
        return {tuple(words[i:i + n]) for i in range(len(words) - n + 1)}

    ours = set().union(*(grams(t.replace("{text}", " ")) for ts in tp.TEMPLATES.values() for t, _ in ts),
                       *(grams(f) for f in tp.FOLLOW_UPS))
    questions = [json.loads(line) for line in (SHARED_DATA / "mt_bench" / "question.jsonl").read_text().splitlines()]
    theirs = set().union(*(grams(turn) for q in questions for turn in q["turns"]))
    assert ours and theirs and not ours & theirs
