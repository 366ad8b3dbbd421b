"""Which token does each P-EAGLE mask slot predict? A diagnostic for a head whose slots do not chain (CPU, fp32, the
default model; not CI).

For the first ``--prompts`` prompts of each evaluation set, the target answers greedily (``--max-tokens``); then at
every answer position as the anchor, the head's one-pass drafts (the real entry's draft 1, mask slots 1..S) are
compared with the target's greedy tokens: slot s aims at the token s + 1 after draft 1's, and ``offset d`` counts
how often it names the target's token d places from its own instead (d < 0: an earlier one). A slot that has
learnt its place peaks at offset 0; slots that collapse onto one prediction peak at the offset of the slot they
copy. Also: each slot's accuracy given that the drafts before it were all right (what chain acceptance needs).

    python benchmarks/peagle_slots_cpu.py heads/smollm2-135m-instruct-peagle --prompts 4 --out OUT.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.eagle_tf_check import cpu_engine_with_head, eval_prompts  # noqa: E402
from specserve.config import TrainDraftConfig  # noqa: E402
from specserve.sampling import SamplingParams  # noqa: E402
from specserve.train.chain_attention import ChainAttentionBackend, ChainMeta, layer_states  # noqa: E402
from specserve.train.generate import Sample  # noqa: E402
from specserve.train.trainer import Trainer, TrainOps, _shift, collate, target_outputs  # noqa: E402

OFFSETS = (-2, -1, 0, 1, 2)


@torch.no_grad()
def one_pass_drafts(head, tgt, tokens: torch.Tensor, slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(draft 1 at every entry [T], mask slots' drafts [T, slots]) for one sequence (tokens [1, T]): every entry j
    is an anchor, its slots at positions j + 1 .. j + slots, as ``trainer.peagle_loss`` lays them out."""
    _, T = tokens.shape
    anc = torch.arange(T)[None, :]  # [1, A = T]
    slot = torch.arange(1, slots + 1)
    n_chain = T * slots
    mask_feature = head.fuse(head.mask_hidden[None, :]).expand(n_chain, -1)
    mask_ids = torch.full((n_chain,), head.config.mask_token_id, dtype=torch.int64)
    positions = torch.cat([torch.arange(T), (anc[:, :, None] + slot).reshape(-1)])
    normed, _ = head(torch.cat([_shift(tokens, 1).reshape(T), mask_ids]),
                     torch.cat([head.fuse(tgt.features.reshape(T, -1)), mask_feature]), positions,
                     layer_states(len(head.layers)), ChainMeta(1, T, real=True, anchors=anc, num_slots=slots),
                     ChainAttentionBackend())
    ids = head.lm_head(normed).argmax(-1)
    return ids[:T], ids[T:].reshape(T, slots)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("head")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--slots", type=int, default=6)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device, S = torch.device("cpu"), args.slots
    model, config, tok, engine, proposer = cpu_engine_with_head("peagle", args.head, device, speculate=False)
    head = proposer.head
    draft_ids = torch.arange(len(head.d2t)) + head.d2t.long()
    trainer = Trainer(model, config, TrainDraftConfig(method="peagle", num_spec_tokens=S + 1), draft_ids, device,
                      Path("/tmp/peagle_slots"), progress=False)
    head.set_ops(TrainOps())
    head.eval()
    hits = {d: [0] * S for d in OFFSETS}
    count, first = [0] * S, [0, 0]
    chained = [[0, 0] for _ in range(S)]  # [right, tried] given every draft before it right
    for prompts in eval_prompts(args.prompts).values():
        ids = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}])) for p in prompts]
        for prompt, req in zip(ids, engine.generate(ids, SamplingParams(max_tokens=args.max_tokens,
                                                                          temperature=0.0))):
            batch = collate([Sample(list(prompt) + list(req.output_ids), len(prompt))], 1 << 16, device)
            tgt = target_outputs(model, batch.tokens, head.config.aux_layer_ids, trainer.draft_ids,
                                 trainer.t2d_index)
            draft1, drafts = one_pass_drafts(head, tgt, batch.tokens, S)
            arg, T = tgt.argmax[0], batch.tokens.shape[1]  # arg[r]: the target's token after position r
            for a in range(len(prompt) - 1, T - 2 - S - max(OFFSETS)):  # anchors whose targets are all answer
                right = bool(draft1[a] == arg[a + 1])
                first[0] += right
                first[1] += 1
                alive = right
                for s in range(S):
                    row = a + 2 + s  # slot s + 1 names the token after row
                    count[s] += 1
                    for d in OFFSETS:
                        hits[d][s] += int(drafts[a, s] == arg[row + d])
                    ok = bool(drafts[a, s] == arg[row])
                    if alive:
                        chained[s][0] += ok
                        chained[s][1] += 1
                    alive = alive and ok
    result = {"command": " ".join(["python", *sys.argv]), "head": args.head, "anchors": first[1],
              "draft1_accuracy": round(first[0] / max(first[1], 1), 3),
              "slot_match_by_offset": {str(d): [round(h / max(c, 1), 3) for h, c in zip(hits[d], count)]
                                       for d in OFFSETS},
              "slot_accuracy_given_earlier_right": [[round(r / max(t, 1), 3), t] for r, t in chained]}
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
