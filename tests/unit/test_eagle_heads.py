"""EAGLE-3 and P-EAGLE heads: both checkpoint dialects load (speculators round trip, SpecForge/EAGLE flat
config with ``midlayer.*`` weights), bad configs are refused by field, and the engine's incremental drafting
(cached head KV, queued target features, truncation after each round) drafts exactly what a from-scratch
reference computation over the whole sequence drafts."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from specserve.config import SpecConfig
from specserve.layers.attention import TorchAttentionBackend, build_attention_metadata
from specserve.sampling import SamplingParams
from specserve.spec.draft_graphs import INGEST_MAX_ENTRIES
from specserve.spec.eagle3 import Eagle3Proposer
from specserve.spec.eagle_checkpoint import (
    dummy_head,
    head_config_from_json,
    load_eagle_head,
    save_speculators,
    with_embedding_table,
)
from specserve.spec.eagle_head import HEAD_QUANT_MAX_ROWS
from specserve.spec.peagle import PEagleProposer
from tests.tiny import prompts, tiny_config, tiny_engine

CPU = torch.device("cpu")
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


def make_head(parallel: bool = False, **overrides):
    return dummy_head(tiny_config(), parallel, seed=3, max_position=512, dtype=torch.float32, device=CPU,
                      **overrides)


def load(path, config=None):
    c = config or tiny_config()
    return load_eagle_head(path, c.num_hidden_layers, c.vocab_size, 512, torch.float32, CPU)


def assert_same_head(a, b) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name
    for field in ("draft_vocab_size", "aux_layer_ids", "norm_before_residual", "parallel", "mask_token_id",
                  "has_embedding", "target_hidden_size"):
        assert getattr(a.config, field) == getattr(b.config, field), field


@pytest.mark.parametrize("variant", [{}, {"norm_before_residual": True, "has_embedding": True},
                                     {"fc_norm": True, "num_layers": 2}, {"parallel": True}])
def test_speculators_checkpoint_round_trip(tmp_path, variant) -> None:
    head = make_head(**variant)
    save_speculators(head, tmp_path, verifier="tiny")
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["speculators_model_type"] == ("peagle" if variant.get("parallel") else "eagle3")
    assert cfg["eagle_aux_hidden_state_layer_ids"] == list(head.config.aux_layer_ids)
    weights = load_file(str(tmp_path / "model.safetensors"))
    assert weights["d2t"].dtype == torch.int64 and int(weights["t2d"].sum()) == head.config.draft_vocab_size
    assert "layers.0.self_attn.q_proj.weight" in weights and "layers.0.hidden_norm.weight" in weights
    assert_same_head(head, load(tmp_path))


def test_speculators_round_trip_gives_the_same_drafts(tmp_path) -> None:
    head = make_head()
    save_speculators(head, tmp_path)
    runs = []
    for h in (head, load(tmp_path)):
        engine = tiny_engine()
        proposer = Eagle3Proposer(h, engine.runner.model, 256, 4, CPU)
        engine = tiny_engine(proposers={"eagle3": proposer}, spec=SpecConfig(method="eagle3", model="given",
                                                                            num_spec_tokens=3))
        proposer.head.target_embed = engine.runner.model.embed_tokens
        drafts = record_drafts(proposer)
        engine.generate(prompts([5, 17, 9]), GREEDY)
        runs.append([d for _, _, d in drafts])
    assert runs[0] == runs[1] and len(runs[0]) > 10


def test_peagle_mask_embedding_forms(tmp_path) -> None:
    """A P-EAGLE head on the target's table stores only its mask token's learned row (``mask_embedding``), never a
    copy of the table; it embeds exactly as a head with its own table holding that row; a checkpoint with neither
    (a head that shares the target's table outright) loads and embeds the mask token with the target's row."""
    engine = tiny_engine()
    table = engine.runner.model.embed_tokens
    head = make_head(parallel=True)
    head.target_embed = table
    save_speculators(head, tmp_path / "compact")
    weights = load_file(str(tmp_path / "compact" / "model.safetensors"))
    assert "embed_tokens.weight" not in weights and weights["mask_embedding"].shape == (tiny_config().hidden_size,)
    mask_id = head.config.mask_token_id
    ids = torch.tensor([3, mask_id, 5, mask_id])
    with torch.inference_mode():
        got = head.embed(ids)
    assert torch.equal(got[[0, 2]], table(ids[[0, 2]])) and torch.equal(got[1], head.mask_embedding)
    full = make_head(parallel=True, has_embedding=True, mask_embedding=False)
    with torch.no_grad():
        full.embed_tokens.weight.copy_(table.weight)
        full.embed_tokens.weight[mask_id] = head.mask_embedding
    with torch.inference_mode():
        assert torch.equal(full.embed(ids), got)
    del weights["mask_embedding"]
    (tmp_path / "shared").mkdir()
    save_file(weights, str(tmp_path / "shared" / "model.safetensors"))
    (tmp_path / "shared" / "config.json").write_text((tmp_path / "compact" / "config.json").read_text())
    shared = load(tmp_path / "shared")
    assert shared.mask_embedding is None and shared.config.parallel
    shared.target_embed = table
    with torch.inference_mode():
        assert torch.equal(shared.embed(ids), table(ids))
    with pytest.raises(ValueError, match="mask_embedding"):
        make_head(parallel=False, mask_embedding=True)
    # a mask_embedding row in a head that would never read it (an EAGLE-3 head; a P-EAGLE head with its own
    # table) is refused by name rather than dropped
    eagle = make_head()
    save_speculators(eagle, tmp_path / "eagle")
    eagle_weights = load_file(str(tmp_path / "eagle" / "model.safetensors"))
    row = {"mask_embedding": torch.zeros(tiny_config().hidden_size)}
    save_file(eagle_weights | row, str(tmp_path / "eagle" / "model.safetensors"))
    with pytest.raises(ValueError, match="EAGLE-3 head but carries mask_embedding"):
        load(tmp_path / "eagle")
    save_speculators(full, tmp_path / "own")
    own = load_file(str(tmp_path / "own" / "model.safetensors"))
    save_file(own | row, str(tmp_path / "own" / "model.safetensors"))
    with pytest.raises(ValueError, match="own embedding table but carries mask_embedding"):
        load(tmp_path / "own")


def test_peagle_head_with_the_targets_table_written_in_drafts_the_same(tmp_path) -> None:
    """``with_embedding_table`` (``specserve convert-head``): a P-EAGLE head's learned mask row moves into a full
    embedding table (the target's rows), the layout vLLM reads; saved and loaded, it proposes exactly the drafts
    the compact head proposes in the engine. An EAGLE-3 head, or a table of another shape, is refused."""
    runs = []
    for form in ("compact", "table"):
        engine = tiny_engine()
        table = engine.runner.model.embed_tokens.weight
        head = make_head(parallel=True)
        head.mask_embedding.data.normal_(generator=torch.Generator().manual_seed(9))  # unlike the target's row
        if form == "table":
            learned = head.mask_embedding.detach().clone()
            head = with_embedding_table(head, table)
            assert head.config.has_embedding and head.mask_embedding is None
            mask_id = head.config.mask_token_id
            assert torch.equal(head.embed_tokens.weight[mask_id], learned)
            others = torch.arange(table.shape[0]) != mask_id
            assert torch.equal(head.embed_tokens.weight[others], table[others])
        save_speculators(head, tmp_path / form)
        weights = load_file(str(tmp_path / form / "model.safetensors"))
        assert ("embed_tokens.weight" in weights) == (form == "table") and ("mask_embedding" in weights) == (
            form == "compact")
        loaded = load(tmp_path / form)
        proposer = PEagleProposer(loaded, engine.runner.model, 256, 4, CPU)
        engine = tiny_engine(proposers={"peagle": proposer}, spec=SpecConfig(method="peagle", model="given",
                                                                             num_spec_tokens=3))
        drafts = record_drafts(proposer)
        engine.generate(prompts([5, 17, 9]), GREEDY)
        runs.append([d for _, _, d in drafts])
    assert runs[0] == runs[1] and len(runs[0]) > 10
    with pytest.raises(ValueError, match="convert-head"):
        with_embedding_table(make_head(), table)
    with pytest.raises(ValueError, match="convert-head.*embedding table"):
        with_embedding_table(make_head(parallel=True), table[:-1])


def test_specforge_flat_checkpoint_loads(tmp_path) -> None:
    head = make_head(has_embedding=True, aux_layer_ids=(1, 2))  # layer ids >= 1: SpecForge counts outputs
    save_speculators(head, tmp_path / "spec")
    state = load_file(str(tmp_path / "spec" / "model.safetensors"))
    flat = {("model." if i % 2 else "") + k.replace("layers.0.", "midlayer."): v
            for i, (k, v) in enumerate(state.items())}
    (tmp_path / "flat").mkdir()
    save_file(flat, str(tmp_path / "flat" / "model.safetensors"))
    c = tiny_config()
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": c.hidden_size,
           "intermediate_size": c.intermediate_size, "num_hidden_layers": 1,
           "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
           "rms_norm_eps": c.rms_norm_eps, "vocab_size": c.vocab_size, "draft_vocab_size": head.config.draft_vocab_size,
           "max_position_embeddings": c.max_position_embeddings, "rope_theta": c.rope_theta,
           # SpecForge names the layer whose *output* is captured: one less than the layer input we store.
           "eagle_config": {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in head.config.aux_layer_ids]}}
    (tmp_path / "flat" / "config.json").write_text(json.dumps(cfg))
    assert_same_head(head, load(tmp_path / "flat"))


def test_head_config_defaults_and_errors() -> None:
    base = {"speculators_model_type": "eagle3", "transformer_layer_config": {"num_hidden_layers": 1,
                                                                             "vocab_size": 1000, "hidden_size": 64,
                                                                             "num_attention_heads": 4}}
    c = head_config_from_json(base, num_target_layers=32, target_vocab_size=1000)
    assert c.aux_layer_ids == (2, 16, 29)  # the EAGLE-3 default for a 32-layer target
    assert c.layer.intermediate_size == 11008 and c.layer.num_key_value_heads == 4  # Llama class defaults
    assert c.draft_vocab_size == 1000 and not c.norm_before_residual and not c.parallel
    with pytest.raises(ValueError, match="vocab_size"):
        head_config_from_json(base, 32, 999)
    with pytest.raises(ValueError, match="eagle_aux_hidden_state_layer_ids"):
        head_config_from_json({**base, "eagle_aux_hidden_state_layer_ids": [1, 40, 2]}, 32, 1000)
    with pytest.raises(ValueError, match="speculators_model_type"):
        head_config_from_json({**base, "speculators_model_type": "medusa"}, 32, 1000)
    with pytest.raises(ValueError, match="mask_token_id"):
        head_config_from_json({**base, "speculators_model_type": "peagle"}, 32, 1000)
    with pytest.raises(ValueError, match="architectures"):
        head_config_from_json({"architectures": ["LlamaForCausalLM"]}, 32, 1000)


def test_missing_weight_is_named(tmp_path) -> None:
    head = make_head()
    save_speculators(head, tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    del state["fc.weight"]
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="fc.weight"):
        load(tmp_path)


# ---- incremental drafting == from-scratch reference ---------------------------------------------------------
def record_drafts(proposer):
    """Wrap ``proposer.propose`` to record (tokens at drafting time, num_spec_tokens, draft) per request."""
    seen = []
    inner = proposer.propose

    def propose(requests, counts):
        drafts = inner(requests, counts)
        seen.extend((r.prompt_ids + r.output_ids, k, d.token_ids) for r, k, d in zip(requests, counts, drafts))
        return drafts
    proposer.propose = propose
    return seen


def fresh_forward(module_call, num_layers: int, num_kv_heads: int, head_dim: int, n: int):
    """Run a model or head over n positions from scratch with a throwaway cache."""
    blocks = -(-n // 4)
    caches = [(torch.zeros(blocks, 4, num_kv_heads, head_dim), torch.zeros(blocks, 4, num_kv_heads, head_dim))
              for _ in range(num_layers)]
    meta = build_attention_metadata([n], [n], [list(range(blocks))], 4, CPU)
    backend = TorchAttentionBackend()
    backend.prepare(meta, 4)
    with torch.inference_mode():
        return module_call(caches, meta, backend)


def reference_drafts(target, head, tokens: list[int], k: int) -> list[int]:
    n = len(tokens) - 1  # target positions with verified features
    tc = target.config
    _, aux = fresh_forward(lambda c, m, b: target(torch.tensor(tokens[:n]), torch.arange(n), c, m, b,
                                                  head.config.aux_layer_ids),
                           tc.num_hidden_layers, tc.num_key_value_heads, tc.head_dim, n)
    by_layer = dict(zip(sorted(head.config.aux_layer_ids), aux))
    with torch.inference_mode():
        hidden = head.fuse(torch.cat([by_layer[i] for i in head.config.aux_layer_ids], dim=-1))
    ids = list(tokens[1:])
    hc = head.config.layer

    def run(ids, hidden):
        m = len(ids)
        return fresh_forward(lambda c, meta, b: head(torch.tensor(ids), hidden, torch.arange(m), c, meta, b),
                             len(head.layers), hc.num_key_value_heads, hc.head_dim, m)
    if head.config.parallel:
        with torch.inference_mode():
            mask = head.fuse(head.mask_hidden[None, :]).expand(k - 1, -1)
        normed, _ = run(ids + [head.config.mask_token_id] * (k - 1), torch.cat([hidden, mask]))
        with torch.inference_mode():
            return head.draft_token_ids(normed[n - 1:]).tolist()
    drafts = []
    for _ in range(k):
        normed, fed = run(ids, hidden)
        with torch.inference_mode():
            d = int(head.draft_token_ids(normed[-1:])[0])
        drafts.append(d)
        ids = ids + [d]
        hidden = torch.cat([hidden, fed[-1:]])
    return drafts


@pytest.mark.parametrize("parallel", [False, True])
@pytest.mark.parametrize("budget", [512, 7])
def test_incremental_drafts_equal_the_from_scratch_reference(parallel: bool, budget: int) -> None:
    method = "peagle" if parallel else "eagle3"
    # float32 head weights and activations: the reference runs the whole sequence at once, the engine a few rows a
    # step, and a CPU head's default int8 activations (head_cpu_quant) round differently by row count
    engine = tiny_engine(spec=SpecConfig(method=method, model="dummy", num_spec_tokens=4, head_cpu_quant="none"),
                         max_num_batched_tokens=budget)
    proposer = engine.proposers[method]
    assert isinstance(proposer, PEagleProposer if parallel else Eagle3Proposer)
    drafts = record_drafts(proposer)
    engine.generate(prompts([5, 17, 3, 40]), GREEDY)
    assert len(drafts) > 20
    for tokens, k, draft in drafts:
        assert draft == reference_drafts(engine.runner.model, proposer.head, tokens, k)


# ---- static chains of draft steps (spec/draft_graphs.py, the path CUDA graphs capture) ------------------------
@pytest.mark.parametrize("buckets, budget", [((1, 2, 4), 512), ((1, 2, 4), 7), ((1, 2), 512)])
def test_static_draft_chain_equals_the_from_scratch_reference(buckets, budget: int) -> None:
    """Draft steps 2..k run as one padded static forward (eagerly here: ``capture=False``) draft exactly what the
    from-scratch reference does, with chunked prefill, requests asking for different k (each gets its own
    count; the chain runs the longest), batches padded to a bucket, and batches larger than the largest bucket
    (buckets (1, 2), four requests) falling back to the eager loop. In steady decoding the ingest runs in the
    same static forward (``run_ingest``); right after a prefill chunk (a long queue) the ingest is eager and the
    chain alone is static."""
    from specserve.spec.params import SpecParams

    engine = tiny_engine(spec=SpecConfig(method="eagle3", model="dummy", num_spec_tokens=4),
                         max_num_batched_tokens=budget, block_size=4)
    proposer = engine.proposers["eagle3"]
    proposer.use_chain_graphs(buckets, max_num_seqs=64, max_steps=7, max_positions=600, capture=False)
    runs, ingests = [], []
    inner, inner_ingest = proposer.chain.run, proposer.chain.run_ingest
    proposer.chain.run = lambda *a: runs.append(len(a[0])) or inner(*a)
    proposer.chain.run_ingest = lambda *a, **kw: ingests.append(tuple(a[2])) or inner_ingest(*a, **kw)
    drafts = record_drafts(proposer)
    ks = [SpecParams("eagle3", k) for k in (4, 2, 7, 1)]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (8, 12, 30, 30)]
    reqs = engine.generate(prompts([5, 17, 3, 40]), params, ks)
    assert len(drafts) > 20 and ingests, "the static ingest ran"
    if budget > INGEST_MAX_ENTRIES:  # whole prompts of 17 and 40 tokens queue more than an ingest graph takes
        assert runs, "after an eager ingest the static chain ran"
    else:  # prompt chunks of 7 fit an ingest graph: requests taking in a chunk share it with those drafting
        assert not runs and any(max(q) > 1 and min(q) == 1 for q in ingests if len(q) > 1)
    if buckets == (1, 2):  # four (or three) requests at once do not fit; the last two do
        assert max(runs) <= 2 and max(map(len, ingests)) <= 2
    for tokens, k, draft in drafts:
        assert len(draft) == k
        assert draft == reference_drafts(engine.runner.model, proposer.head, tokens, k)
    plain = tiny_engine(max_num_batched_tokens=budget).generate(prompts([5, 17, 3, 40]), params)
    assert [r.output_ids for r in reqs] == [r.output_ids for r in plain]


@pytest.mark.parametrize("async_steps", [False, True])
@pytest.mark.parametrize("buckets", [(1, 2, 4), (1, 2, 4, 8, 16)])
def test_catch_up_after_cap_zero_steps_runs_in_the_catch_up_graph(async_steps: bool, buckets) -> None:
    """At the adaptive policy's cap 0 the drafters skip ``lazy_steps`` steps, then catch up on every entry queued
    meanwhile in one static ingest that drafts nothing and reads nothing back (``run_catch_up``): in a synchronous
    step the queue of lazy_steps + 1 entries, with overlapped steps the entries whose next tokens are committed,
    behind the step in flight (``Eagle3Proposer.catch_up``). Three requests fill the largest bucket of (1, 2, 4):
    one pass of INGEST_MAX_ENTRIES, 15 steps skipped; with buckets up to 16 the buffers hold four passes at
    bucket 4: 63 steps skipped, catch-ups of more than 16 entries in one graph, and when drafting resumes the
    long queue is caught up there too but for each request's last entry. Never an eager ingest; the drafts are
    exactly the from-scratch reference's, and the output is plain greedy's."""
    from tests.unit.test_spec_engine import assert_clean
    from tests.unit.test_spec_policy import Alternating

    engine = tiny_engine(spec=SpecConfig(method="eagle3", model="dummy", num_spec_tokens=3, adaptive=True,
                                         head_cpu_quant="none"), block_size=4)
    engine.async_scheduling = async_steps
    proposer = engine.proposers["eagle3"]
    proposer.use_chain_graphs(buckets, max_num_seqs=64, max_steps=3, max_positions=600, capture=False)
    limit = proposer.lazy_steps(3)
    assert limit == (INGEST_MAX_ENTRIES - 1 if buckets[-1] == 4 else 4 * INGEST_MAX_ENTRIES - 1)
    engine.set_spec_policy(Alternating(2 * limit + 4))
    catch_ups, eager = [], []
    inner, inner_eager = proposer.chain.run_catch_up, proposer.kv.metadata
    proposer.chain.run_catch_up = lambda *a: catch_ups.append(tuple(a[2])) or inner(*a)
    proposer.kv.metadata = lambda rids, lens: eager.append(max(lens)) or inner_eager(rids, lens)  # eager ingests
    drafts = record_drafts(proposer)
    params = SamplingParams(max_tokens=3 * limit + 40, temperature=0.0, ignore_eos=True)
    ps = prompts([5, 9, 3])
    reqs = engine.generate(ps, params)
    assert catch_ups and max(map(max, catch_ups)) <= limit + 1
    if buckets[-1] == 16:
        assert max(map(max, catch_ups)) > INGEST_MAX_ENTRIES
    assert not [n for n in eager if n > 9], f"eager ingests of decode queues: {eager}"  # 9: the longest prompt
    assert len(drafts) > 20
    for tokens, k, draft in drafts:
        assert draft == reference_drafts(engine.runner.model, proposer.head, tokens, k)
    plain = tiny_engine(block_size=4).generate(ps, params)
    assert [r.output_ids for r in reqs] == [r.output_ids for r in plain]
    assert_clean(engine)


def test_ingest_staging_matches_the_worked_examples() -> None:
    """``_stage_ingest`` lays out the docstring's worked examples (block_size 4): one pass of q 2 with a chain step,
    and a catch-up of two passes of q 2 (its second pass sees the first pass's keys: seq_len 13), next to a padding
    request; the block tables land in ``block_tables``."""
    engine = tiny_engine(spec=SpecConfig(method="eagle3", model="dummy", num_spec_tokens=3), block_size=4)
    proposer = engine.proposers["eagle3"]
    proposer.use_chain_graphs((1, 2, 4), max_num_seqs=64, max_steps=3, max_positions=600, capture=False)
    chain = proposer.chain
    with torch.inference_mode():
        assert chain._stage_ingest([7], [1], [9], [[3, 6, 8]], 1, 2, 1) == 1
    ids, pos, slots, lens, last, cpos, cslots, clens, index = chain._ingest_views(1, 2, 1)
    assert (ids.tolist(), pos.tolist(), slots.tolist(), lens.tolist(), last.tolist()) == \
        ([7, 0], [9, 10], [8 * 4 + 1, -1], [[11]], [0])
    assert (cpos.tolist(), cslots.tolist(), clens.tolist(), index[:1].tolist()) == ([[10]], [[8 * 4 + 2]], [[11]], [0])
    assert chain.block_tables[0, :3].tolist() == [3, 6, 8]
    with torch.inference_mode():
        assert chain._stage_ingest([7, 8, 9], [3], [9], [[3, 6, 8, 9]], 2, 2, 0, chunks=2) == 3
    ids, pos, slots, lens, last, _, _, _, index = chain._ingest_views(2, 2, 0, chunks=2)
    # rows: pass 0 [r0 e0, r0 e1, pad request x2], pass 1 [r0 e2, r0 padding, pad request x2]
    assert ids.tolist() == [7, 8, 0, 0, 9, 0, 0, 0]
    assert pos.tolist() == [9, 10, 0, 1, 11, 12, 2, 3]
    assert slots.tolist() == [33, 34, -1, -1, 35, -1, -1, -1]
    assert lens.tolist() == [[11, 2], [13, 4]]
    assert last.tolist() == [4, 2] and index[:3].tolist() == [0, 1, 4]
    assert chain.block_tables[:2, :4].tolist() == [[3, 6, 8, 9], [0, 0, 0, 0]]


def test_chain_runner_builds_every_ingest_shape_ahead() -> None:
    """``build`` makes the ingest forwards of every padded queue length (1, 2, 4, 8, 16) for the buckets holding
    the given batch sizes and chain lengths (0: ingest only, with the catch-up forwards of 2..4 passes where the
    buffers hold them: bucket 1 of a largest bucket 4, not bucket 4), and the chain-only forwards of lengths >= 1;
    a run then finds its shape built."""
    engine = tiny_engine(spec=SpecConfig(method="eagle3", model="dummy", num_spec_tokens=3), block_size=4)
    proposer = engine.proposers["eagle3"]
    proposer.use_chain_graphs((1, 2, 4), max_num_seqs=64, max_steps=3, max_positions=600, capture=False)
    chain = proposer.chain
    chain.build([1, 3], [0, 2])
    qs = (1, 2, 4, 8, INGEST_MAX_ENTRIES)
    assert set(chain.forwards) == ({(b, q, n) for b in (1, 4) for q in qs for n in (0, 2)} | {(1, 2), (4, 2)}
                                   | {(1, INGEST_MAX_ENTRIES, 0, c) for c in (2, 3, 4)})


def test_static_ingest_pads_queues_of_different_lengths_like_the_eager_ingest() -> None:
    """``run_ingest`` with queues of different lengths in one batch (padded to the longest: padding entries write no
    KV and the real ones keep their positions) drafts exactly what the eager ingest + loop drafts, round after
    round on the same head caches, for requests asking for different k, and leaves the head caches the same.
    Features are random (the proposer takes them as given); fp32 on CPU, so both paths compute the same sums."""
    from specserve.engine.request import Request
    from specserve.spec.proposer import VerifiedChunk

    target = tiny_engine().runner.model
    head = make_head()
    eager = Eagle3Proposer(head, target, 64, 4, CPU)
    static = Eagle3Proposer(head, target, 64, 4, CPU)
    static.use_chain_graphs((1, 2, 4), max_num_seqs=64, max_steps=7, max_positions=600, capture=False)
    ingests = []
    inner = static.chain.run_ingest
    static.chain.run_ingest = lambda *a, **kw: ingests.append(tuple(a[2])) or inner(*a, **kw)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(1, tiny_config().vocab_size, (3, 40), generator=gen).tolist()
    reqs = {name: [Request(f"r{i}", list(tokens[i][:n]), GREEDY) for i, n in enumerate((7, 3, 2))]
            for name in ("eager", "static")}
    # per round: entries each request verified (its queue), then the drafts asked for
    rounds = [((6, 2, 1), (3, 2, 5)), ((1, 3, 1), (4, 4, 4)), ((4, 1, 2), (1, 3, 2)), ((2, 2, 2), (7, 1, 2))]
    width = head.config.fc_in_features
    for queued, counts in rounds:
        feats = torch.randn(sum(queued), width, generator=gen)
        drafts = {}
        for name, proposer in (("eager", eager), ("static", static)):
            chunks, at = [], 0
            for r, n in zip(reqs[name], queued):
                start = proposer.kv.computed(r.request_id)  # entries start .. start + n - 1 pair with tokens
                r.output_ids.extend(tokens[int(r.request_id[1:])][r.num_tokens:start + n + 1])  # .. up to start + n
                chunks.append(VerifiedChunk(r, start, at, n))
                at += n
            proposer.observe(chunks, feats)
            drafts[name] = [d.token_ids for d in proposer.propose(reqs[name], list(counts))]
            assert [proposer.kv.computed(r.request_id) for r in reqs[name]] == [r.num_tokens - 1 for r in reqs[name]]
        assert drafts["static"] == drafts["eager"]
        assert [len(d) for d in drafts["static"]] == list(counts)
    assert ingests == [q for q, _ in rounds]  # three padded batches, then one whose queues need no padding


def test_static_draft_chain_leaves_the_head_cache_as_the_eager_loop_does() -> None:
    """After every round the head cache holds exactly the verified positions (the chain's reserved positions are
    rolled back), and finished requests free all of their blocks."""
    engine = tiny_engine(spec=SpecConfig(method="eagle3", model="dummy", num_spec_tokens=5), block_size=4)
    proposer = engine.proposers["eagle3"]
    proposer.use_chain_graphs((1, 2, 4), max_num_seqs=64, max_steps=7, max_positions=600, capture=False)
    kv = proposer.kv
    free_before = kv.blocks.num_free_blocks
    inner = proposer.propose

    def propose(requests, counts):
        drafts = inner(requests, counts)
        for r in requests:
            assert kv.computed(r.request_id) <= r.num_tokens - 1
        return drafts
    proposer.propose = propose
    engine.generate(prompts([9, 30]), GREEDY)
    assert not kv.num_computed and kv.blocks.num_free_blocks == free_before


def test_draft_graphs_follow_the_target_graphs_and_share_their_pool(monkeypatch) -> None:
    """``cuda_graphs.draft_steps`` turns the chain on only where the target's steps are captured (so never on
    CPU), and the chain captures into the target graphs' memory pool."""
    from types import SimpleNamespace

    from specserve.config import CudaGraphConfig

    engine = tiny_engine(spec=SpecConfig(method="eagle3", model="dummy", num_spec_tokens=4))
    proposer = engine.proposers["eagle3"]
    assert engine.runner.graphs is None and proposer.chain is None  # CPU: nothing captured
    calls = []
    monkeypatch.setattr(proposer, "use_chain_graphs", lambda *a, **kw: calls.append((a, kw)))
    monkeypatch.setattr(proposer.kv.backend, "capturable", True, raising=False)
    pool = object()
    engine.runner.graphs = SimpleNamespace(capture=True, pool=pool)
    for draft_steps in (False, True):
        engine.config.cuda_graphs = CudaGraphConfig(draft_steps=draft_steps)
        engine._setup_draft_graphs(engine.config, engine.runner.model)
    assert len(calls) == 1 and calls[0][1] == {"capture": True, "pool": pool}


# ---- the head on CPU from 8-bit blocks (SpecConfig.head_cpu_quant) ---------------------------------------------

@pytest.mark.parametrize("method", ["eagle3", "peagle"])
def test_cpu_head_runs_from_q8_0_blocks_of_its_own_weights(method: str) -> None:
    """By default a CPU head's projections hold Q8_0 blocks whose dequantized values are the layer's weight (so the
    block kernel and the fp32 path of larger row counts compute one function), the engine's greedy output is the
    plain one, and "none" leaves the float weights alone."""
    from specserve.layers.linear import Linear
    from specserve.layers.quant_cpu import load_extension
    assert load_extension() is not None
    want = [r.output_ids for r in tiny_engine().generate(prompts([5, 17, 3]), GREEDY)]
    heads = {}
    for quant in ("q8_0", "none"):
        engine = tiny_engine(spec=SpecConfig(method=method, model="dummy", num_spec_tokens=3, head_cpu_quant=quant))
        assert [r.output_ids for r in engine.generate(prompts([5, 17, 3]), GREEDY)] == want
        heads[quant] = engine.proposers[method].head
    linears = {n: m for n, m in heads["q8_0"].named_modules() if isinstance(m, Linear)}
    assert {"fc", "lm_head", "layers.0.self_attn.qkv_proj", "layers.0.mlp.down_proj"} <= set(linears)
    for name, module in linears.items():
        assert module.quant is not None and module.quant.qtype == "q8_0", name
        assert (module.activation_quant, module.quant_max_rows) == ("q8", HEAD_QUANT_MAX_ROWS), name
        assert torch.equal(module.weight, module.quant.dequantize()), name
        fp32 = heads["none"].get_submodule(name)
        assert fp32.quant is None and not torch.equal(fp32.weight, module.weight), name  # same seed, rounded
        blocks = fp32.weight.reshape(fp32.weight.shape[0], -1, 32)  # [out, groups, 32]
        step = blocks.abs().amax(-1, keepdim=True) / 127  # half a step, plus the f16 rounding of the step
        err = (module.weight.reshape(blocks.shape) - blocks).abs()
        assert bool((err <= 0.5 * step * (1 + 127 * 2**-10)).all()), name


def test_head_cpu_quant_is_validated() -> None:
    with pytest.raises(ValueError, match="head_cpu_quant"):
        SpecConfig(method="eagle3", model="dummy", head_cpu_quant="q4_k")
