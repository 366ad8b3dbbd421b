"""EAGLE-3 proposer (Li et al., arXiv 2503.01840): the head (``eagle_head.py``) drafts ``num_spec_tokens``
tokens one forward at a time, each step feeding back its own output feature.

Bookkeeping per request (``DraftKV``): head entry ``j`` pairs target position ``j``'s fused features with the
token at ``j + 1``, so after the target has verified positions ``0 .. n - 1`` (n = num_computed_tokens) and the
request's token list holds ``n + 1`` tokens, the head can ingest entries ``0 .. n - 1``. ``observe`` queues the
features of each step's verified positions; ``propose`` ingests every queued entry of every request in one
ragged forward (prefill chunks included, so queues never grow), takes the first draft from each drafting
request's last entry, then runs ``num_spec_tokens - 1`` single-token steps, and truncates the head's cache
back to the real entries.

    target positions 0..9 verified, tokens t0..t10   ->  entries (t1,h0) .. (t10,h9) ingested
    entry 9's output                                  ->  draft d1 (for position 10), feature f1
    step 2: entry (d1, f1) at position 10             ->  d2;  step 3: (d2, f2) at 11 -> d3
    truncate to 10 entries                            ->  positions 10, 11 are re-ingested with real features
"""

from __future__ import annotations

import torch

from specserve.engine.request import Request
from specserve.spec.draft_graphs import INGEST_MAX_ENTRIES, ChainGraphRunner
from specserve.spec.draft_kv import DraftKV
from specserve.spec.eagle_head import EagleHead
from specserve.spec.proposer import Draft, VerifiedChunk


def _queued(parts: list[tuple[int, torch.Tensor]]) -> int:
    """Entries in one request's queue: ``parts`` is its list of (first position, feature rows [n, width])."""
    return sum(rows.shape[0] for _, rows in parts)


class Eagle3Proposer:
    method = "eagle3"

    def __init__(self, head: EagleHead, target, num_blocks: int, block_size: int, device: torch.device) -> None:
        if head.embed_tokens is None:
            head.target_embed = target.embed_tokens
        self.head = head
        self.aux_layer_ids = tuple(head.config.aux_layer_ids)
        c = head.config.layer
        dtype = next(head.parameters()).dtype
        self.kv = DraftKV(len(head.layers), c.num_key_value_heads, c.head_dim, num_blocks, block_size, dtype, device)
        self.device = device
        # request id -> (request, [(position_start, features [num_tokens, n_aux * target_hidden])])
        self.pending: dict[str, tuple[Request, list[tuple[int, torch.Tensor]]]] = {}
        self.chain: ChainGraphRunner | None = None  # static / captured drafting (``use_chain_graphs``)

    def use_chain_graphs(self, batch_sizes: tuple[int, ...], max_num_seqs: int, max_steps: int,
                         max_positions: int, capture: bool, pool=None) -> None:
        """Run the drafting as static forwards, CUDA graphs when ``capture`` (``spec/draft_graphs.py``; ``pool``:
        the memory pool to capture into, e.g. the target graphs'): the ingest and all k draft steps as one per
        (batch bucket, padded queue length, steps) when every drafting request queued a few entries (steady decoding),
        else draft steps 2..k as one per (batch bucket, steps) after an eager ingest; batches that fit neither keep
        the eager loop."""
        self.chain = ChainGraphRunner(self.head, self.kv, batch_sizes, max_num_seqs, max_steps, max_positions,
                                      self.device, capture, pool)

    def observe(self, chunks: list[VerifiedChunk], aux_hidden: torch.Tensor | None) -> None:
        assert aux_hidden is not None, "EAGLE heads need the target's aux hidden states"
        for c in chunks:
            if c.num_tokens:
                rows = aux_hidden[c.token_start:c.token_start + c.num_tokens]
                self.pending.setdefault(c.request.request_id, (c.request, []))[1].append((c.position_start, rows))

    def free(self, request_id: str) -> None:
        self.kv.free(request_id)
        self.pending.pop(request_id, None)

    @torch.inference_mode()
    def catch_up(self) -> int:
        """Ingest every queued entry whose next token is committed, drafting nothing and reading nothing back, so
        that it can run behind a decode step still in flight; the rest stay queued. Returns the most entries left
        queued for one request. Worked example: a request with 9 prompt tokens and 6 committed output tokens
        (15 known), one more pending, queued entries at positions 9..14 (the last from the step in flight): entry
        p pairs with token p + 1, known up to 14, so positions 9..13 are ingested and 14 stays (returns 1)."""
        keep = {}
        for rid, (req, parts) in self.pending.items():
            start, queued = parts[0][0], _queued(parts)
            keep[rid] = queued - max(0, min(queued, req.num_committed_tokens - 1 - start))
        self._ingest_front(keep, eager=True)
        return max(self._queue_lengths(), default=0)

    def _queue_lengths(self) -> list[int]:
        """Entries queued per pending request, in ``pending``'s order."""
        return [_queued(parts) for _, parts in self.pending.values()]

    def lazy_steps(self, num_running: int) -> int:
        """How many steps this drafter may sit out (adaptive policy at cap 0) before it must catch up: as many as
        one catch-up graph ingests, less one (the entry of a step still in flight waits), with chain graphs; 15
        otherwise."""
        chunks = self.chain.catch_up_chunks(num_running) if self.chain is not None else 0
        return max(1, chunks) * INGEST_MAX_ENTRIES - 1

    def _split_queues(self, keep: dict[str, int]) -> tuple[dict, dict]:
        """(front, back): each request's queued entries but its last ``keep[rid]`` (0 when absent), and those last
        ones, as ``pending`` maps; a slice straddling the cut is split (views, no copy)."""
        front, back = {}, {}
        for rid, (req, parts) in self.pending.items():
            total = _queued(parts)
            cut, at = total - min(keep.get(rid, 0), total), 0
            for position, rows in parts:
                n = rows.shape[0]
                if at + n <= cut:
                    front.setdefault(rid, (req, []))[1].append((position, rows))
                elif at >= cut:
                    back.setdefault(rid, (req, []))[1].append((position, rows))
                else:
                    front.setdefault(rid, (req, []))[1].append((position, rows[:cut - at]))
                    back.setdefault(rid, (req, []))[1].append((position + cut - at, rows[cut - at:]))
                at += n
        return front, back

    def _ingest_front(self, keep: dict[str, int], eager: bool) -> bool:
        """Ingest every queued entry but the last ``keep[rid]`` of each request, drafting nothing: in the chain's
        catch-up graph when it fits, else (``eager``) in the eager ingest. False, with nothing changed, when it
        does not fit and may not run eagerly."""
        original = self.pending
        front, back = self._split_queues(keep)
        if front:
            self.pending = front
            if not (self.chain is not None and self._catch_up_static()):
                if not eager:
                    self.pending = original
                    return False
                self.propose([], [])  # the eager ingest alone: no request drafts, nothing is read back
        self.pending = back
        return True

    def _catch_up_static(self) -> bool:
        """Every queued entry through one catch-up graph (``ChainGraphRunner.run_catch_up``); False, with nothing
        changed, when the queues do not fit it."""
        queued = self._queue_lengths()
        computed = [self.kv.computed(rid) for rid in self.pending]
        if not self.chain.fits_catch_up(queued, computed):
            return False
        rids, query_lens, input_ids, _, feats, _ = self._ingest_inputs({})
        self.pending.clear()
        tables = [self.kv.reserve([rid], n)[1][0] for rid, n in zip(rids, query_lens)]
        self.chain.run_catch_up(input_ids, torch.cat(feats) if len(feats) > 1 else feats[0], query_lens, computed,
                                tables)
        return True

    # ---- drafting ------------------------------------------------------------------------------
    def _ingest_inputs(self, extra_slots: dict[str, int]):
        """Packed inputs for every queued entry, plus ``extra_slots[rid]`` P-EAGLE mask slots after a request's
        entries. Returns (rids, query_lens, input_ids, positions, features, last_real_row per rid); features is
        the list of queued slices in packed order (``torch.cat`` gives the packed rows)."""
        rids, query_lens, input_ids, positions, feats = [], [], [], [], []
        last_real: dict[str, int] = {}
        num_rows = 0
        for rid, (req, parts) in self.pending.items():
            start = parts[0][0]
            computed = self.kv.computed(rid)
            if start != computed:
                raise RuntimeError(f"{self.method}: request {rid} queued entries from position {start} but its "
                                   f"head cache holds {computed}")
            expected = start
            for position, rows in parts:  # queued chunks must follow one another (a duplicate would shift ids)
                if position != expected:
                    raise RuntimeError(f"{self.method}: request {rid} queued entries at position {position}, "
                                       f"expected {expected}")
                expected += rows.shape[0]
                feats.append(rows)
            num = expected - start
            rids.append(rid)
            query_lens.append(num + extra_slots.get(rid, 0))
            input_ids.extend(req.token_slice(start + 1, start + num + 1))
            positions.extend(range(start, start + num))
            num_rows += num
            last_real[rid] = num_rows - 1
            num_rows += extra_slots.get(rid, 0)
        return rids, query_lens, input_ids, positions, feats, last_real

    @torch.inference_mode()
    def propose(self, requests: list[Request], num_spec_tokens: list[int]) -> list[Draft]:
        if not self.pending:
            return [Draft([]) for _ in requests]
        if self.chain is not None:
            if not requests and self._catch_up_static():
                return []
            drafts = self._propose_static(requests, num_spec_tokens) if requests else None
            if drafts is not None:
                return drafts
        rids, query_lens, input_ids, positions, feats, last_real = self._ingest_inputs({})
        self.pending.clear()
        head, kv = self.head, self.kv
        meta = kv.metadata(rids, query_lens)
        hidden = head.fuse(torch.cat(feats))
        ids = torch.tensor(input_ids, dtype=torch.int64, device=self.device)
        pos = torch.tensor(positions, dtype=torch.int64, device=self.device)
        normed, fed = head(ids, hidden, pos, kv.kv_caches, meta, kv.backend)
        drafting = [i for i, r in enumerate(requests) if r.request_id in last_real]
        tokens: list[list[int]] = [[] for _ in requests]
        if not drafting:
            return [Draft([]) for _ in requests]
        rows = torch.tensor([last_real[requests[i].request_id] for i in drafting], device=self.device)
        new = head.draft_token_ids(normed[rows]).tolist()
        fed = fed[rows]
        for i, tok in zip(drafting, new):
            tokens[i].append(tok)
        if self.chain is None or not self._chain(requests, num_spec_tokens, drafting, tokens, fed):
            self._steps(requests, num_spec_tokens, drafting, tokens, fed)
        for r in requests:
            kv.truncate(r.request_id, r.num_tokens - 1)
        return [Draft(t) for t in tokens]

    def _propose_static(self, requests: list[Request], num_spec_tokens: list[int]) -> list[Draft] | None:
        """Ingest and every draft step in one static forward (``ChainGraphRunner.run_ingest``) when every drafting
        request has entries queued and every queue fits it; None, with nothing changed, otherwise (the eager
        ingest then runs, and the chain alone may still take the later steps). Queued requests that do not draft
        this step are ingested too, their chain rows dropped. A queue longer than the ingest graph takes (the
        adaptive policy's cap-0 steps left the drafter up to ``lazy_steps`` behind; a short prompt chunk) is first
        caught up in the catch-up graph but for each drafting request's last entry."""
        if any(r.request_id not in self.pending for r in requests):
            return None
        steps = max(num_spec_tokens, default=1) - 1
        queued = self._queue_lengths()
        if max(queued) > self.chain.max_ingest:
            if not self._ingest_front({r.request_id: 1 for r in requests}, eager=False):
                return None
            queued = self._queue_lengths()
        computed = [self.kv.computed(rid) for rid in self.pending]
        if not self.chain.fits_ingest(queued, steps, max(computed) + max(queued) + steps):
            return None  # checked before _ingest_inputs builds anything: the eager path builds its own
        rids, query_lens, input_ids, _, feats, _ = self._ingest_inputs({})
        self.pending.clear()
        tables = []
        for rid, n in zip(rids, query_lens):
            tables.append(self.kv.reserve([rid], n + steps)[1][0])
        drafts = dict(zip(rids, self.chain.run_ingest(input_ids, torch.cat(feats) if len(feats) > 1 else feats[0],
                                                      query_lens, computed, tables, steps)))
        for rid, c, n in zip(rids, computed, query_lens):  # every chain row ran, drafting or not (a prompt
            self.kv.truncate(rid, c + n)  # chunk's request too): back to the real entries
        return [Draft(drafts[r.request_id][:n]) for r, n in zip(requests, num_spec_tokens)]

    def _steps(self, requests: list[Request], num_spec_tokens: list[int], drafting: list[int],
               tokens: list[list[int]], fed: torch.Tensor) -> None:
        """Drafts 2.. eagerly, one head forward per step over the requests still drafting (``fed``
        [len(drafting), hidden]: the first drafts' features)."""
        head, kv = self.head, self.kv
        step = 1
        active = drafting
        while True:
            keep = [j for j, i in enumerate(active) if num_spec_tokens[i] > step]
            if not keep:
                break
            active = [active[j] for j in keep]
            fed = fed[torch.tensor(keep, device=self.device)]
            # Entry (previous draft, its feature) at position num_tokens - 2 + step.
            meta = kv.metadata([requests[i].request_id for i in active], [1] * len(active))
            ids = torch.tensor([tokens[i][-1] for i in active], dtype=torch.int64, device=self.device)
            pos = torch.tensor([requests[i].num_tokens - 2 + step for i in active], dtype=torch.int64,
                               device=self.device)
            normed, fed = head(ids, fed, pos, kv.kv_caches, meta, kv.backend)
            for i, tok in zip(active, head.draft_token_ids(normed).tolist()):
                tokens[i].append(tok)
            step += 1

    def _chain(self, requests: list[Request], num_spec_tokens: list[int], drafting: list[int],
               tokens: list[list[int]], fed: torch.Tensor) -> bool:
        """Drafts 2.. of every drafting request from one static chain (all run the longest chain asked for;
        extra drafts are dropped). False, with nothing changed, when the batch does not fit it."""
        steps = max(num_spec_tokens[i] for i in drafting) - 1
        if steps < 1:
            return True  # first drafts only: nothing left to run
        rids = [requests[i].request_id for i in drafting]
        longest = max(self.kv.computed(rid) for rid in rids) + steps
        if not self.chain.fits(len(rids), steps, longest):
            return False
        computed, tables = self.kv.reserve(rids, steps)
        chains = self.chain.run([tokens[i][0] for i in drafting], fed, computed, tables, steps)
        for i, chain in zip(drafting, chains):
            tokens[i].extend(chain[:num_spec_tokens[i] - 1])
        return True


def load_eagle_proposer(method: str, model: str, target, target_config, num_blocks: int, block_size: int,
                        device: torch.device, seed: int = 0, cpu_quant: str = "none"):
    """``method`` "eagle3" or "peagle"; ``model`` a checkpoint directory or ``dummy`` / ``dummy:<seed>``.
    ``cpu_quant`` "q8_0": a float32 head on CPU runs its projections from 8-bit blocks (``EagleHead.quantize_cpu``)
    when the block kernel builds."""
    from specserve.spec.eagle_checkpoint import dummy_head, load_eagle_head
    dtype = next(target.parameters()).dtype
    if model == "dummy" or model.startswith("dummy:"):
        head_seed = int(model.split(":", 1)[1]) if ":" in model else seed + 1
        head = dummy_head(target_config, method == "peagle", head_seed, target.max_position, dtype, device)
    else:
        head = load_eagle_head(model, target_config.num_hidden_layers, target_config.vocab_size,
                               target.max_position, dtype, device)
    if head.config.parallel != (method == "peagle"):
        kind = "P-EAGLE" if head.config.parallel else "EAGLE-3"
        raise ValueError(f"speculative.model: {model} is a {kind} head; use --spec-method "
                         f"{'peagle' if head.config.parallel else 'eagle3'}")
    from specserve.layers.ops import select_ops
    head.set_ops(select_ops(device, dtype))
    if cpu_quant != "none" and device.type == "cpu" and dtype == torch.float32:
        from specserve.layers.quant_cpu import load_extension
        if load_extension() is not None:
            head.quantize_cpu(cpu_quant)
    head.pack_weights()
    if method == "peagle":
        from specserve.spec.peagle import PEagleProposer
        return PEagleProposer(head, target, num_blocks, block_size, device)
    return Eagle3Proposer(head, target, num_blocks, block_size, device)
