"""Arguments of ``specserve train-draft`` (defaults from ``TrainDraftConfig``)."""

from __future__ import annotations

import argparse
from dataclasses import fields
from pathlib import Path

from specserve.config import TrainDraftConfig

# TrainDraftConfig fields exposed as flags (the rest keep their defaults)
_FLAGS = ("method", "num_layers", "head_intermediate_size", "draft_vocab_size", "max_new_tokens", "max_turns",
          "sampled_fraction", "sampling_temperature", "answers_per_conversation", "answers_per_source",
          "held_out_fraction", "self_prompts", "self_prompt_temperature", "self_prompt_top_p",
          "self_prompt_max_tokens", "epochs", "lr", "warmup_steps", "max_seq_len", "max_batch_tokens", "ttt_steps",
          "ttt_anchors", "hard_label_weight", "num_spec_tokens", "anchors_per_seq", "anchor_chunk",
          "peagle_chain_weight", "checkpoint_every", "weight_decay", "dataset_answers", "eval_every", "eval_samples",
          "max_generate_seconds", "max_train_seconds", "total_steps", "seed")


def add_train_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default="default", help="target model: 'default', a .gguf file or an HF directory")
    p.add_argument("--prompts", nargs="+", default=[],
                   help="prompt files or directories (ShareGPT, Alpaca, {prompt,completion} jsonl, plain text)")
    p.add_argument("--out", required=True, help="output directory (head, checkpoint, data, report)")
    p.add_argument("--data", nargs="+", default=None,
                   help="reuse data_train.npz / data_held_out.npz from these directories (concatenated)")
    p.add_argument("--extra-data", nargs="+", default=None,
                   help="earlier runs' sample directories (data_train.npz + data_held_out.npz), both appended to "
                        "the training split only")
    p.add_argument("--init-head", default=None,
                   help="start from this trained head directory (speculators format: its weights and draft "
                        "vocabulary, widened with the most generated other tokens when --draft-vocab-size is "
                        "larger; --method and --num-layers must match it, --head-intermediate-size must match it or "
                        "be larger (added MLP units start switched off); a P-EAGLE run may also start from an "
                        "EAGLE-3 head: its layers, fc and LM head, further layers starting as the identity)")
    p.add_argument("--decontaminate", nargs="+", default=None,
                   help="evaluation files (MT-Bench question.jsonl, HumanEval, GSM8K test): no request the target "
                        "writes itself (--self-prompts) may share a word 8-gram with their prompts")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N] (bf16 on cuda, fp32 on cpu)")
    p.add_argument("--per-file-limit", type=int, default=None, help="at most this many conversations per file")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=256, help="concurrent requests while generating data")
    p.add_argument("--kv-cache-gib", type=float, default=8.0, help="KV cache while generating data")
    defaults = TrainDraftConfig()
    for f in fields(TrainDraftConfig):
        if f.name in _FLAGS:
            value = getattr(defaults, f.name)
            flag = "--" + f.name.replace("_", "-")
            if isinstance(value, bool):
                p.add_argument(flag, action=argparse.BooleanOptionalAction, default=value)
                continue
            kw = {"choices": ["eagle3", "peagle"]} if f.name == "method" else {}
            p.add_argument(flag, type=type(value), default=value, **kw)


def main(args: argparse.Namespace) -> int:
    from specserve.cli import config_error_message
    from specserve.train.data import expand_paths
    from specserve.train.pipeline import NoSamplesError, train_draft

    try:
        cfg = TrainDraftConfig(**{name: getattr(args, name) for name in _FLAGS}, init_head=args.init_head)
    except ValueError as exc:
        args.error(str(exc))
    if args.data and cfg.self_prompts:
        args.error("--self-prompts: data generation is skipped with --data (its samples are reused)")
    if not args.prompts and not args.data and not cfg.self_prompts:
        args.error("--prompts: give prompt files (or --data with generated samples, or --self-prompts N)")
    missing = [d for d in args.data or [] if not (Path(d) / "data_train.npz").is_file()]
    if missing:
        args.error(f"argument --data: no data_train.npz in {', '.join(missing)} (give the --out of an earlier run)")
    try:
        expand_paths(args.prompts)  # a missing prompt file, before the target is loaded or --out written
        train_draft(args.target, cfg, args.prompts, args.out, args.device, args.data, args.per_file_limit,
                    args.max_model_len, args.max_num_seqs, args.kv_cache_gib, extra_data=args.extra_data,
                    decontaminate=args.decontaminate)
    except (FileNotFoundError, NoSamplesError) as exc:  # "field: message" of a path or of too few prompts
        args.error(config_error_message(exc))
    return 0
