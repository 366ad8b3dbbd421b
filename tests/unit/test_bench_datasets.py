"""Benchmark datasets: the named sets read from the shared data directory (never copied into the repo) and
``jsonl:PATH`` files in every supported row shape."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from specserve.bench.datasets import DATA_DIR_ENV, HUMANEVAL_INSTRUCTION, load_prompts, select_prompts

SHARED_DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"
needs_shared_data = pytest.mark.skipif(not (SHARED_DATA / "mt_bench").is_dir(),
                                       reason="../shared/data is not present")


@needs_shared_data
@pytest.mark.parametrize("name, count", [("mt_bench", 80), ("humaneval", 164), ("gsm8k", 1319), ("sharegpt", 1000)])
def test_named_sets(name: str, count: int) -> None:
    prompts = load_prompts(name, SHARED_DATA)
    assert len(prompts) == count
    assert all(p.dataset == name and p.text.strip() and p.messages[-1]["role"] == "user" for p in prompts)


@needs_shared_data
def test_named_set_contents() -> None:
    first_mt = json.loads((SHARED_DATA / "mt_bench" / "question.jsonl").read_text().splitlines()[0])
    assert load_prompts("mt_bench", SHARED_DATA)[0].text == first_mt["turns"][0]
    he = load_prompts("humaneval", SHARED_DATA)[0]
    assert he.text.startswith("from typing import List")
    assert he.messages[0]["content"] == HUMANEVAL_INSTRUCTION + he.text
    assert load_prompts("gsm8k", SHARED_DATA)[0].text.startswith("Janet")


@needs_shared_data
def test_data_dir_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(DATA_DIR_ENV, str(SHARED_DATA))
    assert len(load_prompts("mt_bench")) == 80


def test_named_set_without_data_dir_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(DATA_DIR_ENV, raising=False)
    with pytest.raises(ValueError, match="SPECSERVE_DATA_DIR"):
        load_prompts("mt_bench")
    with pytest.raises(ValueError, match="not found"):
        load_prompts("gsm8k", tmp_path)
    with pytest.raises(ValueError, match="expected one of"):
        load_prompts("nope", tmp_path)
    with pytest.raises(ValueError, match="no such file"):
        load_prompts(f"jsonl:{tmp_path / 'missing.jsonl'}")


def test_jsonl_row_shapes(tmp_path: Path) -> None:
    rows = [
        "plain string",
        {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "chat q"}]},
        {"conversations": [{"from": "gpt", "value": "x"}, {"from": "human", "value": "sharegpt q"}]},
        {"turns": ["mt turn 1", "mt turn 2"]},
        {"instruction": "alpaca", "input": "ctx"},
        {"prompt": "p"}, {"question": "q"}, {"text": "t"},
        {"unrelated": 1}, {"prompt": "   "},  # skipped: no prompt field / blank
    ]
    path = tmp_path / "mix.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    prompts = load_prompts(f"jsonl:{path}")
    assert [p.text for p in prompts] == ["plain string", "chat q", "sharegpt q", "mt turn 1", "alpaca\n\nctx",
                                         "p", "q", "t"]
    assert prompts[1].messages[0] == {"role": "system", "content": "be brief"} and len(prompts[1].messages) == 2
    assert [p.row for p in prompts] == [0, 1, 2, 3, 4, 5, 6, 7]
    assert prompts[0].dataset == "mix"


def test_json_list_and_gzip(tmp_path: Path) -> None:
    (tmp_path / "a.json").write_text(json.dumps([{"prompt": "one"}, {"prompt": "two"}]))
    with gzip.open(tmp_path / "b.jsonl.gz", "wt") as f:
        f.write(json.dumps({"question": "zipped"}) + "\n")
    assert [p.text for p in load_prompts(f"jsonl:{tmp_path / 'a.json'}")] == ["one", "two"]
    assert [p.text for p in load_prompts(f"jsonl:{tmp_path / 'b.jsonl.gz'}")] == ["zipped"]


def test_select_prompts_cycles_and_shuffles(tmp_path: Path) -> None:
    (tmp_path / "n.jsonl").write_text("\n".join(json.dumps(str(i)) for i in range(5)))
    prompts = load_prompts(f"jsonl:{tmp_path / 'n.jsonl'}")
    assert [p.text for p in select_prompts(prompts, 7)] == ["0", "1", "2", "3", "4", "0", "1"]
    shuffled = [p.text for p in select_prompts(prompts, 5, shuffle=True, seed=1)]
    assert sorted(shuffled) == ["0", "1", "2", "3", "4"] and shuffled != ["0", "1", "2", "3", "4"]
    assert shuffled == [p.text for p in select_prompts(prompts, 5, shuffle=True, seed=1)]
    with pytest.raises(ValueError):
        select_prompts(prompts, 0)
