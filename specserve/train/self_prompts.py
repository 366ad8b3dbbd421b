"""Self-written training prompts: the target writes user requests itself, then answers them (Magpie: Xu et al.,
"Magpie: Alignment Data Synthesis from Scratch by Prompting Aligned LLMs with Nothing", arXiv 2406.08464).

Why. A draft head learns the target's answers (EAGLE-3, Li et al., arXiv 2503.01840), so what matters is that the
target is asked the kinds of request it will serve. The permitted prompt files hold a few thousand chat requests,
and the head's acceptance on MT-Bench lags its held-out estimate by a generalisation gap (the model card's stop-21
diagnostic). An instruction-tuned model given its chat template up to the point where a user's text starts goes on
with a user request of the kind it was tuned on; sampled many times, that yields as many chat requests as a run
wants, written by the target itself (no dataset text), from the request distribution its own tuning saw.

Worked example (SmolLM2-135M-Instruct's template; no system prompt given, so the template writes its default one):

    pre-query text  "<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                    "<|im_end|>\\n<|im_start|>user\\n"
    sampled         "I'm considering a career change and need some advice on how to be an ethical business
                    consultant. What are some ways I can make a good starting point?<|im_end|>"
    kept            Conversation(["I'm considering a career change ... starting point?"], source="self_prompts")

A request is kept (``select``) when its generation ended with the end-of-turn token (not cut at ``max_tokens``:
those are mostly run-on text), it has at least ``MIN_CHARS`` characters and no control token before that end
(``<|im_start|>``, ``<|endoftext|>``, ...: ``synthesize`` decodes with them kept, so they show as markup), it is
the first with its words (lower-cased ``\\w+`` runs: case, spacing and punctuation aside) and it shares no word
n-gram with an evaluation prompt or a held-out training prompt (``Decontaminator``), so that no evaluation request
is trained on even if the target met it in its own tuning.
"""

from __future__ import annotations

import gzip
import json
import re
import time
from collections.abc import Iterable
from pathlib import Path

from specserve.sampling import SamplingParams
from specserve.train.data import Conversation, _records, conversation_from_record

SOURCE = "self_prompts"  # Conversation.source of every self-written request (``answers_per_source`` matches it)
MIN_CHARS = 12
EXAMPLES = 20  # kept requests quoted in the stats
MARKUP = ("<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|start_header_id|>")
_MARKER = "\u0000"  # stands in for the user's text while the template is rendered


def pre_query_ids(tokenizer, system: str | None = None) -> list[int]:
    """The chat template rendered up to where the first user message's text starts (the template's default
    system prompt included when ``system`` is None)."""
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": _MARKER}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=False)
    if _MARKER not in text:
        raise ValueError("chat template: the user's text does not appear in the rendered chat")
    return tokenizer.encode(text[:text.index(_MARKER)])


def _words(text: str) -> list[str]:
    return re.findall(r"\w+", text.lower())


def _normalised(text: str) -> str:
    """The text's words, lower-cased: "Write a poem about rain!" and "write a poem about RAIN." are one request."""
    return " ".join(_words(text))


class Decontaminator:
    """Word n-grams of evaluation prompts; a text that contains one is contaminated.

    Each evaluation prompt contributes its n-grams of ``n`` words (lower-cased ``\\w+`` words), or, when it has
    fewer than ``n`` words but at least ``min_words``, its whole word sequence; shorter prompts are matched only
    as a whole text. Example with n = 3: "Describe five key principles" gives ("describe", "five", "key") and
    ("five", "key", "principles"); "Please describe five key ideas" contains the first, so it is contaminated."""

    def __init__(self, texts: Iterable[str], n: int = 8, min_words: int = 4) -> None:
        if n < 1 or min_words < 1:
            raise ValueError("n and min_words: must be >= 1")
        self.grams: dict[int, set[tuple[str, ...]]] = {}
        self.whole: set[str] = set()
        for text in texts:
            words = _words(text)
            if not words:  # nothing to match (an empty prompt would match every wordless text)
                continue
            self.whole.add(" ".join(words))
            if len(words) < min_words:
                continue
            k = min(n, len(words))
            self.grams.setdefault(k, set()).update(tuple(words[i:i + k]) for i in range(len(words) - k + 1))

    def __contains__(self, text: str) -> bool:
        words = _words(text)
        if " ".join(words) in self.whole:
            return True
        return any(tuple(words[i:i + k]) in grams for k, grams in self.grams.items()
                   for i in range(len(words) - k + 1))


def eval_texts(paths: Iterable[str | Path]) -> list[str]:
    """The prompts of evaluation files, for ``Decontaminator``: every string under ``turns`` (MT-Bench), the
    user turns of any other record ``train/data.py`` reads (HumanEval's ``prompt``, GSM8K's ``question``,
    ShareGPT, Alpaca, plain text). A file without a single prompt is an error: it would check nothing."""
    out: list[str] = []
    for path in map(Path, paths):
        found: list[str] = []
        for record in _records(path):
            turns = record.get("turns") if isinstance(record, dict) else None
            if isinstance(turns, list):
                found += [t for t in turns if isinstance(t, str)]
            elif (conv := conversation_from_record(record)) is not None:
                found += conv.user_turns
        if not found:
            raise ValueError(f"decontaminate: {path} holds no prompts (MT-Bench turns, prompt, question, ...)")
        out += found
    return out


def select(generated: list[tuple[str, str | None]], decontaminator: Decontaminator | None = None,
           markup: Iterable[str] = MARKUP) -> tuple[list[str], dict]:
    """(kept requests, stats) from ``(text, finish_reason)`` pairs in order, each text decoded with its control
    tokens kept (``markup``: their texts); see the module doc for the rules. Every pair is counted once: ``kept``
    plus the dropped counts equal ``generated``."""
    markup = tuple(markup)
    stats = {"generated": len(generated), "kept": 0, "cut_at_max_tokens": 0, "too_short": 0, "markup": 0,
             "duplicate": 0, "contaminated": 0}
    kept: list[str] = []
    seen: set[str] = set()
    for text, reason in generated:
        text = text.strip()
        key = _normalised(text)
        if reason != "stop":
            stats["cut_at_max_tokens"] += 1
        elif len(text) < MIN_CHARS:
            stats["too_short"] += 1
        elif any(m in text for m in markup):
            stats["markup"] += 1
        elif key in seen:
            stats["duplicate"] += 1
        elif decontaminator is not None and text in decontaminator:
            stats["contaminated"] += 1
        else:
            seen.add(key)
            kept.append(text)
    stats["kept"] = len(kept)
    return kept, stats


def synthesize(engine, tokenizer, n: int, max_tokens: int = 256, temperature: float = 1.0, top_p: float = 0.95,
               seed: int = 0, system: str | None = None, decontaminator: Decontaminator | None = None,
               ) -> tuple[list[Conversation], dict]:
    """``n`` requests sampled from the target after ``pre_query_ids`` (request ``i`` with seed ``seed + i``),
    filtered by ``select``; returns one single-turn conversation per kept request (``source = SOURCE``, the
    template's default system prompt, as at serving time) and the stats (plus generated tokens, seconds and the
    first ``EXAMPLES`` kept requests)."""
    if n < 0:
        raise ValueError("n: must be >= 0")
    start = time.perf_counter()
    ids = pre_query_ids(tokenizer, system)
    params = [SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed + i)
              for i in range(n)]
    reqs = engine.generate([ids] * n, params) if n else []
    special = tokenizer.special_token_ids
    markup = {*MARKUP, *(tokenizer.decode([i], skip_special_tokens=False) for i in special)}
    kept, stats = select([(request_text(tokenizer, r.output_ids, r.finish_reason), r.finish_reason) for r in reqs],
                         decontaminator, markup)
    stats["examples"] = kept[:EXAMPLES]
    stats["generated_tokens"] = sum(len(r.output_ids) for r in reqs)
    stats["seconds"] = time.perf_counter() - start
    return [Conversation([text], system=system, source=SOURCE) for text in kept], stats


def request_text(tokenizer, output_ids: list[int], finish_reason: str | None) -> str:
    """A sampled request's text with its control tokens kept (the end-of-turn token that ended it dropped)."""
    if finish_reason == "stop" and output_ids and output_ids[-1] in tokenizer.eos_token_ids:
        output_ids = output_ids[:-1]
    return tokenizer.decode(output_ids, skip_special_tokens=False)


def write(conversations: list[Conversation], path: str | Path) -> None:
    """ShareGPT-style JSON lines (gzipped for a ``.gz`` path), readable by ``train/data.py``."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "wt", encoding="utf-8") as f:
        for conv in conversations:
            turns = ([{"from": "system", "value": conv.system}] if conv.system else []) + \
                [{"from": "human", "value": t} for t in conv.user_turns]
            f.write(json.dumps({"conversations": turns, "source": conv.source}) + "\n")
