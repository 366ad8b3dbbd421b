"""What the adaptive speculation policy is shown (GPU machine, not CI; a diagnostic for spec/policy.py): the
step times the engine credits to each draft-length cap while the cap switches, next to the step times of runs
at one fixed cap, on the SmolLM2-135M shape (random weights and a random EAGLE-3 head, as gpu_engine.py's
end-to-end section: a step's cost does not depend on what the head accepts), greedy, ``--concurrency``
requests at once.

A scripted policy switches between cap 0 (``--zero`` decisions), no cap and cap 1 (``--burst`` decisions each),
over and over; every ``record`` call is kept with the position in its burst. Reported per cap and position:
the median credited seconds per step; and for the fixed runs (plain decoding; EAGLE-3 at k = 3, at cap 1) the
median wall time per ``engine.step()``. If the policy's view is right, a credited no-cap step costs what a
fixed k = 3 step costs.

    python benchmarks/policy_probe_gpu.py --out $OUT/policy_probe_gpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import benchmarks.gpu_engine as ge  # noqa: E402
from specserve.config import SpecConfig  # noqa: E402
from specserve.sampling import SamplingParams  # noqa: E402
from specserve.spec.params import SPEC_OFF, SpecParams  # noqa: E402


class Scripted:
    """Cap 0 for ``zero`` decisions, then no cap for ``burst``, then cap 1 for ``burst``, and again; keeps
    every record with (cap, position of the decision in its run, seconds, tokens)."""

    def __init__(self, zero: int, burst: int) -> None:
        self.plan = [0] * zero + [None] * burst + [1] * burst
        self.decisions, self.records, self.positions = 0, [], []

    def choose(self, batch_size: int) -> int | None:
        cap = self.plan[self.decisions % len(self.plan)]
        i = self.decisions % len(self.plan)
        while i > 0 and self.plan[i - 1] == cap:
            i -= 1
        self.positions.append(self.decisions % len(self.plan) - i)
        self.decisions += 1
        return cap

    def record(self, batch_size: int, cap: int | None, seconds: float, tokens: int, outcomes=None) -> None:
        # the decision that made these drafts is the one before the latest
        position = self.positions[-2] if len(self.positions) > 1 else -1
        self.records.append((cap, position, seconds, tokens))

    def observe(self, outcomes) -> None:
        pass

    def snapshot(self) -> dict:
        return {}


def step_times(engine, prompts, params, spec) -> list[float]:
    for i, p in enumerate(prompts):
        engine.add_request(f"p{i}", p, params, spec)
    walls = []
    while engine.has_unfinished():
        t0 = time.perf_counter()
        engine.step()
        walls.append(time.perf_counter() - t0)
    return walls


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--new-tokens", type=int, default=400)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--zero", type=int, default=6)
    ap.add_argument("--burst", type=int, default=4)
    ap.add_argument("--out", default=None)
    ap.add_argument("--device", default="cuda", help="cpu: a wiring check")
    args = ap.parse_args()
    device = torch.device(args.device)
    config, model, prompts, max_len = ge.small_model_and_prompts(device, args.prompt_len, args.new_tokens,
                                                                 args.concurrency)
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    head = SpecConfig(method="eagle3", model="dummy", num_spec_tokens=3, adaptive=True)
    engine = ge.engine_for(model, config, device, max(4, args.concurrency), 2.0, max_len, 4096, spec=head,
                           draft_graphs=True)
    result = {"command": " ".join(["python", *sys.argv]),
              "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "concurrency": args.concurrency, "async_scheduling": engine.async_scheduling, "fixed": {}}
    from specserve.spec.policy import SpecPolicy

    class Fixed(SpecPolicy):
        def __init__(self, cap):
            super().__init__(caps=(0, 1))
            self.cap = cap

        def choose(self, batch_size):
            return self.cap

    for name, spec, policy in (("plain", SPEC_OFF, None), ("eagle3_k3", SpecParams("eagle3", 3), None),
                               ("eagle3_cap1", SpecParams("eagle3", 3), Fixed(1)),
                               ("eagle3_cap0", SpecParams("eagle3", 3), Fixed(0))):
        engine.set_spec_policy(policy)
        step_times(engine, prompts, SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True), spec)
        walls = step_times(engine, prompts, params, spec)
        result["fixed"][name] = {"median_step_ms": statistics.median(walls) * 1e3, "steps": len(walls),
                                 "total_s": sum(walls)}
        print(f"{name:12s} median step {statistics.median(walls) * 1e3:.3f} ms over {len(walls)} steps", flush=True)
    scripted = Scripted(args.zero, args.burst)
    engine.set_spec_policy(scripted)
    step_times(engine, prompts, params, SpecParams("eagle3", 3))
    by: dict[str, list[float]] = {}
    for cap, position, seconds, tokens in scripted.records:
        by.setdefault(f"cap={'none' if cap is None else cap} pos={position}", []).append(seconds / max(tokens, 1)
                                                                                         * args.concurrency)
    result["credited_ms_per_step"] = {k: {"median": statistics.median(v) * 1e3, "n": len(v)}
                                      for k, v in sorted(by.items())}
    for k, v in sorted(by.items()):
        print(f"credited {k:16s} {statistics.median(v) * 1e3:.3f} ms/step (n={len(v)})", flush=True)
    out = Path(args.out or (Path(os.environ.get("OUT", "/tmp")) / "policy_probe_gpu.json"))
    out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
