"""Owns the device: the model, the KV cache tensors and the attention backend. Turns a scheduler output
into one packed forward pass and returns the logits of the rows that sample.

    scheduled (query_lens)  = [A: 3 (prefill chunk), B: 1 (decode)]
    input_ids               = [a0 a1 a2 b5]
    positions               = [ 0  1  2  5]
    logits rows             = [2, 3]   (last token of each request that samples)
"""

from __future__ import annotations

import torch

from specserve.config import CacheConfig, ModelConfig
from specserve.engine.scheduler import SchedulerOutput
from specserve.layers.attention import AttentionBackend, TorchAttentionBackend, build_attention_metadata
from specserve.models.llama import LlamaForCausalLM


def default_backend(device: torch.device, dtype: torch.dtype) -> AttentionBackend:
    """Our C++ paged-attention kernel for fp32 on CPU when it builds; the torch reference otherwise."""
    if device.type == "cpu":
        from specserve.layers.cpu_attention import make_cpu_backend
        return make_cpu_backend(dtype)
    return TorchAttentionBackend()


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_hidden_layers * block_size * config.num_key_value_heads * config.head_dim * elem


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
        shape = (self.num_blocks, self.block_size, model_config.num_key_value_heads, model_config.head_dim)
        self.kv_caches = [(torch.zeros(shape, dtype=self.dtype, device=device),
                           torch.zeros(shape, dtype=self.dtype, device=device))
                          for _ in range(model_config.num_hidden_layers)]

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
    def execute(self, sched: SchedulerOutput, block_tables: list[list[int]]) -> torch.Tensor:
        """Returns logits ``[num_sampling_requests, vocab_size]`` (float32), in scheduled order."""
        input_ids: list[int] = []
        positions: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        logit_rows: list[int] = []
        for s in sched.scheduled:
            r = s.request
            start, stop = r.num_computed_tokens, r.num_computed_tokens + s.num_new_tokens
            input_ids.extend(r.token_slice(start, stop))
            positions.extend(range(start, stop))
            query_lens.append(s.num_new_tokens)
            seq_lens.append(stop)
            if s.samples:
                logit_rows.append(len(input_ids) - 1)
        meta = build_attention_metadata(query_lens, seq_lens, block_tables, self.block_size, self.device)
        self.backend.prepare(meta, self.block_size)
        ids = torch.tensor(input_ids, dtype=torch.int64, device=self.device)
        pos = torch.tensor(positions, dtype=torch.int64, device=self.device)
        hidden, _ = self.model(ids, pos, self.kv_caches, meta, self.backend)
        rows = torch.tensor(logit_rows, dtype=torch.int64, device=self.device)
        return self.model.compute_logits(hidden[rows])
