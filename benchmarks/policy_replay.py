"""Replay the adaptive speculation policy (``spec/policy.py``) against real acceptance, offline: how close does it
get to the best fixed draft length, request by request, without a GPU?

Two steps:

``record`` (CPU, minutes; the default model and the shipped EAGLE-3 head): the greedy answers of the first
``--prompts`` prompts of MT-Bench (first turns), HumanEval and GSM8K test, and for every answer position the number
of leading drafts of a ``--max-k`` chain from there that the target accepts (teacher-forced, the trainer's own
held-out estimate, ``train/trainer.eagle3_loss``: the engine's acceptance at each position is the same up to
numerics, ``benchmarks/eagle_tf_check.py``). Writes ``--out`` (JSON: per set, per request, the prompt and answer
lengths and ``runs``, see ``runs_of``).

``replay``: the engine's step loop at concurrency ``--concurrency`` over those requests, the policy choosing a cap
before each step and recording the step after it asks for the next (as ``LLMEngine`` does), with step times from a
cost table (``--costs``, milliseconds per step by arm and batch size, e.g. the H200 step traces of SmolLM2 with the
trained head), jittered by ``--jitter``; the step after cap-0 steps catches the drafters up (``--catch-up-ms``) and
is credited to no arm. Reported per set: tokens per second of the policy and of each fixed arm over the same
requests (fixed arms: no jitter needed, exact expectation over the same positions), the policy's share of each
arm, and its ratio to the best fixed arm.

    python benchmarks/policy_replay.py record --prompts 12 --out benchmarks/results/acceptance_runs_cpu.json
    python benchmarks/policy_replay.py replay --runs benchmarks/results/acceptance_runs_cpu.json --concurrency 1
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.eagle_tf_check import cpu_engine_with_head, eval_prompts  # noqa: E402
from specserve.config import TrainDraftConfig  # noqa: E402
from specserve.sampling import SamplingParams  # noqa: E402
from specserve.spec.policy import RISING, SpecPolicy  # noqa: E402
from specserve.train.generate import Sample  # noqa: E402
from specserve.train.trainer import Trainer, TrainOps, collate, eagle3_loss, target_outputs  # noqa: E402

HEAD = "heads/smollm2-135m-instruct-eagle3"

# Milliseconds per step on the H200, SmolLM2-135M-Instruct with the shipped EAGLE-3 head, k = 3 (benchmarks/results/
# step_trace_*_gpu.json medians): batch 1 from step_trace_mt_bench_c1_gpu.json (plain 0.855, k = 3 verify 1.571,
# cap 1 1.412, cap 0 0.863), batch 8 from step_trace_gsm8k_c8_catchup64_gpu.json (plain 0.977, k = 3 2.273, cap 1
# 2.10, cap 0 0.982). Other batch sizes interpolate linearly.
H200_COSTS = {"1": {"plain": 0.855, "none": 1.571, "1": 1.412, "0": 0.863},
              "8": {"plain": 0.977, "none": 2.273, "1": 2.10, "0": 0.982}}


# ---------------------------------------------------------------------------------------------- record


def runs_of(trainer: Trainer, sample: Sample, max_k: int) -> list[int]:
    """Accepted drafts of a ``max_k`` chain for every state of the answer: ``runs[m - 1]`` once ``m`` answer tokens
    are committed (m = 1 .. answer length - 1; prefill samples the first), i.e. the chain drafted from anchor
    ``num_prompt + m - 2`` (head entry j holds token j + 1, the last committed, and the target's features at j).
    Worked example: prompt of 5 tokens, answer of 4 (positions 5..8): runs[0] is anchor 4 (last committed token 5,
    drafts for 6, 7, ...), runs[2] anchor 6 (drafts token 8 only: its run is at most 1)."""
    batch = collate([sample], 1 << 16, trainer.device)
    tgt = target_outputs(trainer.target, batch.tokens, trainer.head.config.aux_layer_ids, trainer.draft_ids,
                         trainer.t2d_index)
    runs = torch.zeros_like(batch.tokens)
    with torch.no_grad():
        eagle3_loss(trainer.head, tgt, batch, max_k, 1.0, None, runs)
    # anchor j (head entry: token j + 1, features j) drafts token j + 2 on: the last committed token is j + 1
    p, t = sample.num_prompt, len(sample.token_ids)
    return runs[0, p - 1:t - 2].tolist()


def record(args) -> None:
    device = torch.device("cpu")
    model, config, tok, engine, proposer = cpu_engine_with_head("eagle3", args.head, device, speculate=False)
    head = proposer.head
    draft_ids = torch.arange(len(head.d2t)) + head.d2t.long()
    trainer = Trainer(model, config, TrainDraftConfig(method="eagle3", ttt_steps=args.max_k,
                                                      num_spec_tokens=args.max_k),
                      draft_ids, device, Path("/tmp/policy_replay"), progress=False)
    head.set_ops(TrainOps())
    trainer.head = head.eval()
    out = {"command": " ".join(["python", *sys.argv]), "head": args.head, "max_k": args.max_k,
           "max_tokens": args.max_tokens, "sets": {}}
    for name, prompts in eval_prompts(args.prompts).items():
        ids = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}])) for p in prompts]
        reqs = engine.generate(ids, SamplingParams(max_tokens=args.max_tokens, temperature=0.0))
        rows = []
        for i, r in zip(ids, reqs):
            runs = runs_of(trainer, Sample(list(i) + list(r.output_ids), len(i)), args.max_k)
            rows.append({"prompt_len": len(i), "output_len": len(r.output_ids), "runs": runs})
        out["sets"][name] = rows
        k3 = [min(x, 3) for row in rows for x in row["runs"]]
        print(f"{name}: {len(rows)} requests, {sum(len(r['runs']) for r in rows)} positions, "
              f"mean accepted at k = 3 {statistics.mean(k3):.2f}", flush=True)
    Path(args.out).write_text(json.dumps(out))


# ---------------------------------------------------------------------------------------------- replay


class Costs:
    """Step time (seconds) by arm ("plain", "none", "0", "1", ...) and batch size, linear between the table's
    batch sizes and flat beyond them."""

    def __init__(self, table: dict[str, dict[str, float]]) -> None:
        self.table = table
        self.points = sorted((int(b), {a: ms * 1e-3 for a, ms in arms.items()}) for b, arms in table.items())

    def __call__(self, arm: str, batch: int) -> float:
        pts = self.points
        if batch <= pts[0][0]:
            return pts[0][1][arm]
        for (b0, a0), (b1, a1) in zip(pts, pts[1:]):
            if batch <= b1:
                w = (batch - b0) / (b1 - b0)
                return a0[arm] * (1 - w) + a1[arm] * w
        return pts[-1][1][arm]


def simulate(requests: list[dict], concurrency: int, costs: Costs, k: int, policy: SpecPolicy | None,
             fixed: int | None | str, jitter: float, catch_up: float, seed: int, spikes: float = 0.0,
             spike_ms: float = 0.0) -> dict:
    """Run ``requests`` ``concurrency`` at a time (a new one joins as one finishes, as a serving engine admits
    them) and return tokens, seconds and the arms chosen. ``fixed``: "plain" (no drafter), None (every request
    drafts k), or a cap; ignored when ``policy`` is given."""
    rng = random.Random(seed)
    queue = list(range(len(requests)))
    running: list[list[int]] = []  # [request index, answer tokens committed]
    tokens, seconds, chosen = 0, 0.0, []
    waiting, previous = None, None
    while queue or running:
        while queue and len(running) < concurrency:
            running.append([queue.pop(0), 1])  # prefill sampled the first answer token (its time not counted)
            tokens += 1
        batch = len(running)
        if policy is not None:
            cap = policy.choose(batch)
        else:
            cap = None if fixed is None else fixed
        if waiting is not None and policy is not None:  # recorded after the next cap is chosen, as the engine does
            w_batch, w_cap, w_seconds, w_tokens, w_outcomes, credited = waiting
            if credited:
                policy.record(w_batch, w_cap, w_seconds, w_tokens, outcomes=w_outcomes)
            else:
                policy.observe(w_outcomes)
        arm = "plain" if cap == "plain" else ("none" if cap is None else str(cap))
        drafts = 0 if cap == "plain" else (k if cap is None else min(cap, k))
        step = costs(arm, batch) * (1 + rng.uniform(-jitter, jitter))
        if rng.random() < spikes:  # a host hiccup (scheduling, GC): up to spike_ms more
            step += rng.uniform(0, spike_ms * 1e-3)
        credited = not (previous == 0 and cap not in (0, "plain"))
        if not credited:
            step += catch_up
        outcomes, committed = [], 0
        for entry in running:
            req = requests[entry[0]]
            left = req["output_len"] - entry[1]
            n = min(drafts, max(left - 1, 0))
            accepted = min(n, req["runs"][entry[1] - 1]) if n else 0
            if n:
                outcomes.append((n, accepted))
            entry[1] += accepted + 1
            committed += accepted + 1
        running = [e for e in running if e[1] < requests[e[0]]["output_len"]]
        tokens += committed
        seconds += step
        chosen.append(arm)
        waiting, previous = (batch, cap, step, committed, outcomes if drafts else None, credited), cap
    return {"tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds,
            "share": {a: round(chosen.count(a) / len(chosen), 3) for a in sorted(set(chosen))}}


def replay(args) -> None:
    data = json.loads(Path(args.runs).read_text())
    costs = Costs(json.loads(Path(args.costs).read_text()) if args.costs else H200_COSTS)
    result = {"command": " ".join(["python", *sys.argv]), "concurrency": args.concurrency, "k": args.k,
              "rising": args.rising, "costs_ms": costs.table, "sets": {}}
    for name, requests in data["sets"].items():
        if args.sets and name not in args.sets.split(","):
            continue
        row, noise = {}, (args.jitter, args.catch_up_ms * 1e-3)
        for fixed in ("plain", None, 1, 0):  # the same noise (seeds) as the policy's runs
            label = "fixed_" + ("none" if fixed is None else str(fixed))
            row[label] = statistics.mean(simulate(requests, args.concurrency, costs, args.k, None, fixed, *noise,
                                                  seed, args.spikes, args.spike_ms)["tok_s"]
                                         for seed in range(args.seeds))
        best = max(v for key, v in row.items() if key != "fixed_0")
        ratios, shares = [], []
        for seed in range(args.seeds):
            policy = SpecPolicy(caps=(0, 1), rising=args.rising)
            got = simulate(requests, args.concurrency, costs, args.k, policy, None, *noise,
                           seed, args.spikes, args.spike_ms)
            ratios.append(got["tok_s"] / best)
            shares.append(got["share"])
        row["adaptive_vs_best_fixed"] = {"mean": round(statistics.mean(ratios), 3), "min": round(min(ratios), 3),
                                         "runs": [round(r, 3) for r in ratios]}
        row["adaptive_vs_plain"] = round(statistics.mean(ratios) * best / row["fixed_plain"], 3)
        row["adaptive_share"] = shares[0]
        result["sets"][name] = row
        print(f"{name:10s} plain {row['fixed_plain']:7.0f} k={args.k} {row['fixed_none']:7.0f} "
              f"cap1 {row['fixed_1']:7.0f}  adaptive/best {row['adaptive_vs_best_fixed']['mean']:.3f} "
              f"(min {row['adaptive_vs_best_fixed']['min']:.3f}) share {shares[0]}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    rec = sub.add_parser("record")
    rec.add_argument("--head", default=HEAD)
    rec.add_argument("--prompts", type=int, default=12)
    rec.add_argument("--max-tokens", type=int, default=256)
    rec.add_argument("--max-k", type=int, default=5)
    rec.add_argument("--out", required=True)
    rep = sub.add_parser("replay")
    rep.add_argument("--runs", required=True)
    rep.add_argument("--costs", default=None, help="JSON {batch: {arm: ms}}; default: the H200 table above")
    rep.add_argument("--concurrency", type=int, default=1)
    rep.add_argument("--k", type=int, default=3)
    rep.add_argument("--sets", default=None)
    rep.add_argument("--seeds", type=int, default=8)
    rep.add_argument("--jitter", type=float, default=0.03)
    rep.add_argument("--catch-up-ms", type=float, default=0.5)
    rep.add_argument("--rising", type=float, default=RISING, help="SpecPolicy's rising (inf: the rule before stop 31)")
    rep.add_argument("--spikes", type=float, default=0.0, help="share of steps that hit a host hiccup")
    rep.add_argument("--spike-ms", type=float, default=2.0, help="a hiccup adds up to this much (uniform)")
    rep.add_argument("--out", default=None)
    args = ap.parse_args()
    record(args) if args.cmd == "record" else replay(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
