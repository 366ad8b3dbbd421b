"""`specserve serve --help` documents every flag, and the flags build the engine config they describe."""

from __future__ import annotations

import argparse

import pytest

from specserve.cli import build_parser, engine_config_from_args, main


def _serve_parser() -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["serve"]


def test_every_serve_flag_has_help() -> None:
    undocumented = [a.option_strings for a in _serve_parser()._actions
                    if a.option_strings and a.dest != "help" and not (a.help or "").strip()]
    assert not undocumented


def test_help_lists_every_flag(capsys) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    text = capsys.readouterr().out
    for action in _serve_parser()._actions:
        for flag in action.option_strings:
            assert flag in text


def test_flags_reach_the_engine_config() -> None:
    args = build_parser().parse_args(["serve", "--load-format", "dummy", "--model-shape", "llama-3.1-8b",
                                      "--max-num-seqs", "7", "--max-num-batched-tokens", "99", "--block-size", "8",
                                      "--max-model-len", "333", "--no-chunked-prefill", "--dtype", "bfloat16"])
    cfg = engine_config_from_args(args)
    assert cfg.model == "dummy:llama-3.1-8b" and cfg.dtype == "bfloat16"
    assert cfg.scheduler.max_num_seqs == 7 and cfg.scheduler.max_num_batched_tokens == 99
    assert cfg.scheduler.max_model_len == 333 and not cfg.scheduler.enable_chunked_prefill
    assert cfg.cache.block_size == 8


def test_cpu_activation_quant_flag_reaches_the_engine_config() -> None:
    assert engine_config_from_args(build_parser().parse_args(["serve"])).cpu_activation_quant == "none"
    args = build_parser().parse_args(["serve", "--cpu-activation-quant", "q8"])
    assert engine_config_from_args(args).cpu_activation_quant == "q8"
    with pytest.raises(ValueError, match="cpu_activation_quant"):
        engine_config_from_args(build_parser().parse_args(["serve", "--cpu-activation-quant", "q8",
                                                           "--no-quantized-cpu-kernels"]))


def test_bad_config_values_name_the_field() -> None:
    args = build_parser().parse_args(["serve", "--max-num-seqs", "0"])
    with pytest.raises(ValueError, match="max_num_seqs"):
        engine_config_from_args(args)


def test_spec_flags_reach_the_engine_config() -> None:
    args = build_parser().parse_args(["serve", "--spec-method", "draft", "--spec-model", "self",
                                      "--num-spec-tokens", "5", "--ngram-min", "2", "--ngram-max", "3"])
    spec = engine_config_from_args(args).speculative
    assert (spec.method, spec.model, spec.num_spec_tokens, spec.ngram_min, spec.ngram_max) == ("draft", "self", 5, 2, 3)
    assert engine_config_from_args(build_parser().parse_args(["serve"])).speculative.method == "none"


@pytest.mark.parametrize("flags, flag", [
    (["--spec-method", "eagle3"], "--spec-model"),  # eagle3 needs a head
    (["--num-spec-tokens", "0"], "--num-spec-tokens"),
    (["--num-spec-tokens", "17"], "--num-spec-tokens"),
    (["--ngram-min", "4", "--ngram-max", "2"], "--ngram-min"),
    (["--max-num-seqs", "0"], "--max-num-seqs"),
])
def test_bad_config_values_are_argparse_errors_naming_the_flag(flags: list[str], flag: str, capsys) -> None:
    with pytest.raises(SystemExit) as info:
        main(["serve", *flags])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "usage: specserve serve" in err and f"error: argument {flag}: " in err


@pytest.mark.parametrize("make, expect", [
    (lambda d: (d / "m.gguf").write_bytes(b"GGUF" + bytes(60)) and d / "m.gguf", "could not load --model "),
    (lambda d: d, "could not load --model "),  # a directory without config.json
    (lambda d: d / "missing.gguf", "argument --model: "),
])
def test_a_model_that_does_not_load_is_a_one_line_error(tmp_path, make, expect, capsys) -> None:
    """A --model that is not there or not a model: exit 2 with one line naming the flag, not a traceback."""
    model = make(tmp_path)
    with pytest.raises(SystemExit) as info:
        main(["serve", "--model", str(model), "--device", "cpu"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"error: {expect}" in err and str(model) in err and "Traceback" not in err


def test_bad_spec_method_is_rejected_by_argparse(capsys) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--spec-method", "medusa"])
    assert "--spec-method" in capsys.readouterr().err


def test_speculation_flag_defaults_are_the_config_defaults() -> None:
    from specserve.cli import build_parser
    from specserve.config import SpecConfig
    args = build_parser().parse_args(["serve"])
    default = SpecConfig()
    assert (args.num_spec_tokens, args.ngram_min, args.ngram_max) == (
        default.num_spec_tokens, default.ngram_min, default.ngram_max)


def test_cuda_graph_flags():
    args = build_parser().parse_args(["serve", "--enforce-eager", "--cuda-graph-batch-sizes", "1,2,8",
                                      "--cuda-graph-max-query-len", "5"])
    graphs = engine_config_from_args(args).cuda_graphs
    assert not graphs.enabled and graphs.batch_sizes == (1, 2, 8) and graphs.max_query_len == 5
    default = engine_config_from_args(build_parser().parse_args(["serve"])).cuda_graphs
    assert default.enabled and default.draft_steps
    args = build_parser().parse_args(["serve", "--no-cuda-graph-draft-steps"])
    assert not engine_config_from_args(args).cuda_graphs.draft_steps


def test_async_scheduling_flag():
    def scheduler(*flags):
        return engine_config_from_args(build_parser().parse_args(["serve", *flags])).scheduler
    assert scheduler().async_scheduling is None  # the engine decides: on with CUDA, off on CPU
    assert scheduler("--async-scheduling").async_scheduling is True
    assert scheduler("--no-async-scheduling").async_scheduling is False


def test_bad_cuda_graph_flag_names_the_flag():
    from specserve.cli import config_error_message
    args = build_parser().parse_args(["serve", "--cuda-graph-batch-sizes", "8,4"])
    with pytest.raises(ValueError) as exc:
        engine_config_from_args(args)
    assert config_error_message(exc.value).startswith("argument --cuda-graph-batch-sizes:")


def test_make_serve_defaults_to_the_shipped_eagle3_head() -> None:
    """`make serve` (the README's quickstart) serves the default model with the EAGLE-3 head committed under
    heads/, and that head is shaped for the default model: it loads against SmolLM2-135M's layer count and
    vocabulary, with the target features EAGLE-3 takes (low, mid, high layers)."""
    import re
    import shlex
    from pathlib import Path

    import torch

    from specserve.models.fetch import DEFAULT_EAGLE3_HEAD
    from specserve.spec.eagle_checkpoint import load_eagle_head

    root = Path(__file__).resolve().parents[2]
    make = (root / "Makefile").read_text()
    serve_args = re.search(r"^SERVE_ARGS \?=(.*)$", make, re.M).group(1)
    args = _serve_parser().parse_args(shlex.split(serve_args))
    config = engine_config_from_args(args)
    assert config.model == "default"
    assert config.speculative.method == "eagle3" and config.speculative.adaptive
    assert (root / config.speculative.model).resolve() == DEFAULT_EAGLE3_HEAD
    head = load_eagle_head(DEFAULT_EAGLE3_HEAD, 30, 49152, 2048, torch.float32, torch.device("cpu"))
    assert not head.config.parallel and head.config.draft_vocab_size == 32768
    assert head.config.aux_layer_ids == (2, 15, 27)
    d2t = head.d2t + torch.arange(len(head.d2t))  # draft index -> target id: distinct ids of the vocabulary
    assert len(set(d2t.tolist())) == len(d2t) and int(d2t.max()) < 49152


@pytest.mark.parametrize("flags, expect", [
    (["--data", "{tmp}/no-run-here"], "argument --data: no data_train.npz in "),
    (["--prompts", "{tmp}/missing.jsonl"], "argument --prompts: "),
])
def test_train_draft_paths_are_checked_before_anything_is_written(tmp_path, flags, expect, capsys) -> None:
    """A --data directory without samples (once silently regenerated from no prompts into empty sample files that
    later runs reused) or a missing --prompts file: exit 2 naming the flag, and no --out directory left behind."""
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as info:
        main(["train-draft", "--out", str(out), *[f.format(tmp=tmp_path) for f in flags]])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"error: {expect}" in err and "Traceback" not in err
    assert not out.exists()
