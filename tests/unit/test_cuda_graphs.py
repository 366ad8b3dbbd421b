"""The padded static-buffer step of ``engine/cuda_graphs.py`` run eagerly on CPU (``capture=False``): the exact
padding, buffers and slot -1 rule a CUDA graph replays, checked against the ordinary ragged path."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specserve.config import CudaGraphConfig, EngineConfig, SpecConfig
from specserve.engine.cuda_graphs import CudaGraphRunner, bucket_sizes, padded_step_values
from specserve.layers.attention import TorchAttentionBackend
from specserve.layers.cpu_attention import make_cpu_backend
from specserve.sampling import SamplingParams
from tests.tiny import prompts, tiny_engine

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
NGRAM = SpecConfig(method="ngram", num_spec_tokens=3, ngram_min=1, ngram_max=2)
BUCKETS = (1, 2, 4, 8)


def test_padded_step_values_worked_example():
    # The module docstring's example: 3 decoding sequences into bucket 4, block_size 4.
    values, width = padded_step_values([105, 202, 308], [5, 2, 8], [1, 1, 1], [6, 3, 9],
                                       [[7, 2], [5], [1, 3, 8]], query_len=1, bucket=4, block_size=4)
    assert width == 3
    ids, pos, slots, seq_lens = values[0:4], values[4:8], values[8:12], values[12:16]
    tables, index = values[16:28], values[28:]
    assert ids == [105, 202, 308, 0]
    assert pos == [5, 2, 8, 0]
    assert slots == [9, 22, 32, -1]
    assert seq_lens == [6, 3, 9, 1]
    assert tables == [7, 2, 0, 5, 0, 0, 1, 3, 8, 0, 0, 0]
    assert index == [0, 1, 2]


def test_padded_step_values_pads_short_rows():
    # query_len 3: row 1 has one token (no draft) -> [b4, pad, pad], seq_len 5 + 2, slots [s, -1, -1].
    values, width = padded_step_values([1, 2, 3, 4], [6, 7, 8, 4], [3, 1], [9, 5], [[0, 1, 2], [3, 4]],
                                       query_len=3, bucket=2, block_size=4)
    assert values[0:6] == [1, 2, 3, 4, 0, 0]
    assert values[6:12] == [6, 7, 8, 4, 0, 0]
    assert values[12:18] == [1 * 4 + 2, 1 * 4 + 3, 2 * 4 + 0, 4 * 4 + 0, -1, -1]
    assert values[18:20] == [9, 7]
    assert width == 3 and values[20:26] == [0, 1, 2, 3, 4, 0]
    assert values[26:] == [0, 1, 2, 3]


def test_bucket_sizes():
    assert bucket_sizes((1, 2, 4, 8, 16), 5) == [1, 2, 4, 8]
    assert bucket_sizes((1, 2, 4, 8, 16), 64) == [1, 2, 4, 8, 16]
    assert bucket_sizes((1, 2, 4), 4) == [1, 2, 4]


@pytest.mark.parametrize("kwargs, field", [
    (dict(batch_sizes=()), "cuda_graphs.batch_sizes"),
    (dict(batch_sizes=(4, 2)), "cuda_graphs.batch_sizes"),
    (dict(batch_sizes=(0, 2)), "cuda_graphs.batch_sizes"),
    (dict(max_query_len=0), "cuda_graphs.max_query_len"),
    (dict(max_query_len=17), "cuda_graphs.max_query_len"),
    (dict(num_splits=0), "cuda_graphs.num_splits"),
])
def test_config_names_the_bad_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        CudaGraphConfig(**kwargs)


def test_engine_config_has_graphs_on_by_default():
    assert EngineConfig().cuda_graphs.enabled
    assert CudaGraphConfig(batch_sizes=[1, 2]).batch_sizes == (1, 2)


def test_graphs_stay_off_on_cpu():
    engine = tiny_engine()
    assert engine.runner.graphs is None  # CUDA only; CPU steps are eager


def use_static_path(engine, backend, buckets=BUCKETS, max_query_len: int = 8) -> CudaGraphRunner:
    runner = engine.runner
    runner.backend = backend
    runner.graphs = CudaGraphRunner(runner.model, runner.kv_caches, backend,
                                    CudaGraphConfig(batch_sizes=buckets, max_query_len=max_query_len),
                                    runner.block_size, engine.max_model_len, engine.config.scheduler.max_num_seqs,
                                    runner.device, capture=False)
    return runner.graphs


class SlotWatch:
    """Wraps ``CudaGraphRunner.run``: counts static steps, their buckets and query lengths, and checks that a
    step changes no cache slot but its real tokens' (padding writes nothing)."""

    def __init__(self, graphs: CudaGraphRunner, block_size: int):
        self.graphs, self.block_size = graphs, block_size
        self.steps: list[tuple[int, int, int]] = []  # (num_seqs, bucket, query_len)
        self.device_ids = 0  # steps whose input ids came from the device (asynchronous decode steps)
        run = graphs.run

        def watched(input_ids, positions, query_lens, seq_lens, block_tables, aux_layer_ids=(), input_ids_device=None):
            before = [(k.clone(), v.clone()) for k, v in graphs.kv_caches]
            out = run(input_ids, positions, query_lens, seq_lens, block_tables, aux_layer_ids, input_ids_device)
            self.device_ids += input_ids_device is not None
            allowed = set()
            for n, s_len, table in zip(query_lens, seq_lens, block_tables):
                for p in range(s_len - n, s_len):
                    allowed.add(table[p // block_size] * block_size + p % block_size)
            for (k0, v0), (k1, v1) in zip(before, graphs.kv_caches):
                changed = ((k0 != k1) | (v0 != v1)).flatten(2).any(-1).flatten()  # [num_slots]
                assert set(torch.nonzero(changed).flatten().tolist()) <= allowed
            self.steps.append((len(seq_lens), graphs.bucket_for(len(seq_lens)), max(query_lens)))
            return out

        graphs.run = watched


def random_caches(engine, seed: int = 1) -> None:
    """Garbage in every slot, so a stray write shows (a zeroed cache would hide a write of zeros)."""
    gen = torch.Generator().manual_seed(seed)
    for k, v in engine.runner.kv_caches:
        k.copy_(torch.randn(k.shape, generator=gen))
        v.copy_(torch.randn(v.shape, generator=gen))


BACKENDS = {"torch": TorchAttentionBackend, "cpu": make_cpu_backend}


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("num_prompts", [3, 5])
@pytest.mark.parametrize("spec", [None, NGRAM], ids=["decode", "ngram"])
def test_static_path_equals_eager_path(backend, num_prompts, spec):
    """The static (graph) path equals the eager one; with asynchronous decode steps on the static path (the
    GPU default: plain decode steps take their ids from the device) too."""
    ps = prompts([5, 17, 3, 9, 12][:num_prompts], seed=num_prompts)
    outs, caches = [], []
    for static in (False, True):
        engine = tiny_engine(max_num_batched_tokens=64, max_num_seqs=8, spec=spec)
        engine.async_scheduling = static
        engine.runner.backend = BACKENDS[backend]()
        random_caches(engine)
        if static:
            watch = SlotWatch(use_static_path(engine, engine.runner.backend), engine.runner.block_size)
        results = engine.generate(ps, GREEDY)
        outs.append([r.output_ids for r in results])
        caches.append([(k.clone(), v.clone()) for k, v in engine.runner.kv_caches])
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
        if spec is not None:
            assert sum(r.spec_counters.num_drafts for r in results) > 0  # verify steps happened
    assert outs[1] == outs[0]
    # The static path ran padded steps: num_prompts sequences in bucket 4 or 8 (and fewer as requests finish).
    assert any(n == num_prompts and b == {3: 4, 5: 8}[num_prompts] for n, b, _ in watch.steps)
    if spec is not None:
        assert any(q > 1 for _, _, q in watch.steps)  # verify steps went through the static path
        assert watch.device_ids == 0  # speculating requests never run asynchronously
    else:
        assert watch.device_ids > 0
    for (k0, v0), (k1, v1) in zip(*caches):
        torch.testing.assert_close(k1, k0, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(v1, v0, atol=1e-4, rtol=1e-4)


def test_aux_hidden_states_match():
    # The aux hidden states an EAGLE head reads come out of the static buffers in packed order.
    engine = tiny_engine(max_num_seqs=8)
    runner = engine.runner
    tables = [[3, 4], [9], [20, 21, 22]]
    seq_lens, query_lens = [6, 2, 11], [2, 1, 3]  # mixed query lengths: rows padded to 3 tokens
    ids = [5, 6, 7, 8, 9, 10]
    positions = [4, 5, 1, 8, 9, 10]
    ref_hidden, ref_aux = runner.forward(ids, positions, query_lens, seq_lens, tables, (0, 2))
    graphs = use_static_path(engine, runner.backend)
    hidden, aux = graphs.run(ids, positions, query_lens, seq_lens, tables, (0, 2))
    torch.testing.assert_close(hidden, ref_hidden, atol=1e-5, rtol=1e-5)
    assert len(aux) == 2
    for a, r in zip(aux, ref_aux):
        torch.testing.assert_close(a, r, atol=1e-5, rtol=1e-5)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_buckets_and_batches(data):
    """Random bucket lists, batches and query lengths: the static step's hidden states == the ragged forward's,
    and it writes exactly the real tokens' slots, with the same K/V."""
    buckets = tuple(sorted(data.draw(st.sets(st.integers(1, 12), min_size=1, max_size=4))))
    num_seqs = data.draw(st.integers(1, buckets[-1]))
    max_q = data.draw(st.integers(1, 5))
    query_lens = data.draw(st.lists(st.integers(1, max_q), min_size=num_seqs, max_size=num_seqs))
    contexts = data.draw(st.lists(st.integers(0, 30), min_size=num_seqs, max_size=num_seqs))
    block_size = 4
    seq_lens = [c + n for c, n in zip(contexts, query_lens)]
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    free = torch.randperm(64, generator=gen).tolist()
    tables = []
    for s in seq_lens:
        tables.append([free.pop() for _ in range(-(-s // block_size))])
    ids = torch.randint(0, 97, (sum(query_lens),), generator=gen).tolist()
    positions = [p for s, n in zip(seq_lens, query_lens) for p in range(s - n, s)]

    results = []
    for static in (False, True):
        engine = tiny_engine(num_blocks=64, block_size=block_size, max_num_seqs=buckets[-1], max_model_len=64)
        engine.runner.backend = TorchAttentionBackend()
        random_caches(engine, seed=7)
        runner = engine.runner
        if static:
            graphs = use_static_path(engine, runner.backend, buckets=buckets, max_query_len=5)
            assert graphs.fits(query_lens, seq_lens)
            watch = SlotWatch(graphs, block_size)
            hidden, _ = graphs.run(ids, positions, query_lens, seq_lens, tables)
            assert watch.steps[0][1] == min(b for b in buckets if b >= num_seqs)
        else:
            hidden, _ = runner.forward(ids, positions, query_lens, seq_lens, tables)
        results.append((hidden.clone(), [(k.clone(), v.clone()) for k, v in runner.kv_caches]))
    torch.testing.assert_close(results[1][0], results[0][0], atol=1e-5, rtol=1e-5)
    for (k0, v0), (k1, v1) in zip(results[0][1], results[1][1]):
        # Layer 0's K/V are bit-identical; later layers' differ by float round-off of other GEMM shapes.
        torch.testing.assert_close(k1, k0, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v1, v0, atol=1e-5, rtol=1e-5)


def test_steps_that_do_not_fit_stay_eager():
    engine = tiny_engine(max_num_seqs=8)
    graphs = use_static_path(engine, engine.runner.backend, buckets=(1, 2, 4), max_query_len=4)
    assert not graphs.fits([1] * 5, [10] * 5)  # more sequences than the largest bucket
    assert not graphs.fits([1, 5], [10, 10])  # a query longer than max_query_len (a prefill chunk)
    assert not graphs.fits([1], [engine.max_model_len + 1])  # past the tables' fixed width
    assert graphs.fits([1, 4, 2], [10, 20, 3])
