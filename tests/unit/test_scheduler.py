"""Scheduler: token budget, chunked prefill, FCFS admission, the running cap and preemption, on synthetic
requests whose sampled tokens the test supplies itself (no model)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from specserve.config import SchedulerConfig
from specserve.engine.block_manager import BlockManager
from specserve.engine.request import Request, RequestStatus
from specserve.engine.scheduler import Scheduler
from specserve.sampling import SamplingParams


def run_step(sched: Scheduler, max_tokens: int) -> list[tuple[str, int]]:
    """Schedule, pretend the forward ran, append a dummy token to each sampling request."""
    out = sched.schedule()
    for s in out.scheduled:
        samples = s.samples
        s.request.num_computed_tokens += s.num_new_tokens
        if samples:
            s.request.output_ids.append(0)
            if len(s.request.output_ids) >= max_tokens:
                sched.finish(s.request, "length")
    return [(s.request.request_id, s.num_new_tokens) for s in out.scheduled]


def make(num_blocks=64, block_size=4, budget=8, max_seqs=4, chunked=True):
    bm = BlockManager(num_blocks, block_size)
    cfg = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, enable_chunked_prefill=chunked)
    return Scheduler(cfg, bm, max_model_len=1024), bm


def req(rid: str, n: int) -> Request:
    return Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=3, temperature=0.0))


def test_chunked_prefill_respects_budget_and_order() -> None:
    sched, _ = make(budget=8)
    sched.add(req("a", 20))
    sched.add(req("b", 5))
    assert run_step(sched, 3) == [("a", 8)]
    assert run_step(sched, 3) == [("a", 8)]
    assert run_step(sched, 3) == [("a", 4), ("b", 4)]  # a finishes its prompt (and samples), b starts
    assert run_step(sched, 3) == [("a", 1), ("b", 1)]  # a decodes, b finishes its prompt


def test_without_chunking_a_prompt_waits_for_a_whole_budget() -> None:
    sched, _ = make(budget=8, chunked=False)
    sched.add(req("a", 6))
    sched.add(req("b", 6))
    assert run_step(sched, 3) == [("a", 6)]  # b does not fit in the 2 tokens left
    assert run_step(sched, 3) == [("a", 1), ("b", 6)]


def test_preemption_frees_the_newest_and_it_resumes_by_recompute() -> None:
    sched, bm = make(num_blocks=4, block_size=4, budget=64)
    sched.add(req("a", 7))
    sched.add(req("b", 7))
    assert run_step(sched, 10) == [("a", 7), ("b", 7)]  # 4 blocks used
    steps = [run_step(sched, 10) for _ in range(2)]
    assert steps[0] == [("a", 1), ("b", 1)]  # position 7 still fits in each second block
    assert steps[1] == [("a", 1)]  # a needs a third block for position 8: b (newest) is preempted
    b = sched.waiting[0]
    assert b.request_id == "b" and b.num_preemptions == 1 and b.status == RequestStatus.WAITING
    assert b.num_computed_tokens == 0 and not bm.block_table("b")
    while sched.has_unfinished():
        run_step(sched, 10)
    assert bm.num_free_blocks == 4


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(1, 30), min_size=1, max_size=8), budget=st.integers(1, 40),
       max_seqs=st.integers(1, 5), num_blocks=st.integers(10, 40))
def test_random_workloads_finish_within_limits_without_leaks(lengths, budget, max_seqs, num_blocks) -> None:
    sched, bm = make(num_blocks=num_blocks, block_size=4, budget=budget, max_seqs=max_seqs)
    reqs = [req(str(i), n) for i, n in enumerate(lengths)]
    for r in reqs:
        sched.add(r)
    for _ in range(2000):
        if not sched.has_unfinished():
            break
        scheduled = run_step(sched, 3)
        assert sum(n for _, n in scheduled) <= budget
        assert len(sched.running) <= max_seqs
        bm.check_invariants()
    assert all(r.finished and len(r.output_ids) == 3 for r in reqs)
    assert bm.num_free_blocks == num_blocks
