"""Golden equivalence: our engine's greedy output on SmolLM2-135M-Instruct (fp32) equals Hugging Face
transformers' greedy output token for token, alone and batched with prompts of other lengths, with
chunked prefill and with forced preemption."""

from __future__ import annotations

import pytest
import torch

from specserve.config import CacheConfig, EngineConfig, SchedulerConfig
from specserve.engine.engine import LLMEngine
from specserve.sampling import SamplingParams

pytestmark = pytest.mark.slow

NEW_TOKENS = 24
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a land far away, there lived a",
    "Translate to German: The weather is nice today and we are going for a long walk in the park.",
    "1, 2, 3, 5, 8, 13,",
]


@pytest.fixture(scope="module")
def hf_reference(smollm2_gguf_path):
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        smollm2_gguf_path.parent, gguf_file=smollm2_gguf_path.name, dtype=torch.float32).eval()
    return model


@pytest.fixture(scope="module")
def engine_parts(smollm2_gguf_path):
    """The production CPU path: GGUF Q4_1 / Q8_0 blocks through the quantized kernel for small batches."""
    from specserve.models.loader import load_model
    return load_model(str(smollm2_gguf_path), "float32", torch.device("cpu"), 1024)


@pytest.fixture(scope="module")
def fp32_engine_parts(smollm2_gguf_path):
    """Dequantized fp32 weights only (oneDNN-packed GEMMs)."""
    from specserve.models.loader import load_model
    return load_model(str(smollm2_gguf_path), "float32", torch.device("cpu"), 1024, quantized_cpu_kernels=False)


def make_engine(parts, **sched) -> LLMEngine:
    model, config, tokenizer = parts
    num_blocks = sched.pop("num_blocks", 256)
    cfg = EngineConfig(cache=CacheConfig(block_size=16, num_blocks=num_blocks),
                       scheduler=SchedulerConfig(max_model_len=1024, **sched))
    return LLMEngine(cfg, model, config, tokenizer)


@pytest.fixture(scope="module")
def expected(hf_reference, engine_parts):
    tokenizer = engine_parts[2]
    prompt_ids = [tokenizer.encode(p) for p in PROMPTS]
    outs = []
    with torch.no_grad():
        for ids in prompt_ids:
            gen = hf_reference.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                        min_new_tokens=NEW_TOKENS)
            outs.append(gen[0, len(ids):].tolist())
    return prompt_ids, outs


GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


def test_alone_equals_transformers(engine_parts, expected) -> None:
    prompt_ids, want = expected
    engine = make_engine(engine_parts)
    for ids, w in zip(prompt_ids, want):
        assert engine.generate([ids], GREEDY)[0].output_ids == w


def test_batched_with_other_lengths_equals_transformers(engine_parts, expected) -> None:
    prompt_ids, want = expected
    engine = make_engine(engine_parts)
    reqs = engine.generate(prompt_ids, GREEDY)
    assert [r.output_ids for r in reqs] == want


def test_fp32_weights_equal_transformers(fp32_engine_parts, expected) -> None:
    prompt_ids, want = expected
    engine = make_engine(fp32_engine_parts)
    assert [r.output_ids for r in engine.generate(prompt_ids, GREEDY)] == want


def test_quantized_kernel_is_in_use(engine_parts) -> None:
    from specserve.layers.quant_cpu import load_extension
    model = engine_parts[0]
    assert load_extension() is not None, "the CPU kernel failed to build"
    assert all(layer.mlp.gate_up_proj.quant is not None for layer in model.layers)
    assert model._quant_head is not None


def test_chunked_prefill_and_preemption_equal_transformers(engine_parts, expected) -> None:
    prompt_ids, want = expected
    engine = make_engine(engine_parts, max_num_batched_tokens=7, num_blocks=8)
    reqs = engine.generate(prompt_ids, GREEDY)
    assert sum(r.num_preemptions for r in reqs) > 0
    assert [r.output_ids for r in reqs] == want
    assert engine.block_manager.num_free_blocks == 8


def test_text_matches_tokenizer_decode(engine_parts, expected) -> None:
    prompt_ids, want = expected
    engine = make_engine(engine_parts)
    reqs = engine.generate(prompt_ids, GREEDY)
    tokenizer = engine_parts[2]
    assert [r.output_text for r in reqs] == [tokenizer.decode(w) for w in want]
