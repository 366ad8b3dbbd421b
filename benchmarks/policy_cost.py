"""Host cost of the adaptive speculation policy (``spec/policy.py``): microseconds of Python per engine step (one
``choose`` and one ``record`` with the step's verify outcomes), which the engine pays on its critical path at
every step the policy runs (a SmolLM2 step on the H200 takes about 1 ms). Synthetic steps: no cap costs 2.2 units,
caps 0 and 1 one, each drafted request accepts 0..k drafts at random. Prints a line per batch size and writes
``--out`` (JSON) with the command and the machine.

    python benchmarks/policy_cost.py --out benchmarks/results/policy_cost_cpu.json
"""

from __future__ import annotations

import argparse
import importlib
import json
import platform
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))



def per_step_us(policy_class, batch: int, steps: int, seed: int = 0) -> float:
    rng, policy, waiting = random.Random(seed), policy_class(caps=(0, 1)), None
    t0 = time.perf_counter()
    for _ in range(steps):
        cap = policy.choose(batch)
        if waiting is not None:  # the engine records a step after it asks for the next cap
            policy.record(batch, *waiting)
        drafts = 3 if cap is None else cap
        outcomes = [(drafts, min(drafts, int(rng.random() * 4))) for _ in range(batch)] if drafts else None
        tokens = batch + (sum(a for _, a in outcomes) if outcomes else 0)
        waiting = (cap, 1e-3 * (2.2 if cap is None else 1.0) * rng.uniform(0.97, 1.03), tokens, outcomes)
    return (time.perf_counter() - t0) / steps * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--steps", type=int, default=20000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--module", default="specserve.spec.policy",
                    help="where SpecPolicy comes from (an older copy, for a same-machine A/B)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    policy_class = importlib.import_module(args.module).SpecPolicy
    result = {"command": " ".join(["python", *sys.argv]), "machine": {"processor": platform.processor(),
              "python": platform.python_version(), "node": platform.node()}, "module": args.module, "us_per_step": {}}
    for batch in (int(b) for b in args.batches.split(",")):
        best = min(per_step_us(policy_class, batch, args.steps, seed) for seed in range(args.repeats))
        result["us_per_step"][str(batch)] = round(best, 2)
        print(f"batch {batch:3d}: {best:6.1f} us per step (choose + record), best of {args.repeats}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
