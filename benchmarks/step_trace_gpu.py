"""Where the time of an offline run goes, step by step (GPU machine, not CI; a diagnostic): the real SmolLM2 target
and the committed EAGLE-3 head as ``train_heads_gpu.py speed`` loads them (run its two ``stage`` calls first), the
first ``--prompts`` prompts of one evaluation set ``--concurrency`` at a time, greedy, for plain decoding, a
fixed EAGLE-3 k = 3 and the adaptive policy. Every ``engine.step()`` call is timed and classed by what it
scheduled: ``prompt`` (a prompt chunk), ``verify`` (drafts verified), ``decode`` (one token each), ``commit``
(an overlapped step's commit that launched nothing). Reported per row: the run's time, the time and count of
each class, the time between steps (the generate loop), the longest steps, and for the adaptive row each
decision and record of the policy. Writes $OUT/step_trace.json.

    python benchmarks/step_trace_gpu.py --set humaneval --prompts 4
    python benchmarks/step_trace_gpu.py --set mt_bench --prompts 16 --concurrency 8 --repeats 5 \
        --rows eagle3_k3_adaptive,eagle3_k3_adaptive_doubling
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import benchmarks.train_heads_gpu as th  # noqa: E402
from benchmarks.gpu_engine import sync  # noqa: E402
from specserve.sampling import SamplingParams  # noqa: E402
from specserve.spec.params import SPEC_OFF, SpecParams  # noqa: E402
from specserve.spec.policy import SpecPolicy  # noqa: E402


class Logged(SpecPolicy):
    """Keeps every decision and record (decision number, batch size, cap, ms, tokens) and the host time spent in
    the policy (``seconds``). ``pin`` (a cap, or "none" for no cap): every decision returns it instead of the
    policy's choice (the engine runs its adaptive machinery and the policy is timed, but what runs is a fixed arm;
    the policy's other arms are then never measured, so every decision takes its try path: its time and snapshot
    are not a free-running policy's). A decision's entry also holds its bucket's goodput per arm and the acceptance
    model's expected tokens at 3 drafts, as they stood when it chose (host time spent on them is not counted)."""

    def __init__(self, pin: int | str = "free", **kw) -> None:
        super().__init__(**kw)
        self.log: list = []
        self.pin, self.seconds = pin, 0.0
        self._recording = False  # inside record, whose own timing covers the observe it calls

    def choose(self, batch_size: int) -> int | None:
        t0 = time.perf_counter()
        cap = super().choose(batch_size)
        self.seconds += time.perf_counter() - t0
        if self.pin != "free":
            cap = None if self.pin == "none" else self.pin
        arms = self.stats.get(self.bucket(batch_size), {})
        seen = {("none" if a == -1 else str(a)): (None if s.goodput is None else round(s.goodput))
                for a, s in arms.items()}
        self.log.append(["choose", self.decisions, batch_size, cap, seen,
                         round(self.acceptance.expected(3), 3)])
        return cap

    def record(self, batch_size, cap, seconds, tokens, outcomes=None) -> None:
        self.log.append(["record", self.decisions, batch_size, cap, round(seconds * 1e3, 3), tokens,
                         None if outcomes is None else [list(o) for o in outcomes]])
        t0 = time.perf_counter()
        self._recording = True
        try:
            super().record(batch_size, cap, seconds, tokens, outcomes)
        finally:
            self._recording = False
        self.seconds += time.perf_counter() - t0

    def observe(self, outcomes) -> None:
        if self._recording:
            super().observe(outcomes)
            return
        t0 = time.perf_counter()
        super().observe(outcomes)
        self.seconds += time.perf_counter() - t0


# row -> (spec, policy): spec None is EAGLE-3 k = 3; policy None runs none, "free" the adaptive policy, a cap
# ("none": no cap, 0, 1) the adaptive machinery with every decision pinned to that cap; "doubling" the adaptive policy
# as before stop 31 (every losing probe doubles its arm's interval, however much it rose: ``rising`` infinite)
ROWS = {"plain": (SPEC_OFF, None), "eagle3_k3": (None, None), "eagle3_k3_adaptive": (None, "free"),
        "eagle3_k3_adaptive_doubling": (None, "doubling"),
        "eagle3_k3_pinned_none": (None, "none"), "eagle3_k3_pinned_0": (None, 0), "plain_again": (SPEC_OFF, None)}


def trace(engine, prompts, params, spec, concurrency: int = 1) -> dict:
    """Run ``prompts`` ``concurrency`` at a time, timing every step() and classing it."""
    last: list = []
    schedule = engine.scheduler.schedule

    def watched():
        out = schedule()
        last.append(out)
        return out

    engine.scheduler.schedule = watched
    steps, gaps = [], []
    sync(engine.device)
    t0 = time.perf_counter()
    try:
        for i in range(0, len(prompts), concurrency):
            reqs = []
            for prompt in prompts[i:i + concurrency]:
                rid = f"trace-{time.monotonic_ns()}"
                engine.add_request(rid, prompt, params, spec)
                reqs.append(engine.requests[rid])
            end = None
            while not all(r.finished for r in reqs):
                begin = time.perf_counter()
                if end is not None:
                    gaps.append(begin - end)
                last.clear()
                captured = engine._capture_seconds()
                outs = engine.step()
                end = time.perf_counter()
                capture = engine._capture_seconds() - captured
                sched = next((s for s in last if not s.is_empty), None)
                if sched is None:
                    kind = "commit"
                elif not all(s.samples and s.num_new_tokens == 1 + s.num_spec_tokens for s in sched.scheduled):
                    kind = "prompt"
                elif any(s.num_spec_tokens for s in sched.scheduled):
                    kind = "verify"
                else:
                    kind = "decode"
                steps.append((kind, end - begin, sum(len(o.new_token_ids) for o in outs), capture,
                              engine.num_running))
        sync(engine.device)
    finally:
        engine.scheduler.schedule = schedule
    total = time.perf_counter() - t0
    tokens = sum(t for _, _, t, _, _ in steps)
    by_kind = {}
    for kind in ("prompt", "verify", "decode", "commit"):
        times = [d for k, d, *_ in steps if k == kind]
        by_kind[kind] = {"steps": len(times), "seconds": sum(times),
                         "median_ms": statistics.median(times) * 1e3 if times else None,
                         "tokens": sum(t for k, _, t, *_ in steps if k == kind)}
    longest = sorted(((d * 1e3, k, i, round(c * 1e3, 1), b) for i, (k, d, _, c, b) in enumerate(steps)),
                     reverse=True)[:12]
    return {"seconds": total, "tokens": tokens, "tok_s": tokens / total, "steps": len(steps),
            "in_steps_seconds": sum(d for _, d, *_ in steps), "between_steps_seconds": sum(gaps),
            "capture_seconds": sum(c for *_, c, _ in steps), "captures": sum(c > 0 for *_, c, _ in steps),
            "by_kind": by_kind, "longest_ms": longest,
            "steps_ms": [[k, round(d * 1e3, 3), t, round(c * 1e3, 1), b] for k, d, t, c, b in steps]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--set", default="humaneval", choices=["mt_bench", "humaneval", "gsm8k"])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--gsm8k-limit", type=int, default=200)
    ap.add_argument("--cold", action="store_true", help="no warm-up: first-use costs land in the rows")
    ap.add_argument("--eagle3-head", default="heads/smollm2-135m-instruct-eagle3")
    ap.add_argument("--repeats", type=int, default=1, help="run the row list this many times, interleaved")
    ap.add_argument("--rows", default="plain,eagle3_k3,eagle3_k3_adaptive,plain_again",
                    help=f"rows to run, in order, from {','.join(ROWS)}")
    args = ap.parse_args()
    rows = args.rows.split(",")
    if not set(rows) <= set(ROWS):
        ap.error(f"--rows: unknown {sorted(set(rows) - set(ROWS))}; choose from {','.join(ROWS)}")
    engine, ids = th.eval_engine(args, {"eagle3": th.ROOT / args.eagle3_head})
    prompts = ids[args.set][:args.prompts]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    k3 = SpecParams("eagle3", 3)
    if not args.cold:  # warm-up: graphs of every draft length and of a policy's catch-ups at batch 1 and at the
        # concurrency (draining), prefill kernels of a few prompt shapes
        warm = ids[args.set][-args.concurrency - 1:]
        for batch in (warm[:1], warm[1:]):
            for spec in (SPEC_OFF, SpecParams("eagle3", 1), SpecParams("eagle3", 2), k3):
                engine.generate(batch, SamplingParams(max_tokens=32, temperature=0.0), spec)
            engine.set_spec_policy(SpecPolicy(caps=(0, 1), probe_every=4))
            engine.generate(batch, SamplingParams(max_tokens=96, temperature=0.0), k3)
            engine.set_spec_policy(None)
        for prompt in ids[args.set][-8:]:
            engine.generate([prompt], SamplingParams(max_tokens=2, temperature=0.0))
        chain = engine.proposers["eagle3"].chain  # the drafter's graphs of every queue length (catch-ups of 16)
        if chain is not None:
            chain.build(list(range(1, args.concurrency + 1)), [0, 1, 2])
    result = {"command": " ".join(["python", *sys.argv]),
              "device": torch.cuda.get_device_name(0) if args.device == "cuda" else args.device, "rows": {}}
    order = [(f"{name}#{rep}" if args.repeats > 1 else name, name) for rep in range(args.repeats) for name in rows]
    for key, name in order:  # with --repeats, the row list again and again (machine drift hits every row alike)
        spec, pin = ROWS[name]
        if pin == "doubling":
            policy = Logged(caps=(0, 1), rising=float("inf"))
        else:
            policy = None if pin is None else Logged(caps=(0, 1), pin=pin)
        engine.set_spec_policy(policy)
        row = trace(engine, prompts, params, spec if spec is not None else k3, args.concurrency)
        if policy is not None:
            row["policy"] = policy.snapshot()
            row["policy_log"] = policy.log
            row["policy_seconds"] = policy.seconds
        result["rows"][key] = row
        kinds = " ".join(f"{k}:{v['steps']}/{v['seconds'] * 1e3:.0f}ms/med{v['median_ms'] or 0:.2f}"
                         for k, v in row["by_kind"].items())
        print(f"{key:20s} {row['tok_s']:7.0f} tok/s {row['seconds']:.3f}s steps {row['steps']} "
              f"between {row['between_steps_seconds'] * 1e3:.0f}ms captures {row['captures']} "
              f"{row['capture_seconds'] * 1e3:.0f}ms {kinds}", flush=True)
        print("   longest (ms, kind, step, capture ms, running)", [x[:2] + x[3:] for x in row["longest_ms"][:8]],
              flush=True)
    if args.repeats > 1:  # per row: median tokens/s over the repeats, and each repeat's
        result["median_tok_s"] = {name: statistics.median(result["rows"][f"{name}#{rep}"]["tok_s"]
                                                           for rep in range(args.repeats)) for name in rows}
        print("median tok/s", {k: round(v) for k, v in result["median_tok_s"].items()}, flush=True)
    th.OUT.mkdir(parents=True, exist_ok=True)
    (th.OUT / "step_trace.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
