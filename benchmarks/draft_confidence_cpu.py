"""Where an EAGLE-3 head's first draft misses, against how sure the target itself is (CPU, fp32, the default model;
not CI). A diagnostic for issue 4's MT-Bench gap: is the head's first-position accuracy lower on MT-Bench because
the target's own next token is less certain there (more near-ties, which any small drafter misses), or because the
head is worse at equally certain positions (a generalisation gap that training data could close)?

For the first ``--prompts`` prompts of MT-Bench (first turns, with their categories), HumanEval and GSM8K test, the
engine answers greedily (``--max-tokens``, no speculation). Then, teacher-forced on prompt + answer as in training
(``trainer.target_outputs`` and the head's first draft position), for every answer token the head's first draft
predicts: the target's top probability there (over the draft vocabulary, as the trainer sees it) and whether the
head's argmax equals the target's. Reported per set (and MT-Bench category): first-draft accuracy, the share of
positions in each top-probability bin, the accuracy within each bin, and the accuracy the set would have with
the bins weighted as in the reference set (``--reference``, default GSM8K test): a mix-adjusted accuracy.

    python benchmarks/draft_confidence_cpu.py heads/smollm2-135m-instruct-eagle3 --out /tmp/draft_confidence.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.eagle_tf_check import DATA, cpu_engine_with_head, eval_prompts, read_jsonl  # noqa: E402
from specserve.sampling import SamplingParams  # noqa: E402
from specserve.train.chain_attention import ChainAttentionBackend, ChainMeta, layer_states  # noqa: E402
from specserve.train.trainer import TrainOps, _shift, target_outputs  # noqa: E402

BINS = (0.0, 0.3, 0.5, 0.7, 0.9, 1.0001)  # target top-probability bins [lo, hi)


@torch.no_grad()
def first_draft(model, head, draft_ids: torch.Tensor, t2d_index: torch.Tensor, token_ids: list[int],
                num_prompt: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(target top probability [P], head hit [P] bool) at every answer position P that a first draft predicts:
    entry j (token j + 1, target features at j) predicts token j + 2, as in ``trainer.eagle3_loss``."""
    tokens = torch.tensor([token_ids])  # [1, T]
    T = tokens.shape[1]
    tgt = target_outputs(model, tokens, head.config.aux_layer_ids, draft_ids, t2d_index)
    normed, _ = head(_shift(tokens, 1).reshape(T), head.fuse(tgt.features.reshape(T, -1)), torch.arange(T),
                     layer_states(len(head.layers)), ChainMeta(1, T, real=True), ChainAttentionBackend())
    logits = head.lm_head(normed).reshape(1, T, -1)
    answer = torch.zeros(1, T, dtype=torch.bool)
    answer[0, num_prompt:] = True
    mask = _shift(answer, 2, False)[0]  # [T]
    top = _shift(tgt.probs, 1).amax(-1)[0]  # [T] the target's top probability for token j + 2
    hit = (logits.argmax(-1) == _shift(tgt.argmax, 1, -1))[0]  # [T]
    return top[mask], hit[mask]


def summarize(top: torch.Tensor, hit: torch.Tensor) -> dict:
    bins = []
    for lo, hi in zip(BINS, BINS[1:]):
        sel = (top >= lo) & (top < hi)
        n = int(sel.sum())
        bins.append({"top_prob": [lo, min(hi, 1.0)], "share": n / max(len(top), 1),
                     "accuracy": float(hit[sel].float().mean()) if n else None, "positions": n})
    return {"positions": len(top), "accuracy": float(hit.float().mean()), "mean_top_prob": float(top.mean()),
            "bins": bins}


def mix_adjusted(row: dict, reference: dict) -> float | None:
    """Accuracy with ``row``'s per-bin accuracies weighted by ``reference``'s bin shares."""
    total = 0.0
    for mine, ref in zip(row["bins"], reference["bins"]):
        if ref["share"] and mine["accuracy"] is None:
            return None
        total += ref["share"] * (mine["accuracy"] or 0.0)
    return total


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("head", help="EAGLE-3 head directory (speculators format)")
    ap.add_argument("--prompts", type=int, default=80, help="first N prompts of each set (MT-Bench has 80)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--reference", default="gsm8k", choices=["mt_bench", "humaneval", "gsm8k"])
    ap.add_argument("--out", default="/tmp/draft_confidence_cpu.json")
    args = ap.parse_args()
    start = time.perf_counter()
    device = torch.device("cpu")
    model, config, tok, engine, proposer = cpu_engine_with_head("eagle3", args.head, device, speculate=False)
    head = proposer.head
    head.set_ops(TrainOps())
    draft_ids = torch.arange(len(head.d2t)) + head.d2t.long()  # d2t holds draft index -> target id offsets
    t2d_index = torch.full((config.vocab_size,), -1, dtype=torch.int64)
    t2d_index[draft_ids] = torch.arange(len(draft_ids))
    categories = [r["category"] for r in read_jsonl(DATA / "mt_bench/question.jsonl")][:args.prompts]
    out = {"command": " ".join(["python", *sys.argv]), "head": args.head, "max_tokens": args.max_tokens,
           "machine": {"platform": platform.platform(), "torch": torch.__version__, "threads": torch.get_num_threads(),
                       "description": "the dev machine's CPU, fp32"},
           "definitions": {"accuracy": "head's first-draft argmax == target argmax, teacher-forced on the engine's "
                                       "greedy answer (the k = 1 acceptance rate)",
                           "top_prob": "target's largest next-token probability, softmax over the draft vocabulary",
                           "mix_adjusted_accuracy": f"per-bin accuracy weighted by {args.reference}'s bin shares"},
           "sets": {}, "mt_bench_by_category": {}}
    per_set: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    by_cat: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for name, prompts in eval_prompts(args.prompts).items():
        ids = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}])) for p in prompts]
        reqs = engine.generate(ids, SamplingParams(max_tokens=args.max_tokens, temperature=0.0))
        tops, hits = [], []
        for i, (prompt, req) in enumerate(zip(ids, reqs)):
            top, hit = first_draft(model, head, draft_ids, t2d_index, list(prompt) + list(req.output_ids), len(prompt))
            tops.append(top)
            hits.append(hit)
            if name == "mt_bench":
                by_cat.setdefault(categories[i], []).append((top, hit))
        per_set[name] = (torch.cat(tops), torch.cat(hits))
        out["sets"][name] = summarize(*per_set[name])
        print(name, json.dumps({k: v for k, v in out["sets"][name].items() if k != "bins"}), flush=True)
    for cat, pairs in by_cat.items():
        out["mt_bench_by_category"][cat] = summarize(torch.cat([p[0] for p in pairs]), torch.cat([p[1] for p in pairs]))
    reference = out["sets"][args.reference]
    for row in list(out["sets"].values()) + list(out["mt_bench_by_category"].values()):
        row["mix_adjusted_accuracy"] = mix_adjusted(row, reference)
    out["total_seconds"] = round(time.perf_counter() - start, 1)
    Path(args.out).write_text(json.dumps(out, indent=1))
    for name, row in list(out["sets"].items()) + [(f"mt_bench/{c}", r) for c, r in out["mt_bench_by_category"].items()]:
        print(f"{name:22s} acc {row['accuracy']:.3f}  mix-adjusted {row['mix_adjusted_accuracy'] or float('nan'):.3f}  "
              "bins (share/acc): " + "  ".join(
                  f"{b['share']:.2f}/{b['accuracy'] if b['accuracy'] is not None else float('nan'):.2f}"
                  for b in row["bins"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
