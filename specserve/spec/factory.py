"""Build the proposers an engine serves from its ``SpecConfig``: n-gram lookup always (it costs nothing to
keep), plus the model-based drafter named by ``method`` when it has one."""

from __future__ import annotations

from pathlib import Path

import torch

from specserve.config import MAX_NUM_SPEC_TOKENS, EngineConfig, ModelConfig
from specserve.spec.ngram import NgramProposer
from specserve.spec.proposer import Proposer


def build_proposers(config: EngineConfig, target, target_config: ModelConfig, num_blocks: int,
                    device: torch.device) -> dict[str, Proposer]:
    spec = config.speculative
    proposers: dict[str, Proposer] = {"ngram": NgramProposer(spec.ngram_min, spec.ngram_max)}
    # Drafted positions live past the verified ones, so the drafter's cache gets headroom for the longest draft a
    # request may ask for.
    blocks_per_draft = -(-MAX_NUM_SPEC_TOKENS // config.cache.block_size) + 1
    draft_blocks = num_blocks + config.scheduler.max_num_seqs * blocks_per_draft
    if spec.method == "draft":
        from specserve.spec.draft_model import DraftModelProposer
        proposers["draft"] = DraftModelProposer(load_draft_model(config, target, target_config, device),
                                                target_config.vocab_size, draft_blocks, config.cache.block_size,
                                                device, config.seed)
    elif spec.method in ("eagle3", "peagle"):
        from specserve.spec.eagle3 import load_eagle_proposer
        head_quant = spec.head_cpu_quant if config.quantized_cpu_kernels else "none"  # CPU only: the loader checks
        proposers[spec.method] = load_eagle_proposer(spec.method, spec.model, target, target_config, draft_blocks,
                                                     config.cache.block_size, device, config.seed, head_quant)
    return proposers


def load_draft_model(config: EngineConfig, target, target_config: ModelConfig, device: torch.device):
    """The draft model of ``speculative.model``: "self" (or the target's own path) shares the target's weights,
    ``dummy`` / ``dummy:<seed>`` is a random model of the target's shape, anything else goes through the loader."""
    name = config.speculative.model
    if name == "self" or (name == config.model and not name.startswith("dummy:")):
        return target
    from specserve.models.loader import _init_dummy, build_model, load_model, resolve_dtype
    if name == "dummy" or name.startswith("dummy:") and name.split(":", 1)[1].isdigit():
        seed = int(name.split(":", 1)[1]) if ":" in name else config.seed + 1
        dtype = resolve_dtype(config.dtype, device)
        model = build_model(target_config, target.max_position, dtype, device)
        _init_dummy(model, seed)
        model.pack_weights()
        return model
    if not name.startswith("dummy:") and not Path(name).expanduser().exists():
        raise FileNotFoundError(f"speculative.model: {name} does not exist")
    model, _, _ = load_model(name, config.dtype, device, target.max_position, config.seed,
                             config.quantized_cpu_kernels, cpu_activation_quant=config.cpu_activation_quant)
    return model
