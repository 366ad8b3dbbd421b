"""Benchmark prompts, read from files at run time (nothing is copied into the repository).

Named sets resolve under a data directory (``--data-dir``, default ``$SPECSERVE_DATA_DIR``; the project's is
``../shared/data``, each folder documented by its SOURCE.md):

- ``mt_bench``: ``mt_bench/question.jsonl``, the first turn of each of the 80 questions;
- ``humaneval``: ``humaneval/HumanEval.jsonl.gz``, each function stub wrapped in a one-line instruction (chat) or
  sent raw (completions);
- ``gsm8k``: ``gsm8k/test.jsonl``, the question alone;
- ``sharegpt``: ``sharegpt/sharegpt_v3_filtered_first_turn_1000.json``, the first human turn.

``jsonl:PATH`` reads any ``.jsonl``, ``.json`` (a list) or ``.gz`` file whose rows are strings or objects with
one of: ``messages`` (OpenAI chat), ``conversations`` (ShareGPT ``from``/``value``; the first human turn),
``turns`` (MT-Bench; the first), ``prompt``, ``question``, ``instruction`` (+ ``input``, Alpaca) or ``text``.
"""

from __future__ import annotations

import gzip
import json
import os
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DATA_DIR_ENV = "SPECSERVE_DATA_DIR"
NAMED_DATASETS = {
    "mt_bench": "mt_bench/question.jsonl",
    "humaneval": "humaneval/HumanEval.jsonl.gz",
    "gsm8k": "gsm8k/test.jsonl",
    "sharegpt": "sharegpt/sharegpt_v3_filtered_first_turn_1000.json",
}
HUMANEVAL_INSTRUCTION = "Complete the following Python function.\n\n"


@dataclass(frozen=True)
class BenchPrompt:
    """One prompt: ``text`` is what a completions request sends, ``messages`` what a chat request sends."""

    dataset: str
    row: int  # index of the source row in the file
    text: str
    messages: list[dict[str, str]] = field(default_factory=list)


def resolve_dataset(spec: str, data_dir: str | Path | None) -> tuple[str, Path]:
    """(dataset name, file path) for ``spec`` (a named set or ``jsonl:PATH``); raises ValueError naming the problem."""
    if spec.startswith("jsonl:"):
        path = Path(spec.removeprefix("jsonl:")).expanduser()
        if not path.is_file():
            raise ValueError(f"--dataset {spec}: no such file {path}")
        return path.stem.removesuffix(".jsonl"), path
    if spec not in NAMED_DATASETS:
        raise ValueError(f"--dataset {spec!r}: expected one of {sorted(NAMED_DATASETS)} or jsonl:PATH")
    root = data_dir if data_dir is not None else os.environ.get(DATA_DIR_ENV)
    if not root:
        raise ValueError(f"--dataset {spec}: named sets are read from --data-dir or ${DATA_DIR_ENV}; neither is set")
    path = Path(root).expanduser() / NAMED_DATASETS[spec]
    if not path.is_file():
        raise ValueError(f"--dataset {spec}: {path} not found (is --data-dir right?)")
    return spec, path


def load_prompts(spec: str, data_dir: str | Path | None = None) -> list[BenchPrompt]:
    """Every usable prompt of a dataset, in file order."""
    name, path = resolve_dataset(spec, data_dir)
    prompts = []
    for row, obj in enumerate(_read_rows(path)):
        prompt = _prompt_of(name, row, obj)
        if prompt is not None and prompt.text.strip():
            prompts.append(prompt)
    if not prompts:
        raise ValueError(f"--dataset {spec}: no prompts found in {path}")
    return prompts


def select_prompts(prompts: list[BenchPrompt], num_prompts: int, *, shuffle: bool = False,
                   seed: int = 0) -> list[BenchPrompt]:
    """``num_prompts`` prompts: the first ones (or a seeded shuffle), cycling when the set is smaller."""
    if num_prompts < 1:
        raise ValueError("--num-prompts must be >= 1")
    order = list(prompts)
    if shuffle:
        random.Random(seed).shuffle(order)
    return [order[i % len(order)] for i in range(num_prompts)]


def _read_rows(path: Path) -> Iterator[Any]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        text = f.read()
    stripped = text.lstrip()
    if stripped.startswith("["):
        yield from json.loads(text)
        return
    for line in text.splitlines():
        if line.strip():
            yield json.loads(line)


def _chat(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def _prompt_of(name: str, row: int, obj: Any) -> BenchPrompt | None:
    if name == "humaneval" and isinstance(obj, dict) and "prompt" in obj and "task_id" in obj:
        return BenchPrompt(name, row, obj["prompt"], _chat(HUMANEVAL_INSTRUCTION + obj["prompt"]))
    if isinstance(obj, str):
        return BenchPrompt(name, row, obj, _chat(obj))
    if not isinstance(obj, dict):
        return None
    if isinstance(obj.get("messages"), list) and obj["messages"]:
        messages = [{"role": str(m["role"]), "content": str(m["content"])} for m in obj["messages"]]
        last_user = next((m["content"] for m in reversed(messages) if m["role"] == "user"), messages[-1]["content"])
        return BenchPrompt(name, row, last_user, messages)
    if isinstance(obj.get("conversations"), list):
        first = next((t.get("value", "") for t in obj["conversations"] if t.get("from") in ("human", "user")), None)
        return None if first is None else BenchPrompt(name, row, first, _chat(first))
    if isinstance(obj.get("turns"), list) and obj["turns"]:
        return BenchPrompt(name, row, obj["turns"][0], _chat(obj["turns"][0]))
    if isinstance(obj.get("instruction"), str):
        text = obj["instruction"] + (f"\n\n{obj['input']}" if obj.get("input") else "")
        return BenchPrompt(name, row, text, _chat(text))
    for key in ("prompt", "question", "text"):
        if isinstance(obj.get(key), str):
            return BenchPrompt(name, row, obj[key], _chat(obj[key]))
    return None
