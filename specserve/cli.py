"""Command line: ``specserve serve | fetch-model | convert | convert-head | bench | train-draft``."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from specserve.config import (
    CPU_ACTIVATION_QUANTS,
    DEFAULT_CUDA_GRAPH_BATCH_SIZES,
    HEAD_CPU_QUANTS,
    MAX_NUM_SPEC_TOKENS,
    QUANTIZATION_METHODS,
    SPEC_METHODS,
    CacheConfig,
    CudaGraphConfig,
    EngineConfig,
    SchedulerConfig,
    SpecConfig,
)


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--model", default="default",
                   help="model to serve: a .gguf file, a Hugging Face safetensors directory, 'default' "
                        "(SmolLM2-135M-Instruct Q4_1, fetched by `make setup`), or 'dummy' with --model-shape")
    g.add_argument("--load-format", choices=["auto", "dummy"], default="auto",
                   help="'dummy' loads random weights of --model-shape instead of a checkpoint")
    g.add_argument("--model-shape", default="llama-3.1-8b",
                   help="named shape for --load-format dummy (e.g. smollm2-135m, llama-3.1-8b, llama-3.3-70b)")
    g.add_argument("--served-model-name", default=None,
                   help="model name clients send and /v1/models lists (default: the model's own name)")
    g.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto",
                   help="weight and activation dtype; auto = float32 on CPU, bfloat16 on GPU")
    g.add_argument("--device", default="cpu", help="torch device to run on, e.g. cpu or cuda:0")
    g.add_argument("--seed", type=int, default=0, help="seed of the engine's sampler for unseeded requests")
    g.add_argument("--quantization", choices=QUANTIZATION_METHODS, default=None,
                   help="quantize the decoder layers' projections on load: fp8 (e4m3 weights per channel, "
                        "activations per token, torch._scaled_mm on GPU) or int4 (weight-only, groups of 128, "
                        "Triton W4A16 GEMM on GPU); CPU runs reference maths")
    g.add_argument("--quantize-lm-head", action="store_true",
                   help="with --quantization, quantize the LM head too (off: it stays in the model dtype, as in "
                        "vLLM): fewer bytes per decode step, logits of the quantized head")
    g.add_argument("--no-quantized-cpu-kernels", action="store_true",
                   help="on CPU, compute with dequantized fp32 weights instead of the GGUF's Q4_1/Q8_0 blocks")
    g.add_argument("--cpu-activation-quant", choices=CPU_ACTIVATION_QUANTS, default="none",
                   help="activations of the Q4_1/Q8_0 CPU kernels: none (float32) or q8 (int8 per block of 32 with "
                        "integer dot products: cheaper verify steps, slightly different logits)")
    g = p.add_argument_group("KV cache")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block")
    g.add_argument("--num-kv-blocks", type=int, default=None,
                   help="number of KV-cache blocks (default: derived from --kv-cache-memory-gib)")
    g.add_argument("--kv-cache-memory-gib", type=float, default=1.0, help="memory for the KV cache, GiB")
    g = p.add_argument_group("scheduler")
    g.add_argument("--max-num-seqs", type=int, default=64, help="cap on concurrently running sequences")
    g.add_argument("--max-num-batched-tokens", type=int, default=512, help="token budget of one engine step")
    g.add_argument("--max-model-len", type=int, default=4096,
                   help="context limit (prompt + output tokens) per request")
    g.add_argument("--no-chunked-prefill", action="store_true",
                   help="prefill each prompt in one step instead of budget-sized chunks")
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="launch the next plain decode step before committing the previous one (default: on with "
                        "CUDA, off on CPU)")
    g = p.add_argument_group("CUDA graphs", "decode and verify steps replayed from graphs captured per batch "
                             "bucket (GPU with the Triton attention backend only)")
    g.add_argument("--enforce-eager", action="store_true",
                   help="never capture CUDA graphs: run every step eagerly")
    g.add_argument("--cuda-graph-batch-sizes", default=",".join(map(str, DEFAULT_CUDA_GRAPH_BATCH_SIZES)),
                   metavar="N,N,...", help="batch-size buckets captured (a step pads to the next one)")
    g.add_argument("--cuda-graph-max-query-len", type=int, default=CudaGraphConfig.max_query_len,
                   help="longest query (1 + drafts) a captured step may have; longer ones run eagerly")
    g.add_argument("--cuda-graph-draft-steps", action=argparse.BooleanOptionalAction,
                   default=CudaGraphConfig.draft_steps,
                   help="also capture an EAGLE-3 head's drafting: its ingest forward and all k draft steps "
                        "(one graph per batch bucket, queue length and k), or steps 2..k after a long queue")
    g.add_argument("--cublaslt-algos", action=argparse.BooleanOptionalAction, default=EngineConfig.cublaslt_algos,
                   help="run 16-bit projections of verify-sized steps through cuBLASLt with the configurations "
                        "measured fastest there (needs nvmath-python: pip install specserve[gpu])")
    g = p.add_argument_group("speculative decoding", "the server's default; a request may override method and "
                             "num_spec_tokens with its \"speculative\" field (n-gram lookup is always available)")
    g.add_argument("--spec-method", choices=SPEC_METHODS, default="none",
                   help="speculative decoding method: none (off), ngram (prompt lookup), draft (a small draft "
                        "model), eagle3 or peagle (an EAGLE-3 / parallel EAGLE head)")
    g.add_argument("--spec-model", default=None, metavar="PATH",
                   help="drafter for --spec-method draft/eagle3/peagle: a model path or 'self' (the target "
                        "itself) for draft, a head checkpoint directory for eagle3/peagle, or 'dummy' / "
                        "'dummy:<seed>' for a randomly initialised drafter")
    g.add_argument("--num-spec-tokens", type=int, default=SpecConfig.num_spec_tokens, metavar="K",
                   help=f"tokens drafted per step and request, 1..{MAX_NUM_SPEC_TOKENS}")
    g.add_argument("--spec-adaptive", action=argparse.BooleanOptionalAction, default=SpecConfig.adaptive,
                   help="cap the drafts per request each step at 0, 1, K/2 or K, whichever has given the most "
                        "tokens per second at the current batch size (measured while serving; lossless)")
    g.add_argument("--spec-head-cpu-quant", choices=HEAD_CPU_QUANTS, default=SpecConfig.head_cpu_quant,
                   help="on CPU, run an EAGLE-3 / P-EAGLE head's projections from 8-bit blocks of its weights "
                        "(q8_0: ~4x fewer bytes a draft step than fp32; drafts may change slightly, output does "
                        "not) or keep fp32 (none)")
    g.add_argument("--ngram-min", type=int, default=SpecConfig.ngram_min,
                   help="shortest suffix n-gram the n-gram lookup matches")
    g.add_argument("--ngram-max", type=int, default=SpecConfig.ngram_max,
                   help="longest suffix n-gram the n-gram lookup tries first")


# Config fields whose flag is not simply ``--`` + the field name with dashes.
_FLAG_OF_FIELD = {"num_blocks": "--num-kv-blocks", "speculative.method": "--spec-method",
                  "speculative.model": "--spec-model", "speculative.head_cpu_quant": "--spec-head-cpu-quant",
                  "cuda_graphs.batch_sizes": "--cuda-graph-batch-sizes",
                  "cuda_graphs.max_query_len": "--cuda-graph-max-query-len"}


def config_error_message(exc: Exception) -> str:
    """A config error ("field: message", e.g. "speculative.model: ...") in argparse's words, naming the flag."""
    field, sep, message = str(exc).partition(": ")
    if not sep or not field.replace(".", "_").isidentifier():
        return str(exc)
    flag = _FLAG_OF_FIELD.get(field, "--" + field.removeprefix("speculative.").replace("_", "-"))
    return f"argument {flag}: {message}"


def spec_config_from_args(args: argparse.Namespace) -> SpecConfig:
    """The ``SpecConfig`` of the flags; a bad value raises ValueError naming ``speculative.<field>``."""
    try:
        return SpecConfig(method=args.spec_method, model=args.spec_model, num_spec_tokens=args.num_spec_tokens,
                          ngram_min=args.ngram_min, ngram_max=args.ngram_max,
                          adaptive=getattr(args, "spec_adaptive", SpecConfig.adaptive),
                          head_cpu_quant=getattr(args, "spec_head_cpu_quant", SpecConfig.head_cpu_quant))
    except ValueError as exc:
        raise ValueError(f"speculative.{exc}") from None


def cuda_graph_config_from_args(args: argparse.Namespace) -> CudaGraphConfig:
    """The ``CudaGraphConfig`` of the flags; a bad value raises ValueError naming ``cuda_graphs.<field>``."""
    try:
        sizes = tuple(int(x) for x in args.cuda_graph_batch_sizes.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"cuda_graphs.batch_sizes: not a comma-separated list of integers: "
                         f"{args.cuda_graph_batch_sizes!r}") from None
    return CudaGraphConfig(enabled=not args.enforce_eager, batch_sizes=sizes,
                           max_query_len=args.cuda_graph_max_query_len, draft_steps=args.cuda_graph_draft_steps)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The ``EngineConfig`` the flags describe; raises ValueError naming the config field of a bad value."""
    model = f"dummy:{args.model_shape}" if args.load_format == "dummy" else args.model
    return EngineConfig(
        model=model, served_model_name=args.served_model_name, dtype=args.dtype, device=args.device,
        seed=args.seed, quantized_cpu_kernels=not args.no_quantized_cpu_kernels, quantization=args.quantization,
        quantize_lm_head=args.quantize_lm_head, cpu_activation_quant=args.cpu_activation_quant,
        cache=CacheConfig(block_size=args.block_size, num_blocks=args.num_kv_blocks,
                          kv_cache_memory_gib=args.kv_cache_memory_gib),
        scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs,
                                  max_num_batched_tokens=args.max_num_batched_tokens,
                                  enable_chunked_prefill=not args.no_chunked_prefill,
                                  max_model_len=args.max_model_len, async_scheduling=args.async_scheduling),
        speculative=spec_config_from_args(args),
        cuda_graphs=cuda_graph_config_from_args(args),
        cublaslt_algos=args.cublaslt_algos,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API",
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = serve.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind")
    g.add_argument("--port", type=int, default=8000, help="port to bind")
    g.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="log verbosity")
    g.add_argument("--threads", type=int, default=None, help="torch intra-op threads on CPU (default: all cores)")
    _add_engine_args(serve)
    serve.set_defaults(error=serve.error)  # reports a bad config value with `specserve serve`'s usage line

    sub.add_parser("fetch-model", help="download the default model (SmolLM2-135M-Instruct GGUF) into the cache")

    conv = sub.add_parser("convert", help="convert a GGUF file into a Hugging Face safetensors directory")
    conv.add_argument("gguf", help="input .gguf file ('default' for the default model)")
    conv.add_argument("out", help="output directory")
    conv.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16", help="stored dtype")
    conv.add_argument("--max-shard-bytes", type=int, default=None, help="split weights into shards of this size")

    head = sub.add_parser("convert-head", help="write a P-EAGLE head with a full embedding table (the target's rows "
                          "and its learned mask-token row), the layout vLLM reads; the drafts are unchanged")
    head.add_argument("head", help="P-EAGLE head directory (speculators format) with a mask_embedding row")
    head.add_argument("out", help="output directory")
    head.add_argument("--target", default="default", help="the head's target: 'default', a .gguf file or an HF "
                      "directory (its embedding table is written in)")
    head.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16", help="stored dtype")
    head.set_defaults(error=head.error)

    from specserve.bench.cli import __doc__ as bench_doc
    from specserve.bench.cli import add_bench_arguments
    bench = sub.add_parser("bench", help="benchmark an OpenAI-compatible server (latency, throughput, acceptance, "
                           "cost), or sweep specserve speculation settings", description=bench_doc,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    add_bench_arguments(bench)

    from specserve.train.cli import add_train_arguments
    train = sub.add_parser("train-draft", help="train an EAGLE-3 or P-EAGLE draft head on the target's own answers",
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_train_arguments(train)
    train.set_defaults(error=train.error)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "fetch-model":
        from specserve.models.fetch import fetch_default_model
        print(fetch_default_model())
        return 0
    if args.command == "convert":
        import torch

        from specserve.models.convert import convert_gguf_to_hf
        src = args.gguf
        if src == "default":
            from specserve.models.fetch import default_model_path
            src = default_model_path()
        convert_gguf_to_hf(src, args.out, dtype=getattr(torch, args.dtype), max_shard_bytes=args.max_shard_bytes)
        print(args.out)
        return 0
    if args.command == "convert-head":
        return _convert_head(args)
    if args.command == "bench":
        from specserve.bench.cli import main as bench_main
        return bench_main(args, argv)
    if args.command == "train-draft":
        from specserve.train.cli import main as train_main
        return train_main(args)
    if args.command == "serve":
        try:
            config = engine_config_from_args(args)
        except ValueError as exc:
            args.error(config_error_message(exc))  # exits 2, as for any bad flag
        return _serve(args, config)
    return 2


def _convert_head(args: argparse.Namespace) -> int:
    import torch

    from specserve.models.loader import load_model
    from specserve.spec.eagle_checkpoint import load_eagle_head, with_embedding_table
    from specserve.train.pipeline import export_head

    if not (Path(args.head) / "config.json").is_file():
        args.error(f"head: {args.head} is not a head directory (no config.json)")
    cpu = torch.device("cpu")
    model, model_config, _ = load_model(args.target, "float32", cpu, 2048)
    try:
        head = load_eagle_head(args.head, model_config.num_hidden_layers, model_config.vocab_size,
                               model.max_position, torch.float32, cpu)
        full = with_embedding_table(head, model.embed_tokens.weight)
    except ValueError as exc:
        args.error(str(exc))
    verifier = json.loads((Path(args.head) / "config.json").read_text()).get("speculators_config", {}).get(
        "verifier", {}).get("name_or_path") or str(args.target)
    files = export_head(full, Path(args.out), verifier, getattr(torch, args.dtype),
                        verifier_architecture=model_config.architecture)
    print(args.out, *files)
    return 0


def _serve(args: argparse.Namespace, config: EngineConfig) -> int:
    import torch

    from specserve.engine.async_engine import AsyncEngine
    from specserve.engine.engine import LLMEngine
    from specserve.server.launch import serve
    from specserve.server.metrics import ServingMetrics

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        engine = LLMEngine.from_config(config)
    except (OSError, ValueError) as exc:  # a --model / --spec-model path that is not there or not a model, a head
        # that does not fit the model, ...: one line naming the field (the traceback at --log-level debug)
        logging.getLogger(__name__).debug("loading the engine failed", exc_info=exc)
        message = config_error_message(exc)
        if message == str(exc):  # the error names no field: say what was being loaded
            paths = [f"--model {config.model or '(the default model)'}"]
            if config.speculative.model:
                paths.append(f"--spec-model {config.speculative.model}")
            message = f"could not load {', '.join(paths)}: {exc}"
        args.error(message)
    name = args.served_model_name or default_served_name(config.model, engine.model_config.name)
    metrics = ServingMetrics(name, max_model_len=engine.max_model_len, spec_methods=list(engine.proposers))
    async_engine = AsyncEngine(engine, metrics, model_name=name)
    serve(async_engine, args.host, args.port, name, args.log_level)
    return 0


def default_served_name(model: str, config_name: str) -> str:
    """The name clients send: the default model's published name, else the file or directory name."""
    from pathlib import Path

    from specserve.models.fetch import DEFAULT_MODEL_NAME
    if model == "default":
        return DEFAULT_MODEL_NAME
    if model.startswith("dummy:"):
        return config_name
    path = Path(model)
    return path.stem if path.suffix == ".gguf" else path.name


if __name__ == "__main__":
    sys.exit(main())
