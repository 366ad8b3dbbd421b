"""One config tree for the engine: model shape, KV cache, scheduler, engine.

Every dataclass validates itself in ``__post_init__`` so that a bad value fails at construction with a
message that names the field, never deep inside a forward pass.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


def _require(cond: bool, name: str, msg: str) -> None:
    if not cond:
        raise ValueError(f"{name}: {msg}")


@dataclass
class ModelConfig:
    """Shape and numerics of a decoder-only transformer (Llama, Qwen2, Qwen3 families)."""

    architecture: str  # "llama" | "qwen2" | "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int | None = None
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: bias on q, k, v projections
    qk_norm: bool = False  # Qwen3: RMSNorm on each head of q and k
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    name: str = "model"

    def __post_init__(self) -> None:
        _require(self.architecture in ("llama", "qwen2", "qwen3"), "architecture",
                 f"unsupported architecture {self.architecture!r}")
        for f in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "num_key_value_heads"):
            _require(int(getattr(self, f)) > 0, f, "must be positive")
        _require(self.num_attention_heads % self.num_key_value_heads == 0, "num_key_value_heads",
                 "must divide num_attention_heads")
        if self.head_dim is None:
            _require(self.hidden_size % self.num_attention_heads == 0, "head_dim",
                     "hidden_size must be divisible by num_attention_heads when head_dim is not given")
            self.head_dim = self.hidden_size // self.num_attention_heads


@dataclass
class CacheConfig:
    """Paged KV cache: ``num_blocks`` blocks of ``block_size`` token slots per layer."""

    block_size: int = 16
    num_blocks: int | None = None  # None: derived from kv_cache_memory_gib
    kv_cache_memory_gib: float = 1.0

    def __post_init__(self) -> None:
        _require(self.block_size > 0, "block_size", "must be positive")
        _require(self.num_blocks is None or self.num_blocks > 0, "num_blocks", "must be positive")
        _require(self.kv_cache_memory_gib > 0, "kv_cache_memory_gib", "must be positive")


@dataclass
class SchedulerConfig:
    """Continuous batching: FCFS, a per-step token budget, a cap on running sequences.

    ``async_scheduling``: launch the next plain decode step before committing the previous one, so the host's
    work overlaps the device's (``engine/engine.py``). None: on with CUDA, off on CPU (where the forward itself
    runs on the host, so nothing would overlap)."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    enable_chunked_prefill: bool = True
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    async_scheduling: bool | None = None

    def __post_init__(self) -> None:
        _require(self.max_num_seqs > 0, "max_num_seqs", "must be positive")
        _require(self.max_num_batched_tokens > 0, "max_num_batched_tokens", "must be positive")
        _require(self.max_model_len is None or self.max_model_len > 0, "max_model_len", "must be positive")


QUANTIZATION_METHODS = ("fp8", "int4")
# EngineConfig.cpu_activation_quant: activations of the block-quantized CPU matmuls (float32, or int8 per block of 32)
CPU_ACTIVATION_QUANTS = ("none", "q8")
# SpecConfig.head_cpu_quant: the GGUF block format an EAGLE-3 / P-EAGLE head's projections run from on CPU
HEAD_CPU_QUANTS = ("none", "q8_0")

# Batch-size buckets of CUDA-graph decode/verify steps: a step of 5 sequences replays the bucket-8 graph.
DEFAULT_CUDA_GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)
# Longest query (1 + drafts) a captured step may have: the Triton backend's short-sequence (decode) kernel limit.
MAX_CUDA_GRAPH_QUERY_LEN = 16


@dataclass
class CudaGraphConfig:
    """CUDA graphs for decode and verify steps (``engine/cuda_graphs.py``): a step whose every sequence has the
    same query length ``q <= max_query_len`` (1: decode; 1 + drafts: verify) and whose batch fits a bucket of
    ``batch_sizes`` replays a graph captured for (bucket, q), padded to the bucket. Mixed steps (prefill chunks)
    run eagerly. Only used on CUDA with an attention backend that supports capture (the Triton backend).

    ``num_splits``: key-range splits of the captured decode kernel (None: chosen per bucket from the SM count).
    ``capture_at_startup``: capture q = 1 (and, when the server speculates, every q up to 1 + its
    ``num_spec_tokens``: fewer drafts are verified near max_tokens and under the adaptive policy's caps) for every
    bucket when the engine starts; other query lengths are captured the first time a step needs them.
    ``draft_steps``: also capture an EAGLE-3 head's drafting, captured on first use (``spec/draft_graphs.py``): its
    ingest forward and all k draft steps as one graph per (bucket, padded queue length, k) in steady decoding, else
    steps 2..k as one per (bucket, steps) after an eager ingest. On by default: on the H200 (benchmarks/results/
    gpu_engine_session13_sync.json, SmolLM2 shape, k = 4, side by side in one run) steps 2..k alone took EAGLE-3
    from 132 to 341 output tokens/s at concurrency 1 and from 4842 to 7218 at 32; the ingest in the same graph
    then took a step from 3.88 to 2.18 ms at concurrency 1 (spec_step_profile_gpu_before.json / _gpu.json) and the
    random head's tokens/s from 313 to 608 at c = 1, 2,371 to 4,128 at 8, 5,159 to 12,078 at 32
    (gpu_engine.json / gpu_engine_ingest_graphs.json, separate runs)."""

    enabled: bool = True
    batch_sizes: tuple[int, ...] = DEFAULT_CUDA_GRAPH_BATCH_SIZES
    max_query_len: int = 8
    num_splits: int | None = None
    capture_at_startup: bool = True
    draft_steps: bool = True

    def __post_init__(self) -> None:
        self.batch_sizes = tuple(self.batch_sizes)
        _require(len(self.batch_sizes) > 0, "cuda_graphs.batch_sizes", "must name at least one batch size")
        _require(all(int(b) == b and b > 0 for b in self.batch_sizes), "cuda_graphs.batch_sizes",
                 "must be positive integers")
        _require(list(self.batch_sizes) == sorted(set(self.batch_sizes)), "cuda_graphs.batch_sizes",
                 "must be strictly increasing")
        _require(1 <= self.max_query_len <= MAX_CUDA_GRAPH_QUERY_LEN, "cuda_graphs.max_query_len",
                 f"must be in [1, {MAX_CUDA_GRAPH_QUERY_LEN}]")
        _require(self.num_splits is None or self.num_splits >= 1, "cuda_graphs.num_splits", "must be >= 1")


SPEC_METHODS = ("none", "ngram", "draft", "eagle3", "peagle")
# Methods that need a model (``SpecConfig.model``); n-gram lookup needs none.
SPEC_MODEL_METHODS = ("draft", "eagle3", "peagle")
MAX_NUM_SPEC_TOKENS = 16


@dataclass
class SpecConfig:
    """Speculative decoding: the server's default method and ``num_spec_tokens``, the drafter to load and the
    n-gram matcher's settings. Requests may override method and ``num_spec_tokens`` (``SpecParams``).

    ``model`` is the drafter for ``method`` draft / eagle3 / peagle: a model path (draft), a head checkpoint
    directory (eagle3, peagle), or ``dummy`` / ``dummy:<seed>`` for a randomly initialised head (eagle3, peagle)
    or a random draft model shaped like the target (draft) - random drafters are accepted rarely, which makes
    them the hard case for losslessness tests and the cost floor in benchmarks."""

    method: str = "none"
    model: str | None = None
    num_spec_tokens: int = 3
    # Shortest suffix n-gram the lookup will match: a 1- or 2-token match is often chance, and a rejected draft
    # still costs a wider verify step (benchmarks/results/spec_cpu.json: min 3 / max 5 had the best AL and tok/s).
    ngram_min: int = 3
    ngram_max: int = 5  # longest suffix n-gram tried first
    # Adaptive speculation (spec/policy.py): each step, cap every request's drafts at 0, 1, num_spec_tokens // 2
    # or not at all, whichever has given the most committed tokens per second at this batch size (measured,
    # with periodic probes). Lossless either way; seeded sampled outputs then depend on timings.
    adaptive: bool = False
    # On CPU (with EngineConfig.quantized_cpu_kernels) an EAGLE-3 / P-EAGLE head's projections and LM head run from
    # Q8_0 blocks of their own weights: a draft step streams every head weight once, and 8-bit blocks are ~4x fewer
    # bytes than fp32 (SmolLM2's shipped head: 128 MB -> 34 MB a step, more than the Q4_1 target's own step
    # before). Drafts may change slightly; output does not (the verifier decides). "none" keeps fp32.
    head_cpu_quant: str = "q8_0"

    def __post_init__(self) -> None:
        _require(self.head_cpu_quant in HEAD_CPU_QUANTS, "head_cpu_quant",
                 f"must be one of {', '.join(HEAD_CPU_QUANTS)}, got {self.head_cpu_quant!r}")
        _require(self.method in SPEC_METHODS, "method", f"must be one of {', '.join(SPEC_METHODS)}")
        _require(self.method not in SPEC_MODEL_METHODS or bool(self.model), "model",
                 f"speculative method {self.method!r} needs a drafter model")
        _require(1 <= self.num_spec_tokens <= MAX_NUM_SPEC_TOKENS, "num_spec_tokens",
                 f"must be in [1, {MAX_NUM_SPEC_TOKENS}]")
        _require(1 <= self.ngram_min <= self.ngram_max, "ngram_min", "must satisfy 1 <= ngram_min <= ngram_max")


@dataclass
class EngineConfig:
    """Everything the engine needs, in one tree."""

    model: str = "default"  # path to a GGUF file or HF directory, "default", or "dummy:<shape>"
    served_model_name: str | None = None
    dtype: str = "auto"  # "auto" | "float32" | "bfloat16" | "float16"
    device: str = "cpu"
    seed: int = 0
    # Run a GGUF's Q4_1 / Q8_0 matrices straight from their blocks on CPU (same weights, fewer bytes).
    quantized_cpu_kernels: bool = True
    # Quantize the decoder layers' projections on load (models/quantize.py): None keeps the checkpoint's dtype;
    # "fp8" = e4m3 weights per output channel, activations per token (torch._scaled_mm on GPU); "int4" =
    # weight-only, group-wise asymmetric 4-bit (AWQ-style, Triton W4A16 GEMM on GPU). CPU runs reference maths.
    quantization: str | None = None
    # Quantize the LM head too, with the same method (off: it stays in the model dtype, as in vLLM). Saves the
    # head's bytes per step (1 GB of Llama-3.1-8B's 16 in bf16); the logits are then the quantized model's.
    quantize_lm_head: bool = False
    # Activations of those block-quantized matmuls: "none" keeps x in float32 (exact up to fp32 rounding; prefill
    # chunks over 16 rows use fp32 GEMMs); "q8" rounds each row of x per block of 32 to int8 and uses integer dot
    # products for every row count (cheaper verify steps and prefill, slightly different logits; see
    # specserve/layers/quant_cpu.py). Each row stays independent of the others, so speculative greedy output still
    # equals plain greedy output.
    cpu_activation_quant: str = "none"
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpecConfig = field(default_factory=SpecConfig)
    cuda_graphs: CudaGraphConfig = field(default_factory=CudaGraphConfig)
    # On CUDA, run 16-bit projections at the row counts of ``quant_tiles.BF16_LT_ALGOS`` (verify steps) through
    # cuBLASLt with the configuration measured fastest there per GEMM (layers/cublaslt_gemm.py; needs
    # nvmath-python, the ``gpu`` extra; without it, or elsewhere, torch's cuBLAS call). The Llama-3.1-8B-shape
    # batch-32 verify step of 8 tokens ran x1.05 faster with it on an H100, decode unchanged, logits identical
    # (benchmarks/gpu_engine.py --cublaslt-algos, results/gpu_engine_h100_stop43_cublaslt.json).
    cublaslt_algos: bool = True

    def __post_init__(self) -> None:
        _require(self.dtype in ("auto", "float32", "bfloat16", "float16"), "dtype",
                 f"unsupported dtype {self.dtype!r}")
        _require(self.quantization in (None, *QUANTIZATION_METHODS), "quantization",
                 f"must be one of {', '.join(QUANTIZATION_METHODS)} (or unset), not {self.quantization!r}")
        _require(not self.quantize_lm_head or self.quantization is not None, "quantize_lm_head",
                 "needs a quantization method (--quantization fp8 or int4)")
        _require(self.cpu_activation_quant in CPU_ACTIVATION_QUANTS, "cpu_activation_quant",
                 f"must be one of {', '.join(CPU_ACTIVATION_QUANTS)}, got {self.cpu_activation_quant!r}")
        _require(self.cpu_activation_quant == "none" or self.quantized_cpu_kernels, "cpu_activation_quant",
                 "needs quantized_cpu_kernels (it applies to the block-quantized CPU kernels only)")


@dataclass
class TrainDraftConfig:
    """``specserve train-draft``: data generation, draft vocabulary and the EAGLE-3 / P-EAGLE trainers."""

    method: str = "eagle3"  # "eagle3" | "peagle"
    num_layers: int = 1  # decoder layers of the head (P-EAGLE: 2 to 4)
    head_intermediate_size: int = 0  # the head's MLP width; 0: the target's (hidden size and heads always are)
    draft_vocab_size: int = 16384
    # data generation with the target
    max_new_tokens: int = 512
    max_turns: int = 3  # user turns regenerated per conversation
    sampled_fraction: float = 0.25  # share of conversations answered at sampling_temperature (the rest greedy)
    sampling_temperature: float = 0.7
    # answers per training conversation: the first greedy or sampled as above, every further one sampled at
    # sampling_temperature with its own seed (more of the target's distribution on the same prompts); a
    # time-bounded run answers every conversation once before any second answer. Held-out: one greedy answer.
    answers_per_conversation: int = 1
    # per prompt file: "NAME=N,..." gives conversations of files whose name contains NAME N answers instead (the
    # largest matching N), e.g. "sharegpt=3,codegen=2": more answers where the prompts resemble the traffic
    answers_per_source: str = ""
    held_out_fraction: float = 0.02
    # requests the target writes itself before answering them (train/self_prompts.py, Magpie): this many sampled
    # after the chat template's user header, filtered (ended at end-of-turn, unique, no n-gram of an evaluation
    # prompt), added to the training conversations with source "self_prompts"; 0: none
    self_prompts: int = 0
    self_prompt_temperature: float = 1.0
    self_prompt_top_p: float = 0.95
    self_prompt_max_tokens: int = 256
    max_generate_seconds: float = 0.0  # 0: answer every prompt; else start no new group of prompts after this
    # optimisation
    epochs: float = 2.0
    lr: float = 3e-4
    warmup_steps: int = 50
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    max_seq_len: int = 1024  # longer samples are cut
    max_batch_tokens: int = 16384  # B * T of one batch
    ttt_steps: int = 7  # EAGLE-3 training-time-test depth (draft positions trained)
    ttt_anchors: int = 256  # EAGLE-3: sampled anchors per sequence trained past draft 1 (0: every position)
    step_weight_decay: float = 0.8  # loss weight of draft position s is decay ** s
    # labels: (1 - w) * the target's distribution + w * one-hot on its argmax (rows whose argmax is in the draft
    # vocabulary). Greedy verification accepts a draft only when it is the target's argmax, so w > 0 spends the
    # head's capacity on the argmax rather than on the target's full distribution where the target is unsure;
    # w < 1 keeps the head's distribution near the target's for sampled verification. 0: soft labels only
    hard_label_weight: float = 0.0
    num_spec_tokens: int = 7  # P-EAGLE slots trained (draft positions 1..num_spec_tokens)
    anchors_per_seq: int = 128  # P-EAGLE: sampled anchor positions per sequence per pass
    anchor_chunk: int = 64  # P-EAGLE: anchors per forward/backward (memory bound of long sequences)
    # P-EAGLE: weight slot s's loss at an anchor by the head's own probability (not differentiated) that its drafts
    # before s all match the target's greedy tokens, i.e. that a verifier would reach slot s there: the expected
    # acceptance length's gradient, up to its later terms. Off: every anchor weighs the same (a slot may then learn
    # tokens that are right only where the chain has already broken).
    peagle_chain_weight: bool = False
    checkpoint_every: int = 200
    dataset_answers: bool = False  # also train on the prompt files' own answers (off-policy; train/data.py)
    eval_every: int = 0  # steps between held-out estimates; the best head (estimated AL) is kept. 0: off
    eval_samples: int = 256  # held-out samples used by those estimates
    max_train_seconds: float = 0.0  # 0: run every epoch; else fit the step count (and LR schedule) to this
    # > 0: the LR schedule spans exactly this many steps whatever the time budget; a call that runs out of
    # max_train_seconds stops early and checkpoints, and a later call on the same output directory resumes the
    # same schedule (training longer than one time-limited job). 0: steps from epochs / the time budget.
    total_steps: int = 0
    seed: int = 0
    # a trained head (speculators directory) to start from instead of random weights: its weights and draft
    # vocabulary are kept (a larger draft_vocab_size adds the most generated other tokens, never drops one);
    # method, num_layers and head_intermediate_size must build the same head (a larger head_intermediate_size
    # widens the MLPs, the added units starting switched off), except that a P-EAGLE run may start
    # from an EAGLE-3 head of the same width (its layers, fc and LM head; further layers start as the identity)
    init_head: str | None = None

    def __post_init__(self) -> None:
        _require(self.method in ("eagle3", "peagle"), "method", "must be eagle3 or peagle")
        _require(self.num_layers >= 1, "num_layers", "must be at least 1")
        _require(self.head_intermediate_size >= 0, "head_intermediate_size", "must be >= 0 (0: the target's)")
        _require(self.draft_vocab_size >= 1, "draft_vocab_size", "must be positive")
        _require(0.0 <= self.sampled_fraction <= 1.0, "sampled_fraction", "must be in [0, 1]")
        _require(self.answers_per_conversation >= 1, "answers_per_conversation", "must be at least 1")
        _require(self.answers_per_conversation == 1 or self.sampling_temperature > 0, "answers_per_conversation",
                 "more than one answer needs sampling_temperature > 0 (further answers are sampled)")
        try:
            per_source = self.source_answer_counts()
        except ValueError:
            per_source = None
        _require(per_source is not None and all(n >= 1 for n in per_source.values()), "answers_per_source",
                 "must be NAME=N pairs separated by commas, N >= 1 (e.g. sharegpt=3,codegen=2)")
        _require(all(n == 1 for n in per_source.values()) or self.sampling_temperature > 0, "answers_per_source",
                 "more than one answer needs sampling_temperature > 0 (further answers are sampled)")
        _require(0.0 <= self.held_out_fraction < 1.0, "held_out_fraction", "must be in [0, 1)")
        _require(self.self_prompts >= 0, "self_prompts", "must be >= 0 (0: none)")
        _require(self.self_prompt_temperature > 0, "self_prompt_temperature", "must be > 0 (requests are sampled)")
        _require(0 < self.self_prompt_top_p <= 1, "self_prompt_top_p", "must be in (0, 1]")
        _require(self.self_prompt_max_tokens >= 1, "self_prompt_max_tokens", "must be at least 1")
        _require(self.ttt_steps >= 1, "ttt_steps", "must be at least 1")
        _require(0.0 <= self.hard_label_weight <= 1.0, "hard_label_weight", "must be in [0, 1]")
        _require(self.eval_every >= 0, "eval_every", "must be >= 0 (0 turns it off)")
        _require(self.eval_samples >= 1, "eval_samples", "must be at least 1")
        _require(self.total_steps >= 0, "total_steps", "must be >= 0 (0: from epochs or the time budget)")
        _require(self.num_spec_tokens >= 1, "num_spec_tokens", "must be at least 1")
        _require(self.max_seq_len >= 4 and self.max_batch_tokens >= self.max_seq_len, "max_batch_tokens",
                 "must be at least max_seq_len (>= 4)")

    def source_answer_counts(self) -> dict[str, int]:
        """``answers_per_source`` as {name substring: answers}; ValueError when malformed."""
        counts = {}
        for pair in (p.strip() for p in self.answers_per_source.split(",")):
            if not pair:
                continue
            name, sep, n = pair.partition("=")
            if not sep or not name.strip():
                raise ValueError(pair)
            counts[name.strip()] = int(n)
        return counts

    def answers_for(self, source: str) -> int:
        """Answers per training conversation of the prompt file named ``source``."""
        matches = [n for name, n in self.source_answer_counts().items() if name in source]
        return max(matches) if matches else self.answers_per_conversation
