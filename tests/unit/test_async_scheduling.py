"""Asynchronous decode steps (engine/engine.py, ``SchedulerConfig.async_scheduling``): the next plain decode step
is launched with the previous step's tokens still on the device, and the previous step is committed after.

Golden equivalence on the tiny CPU model: with it on, every request's tokens, text-free finish reasons and
counts equal the synchronous engine's, token for token, for greedy and seeded sampling, length limits, stop
tokens hit while the next step is already launched, a small KV cache (preemption in the synchronous steps
between), arrivals and aborts mid-run; no KV block, pending token or in-flight step is left behind.
"""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specserve.engine.request import PENDING_TOKEN_ID, Request
from specserve.layers.sampler import TokenUniforms, sample, sample_on_device
from specserve.sampling import SamplingParams
from specserve.spec.verify import verify
from tests.tiny import prompts, tiny_engine


def run(engine, prompt_ids, params, async_on: bool, arrivals: dict[int, tuple] | None = None,
        aborts: dict[int, str] | None = None):
    """Steps ``engine`` to completion; ``arrivals`` / ``aborts``: call number -> request to add / id to abort.
    Returns {request_id: (output_ids, finish_reason)} from the streamed outputs and the number of steps whose
    ids came from the device."""
    engine.async_scheduling = async_on
    device_steps = []
    execute = engine.runner.execute

    def spy(sched, tables, aux=(), input_ids_device=None):
        device_steps.append(input_ids_device is not None)
        return execute(sched, tables, aux, input_ids_device)
    engine.runner.execute = spy
    for i, (p, sp) in enumerate(zip(prompt_ids, params)):
        engine.add_request(f"r{i}", p, sp)
    streamed: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}
    calls = 0
    while engine.has_unfinished() or (arrivals and any(c >= calls for c in arrivals)):
        if arrivals and calls in arrivals:
            rid, p, sp = arrivals[calls]
            engine.add_request(rid, p, sp)
        if aborts and calls in aborts:
            out = engine.abort_request(aborts[calls])
            if out is not None:
                reasons[out.request_id] = out.finish_reason
        for out in engine.step():
            assert out.request_id not in reasons, "no output after a request finished"
            streamed.setdefault(out.request_id, []).extend(out.new_token_ids)
            assert out.num_output_tokens == len(streamed[out.request_id])
            if out.finished:
                reasons[out.request_id] = out.finish_reason
        calls += 1
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert engine._in_flight is None and not engine.requests
    return {rid: (streamed.get(rid, []), reasons[rid]) for rid in reasons}, sum(device_steps)


def test_greedy_lengths_and_stop_tokens_equal_the_synchronous_engine():
    ps = prompts([5, 17, 3, 9, 12, 4])
    first = run(tiny_engine(max_num_seqs=8), ps, [SamplingParams(max_tokens=24, temperature=0.0)] * 6, False)[0]
    # stop tokens that finish two requests early, while the step after them is already launched
    stops = {0: first["r0"][0][4], 3: first["r3"][0][9]}
    params = [SamplingParams(max_tokens=[24, 7, 1, 30, 2, 16][i], temperature=0.0,
                             stop_token_ids=[stops[i]] if i in stops else []) for i in range(6)]
    sync, n_sync = run(tiny_engine(max_num_seqs=8), ps, params, False)
    asyn, n_async = run(tiny_engine(max_num_seqs=8), ps, params, True)
    assert asyn == sync and n_sync == 0 and n_async >= 8
    assert sync["r0"] == (first["r0"][0][:5], "stop") and sync["r2"][1] == "length"


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lengths=st.lists(st.integers(1, 20), min_size=1, max_size=6),
       max_tokens=st.lists(st.integers(1, 30), min_size=6, max_size=6),
       temperature=st.sampled_from([0.0, 0.8]), top_p=st.sampled_from([1.0, 0.9]),
       num_blocks=st.sampled_from([12, 256]), budget=st.sampled_from([8, 64]), seed=st.integers(0, 1000))
def test_random_batches_equal_the_synchronous_engine(lengths, max_tokens, temperature, top_p, num_blocks, budget,
                                                     seed):
    """Seeded requests (their own streams) sample the same tokens; a small cache forces preemption and
    chunked prefill in the synchronous steps around the asynchronous ones."""
    ps = prompts(lengths, seed=seed)
    params = [SamplingParams(max_tokens=max_tokens[i], temperature=temperature, top_p=top_p, seed=seed + i)
              for i in range(len(ps))]
    results = [run(tiny_engine(num_blocks=num_blocks, max_num_batched_tokens=budget, max_num_seqs=4), ps, params,
                   async_on)[0] for async_on in (False, True)]
    assert results[1] == results[0]


def test_arrival_and_abort_mid_run():
    """A request arriving while a step is in flight waits for it to commit, then joins synchronously; an abort
    of a request whose next step is already launched drops that row's token and frees its blocks."""
    ps = prompts([6, 11, 4])
    greedy = SamplingParams(max_tokens=20, temperature=0.0)
    late = ("late", prompts([9], seed=5)[0], greedy)
    sync = run(tiny_engine(), ps, [greedy] * 3, False, arrivals={6: late}, aborts={12: "r1"})[0]
    asyn, n_async = run(tiny_engine(), ps, [greedy] * 3, True, arrivals={6: late}, aborts={12: "r1"})
    assert sync["r1"][1] == asyn["r1"][1] == "abort"
    for rid in ("r0", "r2", "late"):
        assert asyn[rid] == sync[rid]
    assert n_async > 5
    # r1 was aborted after 12 calls: the asynchronous engine had committed one step fewer by then
    assert 0 < len(asyn["r1"][0]) <= len(sync["r1"][0])


def test_speculating_requests_run_synchronously():
    from specserve.config import SpecConfig
    from specserve.spec.params import SpecParams
    engine = tiny_engine(spec=SpecConfig(method="ngram", num_spec_tokens=3))
    ps = prompts([8, 12])
    greedy = SamplingParams(max_tokens=16, temperature=0.0)
    engine.add_request("off", ps[0], greedy, SpecParams("none", 0))
    results, n_async = run(engine, [ps[1]], [greedy], True)  # r0 speculates (the server's default)
    assert n_async == 0 and set(results) == {"off", "r0"}


def test_pending_tokens_read_as_placeholders():
    req = Request("x", [1, 2, 3], SamplingParams(), output_ids=[4], num_pending_tokens=2)
    assert req.num_tokens == 6 and req.num_committed_tokens == 4
    assert req.token_slice(2, 6) == [3, 4, PENDING_TOKEN_ID, PENDING_TOKEN_ID]
    assert req.token_slice(0, 2) == [1, 2] and req.token_slice(4, 5) == [PENDING_TOKEN_ID]
    assert req.token_at(3) == 4 and req.token_at(5) == PENDING_TOKEN_ID


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), rows=st.integers(1, 6), greedy_mask=st.integers(0, 63))
def test_sample_on_device_draws_what_the_verifier_draws_without_drafts(seed, rows, greedy_mask):
    """The asynchronous steps' sampler and the synchronous steps' (``verify`` with no drafts) draw the same tokens
    from the same streams; ``sample`` is its host read-back."""
    logits = torch.randn(rows, 50, generator=torch.Generator().manual_seed(seed)) * 3
    params = [SamplingParams(temperature=0.0 if greedy_mask >> i & 1 else 0.7, top_k=[0, 5][i % 2])
              for i in range(rows)]

    def gens():  # per-request streams for two rows in three, the default one for the rest
        return [TokenUniforms(seed + i) if i % 3 else None for i in range(rows)], TokenUniforms(seed)
    on_device = sample_on_device(logits, params, *gens())
    verified = verify(logits, list(range(rows)), [[] for _ in range(rows)], [None] * rows, params, *gens())
    assert on_device.tolist() == [toks[0] for toks in verified] == sample(logits, params, *gens())


def test_unseeded_sampling_equals_the_synchronous_engine():
    """Unseeded sampled requests get their own streams (seeded from the engine's seed in arrival order), so a
    row wasted on a request that stopped does not shift anyone else's draws."""
    ps = prompts([5, 9, 7])
    first = run(tiny_engine(), ps, [SamplingParams(max_tokens=16, temperature=1.0)] * 3, False)[0]
    params = [SamplingParams(max_tokens=16, temperature=1.0, stop_token_ids=[first["r0"][0][3]] if i == 0 else [])
              for i in range(3)]
    sync = run(tiny_engine(), ps, params, False)[0]
    asyn, n_async = run(tiny_engine(), ps, params, True)
    assert asyn == sync and n_async > 0 and sync["r0"][1] == "stop" and len(sync["r1"][0]) == 16


def test_a_full_server_keeps_overlapping_while_requests_queue():
    """At max_num_seqs nobody can be admitted, so the queue does not stop asynchronous steps; outputs still equal
    the synchronous engine's."""
    ps = prompts([4, 6, 5, 7])
    params = [SamplingParams(max_tokens=10 + i, temperature=0.0) for i in range(4)]
    sync = run(tiny_engine(max_num_seqs=2), ps, params, False)[0]
    asyn, n_async = run(tiny_engine(max_num_seqs=2), ps, params, True)
    assert asyn == sync and n_async >= 16  # 10 when any queued request stopped the overlap


def test_metrics_count_the_same_tokens():
    """Prompt and generation token counts per step add up to the synchronous engine's (a one-token prompt's only
    prompt token is computed by a decode-shaped, asynchronous step)."""
    class Sink:
        def __init__(self) -> None:
            self.steps: list = []

        def record_step(self, stats) -> None:
            self.steps.append(stats)

        def record_request(self, stats) -> None:
            pass

    totals = []
    for async_on in (False, True):
        engine = tiny_engine()
        engine.metrics = sink = Sink()
        run(engine, prompts([1, 1, 6]), [SamplingParams(max_tokens=5, temperature=0.0)] * 3, async_on)
        totals.append((sum(s.num_prompt_tokens for s in sink.steps),
                       sum(s.num_generation_tokens for s in sink.steps)))
    assert totals[0] == totals[1] == (8, 15)


def test_a_launch_that_fails_after_sampling_leaves_seeded_output_unchanged(monkeypatch, caplog):
    """A launch that raises after its tokens were drawn (here: right after sample_on_device) has consumed no
    uniform of any request, so seeded sampled output is the synchronous engine's token for token."""
    import specserve.engine.engine as engine_module

    ps = prompts([5, 8, 6])
    params = [SamplingParams(max_tokens=12, temperature=0.9, seed=40 + i) for i in range(3)]
    sync = run(tiny_engine(), ps, params, False)[0]
    engine = tiny_engine()
    real, failures, fed = engine_module.sample_on_device, [], []
    execute = engine.runner.execute

    def watched(sched, tables, aux=(), input_ids_device=None):
        fed.append(input_ids_device is not None)
        return execute(sched, tables, aux, input_ids_device)

    def flaky(*args, **kw):  # fails a launch made while another step was in flight (those fall back to sync)
        tokens = real(*args, **kw)
        if fed[-1] and len(failures) < 2:
            failures.append(1)
            raise RuntimeError("injected failure after sampling")
        return tokens
    engine.runner.execute = watched
    monkeypatch.setattr(engine_module, "sample_on_device", flaky)
    asyn, device_steps = run(engine, ps, params, True)
    assert len(failures) == 2 and "failed to launch" in caplog.text and device_steps > 0
    assert asyn == sync


def test_a_failed_launch_commits_the_step_in_flight_and_goes_on_synchronously(caplog):
    ps = prompts([5, 8])
    params = [SamplingParams(max_tokens=12, temperature=0.0)] * 2
    sync = run(tiny_engine(), ps, params, False)[0]
    engine = tiny_engine()
    execute = engine.runner.execute
    failures = []

    def flaky(sched, tables, aux=(), input_ids_device=None):
        if input_ids_device is not None and not failures:
            failures.append(1)
            raise RuntimeError("injected launch failure")
        return execute(sched, tables, aux, input_ids_device)
    engine.runner.execute = flaky
    asyn, _ = run(engine, ps, params, True)
    assert failures and asyn == sync and "failed to launch" in caplog.text
    engine.block_manager.check_invariants()
