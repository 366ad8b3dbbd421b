"""CUDA graphs for decode/verify steps on GPU (engine/cuda_graphs.py): correctness, then speed. One call:

    python benchmarks/cuda_graphs_gpu.py                  # JSON to $OUT/cuda_graphs_gpu.json if $OUT is set,
    python benchmarks/cuda_graphs_gpu.py --out r.json     # else benchmarks/results/cuda_graphs_gpu.json

Models: dummy (random) weights in bf16, Triton attention backend, block_size 16.

1. Correctness, SmolLM2-135M shape, 16 prompts (random phrases repeated, so n-gram lookup finds drafts), greedy,
   ignore_eos, 64 tokens, plain decode and n-gram speculation (num_spec_tokens 4). Three modes of one engine:
   ``graphs`` (replayed CUDA graphs), ``static`` (the same padded static-buffer steps run eagerly, no capture)
   and ``eager`` (the ordinary ragged path, no padding).
   - graphs == static, token for token: same kernels on the same padded shapes, only captured vs launched, so
     any difference is a capture bug (stale buffer, pool aliasing). A mismatch fails the run.
   - graphs == eager, token for token, except where the first divergence of a prompt is a bf16 near-tie: the
     eager model's logits of the two tokens, recomputed at that position, differ by at most ``TIE_REL`` of the
     largest |logit| (padding changes GEMM shapes and the attention split count, hence rounding). Any other
     divergence fails the run. The near-ties are listed.
   - the graph path really ran: replays with query length 1 (decode) and > 1 (verify) are counted.
2. Speed, SmolLM2-135M: ``concurrency`` requests all decoding (prompt 128 tokens), engine.step() timed over
   ``--iters`` steps after ``--warmup``: step ms, output tok/s (= concurrency / step time) and the model part
   (ModelRunner.execute, synchronised) with graphs and eagerly, at concurrency 1, 8, 32, 64. Engine construction
   time, graph capture time, number of graphs and pool memory (growth of reserved memory while capturing).
3. Speed, Llama-3.1-8B shape, prompt 512: decode step at batch 1 and 32 with graphs (and eagerly), and its HBM
   floor: bytes a decode step must read (every weight except the embedding table, of which it gathers a few
   rows; plus every cached K/V of the batch) over the device-to-device copy bandwidth measured here (a 1 GiB
   copy reads and writes 1 GiB each). ``floor %`` = floor / measured time.

Exit status 1 when any check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from specserve.config import CacheConfig, CudaGraphConfig, EngineConfig, SchedulerConfig, SpecConfig  # noqa: E402
from specserve.engine.cuda_graphs import CudaGraphRunner  # noqa: E402
from specserve.engine.engine import LLMEngine  # noqa: E402
from specserve.models.loader import load_model  # noqa: E402
from specserve.sampling import SamplingParams  # noqa: E402
from specserve.spec.params import SPEC_OFF, SpecParams  # noqa: E402

DEVICE = torch.device("cuda")
BLOCK_SIZE = 16
NUM_PROMPTS = 16
MAX_TOKENS = 64
NUM_SPEC_TOKENS = 4
CONCURRENCY = (1, 8, 32, 64)
LLAMA_BATCHES = (1, 32)
TIE_REL = 0.02  # a divergence is a near-tie when |logit_a - logit_b| <= TIE_REL * max |logit|


def make_engine(model, model_config, max_num_seqs: int, max_model_len: int, kv_gib: float,
                graphs: bool) -> tuple[LLMEngine, float]:
    """An engine around an already loaded model; n-gram is the server default so decode (q 1) and verify of
    4 drafts (q 5) are captured at startup. Returns (engine, construction seconds)."""
    config = EngineConfig(
        model=model_config.name, dtype="bfloat16", device="cuda",
        cache=CacheConfig(block_size=BLOCK_SIZE, kv_cache_memory_gib=kv_gib),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=2048,
                                  max_model_len=max_model_len),
        speculative=SpecConfig(method="ngram", num_spec_tokens=NUM_SPEC_TOKENS, ngram_min=2, ngram_max=4),
        cuda_graphs=CudaGraphConfig(enabled=graphs))
    torch.cuda.synchronize()
    start = time.perf_counter()
    engine = LLMEngine(config, model, model_config, tokenizer=None)
    torch.cuda.synchronize()
    return engine, time.perf_counter() - start


def set_mode(engine: LLMEngine, mode: str, captured: CudaGraphRunner | None) -> None:
    """graphs: the captured runner; static: a fresh no-capture runner (same config, same split counts);
    eager: none."""
    runner = engine.runner
    if mode == "graphs":
        assert captured is not None and captured.capture
        runner.graphs = captured
    elif mode == "static":
        runner.graphs = CudaGraphRunner(runner.model, runner.kv_caches, runner.backend, engine.config.cuda_graphs,
                                        runner.block_size, engine.max_model_len,
                                        engine.config.scheduler.max_num_seqs, runner.device, capture=False)
    else:
        runner.graphs = None


def phrase_prompts(vocab: int, seed: int) -> list[list[int]]:
    """Prompts of 24..100 tokens: a random 6..12-token phrase repeated with random tokens between."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(NUM_PROMPTS):
        phrase = torch.randint(0, vocab, (6 + i % 7,), generator=gen).tolist()
        ids: list[int] = []
        while len(ids) < 24 + 5 * i:
            ids += phrase + torch.randint(0, vocab, (int(torch.randint(1, 4, (1,), generator=gen)),),
                                          generator=gen).tolist()
        out.append(ids)
    return out


@torch.inference_mode()
def eager_logits(engine: LLMEngine, tokens: list[int]) -> torch.Tensor:
    """[vocab] float32 logits after ``tokens``, one eager prefill on free blocks of the idle engine."""
    runner = engine.runner
    assert not engine.has_unfinished() and len(tokens) <= engine.max_model_len
    table = list(range(-(-len(tokens) // runner.block_size)))
    hidden, _ = runner.forward(tokens, list(range(len(tokens))), [len(tokens)], [len(tokens)], [table])
    return runner.model.compute_logits(hidden[-1:])[0]


def check_correctness(engine: LLMEngine, captured: CudaGraphRunner) -> dict:
    prompts = phrase_prompts(engine.model_config.vocab_size, seed=0)
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    report: dict = {}
    for name, spec in (("decode", SPEC_OFF), ("ngram_k4", SpecParams("ngram", NUM_SPEC_TOKENS))):
        outs, drafts, accepted = {}, {}, {}
        replays_before = dict(captured.replays_by_query_len)
        for mode in ("graphs", "static", "eager"):
            set_mode(engine, mode, captured)
            reqs = engine.generate(prompts, greedy, spec=spec)
            outs[mode] = [r.output_ids for r in reqs]
            drafts[mode] = sum(r.spec_counters.num_draft_tokens for r in reqs) if spec.enabled else 0
            accepted[mode] = sum(r.spec_counters.num_accepted_tokens for r in reqs) if spec.enabled else 0
        replays = {q: n - replays_before.get(q, 0) for q, n in captured.replays_by_query_len.items()
                   if n - replays_before.get(q, 0)}
        set_mode(engine, "eager", captured)
        ties, mismatches = [], []
        for i, (g, e) in enumerate(zip(outs["graphs"], outs["eager"])):
            if g == e:
                continue
            at = next((j for j, (a, b) in enumerate(zip(g, e)) if a != b), min(len(g), len(e)))
            if at >= min(len(g), len(e)):  # one is a prefix of the other: lengths differ, never a tie
                mismatches.append({"prompt": i, "position": at, "reason": "lengths differ"})
                continue
            logits = eager_logits(engine, prompts[i] + e[:at])
            gap = float((logits[g[at]] - logits[e[at]]).abs())
            scale = float(logits.abs().max())
            entry = {"prompt": i, "position": at, "graphs_token": g[at], "eager_token": e[at], "logit_gap": gap,
                     "max_abs_logit": scale}
            (ties if gap <= TIE_REL * scale else mismatches).append(entry)
        # The graph path ran: decode replays (q 1), and with speculation verify replays (q > 1) of real drafts.
        ran = replays.get(1, 0) > 0 if not spec.enabled else (drafts["graphs"] > 0 and any(q > 1 for q in replays))
        ok = outs["graphs"] == outs["static"] and not mismatches and ran
        report[name] = {
            "ok": ok,
            "graphs_equal_static": outs["graphs"] == outs["static"],
            "graphs_equal_eager_prompts": sum(g == e for g, e in zip(outs["graphs"], outs["eager"])),
            "num_prompts": len(prompts),
            "near_ties": ties,
            "mismatches": mismatches,
            "graph_replays_by_query_len": {str(q): n for q, n in sorted(replays.items())},
            "drafted_tokens": drafts,
            "accepted_tokens": accepted,
        }
    return report


def time_decode(engine: LLMEngine, mode: str, captured: CudaGraphRunner | None, concurrency: int,
                prompt_len: int, warmup: int, iters: int, seed: int) -> dict:
    """``concurrency`` requests, all decoding (no speculation): mean engine.step() and ModelRunner.execute times
    over ``iters`` steps."""
    set_mode(engine, mode, captured)
    gen = torch.Generator().manual_seed(seed)
    vocab = engine.model_config.vocab_size
    # Requests whose prompts finish prefilling first decode while the others still prefill (chunked prefill):
    # leave them room, so that every request is still running when the timed steps end.
    params = SamplingParams(max_tokens=warmup + iters + 512, temperature=0.0, ignore_eos=True)
    ids = [f"t{seed}-{mode}-{concurrency}-{i}" for i in range(concurrency)]
    for rid in ids:
        engine.add_request(rid, torch.randint(0, vocab, (prompt_len,), generator=gen).tolist(), params, SPEC_OFF)
    reqs = [engine.requests[rid] for rid in ids]
    while any(not r.output_ids for r in reqs):  # prefill (chunked) until every request has its first token
        engine.step()
    for _ in range(warmup):
        engine.step()
    runner = engine.runner
    execute = runner.execute
    execute_s = []

    def timed_execute(*args, **kwargs):
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = execute(*args, **kwargs)
        torch.cuda.synchronize()
        execute_s.append(time.perf_counter() - t)
        return out

    runner.execute = timed_execute
    replays = captured.num_replays if captured is not None else 0
    context = sum(r.num_tokens for r in reqs) / concurrency
    try:
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(iters):
            engine.step()
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
    finally:
        del runner.execute  # back to the class's method
    assert all(not r.finished and len(engine.scheduler.running) == concurrency for r in reqs), "a request left"
    replayed = (captured.num_replays - replays) if captured is not None else 0
    for rid in ids:
        engine.abort_request(rid)
    step_s = elapsed / iters
    return {"mode": mode, "concurrency": concurrency, "step_ms": step_s * 1e3, "tok_s": concurrency / step_s,
            "execute_ms": 1e3 * sum(execute_s) / len(execute_s), "graph_replays": replayed,
            "mean_context": context + iters / 2, "graph_path_every_step": replayed == iters if mode == "graphs"
            else None}


def copy_bandwidth(nbytes: int = 2**30, iters: int = 20) -> float:
    """Bytes/s moved (read + written) by a device-to-device copy of ``nbytes``."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        dst.copy_(src)
    end.record()
    end.synchronize()
    seconds = start.elapsed_time(end) / 1e3
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes * iters / seconds


def decode_bytes(model, model_config, batch: int, mean_context: float) -> tuple[int, int]:
    """(weight bytes, KV bytes) one decode step reads: every parameter except the embedding table when the LM
    head is separate (a decode step gathers ``batch`` rows of it), and every cached K/V of the batch."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    if model.lm_head is not None:
        weights -= model.embed_tokens.weight.numel() * model.embed_tokens.weight.element_size()
    elem = next(model.parameters()).element_size()
    per_token = 2 * model_config.num_hidden_layers * model_config.num_key_value_heads * model_config.head_dim * elem
    return weights, int(batch * mean_context * per_token)


def capture_stats(engine: LLMEngine, seconds: float) -> dict:
    graphs = engine.runner.graphs
    return {"engine_init_s": seconds, "num_graphs": len(graphs.steps) if graphs else 0,
            "capture_s": graphs.capture_seconds if graphs else 0.0,
            "pool_mib": graphs.pool_bytes / 2**20 if graphs else 0.0,
            "buckets": graphs.buckets if graphs else [],
            "backend": type(engine.runner.backend).__name__}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--skip-llama", action="store_true", help="skip the Llama-3.1-8B shape (16 GB of weights)")
    args = ap.parse_args()
    assert torch.cuda.is_available(), "needs a CUDA device"
    out = Path(args.out) if args.out else (Path(os.environ["OUT"]) / "cuda_graphs_gpu.json" if os.environ.get("OUT")
                                           else Path("benchmarks/results/cuda_graphs_gpu.json"))
    report: dict = {"command": " ".join(["python", *sys.argv]), "device": torch.cuda.get_device_name(),
                    "torch": torch.__version__, "python": platform.python_version()}
    try:
        import triton
        report["triton"] = triton.__version__
    except ImportError:
        report["triton"] = None
    failures: list[str] = []

    # ---- SmolLM2-135M: correctness, then decode speed --------------------------------------------------------
    model, model_config, _ = load_model("dummy:smollm2-135m", "bfloat16", DEVICE, 2048)
    eager_engine, eager_init_s = make_engine(model, model_config, 64, 2048, 4.0, graphs=False)
    report["smollm2_eager_engine_init_s"] = eager_init_s
    del eager_engine
    torch.cuda.empty_cache()
    engine, init_s = make_engine(model, model_config, 64, 2048, 4.0, graphs=True)
    captured = engine.runner.graphs
    report["smollm2_capture"] = capture_stats(engine, init_s)
    if captured is None:
        report["failures"] = [f"no CUDA graphs were set up (backend {type(engine.runner.backend).__name__})"]
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2))
        print(json.dumps(report, indent=2))
        return 1
    correctness = check_correctness(engine, captured)
    report["smollm2_correctness"] = correctness
    failures += [f"smollm2 {name}" for name, r in correctness.items() if not r["ok"]]
    print(json.dumps({"smollm2_capture": report["smollm2_capture"], "smollm2_correctness": correctness},
                     indent=1, default=str), flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2, default=str))  # kept if the timing below fails

    timings = []
    for concurrency in CONCURRENCY:
        for mode in ("eager", "graphs"):
            timings.append(time_decode(engine, mode, captured, concurrency, 128, args.warmup, args.iters, seed=1))
            if mode == "graphs" and not timings[-1]["graph_path_every_step"]:
                failures.append(f"smollm2 concurrency {concurrency}: a timed step did not replay a graph")
    report["smollm2_decode"] = timings
    del engine, captured, model
    torch.cuda.empty_cache()

    # ---- Llama-3.1-8B: decode step with graphs vs the HBM floor ---------------------------------------------
    bandwidth = copy_bandwidth()
    report["copy_bandwidth_gb_s"] = bandwidth / 1e9
    if not args.skip_llama:
        model, model_config, _ = load_model("dummy:llama-3.1-8b", "bfloat16", DEVICE, 2048)
        engine, init_s = make_engine(model, model_config, max(LLAMA_BATCHES), 2048, 12.0, graphs=True)
        captured = engine.runner.graphs
        report["llama8b_capture"] = capture_stats(engine, init_s)
        rows = []
        for batch in LLAMA_BATCHES:
            for mode in ("eager", "graphs"):
                r = time_decode(engine, mode, captured, batch, 512, args.warmup, args.iters, seed=2)
                weights, kv = decode_bytes(model, model_config, batch, r["mean_context"])
                r.update(weight_bytes=weights, kv_bytes=kv, floor_ms=1e3 * (weights + kv) / bandwidth)
                r["floor_pct_of_step"] = 100 * r["floor_ms"] / r["step_ms"]
                r["floor_pct_of_execute"] = 100 * r["floor_ms"] / r["execute_ms"]
                rows.append(r)
                if mode == "graphs" and not r["graph_path_every_step"]:
                    failures.append(f"llama8b batch {batch}: a timed step did not replay a graph")
        report["llama8b_decode"] = rows

    report["failures"] = failures
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))

    # ---- table -------------------------------------------------------------------------------------------------
    print(f"{report['device']}  torch {report['torch']}  triton {report['triton']}")
    cap = report["smollm2_capture"]
    print(f"SmolLM2-135M: {cap['num_graphs']} graphs (buckets {cap['buckets']}) captured in {cap['capture_s']:.2f} s, "
          f"pool ~{cap['pool_mib']:.0f} MiB; engine init {cap['engine_init_s']:.2f} s "
          f"(eager engine {report['smollm2_eager_engine_init_s']:.2f} s)")
    for name, r in report["smollm2_correctness"].items():
        print(f"  {name:9s} ok={r['ok']}  graphs==static {r['graphs_equal_static']}  graphs==eager "
              f"{r['graphs_equal_eager_prompts']}/{r['num_prompts']} prompts, near-ties {len(r['near_ties'])}, "
              f"mismatches {len(r['mismatches'])}; replays by q {r['graph_replays_by_query_len']}; "
              f"drafted {r['drafted_tokens']} accepted {r['accepted_tokens']}")
    print(f"\n{'model':10s} {'mode':7s} {'batch':>5s} {'step ms':>8s} {'exec ms':>8s} {'tok/s':>9s} {'floor ms':>9s}"
          f" {'floor %':>8s}")
    for model_name, key in (("smollm2", "smollm2_decode"), ("llama8b", "llama8b_decode")):
        for r in report.get(key, []):
            floor = f"{r['floor_ms']:9.3f} {r['floor_pct_of_step']:7.1f}%" if "floor_ms" in r else f"{'':9s} {'':8s}"
            print(f"{model_name:10s} {r['mode']:7s} {r['concurrency']:5d} {r['step_ms']:8.3f} {r['execute_ms']:8.3f} "
                  f"{r['tok_s']:9.1f} {floor}")
    print(f"\ncopy bandwidth {report['copy_bandwidth_gb_s']:.0f} GB/s; JSON: {out}")
    if failures:
        print("FAILED: " + "; ".join(failures))
        return 1
    print("all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
