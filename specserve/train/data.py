"""Prompt sources for draft-head training: every file becomes a list of conversations whose user turns are
kept and whose assistant turns the target will regenerate (``train/generate.py``), so the head learns the
target's own distribution, not the one that wrote the dataset (EAGLE-3, arXiv 2503.01840, section 4).

Formats, recognised per record (a JSON array, JSON lines, or a ``.txt`` file):

    ShareGPT     {"conversations": [{"from": "human", "value": ...}, {"from": "gpt", ...}, ...]}
                 (also "messages": [{"role": "user", "content": ...}, ...])
    Alpaca       {"instruction": ..., "input": ..., "output" | "response": ...}
    prompt       {"prompt": ..., "completion": ...}, and {"question": ..., "answer": ...} (GSM8K)
    plain text   one prompt per non-empty line

A conversation is the list of its user turns (system prompts kept first). The file's own assistant text is
kept apart in ``answers`` (``answers[i]`` follows user turn ``i``; the list stops at the first turn without
one): regeneration never sees it; ``generate.dataset_samples`` can add it as off-policy text on which the
target's own distribution is still the label (EAGLE, arXiv 2401.15077, trains on fixed data this way).
"""

from __future__ import annotations

import gzip
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# File names that must never be trained on (the evaluation sets), whatever directory they are in.
EVAL_FILE_MARKERS = ("mt_bench", "humaneval", "HumanEval", "gsm8k/test", "test.jsonl", "test_socratic")

_ROLE = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
         "bing": "assistant", "bard": "assistant", "system": "system"}


@dataclass
class Conversation:
    """User turns to answer, in order; ``system`` is rendered before the first one."""

    user_turns: list[str]
    system: str | None = None
    source: str = ""
    answers: list[str] = field(default_factory=list)  # the dataset's own assistant turns, see the module doc
    meta: dict[str, Any] = field(default_factory=dict)


def _records(path: Path) -> list[Any]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        text = f.read()
    stem = path.name.removesuffix(".gz")
    if stem.endswith(".txt"):
        return [line.strip() for line in text.splitlines() if line.strip()]
    stripped = text.lstrip()
    if stripped.startswith("["):
        return json.loads(text)
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def conversation_from_record(record: Any, source: str = "") -> Conversation | None:
    """One record in any of the formats above -> a conversation, or None when it has no user text."""
    if isinstance(record, str):
        return Conversation([record], source=source) if record.strip() else None
    if not isinstance(record, dict):
        return None
    turns = record.get("conversations") or record.get("messages")
    if isinstance(turns, list):
        users: list[str] = []
        answers: list[str] = []
        system = None
        for t in turns:
            if not isinstance(t, dict):
                continue
            role = _ROLE.get(str(t.get("from", t.get("role", ""))).lower())
            text = t.get("value", t.get("content"))
            if not isinstance(text, str) or not text.strip():
                continue
            if role == "system" and not users:
                system = text
            elif role == "user":
                users.append(text)
            elif role == "assistant" and users and len(answers) == len(users) - 1:
                answers.append(text)  # the answer to the latest user turn (two in a row: the first is kept)
        return Conversation(users, system, source, answers[:len(users)]) if users else None
    if "instruction" in record:
        extra = record.get("input") or ""
        text = record["instruction"] + (f"\n\n{extra}" if extra.strip() else "")
        return Conversation([text], source=source, answers=_answer(record, "output", "response")) \
            if text.strip() else None
    for key, answer_keys in (("prompt", ("completion",)), ("question", ("answer",)), ("text", ())):
        if isinstance(record.get(key), str) and record[key].strip():
            return Conversation([record[key]], source=source, answers=_answer(record, *answer_keys))
    return None


def _answer(record: dict, *keys: str) -> list[str]:
    for key in keys:
        if isinstance(record.get(key), str) and record[key].strip():
            return [record[key]]
    return []


def read_conversations(path: str | Path, limit: int | None = None, max_turns: int = 3,
                       seed: int = 0) -> list[Conversation]:
    """Every conversation of one file (a random ``limit`` of them when given), each cut to ``max_turns`` user
    turns. Refuses evaluation sets (MT-Bench, HumanEval, GSM8K test) by name."""
    path = Path(path)
    if any(m in str(path) for m in EVAL_FILE_MARKERS):
        raise ValueError(f"prompts: {path} is an evaluation set; training on it would inflate the measured "
                         f"acceptance")
    out = []
    for record in _records(path):
        conv = conversation_from_record(record, path.name)
        if conv is not None:
            conv.user_turns = conv.user_turns[:max_turns]
            conv.answers = conv.answers[:max_turns]
            out.append(conv)
    if limit is not None and len(out) > limit:
        out = random.Random(seed).sample(out, limit)
    return out


def expand_paths(paths: list[str | Path]) -> list[Path]:
    """Files as given, directories expanded to their .json / .jsonl / .txt files (sorted)."""
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            files += sorted(f for f in p.iterdir() if f.suffix in (".json", ".jsonl", ".txt", ".gz")
                            and f.name not in ("package.json",))
        elif p.exists():
            files.append(p)
        else:
            raise FileNotFoundError(f"prompts: {p} does not exist")
    return files


def split_held_out(items: list, fraction: float, seed: int = 0) -> tuple[list, list]:
    """(train, held_out): a seeded random ``fraction`` held out (at least one item when fraction > 0)."""
    order = list(range(len(items)))
    random.Random(seed).shuffle(order)
    n_held = min(len(items) - 1, max(1, round(fraction * len(items)))) if fraction > 0 and len(items) > 1 else 0
    held = set(order[:n_held])
    return [x for i, x in enumerate(items) if i not in held], [x for i, x in enumerate(items) if i in held]
