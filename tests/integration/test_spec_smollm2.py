"""Golden equivalence on the real model: SmolLM2-135M-Instruct (fp32, the production CPU path with the
quantized kernels) decodes the same greedy tokens with every drafter as without speculation, alone and
batched, with chunked prefill; SmolLM2 drafting for itself is always accepted."""

from __future__ import annotations

import pytest
import torch

from specserve.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig
from specserve.engine.engine import LLMEngine
from specserve.sampling import SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = [
    "Copy this sentence exactly: The quick brown fox jumps over the lazy dog near the river bank.",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a land far away, there lived a",
    "1, 2, 3, 5, 8, 13,",
]
GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
DRAFTERS = {"ngram": None, "draft": "self", "eagle3": "dummy", "peagle": "dummy"}


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


@pytest.mark.parametrize("method", list(DRAFTERS))
def test_speculative_greedy_equals_plain_greedy_on_smollm2(parts, prompt_ids, plain, method: str) -> None:
    spec = SpecConfig(method=method, model=DRAFTERS[method], num_spec_tokens=4)
    batched = engine(parts, spec, budget=48).generate(prompt_ids, GREEDY)  # chunked prefill too
    assert [r.output_ids for r in batched] == plain
    alone = engine(parts, spec).generate(prompt_ids[:1], GREEDY)[0]
    assert alone.output_ids == plain[0]
    if method == "ngram":
        assert batched[0].spec_counters.num_accepted_tokens > 0, "the copy prompt was meant to be accepted"
    if method == "draft":
        assert all(r.spec_counters.acceptance_rate == 1.0 for r in batched)
