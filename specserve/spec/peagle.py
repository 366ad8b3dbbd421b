"""P-EAGLE proposer (parallel drafting EAGLE, arXiv 2602.01469): all ``num_spec_tokens`` drafts of a request
come out of one forward of the head. After a request's real entries, slots 2..k are appended with the
learned mask token and the learned shared feature ``fc(mask_hidden)``, at the next positions, under the same
causal attention; slot j's output is draft j. Queued entries of requests that are not drafting (prefill
chunks) ride in the same forward.

    real entries (t8,h7) (t9,h8) | mask slots (m, fc(mask_hidden)) x2, positions 9, 10
    outputs at rows [entry 8, slot 9, slot 10] -> drafts d1, d2, d3 (for positions 9, 10, 11)
"""

from __future__ import annotations

import torch

from specserve.engine.request import Request
from specserve.spec.eagle3 import Eagle3Proposer
from specserve.spec.proposer import Draft


class PEagleProposer(Eagle3Proposer):
    method = "peagle"

    @torch.inference_mode()
    def propose(self, requests: list[Request], num_spec_tokens: list[int]) -> list[Draft]:
        if not self.pending:
            return [Draft([]) for _ in requests]
        head, kv = self.head, self.kv
        drafting = {r.request_id: k for r, k in zip(requests, num_spec_tokens) if r.request_id in self.pending}
        extra = {rid: k - 1 for rid, k in drafting.items()}
        rids, query_lens, input_ids, positions, feats, last_real = self._ingest_inputs(extra)
        reqs = {rid: self.pending[rid][0] for rid in rids}
        self.pending.clear()
        mask_id = head.config.mask_token_id
        mask_feature = head.fuse(head.mask_hidden[None, :])  # [1, hidden_size]
        # Interleave each request's real rows with its mask slots: [real a | mask a | real b | ...].
        hidden_parts, ids, pos = [], [], []
        real = head.fuse(torch.cat(feats))
        offset = 0
        for rid, q_len in zip(rids, query_lens):
            num_extra = extra.get(rid, 0)
            num_real = q_len - num_extra
            hidden_parts.append(real[offset:offset + num_real])
            ids.extend(input_ids[offset:offset + num_real])
            pos.extend(positions[offset:offset + num_real])
            if num_extra:
                hidden_parts.append(mask_feature.expand(num_extra, -1))
                ids.extend([mask_id] * num_extra)
                last_pos = positions[offset + num_real - 1]
                pos.extend(range(last_pos + 1, last_pos + 1 + num_extra))
            offset += num_real
        meta = kv.metadata(rids, query_lens)
        normed, _ = head(torch.tensor(ids, dtype=torch.int64, device=self.device), torch.cat(hidden_parts),
                         torch.tensor(pos, dtype=torch.int64, device=self.device), kv.kv_caches, meta, kv.backend)
        out = []
        for r in requests:
            k = drafting.get(r.request_id, 0)
            if k == 0:
                out.append(Draft([]))
                continue
            first = last_real[r.request_id]
            out.append(Draft(head.draft_token_ids(normed[first:first + k]).tolist()))
        for rid in rids:
            kv.truncate(rid, reqs[rid].num_computed_tokens)
        return out
