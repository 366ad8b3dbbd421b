"""Draft-model speculation (Leviathan et al. 2211.17192; Chen et al. 2302.01318): a smaller model of the
same tokenizer drafts ``num_spec_tokens`` tokens autoregressively, with its own paged KV cache.

Each round first catches the drafter up on the request's real tokens it has not seen (the whole prompt
the first time, afterwards the accepted drafts and the recovered/bonus token; all requests in one ragged
forward), then decodes the remaining drafts one token per forward, and finally truncates its cache back to
the real tokens so the next round starts from verified positions only.

Greedy requests draft the drafter's argmax (a one-hot draft). Sampled requests draw each draft token from
the drafter's distribution under the request's own temperature, top-k and top-p and hand that distribution
to the verifier, which keeps the result exactly the target's distribution whatever the drafter is.
"""

from __future__ import annotations

import random

import torch

from specserve.engine.request import Request
from specserve.layers.argmax import greedy_argmax
from specserve.layers.sampler import draw_tokens, target_probs
from specserve.models.llama import LlamaForCausalLM
from specserve.spec.draft_kv import DraftKV
from specserve.spec.proposer import Draft, VerifiedChunk


class DraftModelProposer:
    method = "draft"
    aux_layer_ids: tuple[int, ...] = ()

    def __init__(self, model: LlamaForCausalLM, target_vocab_size: int, num_blocks: int, block_size: int,
                 device: torch.device, seed: int = 0) -> None:
        config = model.config
        if config.vocab_size != target_vocab_size:
            raise ValueError(f"speculative.model: the draft model's vocabulary ({config.vocab_size} tokens) must "
                             f"be the target's ({target_vocab_size} tokens)")
        self.model = model
        dtype = next(model.parameters()).dtype
        self.kv = DraftKV(config.num_hidden_layers, config.num_key_value_heads, config.head_dim, num_blocks,
                          block_size, dtype, device)
        self.device = device
        self.rng = random.Random(seed)  # draws of requests without a stream of their own

    def observe(self, chunks: list[VerifiedChunk], aux_hidden) -> None:
        pass

    @torch.inference_mode()
    def propose(self, requests: list[Request], num_spec_tokens: list[int]) -> list[Draft]:
        if not requests:
            return []
        kv = self.kv
        rids = [r.request_id for r in requests]
        # 1. Catch up on real tokens: from the drafter's computed prefix to the request's last token.
        input_ids, positions, query_lens = [], [], []
        for r in requests:
            start = min(kv.computed(r.request_id), r.num_tokens - 1)
            kv.truncate(r.request_id, start)
            input_ids.extend(r.token_slice(start, r.num_tokens))
            positions.extend(range(start, r.num_tokens))
            query_lens.append(r.num_tokens - start)
        last_rows = torch.tensor(query_lens).cumsum(0) - 1
        tokens: list[list[int]] = [[] for _ in requests]
        probs: list[list[torch.Tensor]] = [[] for _ in requests]
        active = list(range(len(requests)))
        step = 0
        while True:
            meta = kv.metadata([rids[i] for i in active], query_lens)
            ids = torch.tensor(input_ids, dtype=torch.int64, device=self.device)
            pos = torch.tensor(positions, dtype=torch.int64, device=self.device)
            hidden, _ = self.model(ids, pos, kv.kv_caches, meta, kv.backend)
            logits = self.model.compute_logits(hidden[last_rows.to(self.device)])  # [num_active, vocab]
            self._choose(logits, [requests[i] for i in active], [tokens[i] for i in active],
                         [probs[i] for i in active])
            step += 1
            active = [i for i in active if num_spec_tokens[i] > step]
            if not active:
                break
            # 2. One more draft token for every request that wants more: feed the token just drafted.
            input_ids = [tokens[i][-1] for i in active]
            positions = [requests[i].num_tokens - 1 + step for i in active]
            query_lens = [1] * len(active)
            last_rows = torch.arange(len(active))
        for r in requests:
            kv.truncate(r.request_id, r.num_tokens)  # 3. keep real tokens only
        return [Draft(t, torch.stack(p) if p else None) for t, p in zip(tokens, probs)]

    def _choose(self, logits: torch.Tensor, requests: list[Request], tokens: list[list[int]],
                probs: list[list[torch.Tensor]]) -> None:
        """Append one draft token per request (argmax, or a draw from the drafter under the request's params)."""
        greedy = greedy_argmax(logits).tolist()
        sampled = [i for i, r in enumerate(requests) if not r.params.greedy]
        dist = target_probs(logits[sampled], [requests[i].params for i in sampled]) if sampled else None
        if sampled:
            drawn = draw_tokens(dist, [(requests[i].rng or self.rng).random() for i in sampled]).tolist()
            for j, i in enumerate(sampled):
                greedy[i] = drawn[j]
                probs[i].append(dist[j])
        for i, tok in enumerate(greedy):
            tokens[i].append(tok)

    def free(self, request_id: str) -> None:
        self.kv.free(request_id)
