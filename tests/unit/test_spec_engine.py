"""Golden equivalence on tiny fp32 models: speculative greedy output == plain greedy output, token for token,
for every proposer, several num_spec_tokens, batch 1 and 6, chunked prefill and forced preemption; seeded
sampled output with one-hot drafts == plain seeded sampled output, token for token; a draft identical to the
target is always accepted; stop conditions inside an accepted run; nothing leaks."""

from __future__ import annotations

import random

import pytest
import torch

from specserve.config import SpecConfig
from specserve.sampling import SamplingParams
from specserve.spec.params import SpecParams
from specserve.spec.proposer import Draft
from tests.tiny import prompts, tiny_engine

LENGTHS = [5, 17, 3, 40, 9, 23]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
METHODS = {"ngram": None, "draft": "self", "eagle3": "dummy", "peagle": "dummy"}


def spec_engine(method: str, k: int, **kw):
    return tiny_engine(spec=SpecConfig(method=method, model=METHODS[method], num_spec_tokens=k), **kw)


@pytest.fixture(scope="module")
def plain() -> dict[tuple[int, ...], list[int]]:
    engine = tiny_engine()
    ps = prompts(LENGTHS)
    return {tuple(p): r.output_ids for p, r in zip(ps, engine.generate(ps, GREEDY))}


def assert_clean(engine) -> None:
    engine.block_manager.check_invariants()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    for proposer in engine.proposers.values():
        kv = getattr(proposer, "kv", None)
        if kv is not None:
            kv.blocks.check_invariants()
            assert kv.blocks.num_free_blocks == kv.blocks.num_blocks, f"{proposer.method} leaked draft KV"
            assert not kv.num_computed
        assert not getattr(proposer, "pending", {}), f"{proposer.method} kept queued features"


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.parametrize("batch", [1, 6])
def test_speculative_greedy_equals_plain_greedy(plain, method: str, k: int, batch: int) -> None:
    engine = spec_engine(method, k)
    ps = prompts(LENGTHS)[:batch]
    reqs = engine.generate(ps, GREEDY)
    assert [r.output_ids for r in reqs] == [plain[tuple(p)] for p in ps]
    assert all(r.spec_counters.num_drafts > 0 for r in reqs) or method == "ngram"
    assert_clean(engine)


@pytest.mark.parametrize("method", list(METHODS))
def test_chunked_prefill_and_preemption_keep_speculative_output(plain, method: str) -> None:
    ps = prompts(LENGTHS)
    chunked = spec_engine(method, 3, max_num_batched_tokens=7)
    assert [r.output_ids for r in chunked.generate(ps, GREEDY)] == [plain[tuple(p)] for p in ps]
    assert_clean(chunked)
    tight = spec_engine(method, 3, num_blocks=24, max_num_batched_tokens=32)
    reqs = tight.generate(ps, GREEDY)
    assert sum(r.num_preemptions for r in reqs) > 0, "the cache was meant to be too small"
    assert [r.output_ids for r in reqs] == [plain[tuple(p)] for p in ps]
    assert_clean(tight)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_draft_identical_to_target_is_always_accepted(k: int) -> None:
    engine = spec_engine("draft", k)
    # 1 token from the prefill step, then every step emits k + 1 tokens.
    params = SamplingParams(max_tokens=1 + 4 * (k + 1), temperature=0.0, ignore_eos=True)
    reqs = engine.generate(prompts(LENGTHS), params)
    for r in reqs:
        c = r.spec_counters
        assert c.num_drafts == 4 and c.num_draft_tokens == 4 * k
        assert c.acceptance_rate == 1.0
        assert c.mean_acceptance_length == k + 1
        assert c.acceptance_histogram[k] == c.num_drafts and c.accepted_per_pos == [4] * k


def test_one_batch_mixes_methods_num_spec_tokens_and_speculation_off(plain) -> None:
    base = spec_engine("draft", 3)
    others = {m: spec_engine(m, 2).proposers[m] for m in ("eagle3", "peagle")}
    engine = tiny_engine(proposers={**base.proposers, **others}, spec=SpecConfig(method="draft", model="self"))
    engine.proposers["draft"].model = engine.runner.model
    specs = [SpecParams("ngram", 4), SpecParams("draft", 1), SpecParams(), SpecParams("eagle3", 3),
             SpecParams("peagle", 5), SpecParams("draft", 5)]
    ps = prompts(LENGTHS)
    seen_batches = []
    for i, (p, sp) in enumerate(zip(ps, specs)):
        engine.add_request(f"r{i}", p, GREEDY, sp)
    reqs = [engine.requests[f"r{i}"] for i in range(len(ps))]
    while engine.has_unfinished():
        methods = {r.spec.method for r in engine.scheduler.running if r.spec_token_ids}
        seen_batches.append(methods)
        engine.step()
    assert max(len(m) for m in seen_batches) >= 3, "the methods were meant to share steps"
    assert [r.output_ids for r in reqs] == [plain[tuple(p)] for p in ps]
    assert reqs[2].spec_counters.num_drafts == 0
    assert reqs[5].spec_counters.acceptance_rate == 1.0  # draft == target
    assert all(len(h) <= sp.num_spec_tokens + 1 for r, sp in zip(reqs, specs)
               for h in [r.spec_counters.acceptance_histogram])
    assert_clean(engine)


def test_stop_token_inside_an_accepted_run_ends_the_output_there(plain) -> None:
    p = prompts(LENGTHS)[1]
    want = plain[tuple(p)]
    stop_at = next(i for i in range(3, len(want)) if want[i] not in want[:i])
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop_token_ids=[want[stop_at]])
    engine = spec_engine("draft", 5)
    req = engine.generate([p], params)[0]
    assert req.output_ids == want[:stop_at + 1] and req.finish_reason == "stop"
    assert_clean(engine)


@pytest.mark.parametrize("max_tokens", [1, 2, 7, 13])
def test_max_tokens_is_exact_with_speculation(plain, max_tokens: int) -> None:
    p = prompts(LENGTHS)[0]
    engine = spec_engine("draft", 5)
    req = engine.generate([p], SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))[0]
    assert req.output_ids == plain[tuple(p)][:max_tokens] and req.finish_reason == "length"


def test_no_draft_is_proposed_past_the_context_limit(plain) -> None:
    max_model_len = 40
    engine = spec_engine("draft", 5, max_model_len=max_model_len)
    ps = [p for p in prompts(LENGTHS) if len(p) < 30]
    for i, p in enumerate(ps):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True))
    reqs = [engine.requests[f"r{i}"] for i in range(len(ps))]
    while engine.has_unfinished():
        for r in engine.scheduler.running:
            assert r.num_tokens + len(r.spec_token_ids) <= max_model_len - 1
        engine.step()
    for p, r in zip(ps, reqs):
        assert r.num_tokens == max_model_len and r.finish_reason == "length"
        assert r.output_ids == plain[tuple(p)][:max_model_len - len(p)] or len(plain[tuple(p)]) < len(r.output_ids)
    assert_clean(engine)


SAMPLED = [SamplingParams(max_tokens=24, temperature=[0.7, 1.0][i % 2], top_p=[0.9, 1.0][i % 3 == 0],
                          top_k=[0, 8][i % 2], seed=100 + i, ignore_eos=True) for i in range(len(LENGTHS))]


@pytest.fixture(scope="module")
def plain_sampled() -> list[list[int]]:
    return [r.output_ids for r in tiny_engine().generate(prompts(LENGTHS), SAMPLED)]


class CopyingProposer:
    """One-hot drafts that copy a known continuation of each prompt, each draft right with probability ``right``
    (else a random token), so that verification sees long accepted runs, early rejections and everything
    between."""

    method = "ngram"
    aux_layer_ids = ()

    def __init__(self, continuations: dict[tuple[int, ...], list[int]], right: float, seed: int) -> None:
        self.continuations, self.right, self.rng = continuations, right, random.Random(seed)

    def observe(self, chunks, aux_hidden) -> None:
        pass

    def propose(self, requests, num_spec_tokens: list[int]) -> list[Draft]:
        drafts = []
        for req, k in zip(requests, num_spec_tokens):
            cont, at = self.continuations[tuple(req.prompt_ids)], len(req.output_ids)
            drafts.append(Draft([cont[at + j] if at + j < len(cont) and self.rng.random() < self.right
                                 else self.rng.randrange(97) for j in range(k)]))
        return drafts

    def free(self, request_id: str) -> None:
        pass


@pytest.mark.parametrize(("k", "right", "tight"), [(1, 0.9, False), (3, 0.6, False), (5, 0.97, False),
                                                   (4, 0.8, True)])
def test_seeded_sampling_with_one_hot_drafts_equals_plain_sampling(plain_sampled, k, right, tight) -> None:
    """The verifier draws a one-hot-drafted position with the uniform plain sampling would use there
    (spec/verify.py), so seeded output does not depend on the drafts: token for token the plain engine's, with
    accepted runs of every length, chunked prefill and (``tight``) preemption."""
    ps = prompts(LENGTHS)
    proposer = CopyingProposer({tuple(p): out for p, out in zip(ps, plain_sampled)}, right, seed=k)
    kw = dict(num_blocks=24, max_num_batched_tokens=32) if tight else dict(max_num_batched_tokens=7)
    engine = tiny_engine(spec=SpecConfig(method="ngram", num_spec_tokens=k), proposers={"ngram": proposer}, **kw)
    reqs = engine.generate(ps, SAMPLED)
    assert [r.output_ids for r in reqs] == plain_sampled
    accepted = [r.spec_counters.num_accepted_tokens for r in reqs]
    assert sum(accepted) > len(reqs) * k and any(h[k] for h in (r.spec_counters.acceptance_histogram for r in reqs)
                                                 if len(h) > k), "drafts were meant to be accepted, all k at times"
    assert not tight or sum(r.num_preemptions for r in reqs) > 0, "the cache was meant to be too small"
    assert_clean(engine)


class CapPlan:
    """A policy stub: the caps of ``plan`` in turn, one a decision (0: no drafts, None: no cap, n: at most n)."""

    def __init__(self, plan: list[int | None]) -> None:
        self.plan, self.decisions = plan, 0

    def choose(self, batch_size: int) -> int | None:
        self.decisions += 1
        return self.plan[(self.decisions - 1) % len(self.plan)]

    def record(self, batch_size, cap, seconds, tokens, outcomes=None) -> None:
        pass

    def observe(self, outcomes) -> None:
        pass


@pytest.mark.parametrize("async_on", [False, True])
@pytest.mark.parametrize("plan", [[0, 0, None], [None, 1, 0, 2], [0, 0, 0, 0, None, None]])
def test_seeded_sampling_with_changing_caps_and_overlapped_steps_equals_plain_sampling(plain_sampled, plan,
                                                                                     async_on) -> None:
    """Caps that change from step to step (what the adaptive policy does, here on a fixed plan so that drafts
    are accepted often: the copying drafter is right 80% of the time), with the engine's overlapped cap-0
    decode steps on or off: the output is plain seeded sampling's."""
    ps = prompts(LENGTHS)
    proposer = CopyingProposer({tuple(p): out for p, out in zip(ps, plain_sampled)}, 0.8, seed=len(plan))
    engine = tiny_engine(spec=SpecConfig(method="ngram", num_spec_tokens=3, adaptive=True),
                         proposers={"ngram": proposer})
    engine.set_spec_policy(CapPlan(plan))
    engine.async_scheduling = async_on
    reqs = engine.generate(ps, SAMPLED)
    assert [r.output_ids for r in reqs] == plain_sampled
    assert sum(r.spec_counters.num_accepted_tokens for r in reqs) > len(reqs) * 4
    assert_clean(engine)


@pytest.mark.parametrize("adaptive", [False, True])
@pytest.mark.parametrize("method", ["ngram", "eagle3", "peagle"])
def test_seeded_sampling_with_each_one_hot_proposer_equals_plain_sampling(plain_sampled, method: str,
                                                                          adaptive: bool) -> None:
    """Also under the adaptive policy, whose caps follow measured step times: the drafts change, the output
    does not."""
    engine = tiny_engine(spec=SpecConfig(method=method, model=METHODS[method], num_spec_tokens=3, adaptive=adaptive))
    assert [r.output_ids for r in engine.generate(prompts(LENGTHS), SAMPLED)] == plain_sampled
    assert_clean(engine)


def test_seeded_sampling_with_speculation_is_reproducible() -> None:
    params = SamplingParams(max_tokens=20, temperature=0.8, top_p=0.9, seed=11)
    outs = [[r.output_ids for r in spec_engine("draft", 3).generate(prompts(LENGTHS), params)] for _ in range(2)]
    assert outs[0] == outs[1]


def test_abort_frees_target_and_draft_state() -> None:
    engine = spec_engine("eagle3", 3)
    for i, p in enumerate(prompts(LENGTHS)):
        engine.add_request(f"r{i}", p, GREEDY)
    for _ in range(4):
        engine.step()
    for i in range(len(LENGTHS)):
        engine.abort_request(f"r{i}")
    assert_clean(engine)


def test_budget_trims_drafts_but_never_the_request_token(plain) -> None:
    ps = prompts(LENGTHS)
    engine = spec_engine("draft", 5, max_num_batched_tokens=8)
    reqs = engine.generate(ps, GREEDY)
    assert [r.output_ids for r in reqs] == [plain[tuple(p)] for p in ps]
    assert any(len(r.spec_counters.acceptance_histogram) < 6 for r in reqs) or all(
        r.spec_counters.num_drafts > 0 for r in reqs)
    assert torch.is_grad_enabled()
