"""Training data for a draft head: the target answers every user turn itself, with our engine (continuous
batching, paged KV), greedy for most conversations and sampled for a share of them. The head then learns
to predict what the target will actually say (EAGLE-3, arXiv 2503.01840; Medusa, arXiv 2401.10774, calls
this self-distillation).

A conversation with three user turns gives three samples: round ``r`` renders the system prompt, the user
turns ``0 .. r`` and the target's own answers to turns ``0 .. r - 1`` with the chat template, and the sample
is ``prompt ids + answer ids``; only the answer is trained on (``num_prompt`` marks where it starts).

Samples are stored flat (``save_samples``): one int32 array of every token, offsets, and prompt lengths.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from specserve.sampling import SamplingParams
from specserve.train.data import Conversation


@dataclass
class Sample:
    token_ids: list[int]  # prompt + generated answer
    num_prompt: int  # tokens before the answer


def render_prompt(tokenizer, conv: Conversation, answers: list[str], turn: int) -> list[int]:
    messages = [{"role": "system", "content": conv.system}] if conv.system else []
    for i in range(turn + 1):
        messages.append({"role": "user", "content": conv.user_turns[i]})
        if i < turn:
            messages.append({"role": "assistant", "content": answers[i]})
    return tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True))


def regenerate(engine, tokenizer, conversations: list[Conversation], max_new_tokens: int,
               sampled_fraction: float, temperature: float, seed: int = 0, max_in_flight: int = 1024,
               max_seconds: float | None = None, progress: bool = True,
               answers_per_conversation: int | list[int] = 1) -> tuple[list[Sample], dict]:
    """Answer every user turn of every conversation with ``engine``; returns (samples, stats). Conversation
    ``i`` is sampled (seed ``seed + i``) when ``i`` falls in the first ``sampled_fraction`` of a seeded
    permutation, greedy otherwise. ``answers_per_conversation`` (one count for all, or one per conversation):
    conversation ``i`` with c_i > 1 answers is answered again in passes ``r`` = 1 .. c_i - 1, sampled with seed
    ``seed + r * n + i`` (n conversations).

    The answers start pass by pass, each pass in conversation order, at most ``max_in_flight`` conversations at
    a time; a conversation's next turn is submitted as soon as its previous answer is in, and a new
    conversation starts whenever one ends, so the engine's batch stays full (no turn waits for the slowest
    answer of a group). After ``max_seconds`` no new conversation starts and those started finish, so a
    cut-short run has answered a prefix of that order: every conversation of pass r - 1 before any of pass r
    (stats: ``answered`` of ``planned`` answers, ``sampled`` among them). Samples are in the order their
    answers finished. Prompts that leave no room for an answer are skipped (counted in stats)."""
    if max_in_flight < 1:
        raise ValueError("max_in_flight: must be >= 1")
    rng = np.random.default_rng(seed)
    n = len(conversations)
    counts = answers_per_conversation if isinstance(answers_per_conversation, list) else [answers_per_conversation] * n
    if len(counts) != n or min(counts, default=1) < 1:
        raise ValueError("answers_per_conversation: one count >= 1 per conversation")
    order = rng.permutation(n)
    first_sampled = set(order[:round(sampled_fraction * n)].tolist())
    # answer j of the run: pass r of conversation i, key r * n + i (its seed offset); every further pass sampled
    keys = [r * n + i for r in range(max(counts, default=1)) for i in range(n) if counts[i] > r]
    sampled = {j for j, key in enumerate(keys) if key >= n or key in first_sampled}
    conversations = [conversations[key % n] for key in keys]
    max_len = engine.config.scheduler.max_model_len
    samples: list[Sample] = []
    stats = {"conversations": n, "answers_per_conversation": max(counts, default=1),
             "planned": len(conversations), "answered": 0, "sampled": 0, "samples": 0, "skipped_long": 0,
             "generated_tokens": 0, "seconds": 0.0}
    start = time.perf_counter()
    answers: dict[int, list[str]] = {}  # conversations in flight -> their answers so far
    active: list[tuple[int, list[int], object]] = []  # (answer j, prompt ids, engine request) being answered

    def submit(j: int) -> None:
        """Answer j's next turn, or end answer j (every turn answered, or the prompt too long)."""
        turn = len(answers[j])
        if turn < len(conversations[j].user_turns):
            ids = render_prompt(tokenizer, conversations[j], answers[j], turn)
            if len(ids) + 16 <= max_len:
                params = SamplingParams(max_tokens=min(max_new_tokens, max_len - len(ids)),
                                        temperature=temperature if j in sampled else 0.0,
                                        seed=seed + keys[j] if j in sampled else None)
                rid = f"regen-{j}-{turn}-{time.monotonic_ns()}"
                engine.add_request(rid, ids, params)
                active.append((j, ids, engine.requests[rid]))
                return
            stats["skipped_long"] += 1
        del answers[j]
        bar.update(1)

    next_j = 0
    with tqdm(total=len(conversations), desc="generate", unit="answer", file=sys.stderr, disable=not progress,
              mininterval=5) as bar:
        while True:
            while (len(answers) < max_in_flight and next_j < len(conversations)
                   and (max_seconds is None or time.perf_counter() - start <= max_seconds)):
                answers[next_j] = []
                stats["answered"] += 1
                stats["sampled"] += next_j in sampled
                next_j += 1
                submit(next_j - 1)
            if not active:
                break
            engine.step()
            finished = [(j, ids, req) for j, ids, req in active if req.finished]
            active[:] = [entry for entry in active if not entry[2].finished]
            for j, ids, req in finished:
                samples.append(Sample(list(ids) + list(req.output_ids), len(ids)))
                answers[j].append(req.output_text)
                stats["generated_tokens"] += len(req.output_ids)
                submit(j)
            if progress:
                bar.set_postfix_str(f"{stats['generated_tokens'] / max(time.perf_counter() - start, 1e-9):.0f} "
                                    f"tok/s, {len(active)} in flight", refresh=False)
    stats["samples"] = len(samples)
    stats["seconds"] = time.perf_counter() - start
    return samples, stats


def dataset_samples(tokenizer, conversations: list[Conversation], max_len: int) -> tuple[list[Sample], dict]:
    """Off-policy samples from the dataset's own answers (``Conversation.answers``): turn ``t`` renders the
    conversation with the dataset's earlier answers, and its answer part is the chat template's rendering of
    the dataset's answer ``t`` (closing tokens included). The head still learns the target's distribution: the
    trainer's labels are the target's probabilities at every position, whoever wrote the text. Samples longer
    than ``max_len`` are cut there (they still train on the answer's start); turns whose prompt alone reaches
    it are skipped."""
    samples: list[Sample] = []
    stats = {"conversations": len(conversations), "samples": 0, "answer_tokens": 0, "skipped_long": 0,
             "skipped_template": 0}
    for conv in conversations:
        for turn in range(len(conv.answers)):
            prompt = render_prompt(tokenizer, conv, conv.answers, turn)
            if len(prompt) + 16 > max_len:
                stats["skipped_long"] += 1
                break
            messages = [{"role": "system", "content": conv.system}] if conv.system else []
            for i in range(turn + 1):
                messages += [{"role": "user", "content": conv.user_turns[i]},
                             {"role": "assistant", "content": conv.answers[i]}]
            full = tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=False))
            if full[:len(prompt)] != prompt or len(full) <= len(prompt):  # the template re-tokenised the seam
                stats["skipped_template"] += 1
                continue
            full = full[:max_len]
            samples.append(Sample(full, len(prompt)))
            stats["answer_tokens"] += len(full) - len(prompt)
    stats["samples"] = len(samples)
    return samples, stats


def save_samples(samples: list[Sample], path: str | Path) -> None:
    lengths = np.array([len(s.token_ids) for s in samples], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    tokens = np.array([t for s in samples for t in s.token_ids], dtype=np.int32)
    np.savez_compressed(path, tokens=tokens, offsets=offsets,
                        num_prompt=np.array([s.num_prompt for s in samples], dtype=np.int64))


def load_samples(path: str | Path) -> list[Sample]:
    with np.load(path) as z:
        tokens, offsets, num_prompt = z["tokens"], z["offsets"], z["num_prompt"]
    return [Sample(tokens[offsets[i]:offsets[i + 1]].tolist(), int(num_prompt[i])) for i in range(len(num_prompt))]
