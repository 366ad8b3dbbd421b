"""``specserve train-draft``: prompts -> the target's own answers -> draft vocabulary -> trained head ->
speculators-format checkpoint, with a held-out acceptance estimate.

    specserve train-draft --target default --method eagle3 --prompts ../shared/data/gsm8k/train.jsonl \\
        --out heads/smollm2-eagle3

Files written under ``--out``: ``data_train.npz`` / ``data_held_out.npz`` (the generated samples; pass
``--data DIR`` to reuse them), ``checkpoint.pt`` (resumable), ``config.json`` + ``model*.safetensors``
(the head), ``train_report.json`` (data, vocabulary coverage, loss curve, held-out estimate).
"""

from __future__ import annotations

import json
import random
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from specserve.config import CacheConfig, EngineConfig, SchedulerConfig, TrainDraftConfig
from specserve.train.data import expand_paths, read_conversations, split_held_out
from specserve.train.generate import Sample, dataset_samples, load_samples, regenerate, render_prompt, save_samples
from specserve.train.trainer import Trainer
from specserve.train.vocab import coverage, draft_vocab, extend_vocab, token_counts


def load_conversations(cfg: TrainDraftConfig, prompt_files: list[Path], per_file_limit: int | None):
    """(train conversations, held-out conversations, conversations per file): every file's conversations,
    shuffled with the seed (a time-bounded run keeps a mix of every file) and split before any generation."""
    conversations = []
    per_file = {}
    for f in prompt_files:
        convs = read_conversations(f, per_file_limit, cfg.max_turns, cfg.seed)
        per_file[str(f)] = len(convs)
        conversations += convs
    random.Random(cfg.seed).shuffle(conversations)
    train, held = split_held_out(conversations, cfg.held_out_fraction, cfg.seed)
    return train, held, per_file


def generate_data(target_parts, cfg: TrainDraftConfig, prompt_files: list[Path], device: torch.device,
                  per_file_limit: int | None, max_model_len: int, max_num_seqs: int, kv_gib: float,
                  progress: bool = True, shard: tuple[int, int] = (0, 1),
                  held_out_from: list[Sample] | None = None, decontaminate: list[Path] | None = None):
    """(train samples, held-out samples, stats): held-out conversations are split off before generation.

    ``cfg.self_prompts`` > 0: the target first writes that many requests of its own (``train/self_prompts.py``;
    shard ``i`` of ``n`` writes its share with seeds of its own), none sharing a word n-gram with the prompts of
    the ``decontaminate`` files (the evaluation sets) or with a held-out user turn (so the held-out estimate stays
    held out); the kept ones join the training conversations (never the held-out split) in a seeded shuffle, so
    that a time-bounded run answers a mix of both. Writing them is not bounded by ``max_generate_seconds``.

    ``shard = (i, n)``: only training conversations ``i, i + n, i + 2n, ...`` are answered (n processes share
    one GPU; shard 0 alone answers the held-out ones), sampled with seeds of their own (``cfg.seed + i * 2^32``
    onwards, so that no two shards share a sampling stream). ``held_out_from``: an earlier run's held-out samples are
    the held-out split instead; every conversation whose first rendered prompt is one of theirs is dropped,
    and the rest all train, so that data generated from other prompt files is measured on the same held-out
    conversations as that run."""
    from specserve.engine.engine import LLMEngine

    train_convs, held_convs, per_file = load_conversations(cfg, prompt_files, per_file_limit)
    every_held = held_convs  # every shard keeps its self-written requests clear of all of them
    index, count = shard
    if not 0 <= index < count:
        raise ValueError(f"shard: index {index} not in 0..{count - 1}")
    model, model_config, tokenizer = target_parts
    dropped = 0
    if held_out_from is not None:
        seen = {tuple(s.token_ids[:s.num_prompt]) for s in held_out_from}
        convs = (train_convs + held_convs)[index::count]
        train_convs = [c for c in convs if tuple(render_prompt(tokenizer, c, [], 0)) not in seen]
        dropped, held_convs = len(convs) - len(train_convs), []
    else:
        train_convs, held_convs = train_convs[index::count], held_convs if index == 0 else []
    engine = LLMEngine(EngineConfig(device=str(device), cache=CacheConfig(kv_cache_memory_gib=kv_gib),
                                    scheduler=SchedulerConfig(max_num_seqs=max_num_seqs,
                                                              max_num_batched_tokens=max(8192, max_model_len),
                                                              max_model_len=max_model_len)),
                       model, model_config, tokenizer)
    stats = {"files": per_file, "shard": list(shard), "dropped_as_held_out": dropped}
    if cfg.self_prompts:
        from specserve.train.self_prompts import Decontaminator, eval_texts, synthesize

        if not decontaminate:
            print("warning: --self-prompts without --decontaminate: the target's requests are not checked against "
                  "the evaluation sets", file=sys.stderr)
        held_turns = [t for c in every_held for t in c.user_turns]
        if held_out_from is not None:  # the earlier run's held-out prompts, as rendered
            held_turns += [tokenizer.decode(s.token_ids[:s.num_prompt]) for s in held_out_from]
        share = cfg.self_prompts // count + (index < cfg.self_prompts % count)
        own, stats["self_prompts"] = synthesize(
            engine, tokenizer, share, cfg.self_prompt_max_tokens, cfg.self_prompt_temperature,
            cfg.self_prompt_top_p, seed=cfg.seed + (index << 32) + (1 << 31),
            decontaminator=Decontaminator(eval_texts(decontaminate or []) + held_turns))
        stats["self_prompts"]["decontaminated_against"] = [str(p) for p in decontaminate or []]
        train_convs = train_convs + own
        random.Random(cfg.seed + index).shuffle(train_convs)
    budget = cfg.max_generate_seconds or None
    if held_out_from is None:
        held, stats["held_out"] = regenerate(engine, tokenizer, held_convs, cfg.max_new_tokens, 0.0, 0.0,
                                             cfg.seed + 1, progress=progress)
    else:
        held, stats["held_out"] = held_out_from, {"reused_samples": len(held_out_from)}
    train, stats["train"] = regenerate(engine, tokenizer, train_convs, cfg.max_new_tokens, cfg.sampled_fraction,
                                       cfg.sampling_temperature, cfg.seed + (index << 32),
                                       max_in_flight=max_num_seqs * 4,
                                       max_seconds=budget, progress=progress,
                                       answers_per_conversation=[cfg.answers_for(c.source) for c in train_convs])
    return train, held, stats


HF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def export_head(head, out_dir: Path, verifier: str, dtype: torch.dtype = torch.bfloat16,
                max_shard_bytes: int = 48 << 20, verifier_architecture: str | None = None) -> list[str]:
    """Write the head in the speculators format, in ``dtype``, split into shards of at most
    ``max_shard_bytes`` (``model-0000k-of-0000n.safetensors`` + index) when larger. Returns the weight files."""
    import copy

    from specserve.spec.eagle_checkpoint import save_speculators

    target_embed = head.target_embed
    head.target_embed = None  # the target's table is not part of the head
    try:
        export = copy.deepcopy(head).to(dtype)
    finally:
        head.target_embed = target_embed
    export.d2t = head.d2t.clone()
    out_dir = Path(out_dir)
    for stale in out_dir.glob("model*.safetensors*"):  # an earlier export's files would be read too
        stale.unlink()
    archs = (HF_ARCHITECTURES[verifier_architecture],) if verifier_architecture else ()
    save_speculators(export, out_dir, verifier, max_shard_bytes, archs)
    return sorted(f.name for f in out_dir.glob("model*.safetensors"))


class NoSamplesError(ValueError):
    """Data generation gave no training or no held-out samples (too few prompts)."""


def train_draft(target: str, cfg: TrainDraftConfig, prompts: list[str], out_dir: str | Path, device_name: str,
                data_dir: str | list[str] | None = None, per_file_limit: int | None = None,
                max_model_len: int = 2048, max_num_seqs: int = 256, kv_gib: float = 8.0,
                progress: bool = True, extra_data: list[str] | None = None,
                decontaminate: list[str] | None = None) -> dict:
    """Generate (or reuse, ``data_dir``) samples, pick the draft vocabulary, train and export the head.
    ``extra_data``: directories of earlier runs' ``data_train.npz`` / ``data_held_out.npz``, both appended to
    the training split (never to the held-out one) after generation. ``decontaminate``: evaluation files whose
    prompts no self-written request (``cfg.self_prompts``) may share a word n-gram with."""
    from specserve.models.loader import load_model

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device(device_name)
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    t0 = time.perf_counter()
    parts = load_model(target, dtype, device, max_model_len)
    model, model_config, tokenizer = parts
    report: dict = {"target": target, "config": asdict(cfg), "device": device_name,
                    "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
    sources = [Path(d) for d in ([data_dir] if isinstance(data_dir, str) else data_dir or [])] or [out]
    if all((src / "data_train.npz").exists() for src in sources):  # earlier runs' samples, concatenated
        train = [s for src in sources for s in load_samples(src / "data_train.npz")]
        held = [s for src in sources for s in load_samples(src / "data_held_out.npz")]
        report["data"] = {"reused": [str(src) for src in sources]}
    else:
        train, held, report["data"] = generate_data(parts, cfg, expand_paths(prompts), device, per_file_limit,
                                                    max_model_len, max_num_seqs, kv_gib, progress,
                                                    decontaminate=[Path(p) for p in decontaminate or []])
        if not train or not held:  # saved, an empty set would be reused by the next run on this --out
            raise NoSamplesError(f"prompts: generation gave {len(train)} training and {len(held)} held-out samples; "
                             "give more prompts (--prompts, --self-prompts)")
        save_samples(train, out / "data_train.npz")
        save_samples(held, out / "data_held_out.npz")
    for src in map(Path, extra_data or []):
        extra = [s for name in ("data_train.npz", "data_held_out.npz") for s in load_samples(src / name)]
        train = train + extra
        report.setdefault("extra_data", {})[str(src)] = len(extra)
    report["num_train_samples"], report["num_held_out_samples"] = len(train), len(held)
    report["train_answer_tokens"] = sum(len(s.token_ids) - s.num_prompt for s in train)
    counts = token_counts(train, model_config.vocab_size)  # the target's own answers pick the draft vocabulary
    if cfg.init_head:  # a warm start keeps the trained head's tokens (its lm_head rows), widened to the size asked
        from specserve.train.trainer import init_head_draft_ids
        draft_ids = extend_vocab(init_head_draft_ids(cfg.init_head, model_config), counts,
                                 min(cfg.draft_vocab_size, model_config.vocab_size))
        report["init_head"] = cfg.init_head
    else:
        draft_ids = draft_vocab(counts, min(cfg.draft_vocab_size, model_config.vocab_size))
    report["draft_vocab_coverage"] = coverage(counts, draft_ids)
    if cfg.dataset_answers and prompts:  # off-policy text from the training split's own answers
        train_convs, _, _ = load_conversations(cfg, expand_paths(prompts), per_file_limit)
        extra, report["dataset_answers"] = dataset_samples(tokenizer, train_convs, cfg.max_seq_len)
        train = train + extra
    trainer = Trainer(model, model_config, cfg, draft_ids, device, out, progress)
    report["log"] = trainer.fit(train, held)
    report["best_step"] = trainer.best_step
    report["skipped_batches"] = trainer.skipped_batches
    report["held_out"] = trainer.evaluate(held) if held else None
    report["files"] = export_head(trainer.head, out, target, verifier_architecture=model_config.architecture)
    report["seconds"] = time.perf_counter() - t0
    (out / "train_report.json").write_text(json.dumps(report, indent=2))
    if progress:
        est = (report["held_out"] or {}).get("estimated_al", {})
        print(f"trained {cfg.method} head -> {out}; held-out estimated AL "
              + ", ".join(f"k={k}: {v:.2f}" for k, v in est.items()), file=sys.stderr)
    return report
