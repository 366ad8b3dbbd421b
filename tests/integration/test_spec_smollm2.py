"""Golden equivalence on the real model: SmolLM2-135M-Instruct (fp32, the production CPU path with the
quantized kernels) decodes the same greedy tokens with every drafter as without speculation, alone and
batched, with chunked prefill, and the same seeded sampled tokens with ``make serve``'s drafter; SmolLM2 drafting
for itself is always accepted; the EAGLE-3 head the repository ships (``make serve``'s default drafter) and its
P-EAGLE head are lossless and accepted far more often than a random head."""

from __future__ import annotations

import pytest
import torch

from specserve.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig
from specserve.engine.engine import LLMEngine
from specserve.models.fetch import DEFAULT_EAGLE3_HEAD, PEAGLE_HEAD
from specserve.sampling import SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = [
    "Copy this sentence exactly: The quick brown fox jumps over the lazy dog near the river bank.",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a land far away, there lived a",
    "1, 2, 3, 5, 8, 13,",
]
GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
DRAFTERS = {"ngram": None, "draft": "self", "eagle3": "dummy", "peagle": "dummy",
            "eagle3-trained": str(DEFAULT_EAGLE3_HEAD), "peagle-trained": str(PEAGLE_HEAD)}


@pytest.fixture(scope="module")
def parts(smollm2_gguf_path):
    from specserve.models.loader import load_model
    return load_model(str(smollm2_gguf_path), "float32", torch.device("cpu"), 1024)


def engine(parts, spec: SpecConfig, budget: int = 1024) -> LLMEngine:
    cfg = EngineConfig(cache=CacheConfig(block_size=16, num_blocks=128), speculative=spec,
                       scheduler=SchedulerConfig(max_model_len=1024, max_num_batched_tokens=budget))
    return LLMEngine(cfg, *parts)


@pytest.fixture(scope="module")
def prompt_ids(parts):
    return [parts[2].encode(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def plain(parts, prompt_ids):
    return [r.output_ids for r in engine(parts, SpecConfig()).generate(prompt_ids, GREEDY)]


def test_adaptive_speculation_keeps_plain_greedy_on_smollm2(parts, prompt_ids, plain) -> None:
    """`make serve`'s drafter with its adaptive policy (spec/policy.py) on the real model: the draft caps it
    picks from measured step times change how many tokens a step drafts, never the output."""
    spec = SpecConfig(method="eagle3", model=str(DEFAULT_EAGLE3_HEAD), num_spec_tokens=3, adaptive=True)
    served = engine(parts, spec, budget=48)
    assert [r.output_ids for r in served.generate(prompt_ids, GREEDY)] == plain
    assert [r.output_ids for r in served.generate(prompt_ids[::-1], GREEDY)] == plain[::-1]  # policy warm now
    tried = {arm for arms in served.spec_policy.stats.values() for arm, s in arms.items() if s.goodput}
    assert len(tried) >= 2, served.spec_policy.snapshot()


def test_seeded_sampling_under_make_serves_drafter_equals_plain_sampling_on_smollm2(parts, prompt_ids) -> None:
    """Seeded sampled requests get the tokens plain sampling draws, token for token, with `make serve`'s
    drafter and adaptive policy (the position-coupled verifier, spec/verify.py)."""
    params = [SamplingParams(max_tokens=40, temperature=0.8, top_p=0.95, seed=20 + i, ignore_eos=True)
              for i in range(len(prompt_ids))]
    want = [r.output_ids for r in engine(parts, SpecConfig()).generate(prompt_ids, params)]
    spec = SpecConfig(method="eagle3", model=str(DEFAULT_EAGLE3_HEAD), num_spec_tokens=3, adaptive=True)
    served = engine(parts, spec, budget=48)
    reqs = served.generate(prompt_ids, params)
    assert [r.output_ids for r in reqs] == want
    assert sum(r.spec_counters.num_accepted_tokens for r in reqs) > 0


@pytest.mark.parametrize("method", list(DRAFTERS))
def test_speculative_greedy_equals_plain_greedy_on_smollm2(parts, prompt_ids, plain, method: str) -> None:
    spec = SpecConfig(method=method.removesuffix("-trained"), model=DRAFTERS[method], num_spec_tokens=4)
    batched = engine(parts, spec, budget=48).generate(prompt_ids, GREEDY)  # chunked prefill too
    assert [r.output_ids for r in batched] == plain
    alone = engine(parts, spec).generate(prompt_ids[:1], GREEDY)[0]
    assert alone.output_ids == plain[0]
    if method == "ngram":
        assert batched[0].spec_counters.num_accepted_tokens > 0, "the copy prompt was meant to be accepted"
    if method == "draft":
        assert all(r.spec_counters.acceptance_rate == 1.0 for r in batched)
    if method.startswith(("eagle3", "peagle")):
        drafts = sum(r.spec_counters.num_drafts for r in batched)
        mean_al = 1 + sum(r.spec_counters.num_accepted_tokens for r in batched) / drafts
        # a random head is (almost) never accepted; the trained ones are (EAGLE-3: AL 2.9-3.6 at k = 5 on the GPU's
        # evaluation sets, P-EAGLE 1.8-2.0; their model cards in heads/)
        # (on these 4 prompts, fp32 CPU, k = 4: EAGLE-3 2.05, P-EAGLE 1.66)
        floor = {"eagle3-trained": 1.5, "peagle-trained": 1.4}.get(method)
        assert (mean_al >= floor) if floor else (mean_al < 1.2), mean_al


def test_convert_head_writes_the_peagle_head_with_the_targets_table(tmp_path, parts, capsys) -> None:
    """``specserve convert-head``: the shipped P-EAGLE head with SmolLM2's embedding table written in (the layout
    vLLM reads): every other tensor unchanged, the mask token's row the learned one, the rest the target's rows
    (bf16, as stored). An EAGLE-3 head or a directory without a head is refused with exit code 2."""
    from specserve.cli import main
    from specserve.spec.eagle_checkpoint import load_eagle_head

    assert main(["convert-head", str(PEAGLE_HEAD), str(tmp_path / "full")]) == 0
    model, config, _ = parts
    compact, full = (load_eagle_head(d, config.num_hidden_layers, config.vocab_size, 1024, torch.float32,
                                     torch.device("cpu")) for d in (PEAGLE_HEAD, tmp_path / "full"))
    assert full.config.has_embedding and full.mask_embedding is None and compact.mask_embedding is not None
    a, b = compact.state_dict(), full.state_dict()
    assert a.keys() - {"mask_embedding"} == b.keys() - {"embed_tokens.weight"}
    assert all(torch.equal(a[k], b[k]) for k in b.keys() - {"embed_tokens.weight"})
    mask_id = full.config.mask_token_id
    table = full.embed_tokens.weight
    assert torch.equal(table[mask_id], a["mask_embedding"])
    others = torch.arange(table.shape[0]) != mask_id
    assert torch.equal(table[others], model.embed_tokens.weight[others].to(torch.bfloat16).float())
    capsys.readouterr()
    for head, needle in ((DEFAULT_EAGLE3_HEAD, "mask_embedding"), (tmp_path / "none", "config.json")):
        with pytest.raises(SystemExit) as exc:
            main(["convert-head", str(head), str(tmp_path / "out")])
        assert exc.value.code == 2 and needle in capsys.readouterr().err


def test_static_draft_chain_drafts_what_the_eager_loop_drafts_on_smollm2(parts, prompt_ids, plain) -> None:
    """The shipped head's drafting as padded static forwards (``spec/draft_graphs.py``, the path CUDA graphs
    capture; eager here): the ingest and draft steps 1..4 as one forward in steady decoding, steps 2..4 alone after
    a prefill chunk. The same drafts, hence the same acceptance counts, as the eager path. The head runs in fp32
    (``head_cpu_quant="none"``): with its default Q8_0 blocks, up to ``HEAD_QUANT_MAX_ROWS`` rows take the int8
    kernel and more the fp32 path, so a padded ingest (bucket x longest queue rows) can take the other kernel
    than the unpadded one and round a near-tie differently (still lossless: the output is plain greedy's)."""
    spec = SpecConfig(method="eagle3", model=str(DEFAULT_EAGLE3_HEAD), num_spec_tokens=4, head_cpu_quant="none")
    eager = engine(parts, spec, budget=48).generate(prompt_ids, GREEDY)
    static = engine(parts, spec, budget=48)
    proposer = static.proposers["eagle3"]
    proposer.use_chain_graphs((1, 2, 4), 16, 7, 1024 + 8, capture=False)
    ingests = []
    inner = proposer.chain.run_ingest
    proposer.chain.run_ingest = lambda *a, **kw: ingests.append(tuple(a[2])) or inner(*a, **kw)
    reqs = static.generate(prompt_ids, GREEDY)
    assert [r.output_ids for r in reqs] == plain
    assert any(len(set(q)) > 1 for q in ingests), "padded ingests ran"
    counts = [(r.spec_counters.num_drafts, r.spec_counters.num_accepted_tokens) for r in reqs]
    assert counts == [(r.spec_counters.num_drafts, r.spec_counters.num_accepted_tokens) for r in eager]


# ---- int8 activations (EngineConfig.cpu_activation_quant = "q8") ---------------------------------------------------

@pytest.fixture(scope="module")
def parts_q8(smollm2_gguf_path):
    from specserve.models.loader import load_model
    parts = load_model(str(smollm2_gguf_path), "float32", torch.device("cpu"), 1024, cpu_activation_quant="q8")
    assert parts[0]._head_activation_quant == "q8"
    assert all(layer.mlp.down_proj.activation_quant == "q8" for layer in parts[0].layers)
    return parts


@pytest.fixture(scope="module")
def plain_q8(parts_q8, prompt_ids):
    return [r.output_ids for r in engine(parts_q8, SpecConfig()).generate(prompt_ids, GREEDY)]


def test_ngram_greedy_equals_plain_greedy_with_q8_activations(parts_q8, prompt_ids, plain_q8) -> None:
    """Each row's logits do not depend on the rows beside it (int8 activations take the int8 kernel at every row
    count), so verifying 1 + 4 rows, batched with other requests and with chunked prefill, gives the tokens that
    plain decoding gives."""
    spec = SpecConfig(method="ngram", num_spec_tokens=4)
    batched = engine(parts_q8, spec, budget=48).generate(prompt_ids, GREEDY)  # chunked prefill too
    assert [r.output_ids for r in batched] == plain_q8
    alone = engine(parts_q8, spec).generate(prompt_ids[:1], GREEDY)[0]
    assert alone.output_ids == plain_q8[0]
    assert batched[0].spec_counters.num_accepted_tokens > 0, "the copy prompt was meant to be accepted"


def test_q8_activations_agree_with_fp32_activations_on_next_tokens(parts_q8, prompt_ids, plain) -> None:
    """Teacher-forced top-1 agreement: for prefixes of the fp32-activation greedy outputs, the int8-activation model
    predicts the same next token almost always."""
    prefixes, want = [], []
    for ids, out in zip(prompt_ids, plain):
        for i in range(0, len(out), 2):
            prefixes.append(ids + out[:i])
            want.append(out[i])
    got = engine(parts_q8, SpecConfig()).generate(prefixes, SamplingParams(max_tokens=1, temperature=0.0))
    agreement = sum(r.output_ids[0] == w for r, w in zip(got, want)) / len(want)
    assert agreement >= 0.95, f"top-1 agreement {agreement:.3f} over {len(want)} positions"
