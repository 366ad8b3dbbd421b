"""EAGLE-3 and P-EAGLE head training on the target's own answers.

EAGLE-3 (Li et al., arXiv 2503.01840) with training-time test: step 0 trains every head entry ``j`` (token
``j + 1``, the target's fused features at ``j``) to predict token ``j + 2``; step ``s`` feeds the head its own
output feature from step ``s - 1`` with the true token ``j + 1 + s`` at position ``j + s`` and trains it to
predict token ``j + 2 + s``, attending exactly as at inference (``chain_attention.py``). True tokens are right:
under chain verification draft ``s + 1`` only counts when drafts ``1 .. s`` were accepted, i.e. were the tokens.

P-EAGLE (arXiv 2602.01469): the real entries train draft 1; for a sample of anchor positions ``j`` per
sequence, slots ``1 .. k - 1`` take the learned mask token and the learned shared feature at positions
``j + 1 ..`` and predict tokens ``j + 2 + s`` in the same forward. Anchors are processed ``anchor_chunk`` at a
time (one forward/backward each, gradients accumulated) so memory stays bounded for long sequences.

Labels are the target's distribution over the draft vocabulary at the predicted position (soft cross-entropy,
renormalised over the draft vocabulary), optionally moved part way onto its argmax (``hard_label_weight``: greedy
verification accepts only the argmax; cf. DistillSpec, Zhou et al., arXiv 2310.08461, on choosing the
divergence for the decoding strategy); accuracy is top-1 agreement with the target's argmax.
"""

from __future__ import annotations

import dataclasses
import math
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from specserve.config import ModelConfig, TrainDraftConfig
from specserve.layers.ops import TorchOps
from specserve.models.loader import init_random_weights
from specserve.spec.eagle_checkpoint import build_head, head_aux_layer_ids, head_layer_config
from specserve.spec.eagle_head import EagleHead, EagleHeadConfig
from specserve.train.chain_attention import ChainAttentionBackend, ChainMeta, layer_states
from specserve.train.generate import Sample


class TrainOps(TorchOps):
    """``TorchOps`` safe for autograd: the residual is still updated in place (callers rely on it), but the
    norm reads a copy, so the tensor autograd saved is never modified afterwards."""

    @classmethod
    def fused_add_rms_norm(cls, x, residual, weight, eps):
        residual.add_(x)
        return cls.rms_norm(residual.clone(), weight, eps)


# ---------------------------------------------------------------------------------------------- building


def new_head(target_config: ModelConfig, cfg: TrainDraftConfig, draft_ids: torch.Tensor, max_position: int,
             device: torch.device, target_lm_head: torch.Tensor, target_embed: torch.Tensor,
             gen: torch.Generator) -> EagleHead:
    """A head shaped for the target: ``cfg.num_layers`` Llama layers of the target's width, the draft vocabulary
    ``draft_ids``; lm_head rows start from the target's LM head rows of those ids. Both heads embed with the
    target's table (not part of the head); P-EAGLE's mask token has a learned row of its own (``mask_embedding``,
    starting from the target's row of that id) and its mask feature starts from zero."""
    t = target_config
    parallel = cfg.method == "peagle"
    layer = head_layer_config(t, cfg.num_layers, "eagle-head")
    if cfg.head_intermediate_size:  # a wider MLP than the target's (the only width a head may change freely)
        layer = dataclasses.replace(layer, intermediate_size=cfg.head_intermediate_size)
    hc = EagleHeadConfig(layer=layer, target_hidden_size=t.hidden_size,
                         draft_vocab_size=len(draft_ids), aux_layer_ids=head_aux_layer_ids(t.num_hidden_layers),
                         has_embedding=False, mask_embedding=parallel,
                         parallel=parallel, mask_token_id=_mask_token_id(t) if parallel else None,
                         num_spec_tokens=cfg.num_spec_tokens if parallel else 5)
    head = build_head(hc, max_position, torch.float32, device)
    init_random_weights(head, gen)
    with torch.no_grad():
        head.d2t.copy_(draft_ids - torch.arange(len(draft_ids)))
        head.lm_head.weight.copy_(target_lm_head[draft_ids.to(target_lm_head.device)].float())
        if head.mask_embedding is not None:
            head.mask_embedding.copy_(target_embed[hc.mask_token_id].float())
        if head.mask_hidden is not None:
            head.mask_hidden.zero_()
    head.set_ops(TrainOps())
    return head.train()


def _mask_token_id(t: ModelConfig) -> int:
    return t.vocab_size - 1  # a reserved slot at the end of the vocabulary; its row is learned


# ---------------------------------------------------------------------------------------------- batches


@dataclass
class Batch:
    tokens: torch.Tensor  # [B, T] int64, padded with 0
    answer: torch.Tensor  # [B, T] bool: position holds a generated token (the ones trained on)


def make_batches(samples: list[Sample], max_seq_len: int, max_batch_tokens: int, seed: int) -> list[list[int]]:
    """Indices of samples grouped by similar length so that ``B * T <= max_batch_tokens``; shuffled."""
    order = sorted(range(len(samples)), key=lambda i: min(len(samples[i].token_ids), max_seq_len))
    batches, cur, cur_t = [], [], 0
    for i in order:
        t = min(len(samples[i].token_ids), max_seq_len)
        if cur and max(cur_t, t) * (len(cur) + 1) > max_batch_tokens:
            batches.append(cur)
            cur, cur_t = [], 0
        cur.append(i)
        cur_t = max(cur_t, t)
    if cur:
        batches.append(cur)
    random.Random(seed).shuffle(batches)
    return batches


def collate(samples: list[Sample], max_seq_len: int, device: torch.device) -> Batch:
    T = min(max(len(s.token_ids) for s in samples), max_seq_len)
    tokens = torch.zeros(len(samples), T, dtype=torch.int64)
    answer = torch.zeros(len(samples), T, dtype=torch.bool)
    for b, s in enumerate(samples):
        ids = s.token_ids[:T]
        tokens[b, :len(ids)] = torch.tensor(ids)
        answer[b, s.num_prompt:len(ids)] = True
    return Batch(tokens.to(device), answer.to(device))


def _shift(x: torch.Tensor, n: int, fill=0) -> torch.Tensor:
    """``out[:, j] = x[:, j + n]`` (``fill`` past the end); x is [B, T, ...]."""
    if n == 0:
        return x
    pad = torch.full_like(x[:, :n], fill)
    return torch.cat([x[:, n:], pad], dim=1)


# ---------------------------------------------------------------------------------------------- target


@dataclass
class TargetOut:
    features: torch.Tensor  # [B, T, n_aux * hidden] target layer inputs (aux_layer_ids)
    probs: torch.Tensor  # [B, T, draft_vocab] target distribution after position t, over the draft vocabulary
    argmax: torch.Tensor  # [B, T] draft index of the target's argmax after position t; -1 outside the vocab


@torch.no_grad()
def target_outputs(target, tokens: torch.Tensor, aux_layer_ids: tuple[int, ...], draft_ids: torch.Tensor,
                   t2d_index: torch.Tensor, chunk_rows: int = 4096, hard_label_weight: float = 0.0) -> TargetOut:
    """One causal target forward over the batch: its aux features and its next-token distribution (tokens
    [B, T]; draft_ids [draft_vocab]; t2d_index [vocab], -1 outside the draft vocabulary). ``hard_label_weight``
    w moves w of each row's label mass onto the target's argmax where that token is in the draft vocabulary
    (``TrainDraftConfig.hard_label_weight``), e.g. w = 0.5, p = (0.4, 0.35, 0.25) with argmax 0 -> (0.7, 0.175,
    0.125)."""
    B, T = tokens.shape
    n = B * T
    backend = ChainAttentionBackend()
    pos = torch.arange(T, device=tokens.device).repeat(B)
    hidden, aux = target(tokens.reshape(n), pos, layer_states(len(target.layers)), ChainMeta(B, T, real=True),
                         backend, aux_layer_ids)
    features = torch.cat(aux, dim=-1).reshape(B, T, -1)
    probs, arg = [], []
    for r in range(0, n, chunk_rows):
        logits = target.compute_logits(hidden[r:r + chunk_rows]).float()  # [rows, vocab]
        p = torch.softmax(logits[:, draft_ids], dim=-1)  # [rows, draft_vocab]
        a = t2d_index[logits.argmax(dim=-1)]  # [rows]
        if hard_label_weight > 0:
            w = (a >= 0).float() * hard_label_weight  # [rows]; a row whose argmax is not draftable stays soft
            p.mul_(1 - w[:, None]).scatter_add_(1, a.clamp(min=0)[:, None], w[:, None])
        probs.append(p)
        arg.append(a)
    return TargetOut(features, torch.cat(probs).reshape(B, T, -1), torch.cat(arg).reshape(B, T))


# ---------------------------------------------------------------------------------------------- losses


class _SoftCrossEntropy(torch.autograd.Function):
    """``sum_r w_r * (-sum_v p_rv * log_softmax(z_r)_v)`` without keeping a log-softmax or product tensor:
    per row ``lse(z) * sum(p) - p . z`` forward and ``(softmax(z) * sum(p) - p) * w`` backward, both in fp32 over
    the 16-bit logits autocast gives. The [rows, vocab] tensors dominate a training step's memory traffic."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, probs: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # logits [R, V] (any float dtype), probs [R, V] fp32, weight [R] fp32 -> scalar
        with torch.autocast(logits.device.type, enabled=False):  # autocast would round the bmm to 16 bits
            z = logits.float()
            lse = torch.logsumexp(z, dim=-1)  # [R]
            psum = probs.sum(-1)  # [R]
            dot = torch.bmm(probs.unsqueeze(1), z.unsqueeze(2)).view(-1)  # [R] p . z, nothing [R, V] kept
        ctx.save_for_backward(logits, probs, lse, psum, weight)
        return ((lse * psum - dot) * weight).sum()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        logits, probs, lse, psum, weight = ctx.saved_tensors
        with torch.autocast(logits.device.type, enabled=False):
            g = torch.exp(logits.float() - lse[:, None]).mul_(psum[:, None]).sub_(probs)
            g.mul_((grad * weight)[:, None])
        return g.to(logits.dtype), None, None


def _soft_ce(logits: torch.Tensor, probs: torch.Tensor, mask: torch.Tensor,
             denom: torch.Tensor | None = None) -> torch.Tensor:
    """Mean over ``mask`` rows of ``-sum probs * log_softmax(logits)``; logits/probs [..., V], mask [...] (0/1, or
    row weights, then divided by ``denom``, default their sum)."""
    v = logits.shape[-1]
    weight = mask.reshape(-1).float() / (mask.sum() if denom is None else denom).clamp(min=1)
    return _SoftCrossEntropy.apply(logits.reshape(-1, v), probs.reshape(-1, v).float(), weight)


@dataclass
class StepStats:
    loss: float
    correct: list[int]  # per draft position
    count: list[int]


def eagle3_loss(head: EagleHead, tgt: TargetOut, batch: Batch, steps: int, decay: float,
                anchors: torch.Tensor | None = None,
                run_lengths: torch.Tensor | None = None) -> tuple[torch.Tensor, StepStats]:
    """Training-time test over ``steps`` draft positions. Draft 1 trains at every entry; drafts 2.. at
    ``anchors`` ([B, A] int64, -1 = padding; None = every position), which bounds the chains' attention. With
    ``run_lengths`` ([B, A] int64, zeros), also records for every anchor how many leading draft positions matched
    the target's argmax (the held-out AL estimate)."""
    tokens, answer = batch.tokens, batch.answer
    B, T = tokens.shape
    n = B * T
    dev = tokens.device
    backend = ChainAttentionBackend()
    states = layer_states(len(head.layers))
    j = torch.arange(T, device=dev)
    stats = StepStats(0.0, [], [])
    # draft 1: every entry j (token j + 1, features j) predicts token j + 2
    normed, fed = head(_shift(tokens, 1).reshape(n), head.fuse(tgt.features.reshape(n, -1)), j.repeat(B), states,
                       ChainMeta(B, T, real=True), backend)
    logits = head.lm_head(normed).reshape(B, T, -1)
    mask = _shift(answer, 2, False)
    total = _soft_ce(logits, _shift(tgt.probs, 1), mask.float())
    hit = (logits.argmax(-1) == _shift(tgt.argmax, 1, -1)) & mask
    stats.correct.append(int(hit.sum()))
    stats.count.append(int(mask.sum()))
    if anchors is None:
        anchors = j.expand(B, T)
    valid = anchors >= 0
    anc = anchors.clamp(min=0)
    b_idx = torch.arange(B, device=dev)[:, None]
    fed = fed.reshape(B, T, -1)[b_idx, anc]  # [B, A, hidden]
    alive = hit[b_idx, anc] & valid
    if run_lengths is not None:
        run_lengths += alive.long()
    A = anc.shape[1]
    for s in range(1, steps):
        # draft s + 1 of anchor j: entry (token j + 1 + s, own feature) at position j + s predicts token j + 2 + s
        ids = tokens[b_idx, (anc + 1 + s).clamp(max=T - 1)].reshape(-1)
        meta = ChainMeta(B, T, real=False, anchors=anc, num_slots=1)
        normed, fed = head(ids, fed.reshape(B * A, -1), (anc + s).reshape(-1), states, meta, backend)
        logits = head.lm_head(normed).reshape(B, A, -1)
        row = (anc + 1 + s).clamp(max=T - 1)  # the target's distribution for token j + 2 + s
        predicted = anc + 2 + s
        mask = valid & (predicted < T) & answer[b_idx, predicted.clamp(max=T - 1)]
        total = total + (decay ** s) * _soft_ce(logits, tgt.probs[b_idx, row], mask.float())
        hit = (logits.argmax(-1) == tgt.argmax[b_idx, row]) & mask
        stats.correct.append(int(hit.sum()))
        stats.count.append(int(mask.sum()))
        if run_lengths is not None:
            alive = alive & hit
            run_lengths += alive.long()
        fed = fed.reshape(B, A, -1)
    stats.loss = float(total.detach())
    return total, stats


def peagle_loss(head: EagleHead, tgt: TargetOut, batch: Batch, num_slots: int, decay: float,
                anchors: torch.Tensor, real_loss: bool,
                run_lengths: torch.Tensor | None = None,
                chain_weight: bool = False) -> tuple[torch.Tensor, StepStats]:
    """Real entries (draft 1, when ``real_loss``) plus ``num_slots - 1`` mask slots after every anchor
    (``anchors`` [B, A] int64; -1 = padding) in one forward. With ``run_lengths`` ([B, A] int64, zeros), also
    records for every anchor how many leading drafts (the real entry's, then the slots') matched the target's
    argmax: what a verifier would accept from that anchor's one-pass draft (the held-out AL estimate).

    ``chain_weight`` (``TrainDraftConfig.peagle_chain_weight``): slot s's cross-entropy at an anchor is weighted by
    ``reach = p_1 * ... * p_s``, the head's probabilities (detached) of the target's greedy token at the drafts
    before it (p_1 the real entry's draft), and averaged over the valid anchors. Example: p_1 = 0.9, slot 1's
    p = 0.2 -> slot 1 weighs 0.9 and slot 2 weighs 0.18 at that anchor."""
    tokens = batch.tokens
    B, T = tokens.shape
    n = B * T
    dev = tokens.device
    A, S = anchors.shape[1], num_slots - 1
    backend = ChainAttentionBackend()
    states = layer_states(len(head.layers))
    j = torch.arange(T, device=dev)
    real_ids = _shift(tokens, 1).reshape(n)
    real_hidden = head.fuse(tgt.features.reshape(n, -1))
    valid_anchor = anchors >= 0
    anc = anchors.clamp(min=0)
    slot = torch.arange(1, S + 1, device=dev)
    mask_feature = head.fuse(head.mask_hidden[None, :]).expand(B * A * S, -1)
    mask_ids = torch.full((B * A * S,), head.config.mask_token_id, dtype=torch.int64, device=dev)
    chain_pos = (anc[:, :, None] + slot).reshape(-1)
    meta = ChainMeta(B, T, real=True, anchors=anc, num_slots=S)
    normed, _ = head(torch.cat([real_ids, mask_ids]), torch.cat([real_hidden, mask_feature]),
                     torch.cat([j.repeat(B), chain_pos]), states, meta, backend)
    logits = head.lm_head(normed)
    stats = StepStats(0.0, [], [])
    total = torch.zeros((), device=dev)
    real_logits = logits[:n].reshape(B, T, -1)
    real_mask = _shift(batch.answer, 2, False)
    if real_loss:
        total = total + _soft_ce(real_logits, _shift(tgt.probs, 1), real_mask.float())
    real_arg = _shift(tgt.argmax, 1, -1)  # [B, T] the target's greedy token each real entry drafts
    hit = (real_logits.argmax(-1) == real_arg) & real_mask
    stats.correct.append(int(hit.sum()))
    stats.count.append(int(real_mask.sum()))
    chain_logits = logits[n:].reshape(B, A, S, -1)
    b_idx = torch.arange(B, device=dev)[:, None, None]
    if run_lengths is not None:
        alive = hit[b_idx[:, :, 0], anc] & valid_anchor  # [B, A] draft 1 of each anchor matched
        run_lengths += alive.long()
    if chain_weight:  # [B, A] the head's probability that draft 1 is the target's greedy token
        reach = _prob_of(real_logits[b_idx[:, :, 0], anc], real_arg[b_idx[:, :, 0], anc])
    label_row = (anc[:, :, None] + 1 + slot).clamp(max=T - 1)  # [B, A, S] row of the target's distribution
    tok_row = anc[:, :, None] + 2 + slot  # the predicted token's position
    in_range = tok_row < T
    chain_mask = valid_anchor[:, :, None] & in_range & batch.answer[b_idx, tok_row.clamp(max=T - 1)]
    for s in range(S):
        m = chain_mask[:, :, s]
        probs = tgt.probs[b_idx[:, :, 0], label_row[:, :, s]]  # [B, A, V]
        arg = tgt.argmax[b_idx[:, :, 0], label_row[:, :, s]]
        if chain_weight:
            ce = _soft_ce(chain_logits[:, :, s], probs, m.float() * reach, denom=m.sum())
            reach = reach * _prob_of(chain_logits[:, :, s], arg)
        else:
            ce = _soft_ce(chain_logits[:, :, s], probs, m.float())
        total = total + (decay ** (s + 1)) * ce
        hit = (chain_logits[:, :, s].argmax(-1) == arg) & m
        stats.correct.append(int(hit.sum()))
        stats.count.append(int(m.sum()))
        if run_lengths is not None:
            alive = alive & hit
            run_lengths += alive.long()
    stats.loss = float(total.detach())
    return total, stats


def _prob_of(
    logits: torch.Tensor,  # [..., V] draft logits
    token: torch.Tensor,  # [...] draft-vocabulary index, -1: outside it (probability 0)
) -> torch.Tensor:  # [...] fp32, detached
    """The head's probability of ``token`` under ``logits``, not differentiated."""
    with torch.no_grad():
        logp = logits.float().log_softmax(-1).gather(-1, token.clamp(min=0)[..., None]).squeeze(-1)
        return logp.exp() * (token >= 0)


def sample_anchors(batch: Batch, count: int, gen: torch.Generator) -> torch.Tensor:  # [B, count] int64, -1 pad
    """Up to ``count`` anchor positions per sequence, uniformly among those whose first chain slot predicts a
    generated token."""
    B, T = batch.tokens.shape
    ok = _shift(batch.answer, 3, False).cpu()  # slot 1 of anchor j predicts token j + 3
    out = torch.full((B, count), -1, dtype=torch.int64)
    for b in range(B):
        cand = ok[b].nonzero().flatten()
        if len(cand):
            pick = cand[torch.randperm(len(cand), generator=gen)[:count]]
            out[b, :len(pick)] = pick.sort().values
    return out.to(batch.tokens.device)


# ---------------------------------------------------------------------------------------------- loop


def _lr_at(step: int, total: int, cfg: TrainDraftConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    frac = (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))


def init_head_state(path: str | Path, target_config: ModelConfig, device: torch.device) -> dict[str, torch.Tensor]:
    """The fp32 state of a trained head directory (speculators format), for ``TrainDraftConfig.init_head``."""
    from specserve.spec.eagle_checkpoint import load_eagle_head
    head = load_eagle_head(path, target_config.num_hidden_layers, target_config.vocab_size,
                           target_config.max_position_embeddings, torch.float32, device)
    return {k: v.detach() for k, v in head.state_dict().items()}


def init_head_draft_ids(path: str | Path, target_config: ModelConfig) -> torch.Tensor:  # [draft_vocab_size] int64
    """A trained head's draft vocabulary as target ids (``draft_id + d2t[draft_id]``), in draft order."""
    d2t = init_head_state(path, target_config, torch.device("cpu"))["d2t"]
    return d2t + torch.arange(len(d2t))


class Trainer:
    def __init__(self, target, target_config: ModelConfig, cfg: TrainDraftConfig, draft_ids: torch.Tensor,
                 device: torch.device, out_dir: Path, progress: bool = True) -> None:
        self.target, self.cfg, self.device, self.out_dir = target, cfg, device, Path(out_dir)
        self.draft_ids = draft_ids.to(device)
        self.t2d_index = torch.full((target_config.vocab_size,), -1, dtype=torch.int64, device=device)
        self.t2d_index[self.draft_ids] = torch.arange(len(draft_ids), device=device)
        self.gen = torch.Generator().manual_seed(cfg.seed)
        lm = target.lm_head.weight if target.lm_head is not None else target.embed_tokens.weight
        self.head = new_head(target_config, cfg, draft_ids, cfg.max_seq_len + cfg.num_spec_tokens + cfg.ttt_steps
                             + 2, device, lm.detach(), target.embed_tokens.weight.detach(), self.gen)
        if cfg.init_head:
            self._load_init_head(cfg.init_head, target_config)
        target.requires_grad_(False)
        if self.head.embed_tokens is None:
            self.head.target_embed = target.embed_tokens  # a submodule now: kept out of the optimiser and saves
        self.params = [p for name, p in self.head.named_parameters() if not name.startswith("target_embed.")]
        self.opt = torch.optim.AdamW(self.params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
        self.step = 0
        self.best_step: int | None = None  # the step whose head ``fit`` kept, when held-out estimates ran
        self.skipped_batches = 0  # batches dropped by ``fit`` after running out of GPU memory
        self.progress = progress
        self.autocast = device.type == "cuda"

    def _load_init_head(self, path: str, target_config: ModelConfig) -> None:
        """Start from a trained head (``TrainDraftConfig.init_head``): the same tensors, names and shapes as the head
        this configuration builds, and the same draft vocabulary or a wider one holding all its tokens (see
        ``_widen_lm_head``), or a ValueError naming ``init_head``."""
        trained = init_head_state(path, target_config, self.device)
        mine = self.head.state_dict()
        if trained["d2t"].shape != mine["d2t"].shape:
            trained = self._widen_lm_head(path, trained, mine)
        trained = self._widen_mlps(trained, mine)
        if self.cfg.method == "peagle" and "mask_hidden" not in trained:
            trained = self._eagle3_into_peagle(trained, mine)
        wrong = sorted({k for k in mine if k not in trained or trained[k].shape != mine[k].shape} | (trained.keys()
                                                                                                  - mine.keys()))
        if wrong:
            raise ValueError(f"init_head: {path} is not the head this configuration builds (method, num_layers, "
                             f"head_intermediate_size, draft vocabulary size); differs in {wrong[:4]}")
        if not torch.equal(trained["d2t"].to(self.device), mine["d2t"]):
            raise ValueError(f"init_head: {path} has another draft vocabulary than this run's")
        self.head.load_state_dict(trained)

    def _widen_lm_head(self, path: str, trained: dict[str, torch.Tensor],
                       mine: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``trained`` with this run's wider draft vocabulary: each of its tokens keeps its trained lm_head row (at
        the token's new draft index), every added token starts from the target's LM head row (as a fresh head
        does), scaled by how much longer the trained rows are than the target's rows of the same tokens, so
        that new and trained logits start on one scale.

            trained vocab [2, 5], this run's [0, 2, 3, 5]: rows 1 and 3 <- trained rows 0 and 1; rows 0, 2 new
        """
        old_ids = trained["d2t"] + torch.arange(len(trained["d2t"]), device=self.device)  # ascending target ids
        rows = self.t2d_index[old_ids]  # [old_vocab] their rows in this run's vocabulary (-1: missing)
        if (rows < 0).any():
            raise ValueError(f"init_head: {path} has another draft vocabulary than this run's "
                             f"({int((rows < 0).sum())} of its tokens are not in it)")
        lm = mine["lm_head.weight"].clone()  # [draft_vocab, hidden] the target's rows
        scale = trained["lm_head.weight"].norm(dim=1).mean() / lm[rows].norm(dim=1).mean()
        lm.mul_(scale)
        lm[rows] = trained["lm_head.weight"]
        return {**trained, "lm_head.weight": lm, "d2t": mine["d2t"]}

    @staticmethod
    def _widen_mlps(trained: dict[str, torch.Tensor], mine: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``trained`` with this run's wider MLPs (``head_intermediate_size`` larger than the trained head's), the
        head computing exactly the same function: each MLP keeps its trained units, the added gate and up rows
        start as a fresh head's, and the added ``down_proj`` columns start at zero, so the added units contribute
        nothing until training moves them (their ``down_proj`` columns get gradients at once, and then their gate
        and up rows). A narrower MLP than the trained one is left for the shape check to refuse.

            trained I = 2, this run's I = 3 (gate_up rows [g0 g1 u0 u1] -> [g0 g1 G2 u0 u1 U2], G2 and U2 fresh;
            down_proj columns [d0 d1] -> [d0 d1 0])
        """
        out = dict(trained)
        for name, value in mine.items():
            if not name.endswith("mlp.gate_up_proj.weight") or name not in trained:
                continue
            old, new = trained[name].shape[0] // 2, value.shape[0] // 2
            down = name.replace("gate_up_proj", "down_proj")
            if new <= old or trained[name].shape[1] != value.shape[1] or down not in trained:
                continue
            gate, up = trained[name].split(old)
            out[name] = torch.cat([gate, value[old:new], up, value[new + old:]])
            out[down] = torch.cat([trained[down], torch.zeros_like(mine[down][:, old:])], dim=1)
        return out

    def _eagle3_into_peagle(self, trained: dict[str, torch.Tensor],
                            mine: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A P-EAGLE head started from a trained EAGLE-3 head of the same width: ``fc``, its layers, the final
        norm and the LM head are the EAGLE-3 head's; every further layer starts as the identity (its ``o_proj`` and
        ``down_proj`` are zero, so the residual passes through unchanged) and the mask embedding row and feature
        as a fresh P-EAGLE head's. Slot 1 then drafts exactly as the EAGLE-3 head's first step, and training
        starts from there instead of from random layers."""
        extra = sorted(k for k in trained if k not in mine)
        if extra:  # more layers, or fc norms this head does not have: not a head this one can start from
            raise ValueError(f"init_head: an EAGLE-3 head with tensors this P-EAGLE head lacks: {extra[:4]}")
        trained_layers = len({k.split(".")[1] for k in trained if k.startswith("layers.")})
        state = {**mine, **trained}
        for name, value in mine.items():  # the layers the trained head lacks start as the identity
            if name.startswith("layers.") and int(name.split(".")[1]) >= trained_layers and name.endswith(
                    ("self_attn.o_proj.weight", "mlp.down_proj.weight")):
                state[name] = torch.zeros_like(value)
        return state

    # -- one batch
    def _loss(self, batch: Batch, train: bool, run_lengths=None) -> tuple[list[torch.Tensor], StepStats]:
        cfg = self.cfg
        tgt = target_outputs(self.target, batch.tokens, self.head.config.aux_layer_ids, self.draft_ids,
                             self.t2d_index, hard_label_weight=cfg.hard_label_weight)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            if cfg.method == "eagle3":
                anchors = sample_anchors(batch, cfg.ttt_anchors, self.gen) if cfg.ttt_anchors else None
                loss, stats = eagle3_loss(self.head, tgt, batch, cfg.ttt_steps, cfg.step_weight_decay, anchors,
                                          run_lengths)
                if train:
                    loss.backward()
                return [loss], stats
            anchors = sample_anchors(batch, cfg.anchors_per_seq, self.gen)
            losses, merged = [], None
            for c, start in enumerate(range(0, anchors.shape[1], cfg.anchor_chunk)):
                loss, stats = peagle_loss(self.head, tgt, batch, cfg.num_spec_tokens, cfg.step_weight_decay,
                                          anchors[:, start:start + cfg.anchor_chunk], real_loss=c == 0,
                                          chain_weight=cfg.peagle_chain_weight)
                if train:
                    loss.backward()
                losses.append(loss.detach())
                if merged is None:
                    merged = stats
                else:  # the real entries (position 1) were counted by the first chunk
                    merged.correct[1:] = [a + b for a, b in zip(merged.correct[1:], stats.correct[1:])]
                    merged.count[1:] = [a + b for a, b in zip(merged.count[1:], stats.count[1:])]
            merged.loss = float(sum(losses))
            return losses, merged

    def train_step(self, batch: Batch, lr: float) -> StepStats:
        """One optimiser step on ``batch`` at learning rate ``lr``."""
        for group in self.opt.param_groups:
            group["lr"] = lr
        self.opt.zero_grad(set_to_none=True)
        _, stats = self._loss(batch, train=True)
        torch.nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip)
        self.opt.step()
        self.step += 1
        return stats

    def fit(self, samples: list[Sample], held_out: list[Sample] | None = None,
            stop_after: int | None = None) -> list[dict]:
        """Train until the planned steps (or the time budget) run out. With ``held_out`` and ``cfg.eval_every``,
        every ``eval_every`` steps (and at the end) estimates the held-out AL on ``cfg.eval_samples`` samples and
        keeps the best head: small data sets are memorised long before the budget ends.

        With ``cfg.total_steps`` the LR schedule spans that many steps; this call stops early when
        ``cfg.max_train_seconds`` would be exceeded or at step ``stop_after``, checkpointing the last step (not the
        kept best head), so that a later ``fit`` on the same output directory continues the same run: two calls
        of 3 + 3 steps train exactly what one call of 6 does."""
        cfg = self.cfg
        probe = (held_out or [])[:cfg.eval_samples] if cfg.eval_every else []
        best: tuple[float, int, dict] | None = None
        batches = make_batches(samples, cfg.max_seq_len, cfg.max_batch_tokens, cfg.seed)
        total = planned = cfg.total_steps or max(1, int(cfg.epochs * len(batches)))
        self._maybe_resume()
        started, start_step = time.perf_counter(), self.step
        bar = tqdm(total=total, initial=self.step, desc=f"train {cfg.method}", unit="step", file=sys.stderr,
                   disable=not self.progress, mininterval=2)
        log: list[dict] = []
        correct = count = None
        order_epoch, order = 0, batches
        while self.step < total and (stop_after is None or self.step < stop_after):
            epoch, idx = divmod(self.step, len(batches))
            if epoch != order_epoch:  # a new shuffle each epoch (the same one after a resume)
                order_epoch, order = epoch, make_batches(samples, cfg.max_seq_len, cfg.max_batch_tokens,
                                                         cfg.seed + epoch)
            batch = collate([samples[i] for i in order[idx]], cfg.max_seq_len, self.device)
            try:
                stats = self.train_step(batch, _lr_at(self.step, total, cfg))
            except torch.OutOfMemoryError:
                # a batch of unusually many rows (short sequences: more anchors per token) did not fit: drop it
                # and go on rather than lose the run; the steps count and the schedule are not advanced
                del batch
                self.opt.zero_grad(set_to_none=True)
                torch.cuda.empty_cache()
                self.skipped_batches += 1
                if self.skipped_batches > 100:
                    raise
                order = order[:idx] + order[idx + 1:] + order[idx:idx + 1]  # try it last this epoch
                continue
            done = self.step - start_step
            if cfg.max_train_seconds and done == 5:
                warm = time.perf_counter()  # the first steps pay for allocation and kernel selection
            out_of_time = False
            if cfg.max_train_seconds and done > 5:
                now = time.perf_counter()
                per_step = (now - warm) / (done - 5)
                if cfg.total_steps:  # a fixed schedule: stop this call before the budget runs out
                    out_of_time = (now - started) + per_step > cfg.max_train_seconds
                else:  # fit the step count (and the LR schedule) to the budget
                    total = min(planned, self.step + max(0, int((cfg.max_train_seconds - (now - started))
                                                                / per_step)))
                    bar.total = total
            correct = stats.correct if correct is None else [0.98 * a + b for a, b in zip(correct, stats.correct)]
            count = stats.count if count is None else [0.98 * a + b for a, b in zip(count, stats.count)]
            acc = [c / max(n, 1) for c, n in zip(correct, count)]
            bar.set_postfix_str(f"loss {stats.loss:.3f} acc/pos " + " ".join(f"{a:.2f}" for a in acc), refresh=False)
            bar.update(1)
            if self.step % 50 == 0 or self.step == total:
                log.append({"step": self.step, "loss": stats.loss, "acc_per_pos": acc})
            last = self.step == total or out_of_time or self.step == stop_after
            if probe and (self.step % cfg.eval_every == 0 or last):
                est = self.evaluate(probe)["estimated_al"]
                score = est[min(5 if cfg.method == "eagle3" else cfg.num_spec_tokens, max(est))]
                log.append({"step": self.step, "held_out_estimated_al": est})
                if best is None or score > best[0]:
                    best = (score, self.step, {k: v.detach().clone() for k, v in self.head_state().items()})
            if self.step % cfg.checkpoint_every == 0:
                self.save_checkpoint()
            if out_of_time:
                break
        bar.close()
        self.save_checkpoint()  # the last step's state: what a resumed run continues from
        if best is not None:
            self.best_step = best[1]
            if best[1] != self.step:
                self.head.load_state_dict(best[2], strict=False)
                log.append({"step": self.step, "kept_step": best[1], "held_out_score": best[0]})
        return log

    @torch.no_grad()
    def evaluate(self, samples: list[Sample], max_k: int = 7) -> dict:
        """Teacher-forced held-out estimate: per draft position accuracy, and the mean acceptance length a
        greedy chain of ``k`` drafts would get (1 + E[min(leading matches, k)]) for k = 1..max_k (EAGLE-3's
        sequential drafting; for P-EAGLE the slots' joint matches)."""
        self.head.eval()
        cfg = self.cfg
        anchor_gen = torch.Generator().manual_seed(cfg.seed + 1)  # the same anchors every call: comparable
        correct = count = None
        runs_all = []
        steps = max(max_k, cfg.ttt_steps if cfg.method == "eagle3" else cfg.num_spec_tokens)
        for idx in make_batches(samples, cfg.max_seq_len, cfg.max_batch_tokens, cfg.seed):
            batch = collate([samples[i] for i in idx], cfg.max_seq_len, self.device)
            tgt = target_outputs(self.target, batch.tokens, self.head.config.aux_layer_ids, self.draft_ids,
                                 self.t2d_index)
            with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
                if cfg.method == "eagle3":
                    runs = torch.zeros_like(batch.tokens)
                    _, stats = eagle3_loss(self.head, tgt, batch, steps, cfg.step_weight_decay, None, runs)
                    runs_all.append(runs[_shift(batch.answer, 2, False)])
                else:
                    anchors = sample_anchors(batch, cfg.anchors_per_seq, anchor_gen)
                    runs = torch.zeros_like(anchors)
                    _, stats = peagle_loss(self.head, tgt, batch, min(steps, cfg.num_spec_tokens),
                                           cfg.step_weight_decay, anchors, real_loss=True, run_lengths=runs)
                    runs_all.append(runs[anchors >= 0])
            correct = stats.correct if correct is None else [a + b for a, b in zip(correct, stats.correct)]
            count = stats.count if count is None else [a + b for a, b in zip(count, stats.count)]
        self.head.train()
        acc = [c / max(n, 1) for c, n in zip(correct or [], count or [])]
        result = {"acc_per_pos": acc, "count_per_pos": count}
        if runs_all:
            runs = torch.cat(runs_all).float()
            max_k = max_k if cfg.method == "eagle3" else min(max_k, cfg.num_spec_tokens)
            result["estimated_al"] = {k: 1 + float(runs.clamp(max=k).mean()) if runs.numel() else 1.0
                                      for k in range(1, max_k + 1)}
        return result

    # -- checkpoints
    def head_state(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in self.head.state_dict().items() if not k.startswith("target_embed.")}

    def save_checkpoint(self) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        torch.save({"step": self.step, "head": self.head_state(), "opt": self.opt.state_dict(),
                    "config": asdict(self.cfg), "gen": self.gen.get_state()},
                   self.out_dir / "checkpoint.pt")

    def _maybe_resume(self) -> None:
        path = self.out_dir / "checkpoint.pt"
        if not path.exists():
            return
        state = torch.load(path, map_location=self.device, weights_only=False)
        self.head.load_state_dict(state["head"], strict=False)
        self.opt.load_state_dict(state["opt"])
        self.gen.set_state(state["gen"].cpu())  # map_location moved the RNG state to the device
        self.step = int(state["step"])
        if self.progress:
            print(f"resumed from {path} at step {self.step}", file=sys.stderr)
