"""Owns the device: the model, the KV cache tensors and the attention backend. Turns a scheduler output
into one packed forward pass and returns the logits of the rows that sample: the last token of a request
that samples, and every draft token of a request that verifies drafts (the verifier needs the target's
distribution after the last token and after each draft).

    scheduled (query_lens)  = [A: 3 (prefill chunk), B: 1 (decode), C: 3 (decode + 2 drafts)]
    input_ids               = [a0 a1 a2 b5 c7 d1 d2]
    positions               = [ 0  1  2  5  7  8  9]
    logits rows             = [2, 3, 4, 5, 6]   -> logit_starts = [0, 1, 2]

A step whose queries are all short (decode, verify of up to ``CudaGraphConfig.max_query_len - 1`` drafts) and whose
batch fits a bucket runs padded in static buffers instead, replaying a CUDA graph on GPU
(``engine/cuda_graphs.py``); the logits are computed from its hidden states the same way.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from specserve.config import CacheConfig, CudaGraphConfig, ModelConfig
from specserve.engine.cuda_graphs import CudaGraphRunner
from specserve.engine.scheduler import SchedulerOutput
from specserve.layers.attention import AttentionBackend, TorchAttentionBackend, build_attention_metadata
from specserve.models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)


# Set to force the plain-torch reference backend on CUDA (e.g. to bisect a numerical difference).
DISABLE_TRITON_ATTENTION_ENV = "SPECSERVE_DISABLE_TRITON_ATTENTION"


def default_backend(device: torch.device, dtype: torch.dtype) -> AttentionBackend:
    """Our C++ paged-attention kernel for fp32 on CPU when it builds; on CUDA the Triton paged-attention kernels
    when Triton imports and ``SPECSERVE_DISABLE_TRITON_ATTENTION`` is unset; the torch reference otherwise.
    Triton is imported only here, on the CUDA path: CPU runs never load it."""
    if device.type == "cpu":
        from specserve.layers.cpu_attention import make_cpu_backend
        return make_cpu_backend(dtype)
    if device.type == "cuda" and not os.environ.get(DISABLE_TRITON_ATTENTION_ENV):
        try:
            from specserve.layers.triton_attention import TritonAttentionBackend
        except (ImportError, RuntimeError) as exc:  # not installed, or no usable driver / compiler
            logger.warning("Triton attention unavailable (%s); using the torch reference backend", exc)
        else:
            return TritonAttentionBackend()
    return TorchAttentionBackend()


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_hidden_layers * block_size * config.num_key_value_heads * config.head_dim * elem


def allocate_kv_caches(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                       dtype: torch.dtype, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One (key, value) pair per layer, each ``[num_blocks, block_size, num_kv_heads, head_dim]``."""
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(num_layers)]


@dataclass
class StepOutput:
    """What one target forward returns to the engine."""

    logits: torch.Tensor  # [num_logit_rows, vocab_size] float32
    logit_starts: list[int]  # [num_sampling_requests] first logits row of each sampling request, scheduled order
    token_starts: list[int]  # [num_scheduled] first packed token of each scheduled request
    aux_hidden: dict[int, torch.Tensor]  # layer id -> [num_tokens, hidden_size] input of that target layer


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, model_config: ModelConfig, cache_config: CacheConfig,
                 device: torch.device, backend: AttentionBackend | None = None) -> None:
        self.model = model
        self.model_config = model_config
        self.device = device
        self.dtype = next(model.parameters()).dtype
        self.block_size = cache_config.block_size
        self.backend = backend or default_backend(device, self.dtype)
        if cache_config.num_blocks is not None:
            self.num_blocks = cache_config.num_blocks
        else:
            per_block = kv_bytes_per_block(model_config, self.block_size, self.dtype)
            self.num_blocks = max(1, int(cache_config.kv_cache_memory_gib * 2**30) // per_block)
        self.kv_caches = allocate_kv_caches(model_config.num_hidden_layers, self.num_blocks, self.block_size,
                                            model_config.num_key_value_heads, model_config.head_dim,
                                            self.dtype, device)
        # Uniform decode/verify steps go through padded static buffers (CUDA graphs on GPU); see setup_cuda_graphs.
        self.graphs: CudaGraphRunner | None = None

    def setup_cuda_graphs(self, config: CudaGraphConfig, max_model_len: int, max_num_seqs: int,
                          aux_layer_ids: tuple[int, ...] = (), startup_query_lens: tuple[int, ...] = (1,)) -> None:
        """Turn CUDA graphs on for decode/verify steps when ``config.enabled``, the device is CUDA and the attention
        backend is capturable (the Triton backend; the torch reference is not); capture ``startup_query_lens``
        for every bucket now when ``config.capture_at_startup``. Otherwise every step stays eager."""
        if not config.enabled or self.device.type != "cuda":
            return
        if not getattr(self.backend, "capturable", False):
            logger.warning("CUDA graphs disabled: the %s attention backend cannot be captured",
                           type(self.backend).__name__)
            return
        self.graphs = CudaGraphRunner(self.model, self.kv_caches, self.backend, config, self.block_size,
                                      max_model_len, max_num_seqs, self.device, capture=True)
        if config.capture_at_startup:
            self.graphs.capture_all(list(startup_query_lens), aux_layer_ids)

    @torch.inference_mode()
    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole KV blocks ``src -> dst`` in every layer (copy-on-write of shared blocks)."""
        if not copies:
            return
        src = torch.tensor([c[0] for c in copies], device=self.device)
        dst = torch.tensor([c[1] for c in copies], device=self.device)
        for k_cache, v_cache in self.kv_caches:
            k_cache[dst] = k_cache[src]
            v_cache[dst] = v_cache[src]

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, block_tables: list[list[int]],
                aux_layer_ids: tuple[int, ...] = (),
                input_ids_device: torch.Tensor | None = None,  # [num_scheduled] int64: the previous step's samples
                ) -> StepOutput:
        """One packed forward over the scheduled tokens (draft tokens appended after each request's own).

        ``input_ids_device``: a decode step (one new token per request) whose tokens are still on the device,
        sampled by the previous step in this step's request order (asynchronous decode steps, ``engine.py``);
        the host-side ids are then placeholders and never read."""
        input_ids: list[int] = []
        positions: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        logit_rows: list[int] = []
        logit_starts: list[int] = []
        token_starts: list[int] = []
        for s in sched.scheduled:
            r = s.request
            start, stop = r.num_computed_tokens, r.num_computed_tokens + s.num_new_tokens
            token_starts.append(len(input_ids))
            input_ids.extend(r.token_slice(start, stop - s.num_spec_tokens))
            input_ids.extend(r.spec_token_ids[:s.num_spec_tokens])
            positions.extend(range(start, stop))
            query_lens.append(s.num_new_tokens)
            seq_lens.append(stop)
            if s.samples:
                logit_starts.append(len(logit_rows))
                logit_rows.extend(range(len(input_ids) - 1 - s.num_spec_tokens, len(input_ids)))
        if input_ids_device is not None and not len(input_ids_device) == len(input_ids) == len(sched.scheduled):
            raise ValueError("input_ids_device: one id per scheduled request, each decoding one token")
        if self.graphs is not None and self.graphs.fits(query_lens, seq_lens):
            hidden, aux = self.graphs.run(input_ids, positions, query_lens, seq_lens, block_tables, aux_layer_ids,
                                          input_ids_device)
        else:
            hidden, aux = self.forward(input_ids, positions, query_lens, seq_lens, block_tables, aux_layer_ids,
                                       input_ids_device)
        if len(logit_rows) == len(input_ids):  # every token samples (decode): the rows are 0..n-1, no gather
            logits = self.model.compute_logits(hidden)
        else:
            rows = torch.tensor(logit_rows, dtype=torch.int64, device=self.device)
            logits = self.model.compute_logits(hidden[rows])
        return StepOutput(logits, logit_starts, token_starts, dict(zip(sorted(aux_layer_ids), aux)))

    @torch.inference_mode()
    def forward(self, input_ids: list[int], positions: list[int], query_lens: list[int], seq_lens: list[int],
                block_tables: list[list[int]], aux_layer_ids: tuple[int, ...] = (),
                input_ids_device: torch.Tensor | None = None):  # [num_tokens] int64, replaces input_ids
        """Host lists of a packed ragged batch -> ``(hidden [num_tokens, hidden_size], aux hidden list)``."""
        meta = build_attention_metadata(query_lens, seq_lens, block_tables, self.block_size, self.device)
        self.backend.prepare(meta, self.block_size)
        ids = input_ids_device if input_ids_device is not None else torch.tensor(input_ids, dtype=torch.int64,
                                                                                   device=self.device)
        pos = torch.tensor(positions, dtype=torch.int64, device=self.device)
        return self.model(ids, pos, self.kv_caches, meta, self.backend, aux_layer_ids)
