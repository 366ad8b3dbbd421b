"""Engine speed on one GPU, in one run (issue 6 item 5; GPU machine, not CI). Prints a table and writes JSON:

1. decode: the engine's decode step on the Llama-3.1-8B shape (bf16, dummy weights) at batch 1, 8, 32, 64,
   against the HBM floor = (weight bytes + KV bytes read per step) / copy bandwidth measured here;
2. verify: the target forward over 2, 4, 8 query tokens per request against 1 (decode), same batch;
3. quantized: FP8 (e4m3, torch._scaled_mm) and INT4 (W4A16 Triton) decode steps against bf16 at batch 1, 32,
   and FP8 with the LM head quantized too (``--quantize-lm-head``, ``fp8_lm_head``; not the default);
4. end to end: output tokens/s on the SmolLM2-135M-Instruct shape (random weights) at concurrency 1, 8, 32,
   256 greedy tokens per request, for specserve (no speculation, n-gram k=4, EAGLE-3 with a random head) and
   for Hugging Face transformers ``generate(cache_implementation="static")`` on a LlamaForCausalLM holding the
   same weights (identical maths), on the same GPU.

Every section runs in its own try/except: a failure is recorded under ``errors`` and the rest still runs.
The ``summary`` object holds the five bar figures (fractions and ratios; tokens/s for smollm2_c1_tok_s), and
``fp8_lm_head_speedup_b1`` beside them (not a bar figure: the bar's FP8 keeps the default bf16 LM head).

    python benchmarks/gpu_engine.py --out $OUT/gpu_engine.json
    python benchmarks/gpu_engine.py --device cpu --smoke     # wiring check on CPU: tiny shapes, few tokens
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from specserve.config import (  # noqa: E402
    CacheConfig,
    CudaGraphConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    SpecConfig,
)
from specserve.engine.engine import LLMEngine  # noqa: E402
from specserve.engine.model_runner import ModelRunner  # noqa: E402
from specserve.layers.quant_gpu import weight_bytes  # noqa: E402
from specserve.models.loader import build_model, init_random_weights  # noqa: E402
from specserve.models.quantize import quantize_model  # noqa: E402
from specserve.models.shapes import shape_config  # noqa: E402
from specserve.sampling import SamplingParams  # noqa: E402
from specserve.spec.params import SPEC_OFF, SpecParams  # noqa: E402

BLOCK_SIZE = 16


# ---- helpers ---------------------------------------------------------------------------------------------------
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def dummy_model(config: ModelConfig, max_position: int, dtype: torch.dtype, device: torch.device, seed: int = 0):
    """Random weights of the loader's distribution, drawn on ``device`` (a host draw takes minutes for 8B
    parameters)."""
    model = build_model(config, max_position, dtype, device)
    init_random_weights(model, torch.Generator(device=device).manual_seed(seed))
    model.pack_weights()
    return model


def step_weight_bytes(model) -> int:
    """Weight bytes one decode step reads: every decoder layer, the final norm and the LM head (the embedding
    table only through the few rows looked up, unless it is the tied head)."""
    head = model.quantized_head or (model.embed_tokens if model.lm_head is None else model.lm_head)
    return sum(weight_bytes(m) for m in (*model.layers, model.norm, head))


def kv_bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * elem


def copy_bandwidth(device: torch.device, nbytes: int, iters: int = 20) -> float:
    """Bytes/s of a device-to-device copy, counting the read and the write (what a kernel streaming weights
    could reach at best)."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        dst.copy_(src)
    sync(device)
    dt = (time.perf_counter() - t0) / iters
    del src, dst
    return 2 * nbytes / dt


def engine_for(model, config: ModelConfig, device: torch.device, max_num_seqs: int, kv_gib: float,
               max_model_len: int, budget: int, spec: SpecConfig | None = None, proposers: dict | None = None,
               draft_graphs: bool = False, cublaslt_algos: bool = EngineConfig.cublaslt_algos):
    cfg = EngineConfig(model="bench", device=str(device), cache=CacheConfig(block_size=BLOCK_SIZE,
                                                                             kv_cache_memory_gib=kv_gib),
                       scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                                                 max_model_len=max_model_len),
                       speculative=spec or SpecConfig(), cuda_graphs=CudaGraphConfig(draft_steps=draft_graphs),
                       cublaslt_algos=cublaslt_algos)
    return LLMEngine(cfg, model, config, None, proposers=proposers)


def small_model_and_prompts(device: torch.device, prompt_len: int, new_tokens: int, concurrency: int,
                            shape: str = "smollm2-135m"):
    """(config, model, prompts, max_len): the random model of a small shape (the end-to-end section's; bf16 on
    CUDA, fp32 elsewhere), room for ``prompt_len + new_tokens``, and ``concurrency`` random prompts."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = shape_config(shape)
    max_len = prompt_len + new_tokens + 64
    model = dummy_model(config, max_len + 64, dtype, device)
    return config, model, random_prompts(concurrency, prompt_len, config.vocab_size, seed=1), max_len


def random_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (length,), generator=gen).tolist() for _ in range(n)]


def start_decoding(engine: LLMEngine, batch: int, prompt_len: int, max_tokens: int, seed: int) -> None:
    """Add ``batch`` greedy requests of random ``prompt_len``-token prompts (no speculation, EOS ignored) and step
    the engine until every one has prefilled: the next steps are all decode steps."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(random_prompts(batch, prompt_len, engine.model_config.vocab_size, seed=seed)):
        engine.add_request(f"d{seed}-{batch}-{i}", p, params, SPEC_OFF)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.requests.values()):
        engine.step()


def time_decode_steps(engine: LLMEngine, device: torch.device, batch: int, prompt_len: int, steps: int,
                      warmup: int = 3) -> dict:
    """Median wall time of back-to-back ``engine.step()`` calls once all ``batch`` requests decode (prefill steps
    excluded; no device sync between calls, see below)."""
    profile_steps = 10 if batch == 1 else 0
    start_decoding(engine, batch, prompt_len, steps + warmup + profile_steps + 8, seed=batch)
    # No device sync between steps: with asynchronous decode steps (the CUDA default) a step() call launches the
    # next step and then waits for the previous one, and a sync after each call would idle the GPU during the
    # host's launch work, which the engine hides when it runs alone. Each call still waits for one step, so in the
    # steady state a call's wall time is one step; the whole run is synced once at each end (``mean_step_s``).
    for _ in range(warmup):
        engine.step()
    sync(device)
    times, contexts = [], []
    start = time.perf_counter()
    for _ in range(steps):
        contexts.append(statistics.mean(r.num_tokens for r in engine.requests.values()))
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    sync(device)
    mean_step = (time.perf_counter() - start) / steps
    # While every request still decodes, the static buffers hold this batch's last decode step: replay it alone.
    replay = time_graph_replay(engine, batch) if device.type == "cuda" else None
    host_profile = profile_steps_host(engine, profile_steps) if profile_steps else None
    while engine.has_unfinished():
        engine.step()
    return {"median_step_s": statistics.median(times), "min_step_s": min(times), "mean_step_s": mean_step,
            "steps": len(times), "mean_context": statistics.mean(contexts), "graph_replay_s": replay,
            "host_profile": host_profile}


def profile_steps_host(engine: LLMEngine, steps: int, top: int = 20) -> list[str]:
    """cProfile of ``steps`` engine steps: the functions with the most own time (where the host time of a
    step goes; the waits for the device show up in the call that synchronises, e.g. ``tolist``)."""
    import cProfile
    import io
    import pstats
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        engine.step()
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    return [line for line in buf.getvalue().splitlines() if line.strip()][-top - 1:]


def forward_inputs(runner: ModelRunner, batch: int, context: int, query_len: int):
    """Host inputs of a uniform step: ``batch`` sequences with ``context`` cached tokens and ``query_len`` new ones
    each (random ids), sequence i on KV blocks ``[i * blocks, (i + 1) * blocks)`` ->
    ``(input_ids, positions, query_lens, seq_lens, block_tables)`` as ``ModelRunner.forward`` takes them."""
    seq_len = context + query_len
    blocks = -(-seq_len // BLOCK_SIZE)
    if batch * blocks > runner.num_blocks:
        raise ValueError(f"KV cache too small: {batch * blocks} blocks > {runner.num_blocks}")
    tables = [list(range(i * blocks, (i + 1) * blocks)) for i in range(batch)]
    ids = torch.randint(0, runner.model_config.vocab_size, (batch * query_len,)).tolist()
    positions = [p for _ in range(batch) for p in range(context, seq_len)]
    return ids, positions, [query_len] * batch, [seq_len] * batch, tables


@torch.inference_mode()
def time_forward(runner: ModelRunner, device: torch.device, batch: int, context: int, query_len: int,
                 iters: int, warmup: int = 3) -> float:
    """Median time of one target forward + LM head over ``query_len`` tokens per request (1: a decode step;
    1 + num_spec_tokens: a verify step) for ``batch`` requests with ``context`` cached tokens each. The forward
    replays the runner's CUDA graph for (batch bucket, query_len) when it has graphs (captured on first use, in
    the warm-up), as the engine's decode and verify steps do; eagerly otherwise."""
    return time_forwards(runner, device, batch, context, (query_len,), iters, 1, warmup)[query_len]


@torch.inference_mode()
def time_forwards(runner: ModelRunner, device: torch.device, batch: int, context: int, query_lens: tuple[int, ...],
                  iters: int, rounds: int, warmup: int = 3) -> dict[int, float]:
    """``time_forward`` for several query lengths, interleaved (``interleaved_medians``): their ratios are the
    figures, so a drift of the GPU's clocks or of the host reaches every length alike."""
    calls = {q: forward_call(runner, batch, context, q) for q in query_lens}
    return interleaved_medians(calls, device, iters, rounds, warmup)


def forward_call(runner: ModelRunner, batch: int, context: int, query_len: int):
    """A no-argument call of one target forward + LM head over ``forward_inputs(runner, batch, context,
    query_len)``: a replay of the runner's CUDA graph for that step when it has graphs (captured on the first
    call), eager otherwise."""
    ids, positions, query_lens, seq_lens, tables = forward_inputs(runner, batch, context, query_len)
    lens = (query_lens, seq_lens)
    graphs = runner.graphs if runner.graphs is not None and runner.graphs.fits(*lens) else None
    run = graphs.run if graphs is not None else runner.forward
    return lambda: runner.model.compute_logits(run(ids, positions, *lens, tables)[0])


@torch.inference_mode()
def interleaved_medians(calls: dict, device: torch.device, iters: int, rounds: int, warmup: int = 3) -> dict:
    """Median seconds of each call of ``calls`` (key -> no-argument call): after ``warmup`` calls of each,
    ``rounds`` rounds that each time ``iters`` calls of every key in turn (host clock, synchronised around each
    call). Keys whose ratios are the figure see the same drift of clocks and host."""
    for call in calls.values():
        for _ in range(warmup):
            call()
    times: dict = {key: [] for key in calls}
    for _ in range(rounds):
        for key, call in calls.items():
            for _ in range(iters):
                sync(device)
                t0 = time.perf_counter()
                call()
                sync(device)
                times[key].append(time.perf_counter() - t0)
    return {key: statistics.median(t) for key, t in times.items()}


@torch.inference_mode()
def time_graph_replay(engine: LLMEngine, batch: int, iters: int = 20) -> float | None:
    """Median device time of replaying the engine's captured decode graph for ``batch`` alone (no host work
    around it): the GPU part of an engine decode step. Call it right after a decode step of exactly ``batch``
    running requests: the graph re-reads that step's inputs from the static buffers (and rewrites the same KV
    values into the same slots); after a step of another layout the buffers hold other offsets. None without
    graphs."""
    graphs = engine.runner.graphs
    bucket = graphs.bucket_for(batch) if graphs is not None else None
    step = graphs.steps.get((bucket, 1, ())) if bucket is not None else None
    if step is None or step.graph is None:
        return None
    return median_replay_s(step.graph, iters)  # the last step's inputs: the same shapes, KV to the same slots


def median_replay_s(graph: torch.cuda.CUDAGraph, replays: int = 5) -> float:
    """Median seconds of one replay of ``graph`` (CUDA events around each of ``replays`` replays)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def graph_time_s(body, replays: int = 5) -> float:
    """Median seconds of a CUDA graph of ``body()``: run once on a side stream (compiles, warms the allocator),
    captured, replayed once, then ``median_replay_s``."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        body()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    graph.replay()
    torch.cuda.synchronize()
    try:
        return median_replay_s(graph, replays)
    finally:
        del graph


class Report:
    def __init__(self, command: str, out: str | None = None) -> None:
        self.data: dict = {"command": command, "errors": {}}
        self.start = time.perf_counter()
        self.out = out  # written after every section: a run cut short keeps what it measured

    def write(self) -> None:
        if self.out:
            Path(self.out).parent.mkdir(parents=True, exist_ok=True)
            Path(self.out).write_text(json.dumps(self.data, indent=2, default=str))

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def section(self, name: str, fn, *args) -> None:
        print(f"--- {name} ({self.elapsed():.0f} s)", flush=True)
        t0 = time.perf_counter()
        try:
            fn(*args)
        except Exception as exc:  # record and go on: one failure must not lose the other sections
            self.data["errors"][name] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=6)}"
            print(f"!!! {name} failed: {type(exc).__name__}: {exc}", flush=True)
        self.data.setdefault("section_seconds", {})[name] = round(time.perf_counter() - t0, 1)
        self.write()


# ---- sections ----------------------------------------------------------------------------------------------------
def machine_section(rep: Report, device: torch.device) -> None:
    m = {"device": str(device), "torch": torch.__version__, "python": platform.python_version()}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        m |= {"gpu": torch.cuda.get_device_name(device), "gpu_memory_gib": round(props.total_memory / 2**30, 1),
              "sm_count": props.multi_processor_count, "capability": ".".join(map(str, props.major_minor))
              if hasattr(props, "major_minor") else f"{props.major}.{props.minor}", "cuda": torch.version.cuda}
    for mod in ("triton", "transformers"):
        try:
            m[mod] = __import__(mod).__version__
        except Exception as exc:  # noqa: BLE001 - absent is a fact worth recording
            m[mod] = f"unavailable ({type(exc).__name__})"
    rep.data["machine"] = m


def bandwidth_section(rep: Report, device: torch.device, nbytes: int) -> None:
    bw = copy_bandwidth(device, nbytes)
    rep.data["copy_bandwidth_gb_s"] = bw / 1e9
    print(f"copy bandwidth (read + write): {bw / 1e9:.0f} GB/s")


def decode_section(rep: Report, args, device: torch.device, dtype: torch.dtype) -> None:
    config = shape_config(args.big_shape)
    model = dummy_model(config, args.max_model_len, dtype, device)
    engine = engine_for(model, config, device, max(args.batches), args.kv_gib, args.max_model_len,
                        args.prefill_budget, proposers={}, cublaslt_algos=args.cublaslt_algos)
    bw = rep.data.get("copy_bandwidth_gb_s", float("nan")) * 1e9
    wbytes = step_weight_bytes(model)
    kv_tok = kv_bytes_per_token(config, dtype)
    out = {"shape": args.big_shape, "dtype": str(dtype).removeprefix("torch."), "prompt_len": args.prompt_len,
           "weight_bytes": wbytes, "kv_bytes_per_token": kv_tok, "async_scheduling": engine.async_scheduling,
           "cublaslt_layers": engine.cublaslt_layers, "by_batch": {}}
    rep.data["decode"] = out
    for b in args.batches:
        r = time_decode_steps(engine, device, b, args.prompt_len, args.decode_steps)
        kv_read = b * r["mean_context"] * kv_tok
        floor = (wbytes + kv_read) / bw
        r |= {"kv_bytes_read": kv_read, "hbm_floor_s": floor, "floor_fraction": floor / r["median_step_s"],
              "tok_s": b / r["median_step_s"]}
        out["by_batch"][str(b)] = r
        print(f"decode b={b:3d}: {r['median_step_s'] * 1e3:7.2f} ms/step, floor {floor * 1e3:6.2f} ms "
              f"({r['floor_fraction']:.0%}), {r['tok_s']:.0f} tok/s", flush=True)
    del engine
    free(device)
    # verify steps: target forward over query_len tokens per request vs query_len 1, same batch and context
    runner = ModelRunner(model, config, CacheConfig(block_size=BLOCK_SIZE, kv_cache_memory_gib=args.kv_gib), device)
    runner.setup_cuda_graphs(CudaGraphConfig(batch_sizes=tuple(args.verify_batches), capture_at_startup=False),
                             args.max_model_len, max(args.verify_batches))
    ver: dict = {"context": args.prompt_len, "rounds": args.forward_rounds, "iters_per_round": args.forward_iters,
                 "by_batch": {}}
    rep.data["verify"] = ver
    for b in args.verify_batches:
        timed = time_forwards(runner, device, b, args.prompt_len, (1, 2, 4, 8), args.forward_iters,
                              args.forward_rounds)
        row = {"forward_s": {str(q): t for q, t in timed.items()}}
        row["vs_decode"] = {q: t / row["forward_s"]["1"] for q, t in row["forward_s"].items()}
        ver["by_batch"][str(b)] = row
        print(f"verify b={b:3d}: " + ", ".join(f"q={q} {t * 1e3:.2f} ms (x{row['vs_decode'][q]:.2f})"
                                              for q, t in row["forward_s"].items()), flush=True)
    lt_layers = [m for m in model.modules() if getattr(m, "lt", None) is not None]
    if lt_layers:
        try:
            ver["cublaslt_ab"] = cublaslt_ab(runner, lt_layers, device, max(args.verify_batches), args)
        except Exception as exc:  # the figures above stand without it
            rep.data["errors"]["verify.cublaslt_ab"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=6)}"
            print(f"!!! cuBLASLt A/B failed: {exc}", flush=True)
    del runner, model
    free(device)


def recapture(runner: ModelRunner, batch: int, max_model_len: int = 2048) -> None:
    """Fresh graphs for ``batch`` (captured on first use) under the settings now in force; the old pool freed
    first."""
    runner.graphs = None
    free(runner.device)
    runner.setup_cuda_graphs(CudaGraphConfig(batch_sizes=(batch,), capture_at_startup=False), max_model_len, batch)


@torch.inference_mode()
def logits_of(runner: ModelRunner, inputs, graphs: bool) -> torch.Tensor:
    """[tokens, vocab]: the target forward + LM head over ``forward_inputs``' tuple, replayed from the runner's
    graphs or eager."""
    ids, positions, query_lens, seq_lens, tables = inputs
    forward = runner.graphs.run if graphs else runner.forward
    hidden, _ = forward(ids, positions, query_lens, seq_lens, tables)
    return runner.model.compute_logits(hidden).clone()


def cublaslt_ab(runner: ModelRunner, lt_layers: list, device: torch.device, batch: int, args) -> dict:
    """The verify figure's steps (q = 1 and 8 at ``batch``) with the projections' measured cuBLASLt configurations
    (``layers/cublaslt_gemm.py``, as the engine runs them) and without (torch's cuBLAS calls), settings alternated,
    graphs captured afresh for each; and the verify logits' distance between the two."""
    saved = [(m, m.lt) for m in lt_layers]
    inputs = forward_inputs(runner, batch, args.prompt_len, 8)
    times: dict = {"torch": {1: [], 8: []}, "cublaslt": {1: [], 8: []}}
    logits = {}
    for _ in range(args.forward_rounds):
        for setting in times:
            for m, lt in saved:
                m.lt = lt if setting == "cublaslt" else None
            recapture(runner, batch, args.max_model_len)
            got = time_forwards(runner, device, batch, args.prompt_len, (1, 8), args.forward_iters, 1)
            for q in (1, 8):
                times[setting][q].append(got[q])
            logits[setting] = logits_of(runner, inputs, graphs=True).float()
    for m, lt in saved:
        m.lt = lt
    med = {k: {q: statistics.median(v) for q, v in t.items()} for k, t in times.items()}
    agree = (logits["cublaslt"].argmax(-1) == logits["torch"].argmax(-1)).float().mean().item()
    out = {"batch": batch, "layers": len(lt_layers), "step_s": med,
           "verify8_vs_decode": {k: v[8] / v[1] for k, v in med.items()},
           "verify8_speedup": med["torch"][8] / med["cublaslt"][8],
           "decode_speedup": med["torch"][1] / med["cublaslt"][1],
           "verify_logits_max_abs_diff": (logits["cublaslt"] - logits["torch"]).abs().max().item(),
           "verify_argmax_agreement": agree}
    print(f"cuBLASLt configurations at b={batch}: verify8/decode {out['verify8_vs_decode']['torch']:.3f} (torch) -> "
          f"{out['verify8_vs_decode']['cublaslt']:.3f}, verify x{out['verify8_speedup']:.3f}, decode "
          f"x{out['decode_speedup']:.3f}, logits diff {out['verify_logits_max_abs_diff']:.3g}, argmax agree "
          f"{out['verify_argmax_agreement']:.3f}", flush=True)
    return out


def quant_section(rep: Report, args, device: torch.device, dtype: torch.dtype) -> None:
    config = shape_config(args.big_shape)
    out: dict = {"shape": args.big_shape, "by_method": {}}
    rep.data["quantized"] = out
    bf16 = rep.data.get("decode", {}).get("by_batch", {})
    for method in ("bf16", "fp8", "fp8_lm_head", "int4"):  # fp8_lm_head: --quantize-lm-head too
        try:
            if method == "bf16" and all(str(b) in bf16 for b in args.quant_batches):
                res = {str(b): bf16[str(b)]["median_step_s"] for b in args.quant_batches}
                out["by_method"][method] = {"median_step_s": res, "weight_bytes": rep.data["decode"]["weight_bytes"]}
                continue
            model = dummy_model(config, args.max_model_len, dtype, device)
            if method != "bf16":
                quantize_model(model, method.removesuffix("_lm_head"), lm_head=method.endswith("_lm_head"))
                free(device)
            engine = engine_for(model, config, device, max(args.quant_batches), args.kv_gib, args.max_model_len,
                                args.prefill_budget, proposers={})
            res = {str(b): time_decode_steps(engine, device, b, args.prompt_len, args.decode_steps)["median_step_s"]
                   for b in args.quant_batches}
            out["by_method"][method] = {"median_step_s": res, "weight_bytes": step_weight_bytes(model)}
            print(f"{method}: " + ", ".join(f"b={b} {t * 1e3:.2f} ms" for b, t in res.items()), flush=True)
            del engine, model
            free(device)
        except Exception as exc:  # one method failing keeps the others
            rep.data["errors"][f"quantized.{method}"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=6)}"
            print(f"!!! quantized {method} failed: {exc}", flush=True)
            free(device)
    base = out["by_method"].get("bf16", {}).get("median_step_s", {})
    for method in ("fp8", "fp8_lm_head", "int4"):
        got = out["by_method"].get(method, {}).get("median_step_s", {})
        out["by_method"].get(method, {})["speedup_vs_bf16"] = {b: base[b] / t for b, t in got.items() if b in base}


def hf_llama(model, config: ModelConfig, device: torch.device, dtype: torch.dtype):
    """transformers' LlamaForCausalLM holding exactly our model's weights (q|k|v and gate|up split back; a tied
    head stays tied). Built in fp32 so its rotary buffers are computed as ours are (fp32), then only the
    parameters are cast to ``dtype``."""
    from transformers import LlamaConfig, LlamaForCausalLM
    hf_cfg = LlamaConfig(vocab_size=config.vocab_size, hidden_size=config.hidden_size,
                         intermediate_size=config.intermediate_size, num_hidden_layers=config.num_hidden_layers,
                         num_attention_heads=config.num_attention_heads,
                         num_key_value_heads=config.num_key_value_heads, head_dim=config.head_dim,
                         rms_norm_eps=config.rms_norm_eps, rope_theta=config.rope_theta,
                         max_position_embeddings=config.max_position_embeddings,
                         tie_word_embeddings=config.tie_word_embeddings, bos_token_id=None, eos_token_id=None,
                         pad_token_id=0, attention_bias=False, mlp_bias=False)
    if hasattr(hf_cfg, "rope_parameters"):
        hf_cfg.rope_parameters = {"rope_type": "default", "rope_theta": config.rope_theta,
                                  **(config.rope_scaling or {})}  # transformers 5 keeps rope settings here
    elif config.rope_scaling:
        hf_cfg.rope_scaling = config.rope_scaling
    with torch.device(device):
        hf = LlamaForCausalLM(hf_cfg)
    q, kv, ffn = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim, \
        config.intermediate_size
    sd = {"model.embed_tokens.weight": model.embed_tokens.weight, "model.norm.weight": model.norm.weight}
    if model.lm_head is not None:
        sd["lm_head.weight"] = model.lm_head.weight
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        qkv = layer.self_attn.qkv_proj.weight
        gate_up = layer.mlp.gate_up_proj.weight
        sd |= {p + "input_layernorm.weight": layer.input_layernorm.weight,
               p + "post_attention_layernorm.weight": layer.post_attention_layernorm.weight,
               p + "self_attn.q_proj.weight": qkv[:q], p + "self_attn.k_proj.weight": qkv[q:q + kv],
               p + "self_attn.v_proj.weight": qkv[q + kv:],
               p + "self_attn.o_proj.weight": layer.self_attn.o_proj.weight,
               p + "mlp.gate_proj.weight": gate_up[:ffn], p + "mlp.up_proj.weight": gate_up[ffn:],
               p + "mlp.down_proj.weight": layer.mlp.down_proj.weight}
    missing, unexpected = hf.load_state_dict({k: v.detach().float() for k, v in sd.items()}, strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise ValueError(f"HF weight mapping: missing {missing[:4]}, unexpected {unexpected[:4]}")
    if config.tie_word_embeddings and hf.lm_head.weight.data_ptr() != hf.model.embed_tokens.weight.data_ptr():
        hf.lm_head.weight = hf.model.embed_tokens.weight
    for param in hf.parameters():  # parameters only: the rotary inv_freq buffer stays fp32
        param.data = param.data.to(dtype)
    return hf.eval()


def e2e_section(rep: Report, args, device: torch.device, dtype: torch.dtype) -> None:
    config = shape_config(args.small_shape)
    max_len = args.e2e_prompt_len + args.new_tokens + 32
    model = dummy_model(config, max_len + 64, dtype, device)
    out: dict = {"shape": args.small_shape, "prompt_len": args.e2e_prompt_len, "new_tokens": args.new_tokens,
                 "specserve": {}, "hf": {}}
    rep.data["e2e"] = out
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    runs = {"none": (SpecConfig(), SPEC_OFF), "ngram": (SpecConfig(), SpecParams("ngram", 4)),
            "eagle3": (SpecConfig(method="eagle3", model="dummy", num_spec_tokens=4), SpecParams("eagle3", 4)),
            # the same random head with draft steps 2..4 replayed from CUDA graphs (CudaGraphConfig.draft_steps)
            "eagle3_graphs": (SpecConfig(method="eagle3", model="dummy", num_spec_tokens=4), SpecParams("eagle3", 4))}
    first_tokens = {}
    for name, (spec_cfg, spec) in runs.items():
        try:
            engine = engine_for(model, config, device, max(args.concurrency), 4.0, max_len, 4096, spec=spec_cfg,
                                draft_graphs=name == "eagle3_graphs")
            for c in args.concurrency:  # warm-up at every concurrency: Triton compiles a prefill's variants once
                engine.generate(random_prompts(c, args.e2e_prompt_len, config.vocab_size, seed=99),
                                SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True), spec)
            res = {}
            for c in args.concurrency:
                prompts = random_prompts(c, args.e2e_prompt_len, config.vocab_size, seed=c)
                sync(device)
                t0 = time.perf_counter()
                reqs = engine.generate(prompts, params, spec)
                sync(device)
                dt = time.perf_counter() - t0
                n = sum(len(r.output_ids) for r in reqs)
                drafts = sum(r.spec_counters.num_drafts for r in reqs)
                accepted = sum(r.spec_counters.num_accepted_tokens for r in reqs)
                res[str(c)] = {"tok_s": n / dt, "seconds": dt, "output_tokens": n, "num_drafts": drafts,
                               "mean_acceptance_length": 1 + accepted / drafts if drafts else None}
                if c == 1:
                    first_tokens[name] = reqs[0].output_ids
                print(f"specserve {name:6s} c={c:2d}: {n / dt:8.0f} tok/s ({dt:.2f} s)", flush=True)
            out["specserve"][name] = res
            del engine
            free(device)
        except Exception as exc:
            rep.data["errors"][f"e2e.specserve.{name}"] = f"{type(exc).__name__}: {exc}\n" \
                                                         f"{traceback.format_exc(limit=6)}"
            print(f"!!! specserve {name} failed: {exc}", flush=True)
    out["speculative_equals_plain_c1"] = {k: v == first_tokens.get("none") for k, v in first_tokens.items()}
    try:
        hf_section(rep, args, model, config, device, dtype, first_tokens.get("none"))
    except Exception as exc:
        rep.data["errors"]["e2e.hf"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=6)}"
        print(f"!!! HF failed: {exc}", flush=True)
    del model
    free(device)


@torch.inference_mode()
def hf_section(rep: Report, args, model, config: ModelConfig, device: torch.device, dtype: torch.dtype,
               ours_c1: list[int] | None) -> None:
    from transformers import GenerationConfig
    hf = hf_llama(model, config, device, dtype)
    out = rep.data["e2e"]["hf"]

    def gen_config(compile_: bool, new_tokens: int) -> GenerationConfig:
        kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                  cache_implementation="static", pad_token_id=0, eos_token_id=None, bos_token_id=None)
        g = GenerationConfig(**kw)
        if not compile_:
            g.disable_compile = True  # transformers compiles static-cache decoding itself unless told not to
        return g

    def run(c: int, compile_: bool, new_tokens: int, seed: int) -> tuple[float, torch.Tensor]:
        ids = torch.tensor(random_prompts(c, args.e2e_prompt_len, config.vocab_size, seed=seed), device=device)
        mask = torch.ones_like(ids)  # equal-length prompts: no padding needed, the mask says so explicitly
        sync(device)
        t0 = time.perf_counter()
        seqs = hf.generate(input_ids=ids, attention_mask=mask, generation_config=gen_config(compile_, new_tokens))
        sync(device)
        return time.perf_counter() - t0, seqs[:, ids.shape[1]:]

    for label, compile_, concurrency in (("eager", False, args.concurrency), ("compiled", True, args.hf_compile_c)):
        res = {}
        out[label] = res
        for c in concurrency:
            if compile_ and rep.elapsed() > args.time_budget_s:
                res[str(c)] = {"skipped": f"time budget ({rep.elapsed():.0f} s elapsed)"}
                continue
            try:
                # warm-up; compiled: the full length, so the static cache (and its graphs) are the timed run's
                run(c, compile_, args.new_tokens if compile_ else min(16, args.new_tokens), seed=99)
                dt, new = run(c, compile_, args.new_tokens, seed=c)
                n = new.numel()
                res[str(c)] = {"tok_s": n / dt, "seconds": dt, "output_tokens": n}
                if c == 1 and ours_c1 is not None:
                    theirs = new[0].tolist()
                    agree = next((i for i, (a, b) in enumerate(zip(theirs, ours_c1)) if a != b), len(ours_c1))
                    res[str(c)]["greedy_tokens_equal_to_specserve"] = agree  # bf16 round-off may split late
                print(f"hf {label:8s} c={c:2d}: {n / dt:8.0f} tok/s ({dt:.2f} s)", flush=True)
            except Exception as exc:
                rep.data["errors"][f"e2e.hf.{label}.c{c}"] = f"{type(exc).__name__}: {exc}\n" \
                                                             f"{traceback.format_exc(limit=6)}"
                print(f"!!! hf {label} c={c} failed: {exc}", flush=True)


def summarize(rep: Report) -> None:
    d = rep.data

    def get(*path):
        cur = d
        for p in path:
            if not isinstance(cur, dict) or p not in cur:
                return None
            cur = cur[p]
        return cur

    ours = get("e2e", "specserve", "none", "1", "tok_s")
    hf_best = max((v for v in (get("e2e", "hf", "eager", "1", "tok_s"), get("e2e", "hf", "compiled", "1", "tok_s"))
                   if v is not None), default=None)
    d["definitions"] = {
        "hbm_floor_s": "(weight bytes read per step + KV bytes read per step) / copy_bandwidth_gb_s (read + write)",
        "floor_fraction": "hbm_floor_s / median engine decode step (1.0 = at the memory-bandwidth floor)",
        "verify vs_decode": "target forward (CUDA graph replay on GPU, as the engine runs it) + LM head over q tokens "
                            "per request / the same with q = 1, same batch; medians over verify.rounds interleaved "
                            "rounds of verify.iters_per_round forwards per q (q = 1, 2, 4, 8 in turn)",
        "graph_replay_s": "device time of the captured decode graph alone (no host work): the GPU part of a step",
        "speedup_vs_bf16": "bf16 median decode step / quantized median decode step, same batch",
        "e2e tok_s": "output tokens of all requests / wall time of LLMEngine.generate (prefill included)",
        "e2e_vs_hf_c1": "specserve (no speculation) c=1 tok/s / the best HF generate c=1 tok/s (compiled if run)",
    }
    d["summary"] = {
        "decode_b1_floor_fraction": get("decode", "by_batch", "1", "floor_fraction"),
        "verify8_vs_decode_b32": get("verify", "by_batch", "32", "vs_decode", "8"),
        "fp8_speedup_b1": get("quantized", "by_method", "fp8", "speedup_vs_bf16", "1"),
        # not a bar figure: the same with --quantize-lm-head (off by default, as in vLLM)
        "fp8_lm_head_speedup_b1": get("quantized", "by_method", "fp8_lm_head", "speedup_vs_bf16", "1"),
        "smollm2_c1_tok_s": ours,
        "e2e_vs_hf_c1": None if ours is None or not hf_best else ours / hf_best,
    }


def print_table(d: dict) -> None:
    rows = [("metric", "value")]
    for b, r in d.get("decode", {}).get("by_batch", {}).items():
        replay = r.get("graph_replay_s")
        rows.append((f"decode b={b} step ms (floor ms, fraction; graph replay ms)",
                     f"{r['median_step_s'] * 1e3:.2f} ({r['hbm_floor_s'] * 1e3:.2f}, {r['floor_fraction']:.2f}; "
                     f"{'n/a' if replay is None else f'{replay * 1e3:.2f}'})"))
    for b, r in d.get("verify", {}).get("by_batch", {}).items():
        ratios = " / ".join(f"{r['vs_decode'][q]:.2f}" for q in ("2", "4", "8"))
        rows.append((f"verify b={b} q=2/4/8 vs decode", ratios))
    for m, r in d.get("quantized", {}).get("by_method", {}).items():
        rows.append((f"{m} step ms by batch", ", ".join(f"b{b}: {t * 1e3:.2f}" for b, t in r["median_step_s"].items())))
    for who in ("specserve", "hf"):
        for name, res in d.get("e2e", {}).get(who, {}).items():
            rows.append((f"e2e {who} {name} tok/s", ", ".join(f"c{c}: {v['tok_s']:.0f}" for c, v in res.items()
                                                            if "tok_s" in v)))
    for k, v in d.get("summary", {}).items():
        rows.append((f"summary.{k}", "n/a" if v is None else f"{v:.3f}"))
    width = max(len(r[0]) for r in rows)
    print("\n".join(f"{a:<{width}}  {b}" for a, b in rows))
    if d.get("errors"):
        print(f"errors in: {', '.join(d['errors'])}")


def gemm_table(raw: dict) -> dict:
    """``{"N,K": {"M": TileConfig fields or null}}`` (parsed JSON) -> ``quant_tiles.BF16_GEMM_TILES``'s form."""
    from specserve.layers.quant_tiles import TileConfig
    return {tuple(int(v) for v in key.split(",")): {int(m): TileConfig(**c) if c else None for m, c in b.items()}
            for key, b in raw.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="JSON path (default: $OUT/gpu_engine.json, else benchmarks/results)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes and few tokens: check the wiring (CPU ok)")
    ap.add_argument("--time-budget-s", type=float, default=400.0,
                    help="optional parts (compiled HF generate) are skipped once this much time has passed")
    ap.add_argument("--bf16-gemm-table", default=None,
                    help="JSON of quant_tiles.BF16_GEMM_TILES entries to use instead of the module's (as "
                         "benchmarks/triton_gemm_gpu.py --table-out writes): try a table before committing it")
    ap.add_argument("--cublaslt-algos", action=argparse.BooleanOptionalAction, default=EngineConfig.cublaslt_algos,
                    help="decode and verify section: the engine's --cublaslt-algos (with it, also an A/B of the "
                         "verify figure without them)")
    ap.add_argument("--sections", default="machine,bandwidth,decode_and_verify,quantized,e2e",
                    help="which sections to run (the summary names only the figures they measure)")
    args = ap.parse_args(argv)
    import os
    gemm_table_json = json.loads(Path(args.bf16_gemm_table).read_text()) if args.bf16_gemm_table else None
    if gemm_table_json is not None:
        from specserve.layers import quant_tiles
        quant_tiles.BF16_GEMM_TILES = gemm_table(gemm_table_json)
    if args.out is None:
        args.out = str(Path(os.environ.get("OUT", "benchmarks/results")) / "gpu_engine.json")
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    args.big_shape, args.small_shape = "llama-3.1-8b", "smollm2-135m"
    args.batches, args.verify_batches, args.quant_batches = [1, 8, 32, 64], [1, 8, 32], [1, 32]
    args.concurrency, args.hf_compile_c = [1, 8, 32], [1]
    args.prompt_len, args.e2e_prompt_len, args.new_tokens = 512, 128, 256
    args.decode_steps, args.forward_iters, args.forward_rounds = 20, 10, 5
    args.max_model_len, args.kv_gib, args.prefill_budget = 1024, 12.0, 8192
    if args.smoke:
        args.big_shape = args.small_shape
        args.batches, args.verify_batches, args.quant_batches = [1, 4], [1, 4], [1, 4]
        args.concurrency, args.hf_compile_c = [1, 4], []
        args.prompt_len, args.e2e_prompt_len, args.new_tokens = 32, 16, 12
        args.decode_steps, args.forward_iters, args.kv_gib, args.prefill_budget = 3, 2, 0.25, 512
        args.forward_rounds = 1
    rep = Report(" ".join(["python", *sys.argv]), args.out)
    if gemm_table_json is not None:
        rep.data["bf16_gemm_table"] = gemm_table_json
    sections = {"machine": (machine_section, rep, device),
                "bandwidth": (bandwidth_section, rep, device, 2**30 if device.type == "cuda" else 2**26),
                "decode_and_verify": (decode_section, rep, args, device, dtype),
                "quantized": (quant_section, rep, args, device, dtype),
                "e2e": (e2e_section, rep, args, device, dtype)}
    wanted = args.sections.split(",")
    for name, (fn, *fn_args) in sections.items():
        if name in wanted:
            rep.section(name, fn, *fn_args)
    summarize(rep)
    rep.data["total_seconds"] = round(rep.elapsed(), 1)
    print_table(rep.data)
    rep.write()
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
