"""Draft-head training on tiny fp32 models: prompt formats, the draft vocabulary, the training attention
against a causal recompute of what the head sees at inference, TTT drafts against the engine's own EAGLE-3
proposer, loss going down, and export -> load giving identical drafts."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from specserve.config import TrainDraftConfig
from specserve.sampling import SamplingParams
from specserve.spec.eagle3 import Eagle3Proposer
from specserve.spec.eagle_checkpoint import load_eagle_head
from specserve.spec.peagle import PEagleProposer
from specserve.train.chain_attention import ChainAttentionBackend, ChainMeta, layer_states
from specserve.train.data import conversation_from_record, read_conversations, split_held_out
from specserve.train.generate import Sample, load_samples, save_samples
from specserve.train.pipeline import export_head
from specserve.train.trainer import Trainer, _lr_at, _shift, _soft_ce, collate, make_batches, target_outputs
from specserve.train.vocab import coverage, d2t_t2d, draft_vocab, extend_vocab, token_counts
from tests.tiny import prompts, tiny_engine

VOCAB = 97


def tiny_trainer(method: str, tmp_path, num_layers: int = 1, seed: int = 0, **cfg) -> tuple[Trainer, object]:
    engine = tiny_engine(seed=seed)
    draft_ids = torch.arange(0, VOCAB, 2)  # every other id: the d2t mapping is exercised
    config = TrainDraftConfig(**{**dict(method=method, num_layers=num_layers, draft_vocab_size=len(draft_ids),
                                        max_seq_len=64, max_batch_tokens=256, warmup_steps=1, lr=3e-3, ttt_steps=4,
                                        num_spec_tokens=4, anchors_per_seq=16, anchor_chunk=8, seed=seed), **cfg})
    trainer = Trainer(engine.runner.model, engine.model_config, config, draft_ids, torch.device("cpu"), tmp_path,
                      progress=False)
    if not cfg.get("init_head"):
        with torch.no_grad():  # a random head drafts near-uniformly; sharpen it so argmaxes are not near-ties
            trainer.head.lm_head.weight.mul_(8.0)
    return trainer, engine


def greedy_samples(engine, n: int, prompt_len: int = 12, answer: int = 20) -> list[Sample]:
    ps = prompts([prompt_len + i for i in range(n)], seed=3)
    reqs = engine.generate(ps, SamplingParams(max_tokens=answer, temperature=0.0, ignore_eos=True))
    return [Sample(p + r.output_ids, len(p)) for p, r in zip(ps, reqs)]


# ---------------------------------------------------------------------------------------------- data


def test_every_prompt_format_is_read(tmp_path) -> None:
    (tmp_path / "share.json").write_text(json.dumps([
        {"conversations": [{"from": "system", "value": "be brief"}, {"from": "human", "value": "hi"},
                           {"from": "gpt", "value": "hello"}, {"from": "human", "value": "and?"}]},
        {"conversations": [{"from": "gpt", "value": "only an answer"}]}]))
    (tmp_path / "alpaca.json").write_text(json.dumps([{"instruction": "Add.", "input": "2 and 3", "output": "5"},
                                                      {"instruction": "Say hi.", "input": "", "output": "hi"}]))
    (tmp_path / "pc.jsonl").write_text('{"prompt": "p1", "completion": "c1"}\n{"question": "q?", "answer": "a"}\n')
    (tmp_path / "plain.txt").write_text("first line\n\n  second line \n")
    share = read_conversations(tmp_path / "share.json")
    assert [(c.system, c.user_turns) for c in share] == [("be brief", ["hi", "and?"])]
    assert [c.user_turns for c in read_conversations(tmp_path / "alpaca.json")] == [["Add.\n\n2 and 3"], ["Say hi."]]
    assert [c.user_turns for c in read_conversations(tmp_path / "pc.jsonl")] == [["p1"], ["q?"]]
    assert [c.user_turns for c in read_conversations(tmp_path / "plain.txt")] == [["first line"], ["second line"]]
    assert read_conversations(tmp_path / "share.json", max_turns=1)[0].user_turns == ["hi"]
    # the files' own answers are kept apart (off-policy samples), aligned with the user turns they follow
    assert share[0].answers == ["hello"]
    assert [c.answers for c in read_conversations(tmp_path / "alpaca.json")] == [["5"], ["hi"]]
    assert [c.answers for c in read_conversations(tmp_path / "pc.jsonl")] == [["c1"], ["a"]]
    assert [c.answers for c in read_conversations(tmp_path / "plain.txt")] == [[], []]
    two_in_a_row = {"messages": [{"role": "user", "content": "u1"}, {"role": "assistant", "content": "a1"},
                                 {"role": "assistant", "content": "a1 again"}, {"role": "user", "content": "u2"}]}
    assert conversation_from_record(two_in_a_row).answers == ["a1"]
    assert conversation_from_record({"messages": [{"role": "user", "content": "x"}]}).user_turns == ["x"]
    assert conversation_from_record({"unrelated": 1}) is None


def test_evaluation_sets_are_refused(tmp_path) -> None:
    path = tmp_path / "mt_bench" / "question.jsonl"
    path.parent.mkdir()
    path.write_text('{"prompt": "x"}\n')
    with pytest.raises(ValueError, match="evaluation set"):
        read_conversations(path)


def test_held_out_split_is_disjoint_and_seeded() -> None:
    items = list(range(50))
    train, held = split_held_out(items, 0.1, seed=1)
    assert sorted(train + held) == items and len(held) == 5
    assert split_held_out(items, 0.1, seed=1) == (train, held)


def test_samples_round_trip(tmp_path) -> None:
    samples = [Sample([1, 2, 3, 4], 2), Sample([5, 6], 1)]
    save_samples(samples, tmp_path / "d.npz")
    assert load_samples(tmp_path / "d.npz") == samples


def test_draft_vocabulary_keeps_the_most_generated_tokens() -> None:
    samples = [Sample([90, 91, 5, 5, 5, 7, 7, 3], 2), Sample([90, 7, 9], 1)]  # prompts (90, 91) do not count
    counts = token_counts(samples, VOCAB)
    assert counts[5] == 3 and counts[7] == 3 and counts[90] == 0
    ids = draft_vocab(counts, 3)
    assert ids.tolist() == [3, 5, 7]  # 5 and 7 (3 each), then 3 and 9 tie at 1: the lower id wins
    d2t, t2d = d2t_t2d(ids, VOCAB)
    assert (torch.arange(3) + d2t).tolist() == ids.tolist()
    assert t2d.nonzero().flatten().tolist() == ids.tolist()
    assert coverage(counts, ids) == pytest.approx(7 / 8)
    with pytest.raises(ValueError, match="draft_vocab_size"):
        draft_vocab(counts, VOCAB + 1)


@settings(max_examples=60, deadline=None)
@given(counts=st.lists(st.integers(0, 5), min_size=1, max_size=40), data=st.data())
def test_extend_vocab_keeps_the_trained_tokens_and_adds_the_most_frequent(counts, data) -> None:
    counts = np.asarray(counts, dtype=np.int64)
    keep = sorted(data.draw(st.sets(st.integers(0, len(counts) - 1), min_size=1)))
    size = data.draw(st.integers(1, len(counts)))
    ids = extend_vocab(torch.tensor(keep), counts, size).tolist()
    assert ids == sorted(set(ids)) and set(keep) <= set(ids)
    assert len(ids) == max(size, len(keep))
    added = set(ids) - set(keep)
    left = set(range(len(counts))) - set(ids)
    if added and left:  # nothing left out is generated more often than something added
        assert min(counts[i] for i in added) >= max(counts[i] for i in left)
    assert extend_vocab(torch.tensor([2, 5]), np.array([9, 0, 1, 7, 0, 3]), 4).tolist() == [0, 2, 3, 5]
    with pytest.raises(ValueError, match="draft_vocab_size"):
        extend_vocab(torch.tensor(keep), counts, len(counts) + 1)


# ---------------------------------------------------------------------------------------------- attention


def _causal_reference(head, feats, tokens, anchor: int, slots: list[tuple[int, torch.Tensor]]):
    """What the head computes at inference for anchor ``anchor``: entries 0..anchor plus the given chain slots
    (token, input feature), one causal sequence; returns the normed output of the last row."""
    hidden = head.fuse(feats[:anchor + 1])
    ids = tokens[1:anchor + 2].tolist()
    for tok, h in slots:
        hidden = torch.cat([hidden, h[None]])
        ids.append(tok)
    n = len(ids)
    normed, fed = head(torch.tensor(ids), hidden, torch.arange(n), layer_states(len(head.layers)),
                       ChainMeta(1, n, real=True), ChainAttentionBackend())
    return normed[-1], fed[-1]


@pytest.mark.parametrize("num_layers", [1, 2])
def test_training_time_test_sees_what_inference_sees(tmp_path, num_layers: int) -> None:
    trainer, engine = tiny_trainer("eagle3", tmp_path, num_layers)
    head = trainer.head.eval()
    sample = greedy_samples(engine, 1)[0]
    batch = collate([sample], 64, torch.device("cpu"))
    tgt = target_outputs(trainer.target, batch.tokens, head.config.aux_layer_ids, trainer.draft_ids,
                         trainer.t2d_index)
    tokens, feats = batch.tokens[0], tgt.features[0]
    T = tokens.shape[0]
    with torch.no_grad():
        states, backend = layer_states(num_layers), ChainAttentionBackend()
        hidden = head.fuse(tgt.features.reshape(T, -1))
        outs = []
        for s in range(3):
            meta = ChainMeta(1, T, real=True) if s == 0 else ChainMeta(1, T, False, torch.arange(T)[None], 1)
            normed, fed = head(_shift(batch.tokens, 1 + s)[0], hidden, torch.arange(T) + s, states, meta, backend)
            outs.append((normed, fed))
            hidden = fed
        for anchor in (0, 5, T - 8):
            slots = []
            for s in range(3):
                ref_normed, ref_fed = _causal_reference(head, feats, tokens, anchor, slots)
                torch.testing.assert_close(outs[s][0][anchor], ref_normed, rtol=1e-4, atol=1e-5)
                slots.append((int(tokens[anchor + 2 + s]), ref_fed))


def test_peagle_slots_see_what_inference_sees(tmp_path) -> None:
    trainer, engine = tiny_trainer("peagle", tmp_path, num_layers=2)
    head = trainer.head.eval()
    batch = collate(greedy_samples(engine, 1), 64, torch.device("cpu"))
    tgt = target_outputs(trainer.target, batch.tokens, head.config.aux_layer_ids, trainer.draft_ids,
                         trainer.t2d_index)
    T, S = batch.tokens.shape[1], 3
    anchors = torch.tensor([[0, 4, T - 6]])
    mask_id = head.config.mask_token_id
    with torch.no_grad():
        mask_feature = head.fuse(head.mask_hidden[None])
        ids = torch.cat([_shift(batch.tokens, 1)[0], torch.full((3 * S,), mask_id)])
        hidden = torch.cat([head.fuse(tgt.features[0]), mask_feature.expand(3 * S, -1)])
        pos = torch.cat([torch.arange(T), (anchors[0, :, None] + torch.arange(1, S + 1)).reshape(-1)])
        normed, _ = head(ids, hidden, pos, layer_states(2), ChainMeta(1, T, True, anchors, S),
                         ChainAttentionBackend())
        chain = normed[T:].reshape(3, S, -1)
        for a, anchor in enumerate(anchors[0].tolist()):
            slots = []
            for s in range(S):
                slots.append((mask_id, mask_feature[0]))
                ref, _ = _causal_reference(head, tgt.features[0], batch.tokens[0], anchor, slots)
                torch.testing.assert_close(chain[a, s], ref, rtol=1e-4, atol=1e-5)


def test_peagle_run_lengths_count_each_anchors_leading_matches(tmp_path) -> None:
    """The P-EAGLE held-out estimate: for every anchor, how many of its one-pass drafts (the real entry's, then the
    mask slots') match the target's greedy tokens before the first miss, counted by hand from the same forward's
    logits; ``evaluate`` reports 1 + the mean of those runs capped at k."""
    from specserve.train.trainer import peagle_loss, sample_anchors
    trainer, engine = tiny_trainer("peagle", tmp_path, num_layers=2, epochs=3.0)
    samples = greedy_samples(engine, 6)
    trainer.fit(samples)  # a trained head: runs of several lengths
    head = trainer.head.eval()
    batch = collate(samples[:3], 64, torch.device("cpu"))
    tgt = target_outputs(trainer.target, batch.tokens, head.config.aux_layer_ids, trainer.draft_ids,
                         trainer.t2d_index)
    anchors = sample_anchors(batch, 12, torch.Generator().manual_seed(2))
    runs = torch.zeros_like(anchors)
    seen: list[torch.Tensor] = []
    hook = head.lm_head.register_forward_hook(lambda mod, inp, out: seen.append(out.detach()))
    with torch.no_grad():
        peagle_loss(head, tgt, batch, 4, 0.8, anchors, True, run_lengths=runs)
    hook.remove()
    B, T = batch.tokens.shape
    A = anchors.shape[1]
    real = seen[0][:B * T].argmax(-1).reshape(B, T)
    chain = seen[0][B * T:].argmax(-1).reshape(B, A, 3)
    want = torch.zeros_like(runs)
    for b in range(B):
        for a, j in enumerate(anchors[b].tolist()):
            if j < 0:
                continue
            drafts = [int(real[b, j])] + chain[b, a].tolist()  # predict tokens j + 2 .. j + 5
            for s, d in enumerate(drafts):
                row = j + 1 + s
                if j + 2 + s >= T or not batch.answer[b, j + 2 + s] or d != int(tgt.argmax[b, row]):
                    break
                want[b, a] += 1
    assert torch.equal(runs, want)
    assert len(set(want[anchors >= 0].tolist())) >= 2, want  # not all equal: the check can tell runs apart
    est = trainer.evaluate(samples[:3], max_k=7)["estimated_al"]
    assert sorted(est) == [1, 2, 3, 4] and list(est.values()) == sorted(est.values())  # k <= num_spec_tokens


def test_peagle_chain_weight_weighs_each_slot_by_the_chance_of_reaching_it(tmp_path) -> None:
    """``peagle_loss(chain_weight=True)``: slot s's cross-entropy at an anchor times the head's probabilities of the
    target's greedy tokens at the drafts before it (the real entry's, then the slots'), averaged over the valid
    anchors, recomputed by hand from the same forward's logits; and one training step with it lowers that loss."""
    from specserve.train.trainer import peagle_loss, sample_anchors
    trainer, engine = tiny_trainer("peagle", tmp_path, num_layers=2, epochs=2.0)
    samples = greedy_samples(engine, 4)
    trainer.fit(samples)  # a trained head: probabilities far from uniform and from one another
    head = trainer.head.eval()
    batch = collate(samples[:3], 64, torch.device("cpu"))
    tgt = target_outputs(trainer.target, batch.tokens, head.config.aux_layer_ids, trainer.draft_ids,
                         trainer.t2d_index)
    anchors = sample_anchors(batch, 10, torch.Generator().manual_seed(4))
    seen: list[torch.Tensor] = []
    hook = head.lm_head.register_forward_hook(lambda mod, inp, out: seen.append(out.detach()))
    with torch.no_grad():
        weighted, _ = peagle_loss(head, tgt, batch, 4, 0.8, anchors, False, chain_weight=True)
        plain, _ = peagle_loss(head, tgt, batch, 4, 0.8, anchors, False)
    hook.remove()
    B, T = batch.tokens.shape
    A, S = anchors.shape[1], 3
    real = seen[0][:B * T].reshape(B, T, -1).log_softmax(-1)
    chain = seen[0][B * T:].reshape(B, A, S, -1).log_softmax(-1)
    arg_real = _shift(tgt.argmax, 1, -1)

    def prob(logp: torch.Tensor, token: int) -> float:
        return 0.0 if token < 0 else float(logp[token].exp())

    num, plain_num, den = [0.0] * S, [0.0] * S, [0] * S
    for b in range(B):
        for a, j in enumerate(anchors[b].tolist()):
            if j < 0:
                continue
            reach = prob(real[b, j], int(arg_real[b, j]))
            for s in range(S):
                label_row = min(j + 2 + s, T - 1)
                ce = float(-(tgt.probs[b, label_row] * chain[b, a, s]).sum())
                if j + 3 + s < T and batch.answer[b, j + 3 + s]:
                    num[s], plain_num[s], den[s] = num[s] + reach * ce, plain_num[s] + ce, den[s] + 1
                reach *= prob(chain[b, a, s], int(tgt.argmax[b, label_row]))
    want = sum(0.8 ** (s + 1) * num[s] / max(den[s], 1) for s in range(S))
    want_plain = sum(0.8 ** (s + 1) * plain_num[s] / max(den[s], 1) for s in range(S))
    assert 0 < want < want_plain  # reach < 1 shrinks every term: the weighting is not a no-op here
    torch.testing.assert_close(float(weighted), want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(float(plain), want_plain, rtol=1e-5, atol=1e-6)
    head.train()
    loss, _ = peagle_loss(head, tgt, batch, 4, 0.8, anchors, True, chain_weight=True)
    loss.backward()
    torch.optim.SGD(head.parameters(), lr=0.05).step()
    with torch.no_grad():
        after, _ = peagle_loss(head, tgt, batch, 4, 0.8, anchors, True, chain_weight=True)
    assert float(after) < float(loss.detach())


@pytest.mark.parametrize("method", ["eagle3", "peagle"])
def test_training_predictions_equal_the_engine_proposers_drafts(tmp_path, method: str) -> None:
    """The engine's proposer drafts d1..dk after a prompt; with d1..dk as the 'true' continuation, the training
    forward's argmax at the last anchor must be exactly d1..dk (EAGLE-3), or d1 and the slots' argmaxes
    (P-EAGLE)."""
    k = 4
    trainer, engine = tiny_trainer(method, tmp_path, num_layers=1 if method == "eagle3" else 2)
    head = trainer.head.eval()
    cls = Eagle3Proposer if method == "eagle3" else PEagleProposer
    proposer = cls(head, engine.runner.model, 64, 4, torch.device("cpu"))
    spec_engine = tiny_engine(proposers={method: proposer})  # the same seeded target as the trainer's
    from specserve.spec.params import SpecParams
    prompt = prompts([19], seed=5)[0]
    spec_engine.add_request("r", prompt, SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True),
                            SpecParams(method, k))
    req = spec_engine.requests["r"]
    spec_engine.step()  # prefill: samples one token and drafts k
    drafts = list(req.spec_token_ids)
    assert len(drafts) == k
    seq = prompt + req.output_ids + drafts
    batch = collate([Sample(seq, len(prompt))], 64, torch.device("cpu"))
    tgt = target_outputs(trainer.target, batch.tokens, head.config.aux_layer_ids, trainer.draft_ids,
                         trainer.t2d_index)
    anchor = len(prompt) - 1  # entry (first sampled token, features of the last prompt position)
    T = batch.tokens.shape[1]
    with torch.no_grad():
        if method == "eagle3":
            states, backend, hidden, got = layer_states(1), ChainAttentionBackend(), None, []
            hidden = head.fuse(tgt.features.reshape(T, -1))
            for s in range(k):
                meta = ChainMeta(1, T, real=True) if s == 0 else ChainMeta(1, T, False, torch.arange(T)[None], 1)
                normed, hidden = head(_shift(batch.tokens, 1 + s)[0], hidden, torch.arange(T) + s, states, meta,
                                      backend)
                got.append(int(head.draft_token_ids(normed[anchor:anchor + 1])[0]))
        else:
            S = k - 1
            mask_id = head.config.mask_token_id
            ids = torch.cat([_shift(batch.tokens, 1)[0], torch.full((S,), mask_id)])
            hidden = torch.cat([head.fuse(tgt.features[0]), head.fuse(head.mask_hidden[None]).expand(S, -1)])
            pos = torch.cat([torch.arange(T), anchor + torch.arange(1, S + 1)])
            normed, _ = head(ids, hidden, pos, layer_states(2), ChainMeta(1, T, True, torch.tensor([[anchor]]), S),
                             ChainAttentionBackend())
            got = head.draft_token_ids(torch.cat([normed[anchor:anchor + 1], normed[T:]])).tolist()
    assert got == drafts


# ---------------------------------------------------------------------------------------------- training


@pytest.mark.parametrize("method", ["eagle3", "peagle"])
def test_training_steps_lower_the_loss_on_a_fixed_batch(tmp_path, method: str) -> None:
    trainer, engine = tiny_trainer(method, tmp_path, num_layers=1 if method == "eagle3" else 2)
    samples = greedy_samples(engine, 4)
    batch = collate(samples, 64, torch.device("cpu"))
    trainer.gen.manual_seed(0)
    before = sum(float(x.detach()) for x in trainer._loss(batch, train=False)[0])
    for _ in range(5):
        trainer.opt.zero_grad()
        trainer.gen.manual_seed(0)
        trainer._loss(batch, train=True)
        trainer.opt.step()
    trainer.gen.manual_seed(0)
    after = sum(float(x.detach()) for x in trainer._loss(batch, train=False)[0])
    assert after < 0.9 * before
    target_embed = engine.runner.model.embed_tokens.weight
    assert trainer.head.embed_tokens is None and trainer.head.target_embed.weight is target_embed  # not trained
    assert not any(n.startswith(("embed_tokens", "target_embed")) for n in trainer.head_state())
    if method == "peagle":  # the mask token's own row learned, away from the target's row it started from
        mask_id = trainer.head.config.mask_token_id
        assert not torch.allclose(trainer.head.mask_embedding, target_embed[mask_id])


@settings(max_examples=6, deadline=None)
@given(w=st.floats(0.0, 1.0))
@example(w=1.0)
def test_hard_label_weight_moves_label_mass_onto_the_argmax(tmp_path_factory, w: float) -> None:
    trainer, engine = tiny_trainer("eagle3", tmp_path_factory.mktemp("hard"))
    batch = collate(greedy_samples(engine, 2), 64, torch.device("cpu"))
    args = (trainer.target, batch.tokens, trainer.head.config.aux_layer_ids, trainer.draft_ids, trainer.t2d_index)
    soft, mixed = target_outputs(*args), target_outputs(*args, hard_label_weight=w)
    assert torch.equal(soft.argmax, mixed.argmax) and torch.equal(soft.features, mixed.features)
    inside = soft.argmax >= 0  # [B, T]; the draft vocabulary is every other id, so some rows fall outside
    assert inside.any() and (~inside).any()
    onehot = torch.zeros_like(soft.probs)
    onehot[inside] = torch.nn.functional.one_hot(soft.argmax[inside], soft.probs.shape[-1]).float()
    expected = torch.where(inside[..., None], (1 - w) * soft.probs + w * onehot, soft.probs)
    torch.testing.assert_close(mixed.probs, expected)
    torch.testing.assert_close(mixed.probs.sum(-1), soft.probs.sum(-1))  # still distributions
    if w == 1.0:  # pure hard labels: the soft cross-entropy is the usual cross-entropy on the argmax
        logits = torch.randn(*soft.probs.shape, generator=torch.Generator().manual_seed(0))
        hard = torch.nn.functional.cross_entropy(logits[inside], soft.argmax[inside])
        torch.testing.assert_close(_soft_ce(logits, mixed.probs, inside.float()), hard)


def test_hard_label_weight_is_checked_and_reaches_the_loss(tmp_path) -> None:
    with pytest.raises(ValueError, match="hard_label_weight"):
        TrainDraftConfig(hard_label_weight=1.5)
    losses = []
    for w in (0.0, 1.0):
        trainer, engine = tiny_trainer("eagle3", tmp_path / str(w), hard_label_weight=w)
        batch = collate(greedy_samples(engine, 2), 64, torch.device("cpu"))
        trainer.gen.manual_seed(0)
        losses.append(float(trainer._loss(batch, train=False)[0][0].detach()))
    assert losses[0] != pytest.approx(losses[1], rel=1e-3)


def test_fit_resumes_from_its_checkpoint(tmp_path) -> None:
    trainer, engine = tiny_trainer("eagle3", tmp_path, epochs=1.0, checkpoint_every=1)
    samples = greedy_samples(engine, 6)
    log = trainer.fit(samples)
    assert log and (tmp_path / "checkpoint.pt").exists()
    again, _ = tiny_trainer("eagle3", tmp_path, epochs=1.0, checkpoint_every=1, seed=0)
    again.fit(samples)  # nothing left to do: resumes at the last step
    assert again.step == trainer.step
    for (name, a), b in zip(trainer.head_state().items(), again.head_state().values()):
        assert torch.equal(a, b), name
    report = trainer.evaluate(samples[:2], max_k=3)
    assert set(report["estimated_al"]) == {1, 2, 3}
    als = list(report["estimated_al"].values())
    assert all(1.0 <= a <= 1 + k for k, a in zip((1, 2, 3), als)) and als == sorted(als)


def test_a_fixed_schedule_resumed_across_calls_trains_what_one_call_does(tmp_path) -> None:
    # total_steps fixes the LR schedule: 3 steps, a new Trainer on the same directory, 3 more steps must give the
    # very head (and step) one uninterrupted 6-step run gives (batches, anchors' RNG, Adam state, LR all resume).
    samples = None
    heads = {}
    for name, stops in (("split", (3, None)), ("whole", (None,))):
        for stop in stops:
            trainer, engine = tiny_trainer("eagle3", tmp_path / name, total_steps=6, checkpoint_every=100,
                                           warmup_steps=2)
            samples = samples or greedy_samples(engine, 6)
            trainer.fit(samples, stop_after=stop)
            assert trainer.step == (stop or 6)
        heads[name] = trainer.head_state()
    assert heads["split"].keys() == heads["whole"].keys()
    for key in heads["whole"]:
        assert torch.equal(heads["split"][key], heads["whole"][key]), key
    first, _ = tiny_trainer("eagle3", tmp_path / "lr", total_steps=6, warmup_steps=2)
    assert _lr_at(3, 6, first.cfg) > _lr_at(5, 6, first.cfg) > 0  # the schedule still had to decay after step 3


@pytest.mark.parametrize("method", ["eagle3", "peagle"])
def test_fit_keeps_the_head_with_the_best_held_out_estimate(tmp_path, method: str) -> None:
    trainer, engine = tiny_trainer(method, tmp_path, num_layers=1 if method == "eagle3" else 2, epochs=6.0,
                                   eval_every=2, eval_samples=3, lr=3e-2)  # a high LR: the estimate moves
    samples = greedy_samples(engine, 8)
    log = trainer.fit(samples[:6], samples[6:])
    k = 5 if method == "eagle3" else trainer.cfg.num_spec_tokens
    scores = {e["step"]: e["held_out_estimated_al"][min(k, max(e["held_out_estimated_al"]))]
              for e in log if "held_out_estimated_al" in e}
    assert len(scores) == trainer.step // 2 + (trainer.step % 2 > 0)
    assert trainer.best_step == max(scores, key=lambda step: (scores[step], -step))
    est = trainer.evaluate(samples[6:])["estimated_al"]  # the head it kept scores what it scored then
    assert est[min(k, max(est))] == pytest.approx(max(scores.values()))


@pytest.mark.parametrize("method,mlp", [("eagle3", 0), ("peagle", 0), ("eagle3", 96)])
def test_export_then_load_gives_identical_drafts(tmp_path, method: str, mlp: int) -> None:
    """``mlp``: the head's MLP width (``head_intermediate_size``; 0 = the target's), written to and read from the
    checkpoint's transformer_layer_config."""
    trainer, engine = tiny_trainer(method, tmp_path / "run", num_layers=1 if method == "eagle3" else 2,
                                   head_intermediate_size=mlp)
    out = tmp_path / "head"
    files = export_head(trainer.head, out, "tiny", dtype=torch.float32, max_shard_bytes=20_000,
                        verifier_architecture="qwen3")
    assert len(files) > 1 and (out / "model.safetensors.index.json").exists()  # sharded
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["speculators_model_type"] == method and cfg["draft_vocab_size"] == VOCAB // 2 + 1
    assert cfg["speculators_config"]["verifier"] == {"name_or_path": "tiny", "architectures": ["Qwen3ForCausalLM"]}
    width = cfg["transformer_layer_config"]["intermediate_size"]
    assert width == (mlp or engine.model_config.intermediate_size) and width != (96 if not mlp else 0)
    loaded = load_eagle_head(out, 2, VOCAB, 512, torch.float32, torch.device("cpu"))
    runs = []
    for head in (trainer.head.eval(), loaded):
        cls = Eagle3Proposer if method == "eagle3" else PEagleProposer
        eng = tiny_engine(proposers={method: cls(head, engine.runner.model, 64, 4, torch.device("cpu"))})
        from specserve.spec.params import SpecParams
        reqs = eng.generate(prompts([7, 15]), SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
                            SpecParams(method, 3))
        runs.append([(r.output_ids, r.spec_counters.num_accepted_tokens, r.spec_counters.num_drafts) for r in reqs])
    assert runs[0] == runs[1]
    assert np.isfinite([a for _, a, _ in runs[0]]).all()


def test_train_draft_cli_names_the_bad_field(tmp_path, capsys) -> None:
    from specserve.cli import main
    with pytest.raises(SystemExit) as exc:
        main(["train-draft", "--out", str(tmp_path), "--num-layers", "0", "--prompts", "x.jsonl"])
    assert exc.value.code == 2 and "num_layers" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["train-draft", "--out", str(tmp_path)])
    assert "--prompts" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["train-draft", "--out", str(tmp_path), "--data", str(tmp_path), "--self-prompts", "10"])
    assert "--self-prompts" in capsys.readouterr().err
    for bad, field in ((["--answers-per-conversation", "0"], "answers_per_conversation"),
                       (["--answers-per-conversation", "3", "--sampling-temperature", "0"], "answers_per_conversation"),
                       (["--answers-per-source", "sharegpt=two"], "answers_per_source"),
                       (["--answers-per-source", "sharegpt=0"], "answers_per_source"),
                       (["--self-prompts", "-1"], "self_prompts"),
                       (["--self-prompt-temperature", "0"], "self_prompt_temperature"),
                       (["--self-prompt-top-p", "1.5"], "self_prompt_top_p"),
                       (["--self-prompt-max-tokens", "0"], "self_prompt_max_tokens")):
        with pytest.raises(SystemExit) as exc:
            main(["train-draft", "--out", str(tmp_path), "--prompts", "x.jsonl", *bad])
        assert exc.value.code == 2 and field in capsys.readouterr().err


@pytest.mark.parametrize("method", ["eagle3", "peagle"])
def test_steady_state_drafts_match_training_predictions(tmp_path, method: str) -> None:
    """Every draft the engine proposes during a whole generation (not only the first, after prefill) is what the
    training forward predicts on the final sequence: draft 1 after position n always; draft s + 1 whenever drafts
    1..s were the tokens that actually followed (the training forward feeds true tokens)."""
    k = 3
    trainer, engine = tiny_trainer(method, tmp_path, num_layers=1 if method == "eagle3" else 2)
    head = trainer.head.eval()
    cls = Eagle3Proposer if method == "eagle3" else PEagleProposer
    spec_engine = tiny_engine(proposers={method: cls(head, engine.runner.model, 64, 4, torch.device("cpu"))})
    from specserve.spec.params import SpecParams
    prompt = prompts([11], seed=9)[0]
    spec_engine.add_request("r", prompt, SamplingParams(max_tokens=28, temperature=0.0, ignore_eos=True),
                            SpecParams(method, k))
    req = spec_engine.requests["r"]
    proposals = []  # (number of known tokens when drafted, drafts)
    while not req.finished:
        spec_engine.step()
        if not req.finished and req.spec_token_ids:
            proposals.append((len(prompt) + len(req.output_ids), list(req.spec_token_ids)))
    seq = prompt + req.output_ids
    batch = collate([Sample(seq, len(prompt))], 64, torch.device("cpu"))
    tgt = target_outputs(trainer.target, batch.tokens, head.config.aux_layer_ids, trainer.draft_ids,
                         trainer.t2d_index)
    T = batch.tokens.shape[1]
    with torch.no_grad():
        pred = []  # pred[s][j]: draft s + 1 at anchor j, fed true tokens
        if method == "eagle3":
            states, backend = layer_states(1), ChainAttentionBackend()
            hidden = head.fuse(tgt.features.reshape(T, -1))
            for s in range(k):
                meta = ChainMeta(1, T, real=True) if s == 0 else ChainMeta(1, T, False, torch.arange(T)[None], 1)
                normed, hidden = head(_shift(batch.tokens, 1 + s)[0], hidden, torch.arange(T) + s, states, meta,
                                      backend)
                pred.append(head.draft_token_ids(normed).tolist())
        else:
            S, mask_id = k - 1, head.config.mask_token_id
            anchors = torch.arange(T)[None]
            ids = torch.cat([_shift(batch.tokens, 1)[0], torch.full((T * S,), mask_id)])
            hidden = torch.cat([head.fuse(tgt.features[0]), head.fuse(head.mask_hidden[None]).expand(T * S, -1)])
            pos = torch.cat([torch.arange(T), (torch.arange(T)[:, None] + torch.arange(1, S + 1)).reshape(-1)])
            normed, _ = head(ids, hidden, pos, layer_states(2), ChainMeta(1, T, True, anchors, S),
                             ChainAttentionBackend())
            pred.append(head.draft_token_ids(normed[:T]).tolist())
            chain = head.draft_token_ids(normed[T:]).reshape(T, S)
            pred += [chain[:, s].tolist() for s in range(S)]
    checked = 0
    for n_known, drafts in proposals:
        anchor = n_known - 2  # entry (token n_known - 1, features of position n_known - 2)
        for s, d in enumerate(drafts):
            if method == "eagle3" and s and seq[n_known + s - 1:n_known + s] != drafts[s - 1:s]:
                break  # the engine fed a wrong draft back; training never sees that input
            if n_known + s >= len(seq):
                break
            assert d == pred[s][anchor], (n_known, s, drafts)
            checked += 1
    assert checked >= len(proposals) > 5


def test_sampled_ttt_anchors_compute_what_every_anchor_computes(tmp_path) -> None:
    """Training drafts 2.. on a sample of anchors gives, at those anchors, exactly the draft logits computed when
    every position is an anchor (4 draft positions)."""
    from specserve.train.trainer import eagle3_loss, sample_anchors
    trainer, engine = tiny_trainer("eagle3", tmp_path)
    head = trainer.head
    batch = collate(greedy_samples(engine, 3), 64, torch.device("cpu"))
    tgt = target_outputs(trainer.target, batch.tokens, head.config.aux_layer_ids, trainer.draft_ids,
                         trainer.t2d_index)
    calls: list[torch.Tensor] = []
    hook = head.lm_head.register_forward_hook(lambda mod, inp, out: calls.append(out.detach()))
    with torch.no_grad():
        eagle3_loss(head, tgt, batch, 4, 0.8, None)
        full, calls[:] = list(calls), []
        anchors = sample_anchors(batch, 5, torch.Generator().manual_seed(1))
        eagle3_loss(head, tgt, batch, 4, 0.8, anchors)
        some = list(calls)
    hook.remove()
    B, T = batch.tokens.shape
    torch.testing.assert_close(some[0], full[0])  # draft 1 covers every entry either way
    ok = anchors >= 0
    assert ok.sum() >= 10
    for s in range(1, 4):
        expect = full[s].reshape(B, T, -1)[torch.arange(B)[:, None], anchors.clamp(min=0)]
        torch.testing.assert_close(some[s].reshape(B, anchors.shape[1], -1)[ok], expect[ok], rtol=1e-5, atol=1e-5)


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 9), vocab=st.integers(1, 17), lead=st.booleans(), seed=st.integers(0, 2**16),
       scale=st.floats(0.1, 30.0))
def test_soft_cross_entropy_matches_the_log_softmax_formula(rows, vocab, lead, seed, scale) -> None:
    """The fused soft cross-entropy (loss and gradient) equals the textbook
    ``mean over masked rows of -sum p * log_softmax(z)``, computed in fp64, for any shape, mask (empty too),
    target distribution (renormalised or not) and logit scale."""
    gen = torch.Generator().manual_seed(seed)
    shape = (2, rows, vocab) if lead else (rows, vocab)
    z = (torch.randn(shape, generator=gen, dtype=torch.float64) * scale).requires_grad_()
    p = torch.rand(shape, generator=gen, dtype=torch.float64)
    p = p / p.sum(-1, keepdim=True) * torch.rand(shape[:-1] + (1,), generator=gen, dtype=torch.float64)
    mask = (torch.rand(shape[:-1], generator=gen) > 0.4).double()
    ref = (-(p * torch.log_softmax(z, -1)).sum(-1) * mask).sum() / mask.sum().clamp(min=1)
    (g_ref,) = torch.autograd.grad(ref, z)
    got = _soft_ce(z, p, mask)
    (g_got,) = torch.autograd.grad(got, z)
    assert got.item() == pytest.approx(ref.item(), rel=1e-5, abs=1e-5)
    assert torch.allclose(g_got, g_ref, rtol=1e-4, atol=1e-6)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # as training runs on GPU: the sums stay fp32
        assert _soft_ce(z, p, mask).item() == pytest.approx(got.item(), rel=1e-6, abs=1e-6)


@pytest.mark.parametrize("method", ["eagle3", "peagle"])
def test_init_head_starts_from_the_exported_head(tmp_path, method: str) -> None:
    """``init_head``: a new trainer starts with exactly the exported head's weights (fp32 export) and keeps
    training it; a configuration that builds another head, or another draft vocabulary, is refused by name."""
    layers = 1 if method == "eagle3" else 2
    trainer, engine = tiny_trainer(method, tmp_path / "first", num_layers=layers, epochs=1.0)
    samples = greedy_samples(engine, 6)
    trainer.fit(samples)
    export_head(trainer.head, tmp_path / "head", "tiny", dtype=torch.float32)
    warm, _ = tiny_trainer(method, tmp_path / "second", num_layers=layers, epochs=1.0,
                           init_head=str(tmp_path / "head"))
    for (name, a), b in zip(trainer.head_state().items(), warm.head_state().values()):
        assert torch.equal(a, b), name
    assert warm.evaluate(samples[:2], max_k=2) == trainer.evaluate(samples[:2], max_k=2)
    warm.fit(samples)
    assert warm.step > 0 and any(not torch.equal(a, b) for a, b in zip(trainer.head_state().values(),
                                                                      warm.head_state().values()))
    with pytest.raises(ValueError, match="init_head"):
        tiny_trainer(method, tmp_path / "third", num_layers=layers + 1, init_head=str(tmp_path / "head"))
    other_vocab = torch.arange(0, VOCAB, 2).flip(0)  # the same size, other tokens per row
    with pytest.raises(ValueError, match="init_head.*draft vocabulary"):
        Trainer(engine.runner.model, engine.model_config, dataclasses.replace(warm.cfg, draft_vocab_size=len(
            other_vocab)), other_vocab, torch.device("cpu"), tmp_path / "fourth", progress=False)


def test_init_head_widens_the_draft_vocabulary(tmp_path) -> None:
    """A warm start with a wider draft vocabulary (every trained token kept): each trained token keeps its lm_head
    row, so its logits are unchanged; added tokens start from the target's rows on the trained rows' scale;
    every other tensor is the trained head's. A vocabulary that drops a trained token is refused."""
    trainer, engine = tiny_trainer("eagle3", tmp_path / "first", epochs=1.0)
    trainer.fit(greedy_samples(engine, 6))
    export_head(trainer.head, tmp_path / "head", "tiny", dtype=torch.float32)
    old = torch.arange(0, VOCAB, 2)
    counts = np.arange(VOCAB)[::-1].copy()  # low ids most frequent: adds 1, 3, 5, ...
    wide = extend_vocab(old, counts, len(old) + 10)
    assert wide.tolist() == sorted(old.tolist() + list(range(1, 21, 2)))
    cfg = dataclasses.replace(trainer.cfg, draft_vocab_size=len(wide), init_head=str(tmp_path / "head"))
    warm = Trainer(engine.runner.model, engine.model_config, cfg, wide, torch.device("cpu"), tmp_path / "w",
                   progress=False)
    rows = torch.searchsorted(wide, old)
    got, want = warm.head_state(), trainer.head_state()
    assert torch.equal(got["lm_head.weight"][rows], want["lm_head.weight"])
    assert torch.equal(got["d2t"] + torch.arange(len(wide)), wide)  # d2t maps rows to the wide ids
    for name in want.keys() - {"lm_head.weight", "d2t"}:
        assert torch.equal(got[name], want[name]), name
    added = torch.tensor([i for i in range(len(wide)) if i not in set(rows.tolist())])
    target_rows = engine.runner.model.embed_tokens.weight if engine.runner.model.lm_head is None else \
        engine.runner.model.lm_head.weight
    scale = want["lm_head.weight"].norm(dim=1).mean() / target_rows[old].float().norm(dim=1).mean()
    assert torch.allclose(got["lm_head.weight"][added], target_rows[wide[added]].float() * scale)
    warm.fit(greedy_samples(engine, 4))  # and it trains
    assert warm.step > 0
    with pytest.raises(ValueError, match="init_head.*draft vocabulary"):
        narrow = torch.cat([old[1:], torch.tensor([1, 3])]).sort().values  # same size + 1, token 0 dropped
        Trainer(engine.runner.model, engine.model_config, dataclasses.replace(cfg, draft_vocab_size=len(narrow)),
                narrow, torch.device("cpu"), tmp_path / "n", progress=False)


def test_fit_drops_a_batch_that_runs_out_of_memory(tmp_path, monkeypatch) -> None:
    """A batch that runs out of GPU memory is tried again at the end of its epoch instead of ending the run:
    every planned step still runs, each batch once; a run where nothing fits still fails."""
    trainer, engine = tiny_trainer("eagle3", tmp_path / "run", epochs=1.0, max_batch_tokens=96)
    samples = greedy_samples(engine, 8)
    planned = make_batches(samples, trainer.cfg.max_seq_len, trainer.cfg.max_batch_tokens, trainer.cfg.seed)
    assert len(planned) >= 3
    real, seen = trainer.train_step, []

    def flaky(batch, lr):
        seen.append(tuple(batch.tokens.shape))
        if len(seen) == 2:
            raise torch.OutOfMemoryError("simulated")
        return real(batch, lr)

    monkeypatch.setattr(trainer, "train_step", flaky)
    trainer.fit(samples)
    assert trainer.step == len(planned) and trainer.skipped_batches == 1
    assert len(seen) == len(planned) + 1 and seen[-1] == seen[1]  # the dropped batch ran last
    broke, _ = tiny_trainer("eagle3", tmp_path / "broke", epochs=1.0, max_batch_tokens=96)
    monkeypatch.setattr(broke, "train_step", lambda batch, lr: (_ for _ in ()).throw(torch.OutOfMemoryError("x")))
    with pytest.raises(torch.OutOfMemoryError):
        broke.fit(samples)
    assert broke.step == 0


@pytest.mark.parametrize("method", ["eagle3", "peagle"])
def test_init_head_widens_the_mlp_without_changing_the_head(tmp_path, method: str) -> None:
    """A warm start with a wider MLP (``head_intermediate_size`` above the trained head's): the trained units keep
    their gate / up rows and down_proj columns, the added down_proj columns are zero, so the head scores every
    sample exactly as before; training then switches the added units on. A narrower MLP is refused."""
    layers = 1 if method == "eagle3" else 2
    width = tiny_engine().model_config.intermediate_size
    trainer, engine = tiny_trainer(method, tmp_path / "first", num_layers=layers, epochs=1.0)
    samples = greedy_samples(engine, 6)
    trainer.fit(samples)
    export_head(trainer.head, tmp_path / "head", "tiny", dtype=torch.float32)
    wide, _ = tiny_trainer(method, tmp_path / "wide", num_layers=layers, epochs=1.0, head_intermediate_size=3 * width,
                           init_head=str(tmp_path / "head"))
    got, want = wide.head_state(), trainer.head_state()
    for i in range(layers):
        gate_up, down = f"layers.{i}.mlp.gate_up_proj.weight", f"layers.{i}.mlp.down_proj.weight"
        assert got[gate_up].shape[0] == 6 * width and got[down].shape[1] == 3 * width
        old_gate, old_up = want[gate_up].split(width)
        assert torch.equal(got[gate_up][:width], old_gate) and torch.equal(got[gate_up][3 * width:4 * width], old_up)
        assert got[gate_up][width:3 * width].abs().sum() > 0  # the added units' rows are not zero...
        assert torch.equal(got[down][:, :width], want[down]) and not got[down][:, width:].any()  # ...their output is
    for name in want.keys() - {n for n in want if ".mlp." in n}:
        assert torch.equal(got[name], want[name]), name
    assert wide.evaluate(samples[:3], max_k=3) == trainer.evaluate(samples[:3], max_k=3)
    wide.fit(samples)
    assert wide.head_state()["layers.0.mlp.down_proj.weight"][:, width:].abs().sum() > 0
    narrow_width = max(1, width // 2)
    with pytest.raises(ValueError, match="init_head"):
        tiny_trainer(method, tmp_path / "narrow", num_layers=layers, head_intermediate_size=narrow_width,
                     init_head=str(tmp_path / "head"))


def test_peagle_starts_from_a_trained_eagle3_head(tmp_path) -> None:
    """``init_head`` of a P-EAGLE run may be an EAGLE-3 head of the same width: slot 1 then drafts exactly as the
    EAGLE-3 head's first step (same position-1 accuracy on the same samples), the later layers start as the
    identity, and training goes on from there."""
    eagle, engine = tiny_trainer("eagle3", tmp_path / "e", epochs=2.0)
    samples = greedy_samples(engine, 6)
    eagle.fit(samples)
    export_head(eagle.head, tmp_path / "head", "tiny", dtype=torch.float32)
    fresh, _ = tiny_trainer("peagle", tmp_path / "fresh", num_layers=3)
    warm, _ = tiny_trainer("peagle", tmp_path / "p", num_layers=3, epochs=1.0, init_head=str(tmp_path / "head"))
    state, trained = warm.head_state(), eagle.head_state()
    for name, value in trained.items():
        assert torch.equal(state[name], value), name
    assert not state["layers.1.self_attn.o_proj.weight"].any() and not state["layers.2.mlp.down_proj.weight"].any()
    assert torch.equal(state["mask_hidden"], fresh.head_state()["mask_hidden"])
    batch = collate(samples[:1], 64, torch.device("cpu"))
    tgt = target_outputs(eagle.target, batch.tokens, eagle.head.config.aux_layer_ids, eagle.draft_ids,
                         eagle.t2d_index)
    with torch.no_grad():
        for anchor in (0, 5, 17):  # slot 1 at this anchor: what each head scores for the next token
            want, _ = _causal_reference(eagle.head.eval(), tgt.features[0], batch.tokens[0], anchor, [])
            got, _ = _causal_reference(warm.head.eval(), tgt.features[0], batch.tokens[0], anchor, [])
            other, _ = _causal_reference(fresh.head.eval(), tgt.features[0], batch.tokens[0], anchor, [])
            torch.testing.assert_close(warm.head.lm_head(got), eagle.head.lm_head(want), rtol=1e-5, atol=1e-5)
            assert not torch.allclose(fresh.head.lm_head(other), eagle.head.lm_head(want), atol=1e-3)
    warm.head.train()
    warm.fit(samples)
    assert warm.head_state()["layers.1.self_attn.o_proj.weight"].any()  # the identity layers learn
    deep, _ = tiny_trainer("eagle3", tmp_path / "deep", num_layers=3)
    export_head(deep.head, tmp_path / "deep_head", "tiny", dtype=torch.float32)
    with pytest.raises(ValueError, match="init_head.*lacks"):  # 3 trained layers do not fit in 2
        tiny_trainer("peagle", tmp_path / "p2", num_layers=2, init_head=str(tmp_path / "deep_head"))


def test_init_head_draft_ids_are_the_heads_vocabulary(tmp_path) -> None:
    from specserve.train.trainer import init_head_draft_ids
    trainer, engine = tiny_trainer("eagle3", tmp_path / "run")
    export_head(trainer.head, tmp_path / "head", "tiny", dtype=torch.float32)
    assert torch.equal(init_head_draft_ids(tmp_path / "head", engine.model_config), torch.arange(0, VOCAB, 2))
