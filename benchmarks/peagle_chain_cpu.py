"""P-EAGLE's chain-weighted loss (``TrainDraftConfig.peagle_chain_weight``) against the plain one, side by side on
CPU (fp32, the default model; not CI): a small fine-tuning of the same starting head, same samples, same steps and
seed, once each way, then the trainer's held-out estimate (per-slot accuracy and the acceptance length a verifier
would get from each anchor's one-pass draft) of the starting head and of both results.

    python benchmarks/peagle_chain_cpu.py --out benchmarks/results/peagle_chain_cpu.json

Prompts are ShareGPT first turns (a training source; never an evaluation set), answered greedily by the target
with our engine; the last ``--held-out`` of them are held out. This is a direction check at a CPU's budget (tens of
steps of about a thousand tokens), not a trained head: a GPU run decides.
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

from specserve.config import CacheConfig, EngineConfig, SchedulerConfig, TrainDraftConfig  # noqa: E402
from specserve.engine.engine import LLMEngine  # noqa: E402
from specserve.models.fetch import default_model_path  # noqa: E402
from specserve.models.loader import load_model  # noqa: E402
from specserve.sampling import SamplingParams  # noqa: E402
from specserve.train.data import read_conversations  # noqa: E402
from specserve.train.generate import Sample  # noqa: E402
from specserve.train.trainer import Trainer, init_head_draft_ids  # noqa: E402

DATA = Path(__file__).resolve().parent.parent.parent / "shared" / "data"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--head", default="heads/smollm2-135m-instruct-peagle")
    ap.add_argument("--prompts", type=int, default=160)
    ap.add_argument("--held-out", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--batch-tokens", type=int, default=1024)
    ap.add_argument("--out", default="peagle_chain_cpu.json")
    args = ap.parse_args()
    torch.manual_seed(0)
    device = torch.device("cpu")
    start = time.perf_counter()
    model, config, tok = load_model(str(default_model_path()), "float32", device, 2048)
    engine = LLMEngine(EngineConfig(device="cpu", cache=CacheConfig(kv_cache_memory_gib=2.0),
                                    scheduler=SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=4096,
                                                              max_model_len=2048)), model, config, tok)
    convs = read_conversations(DATA / "sharegpt/sharegpt_first_turn_2978.json", limit=args.prompts, max_turns=1)
    ids = [tok.encode(tok.apply_chat_template([{"role": "user", "content": c.user_turns[0]}]))[-768:]
           for c in convs]
    reqs = engine.generate(ids, SamplingParams(max_tokens=args.max_tokens, temperature=0.0))
    samples = [Sample(list(i) + list(r.output_ids), len(i)) for i, r in zip(ids, reqs)]
    train, held = samples[:-args.held_out], samples[-args.held_out:]
    gen_s = time.perf_counter() - start
    print(f"{len(train)} train / {len(held)} held-out samples, {sum(len(r.output_ids) for r in reqs)} answer tokens "
          f"in {gen_s:.0f} s", flush=True)
    del engine
    draft_ids = init_head_draft_ids(args.head, config)

    def trainer_for(chain: bool, out: Path) -> Trainer:
        cfg = TrainDraftConfig(method="peagle", num_layers=2, head_intermediate_size=6144,
                               draft_vocab_size=len(draft_ids), init_head=args.head, max_seq_len=1024,
                               max_batch_tokens=args.batch_tokens, num_spec_tokens=7, anchors_per_seq=64,
                               anchor_chunk=32, lr=args.lr, warmup_steps=5, total_steps=args.steps,
                               peagle_chain_weight=chain, checkpoint_every=10**9, seed=0)
        return Trainer(model, config, cfg, draft_ids, device, out, progress=False)

    def summary(est: dict) -> dict:
        return {"estimated_al": {k: round(v, 4) for k, v in est["estimated_al"].items()},
                "acc_per_pos": [round(a, 4) for a in est["acc_per_pos"]]}

    results = {"start": summary(trainer_for(False, Path("/tmp/peagle_chain_cpu/start")).evaluate(held))}
    print("start", results["start"], flush=True)
    for chain in (False, True):
        name = "chain_weight" if chain else "plain"
        t0 = time.perf_counter()
        trainer = trainer_for(chain, Path(f"/tmp/peagle_chain_cpu/{name}"))
        trainer.fit(train)
        results[name] = summary(trainer.evaluate(held)) | {"steps": trainer.step,
                                                           "seconds": round(time.perf_counter() - t0, 1)}
        print(name, results[name], flush=True)
    out = {"command": " ".join(["python", *sys.argv]), "date": time.strftime("%Y-%m-%d"),
           "machine": {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
                       "threads": torch.get_num_threads()},
           "head": args.head, "train_samples": len(train), "held_out_samples": len(held),
           "answer_tokens": sum(len(r.output_ids) for r in reqs), "generate_seconds": round(gen_s, 1),
           "settings": {"steps": args.steps, "lr": args.lr, "batch_tokens": args.batch_tokens, "anchors_per_seq": 64,
                        "num_spec_tokens": 7},
           "results": results, "total_seconds": round(time.perf_counter() - start, 1)}
    Path(args.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
