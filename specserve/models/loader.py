"""Load a target model from a GGUF file, a Hugging Face safetensors directory, or dummy weights of a
named shape, onto the device the caller passes in."""

from __future__ import annotations

from pathlib import Path

import torch

from specserve.config import ModelConfig
from specserve.layers.norm import RMSNorm
from specserve.layers.ops import select_ops
from specserve.models.llama import LlamaForCausalLM
from specserve.models.shapes import shape_config

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """"auto" is float32 on CPU (fastest there without bf16 matmul units) and bfloat16 on accelerators."""
    if name == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    return DTYPES[name]


def build_model(config: ModelConfig, max_position: int, dtype: torch.dtype, device: torch.device) -> LlamaForCausalLM:
    """Construct on the meta device (no allocation), then materialise uninitialised on ``device``."""
    with torch.device("meta"):
        model = LlamaForCausalLM(config, max_position)
    model = model.to_empty(device=device).to(dtype)
    model.init_rope(device)
    model.set_ops(select_ops(device, dtype))
    return model.eval()


def init_random_weights(model: torch.nn.Module, gen: torch.Generator) -> None:
    """Norm weights 1, biases 0, every other parameter N(0, 1 / fan_in), drawn from ``gen`` in parameter order,
    on ``gen``'s device (a CUDA generator draws on the GPU: seconds instead of minutes for 8B parameters)."""
    norms = {id(m.weight) for m in model.modules() if isinstance(m, RMSNorm)}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if id(p) in norms:
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                std = 1.0 / p.shape[-1] ** 0.5
                p.copy_((torch.randn(p.shape, generator=gen, device=gen.device) * std).to(p.dtype))


def _init_dummy(model: LlamaForCausalLM, seed: int) -> None:
    init_random_weights(model, torch.Generator(device="cpu").manual_seed(seed))


def load_model(model: str, dtype_name: str, device: torch.device, max_model_len: int | None = None,
               seed: int = 0, quantized_cpu_kernels: bool = True, quantization: str | None = None,
               cpu_activation_quant: str = "none", quantize_lm_head: bool = False):
    """Returns ``(model, model_config, tokenizer_or_None)``.

    ``model`` is a path to a .gguf file or a HF directory, "default" (the cached SmolLM2 GGUF), or
    "dummy:<shape>" (random weights; no tokenizer). With ``quantized_cpu_kernels``, a GGUF's Q4_1 / Q8_0
    matrices also stay in block form for the CPU kernel (fp32 on CPU only). ``quantization`` "fp8" / "int4"
    quantizes the decoder layers' projections after loading (``models/quantize.py``), and the LM head too with
    ``quantize_lm_head``; an AWQ checkpoint directory
    (4-bit "gemm", config.json ``quantization_config.quant_method == "awq"``) loads its projections as int4.
    The block-quantized CPU kernels take their activations as ``cpu_activation_quant`` ("none": float32; "q8":
    int8 per block of 32, see ``layers/quant_cpu.py``).
    """
    dtype = resolve_dtype(dtype_name, device)
    if model.startswith("dummy:"):
        config = shape_config(model.split(":", 1)[1])
        max_pos = min(config.max_position_embeddings, max_model_len or config.max_position_embeddings)
        net = build_model(config, max_pos, dtype, device)
        _init_dummy(net, seed)
        _quantize(net, quantization, quantize_lm_head)
        net.pack_weights()
        return net, config, None
    if model == "default":
        from specserve.models.fetch import default_model_path
        path = default_model_path()
    else:
        path = Path(model).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"model: {path} does not exist")
    quantized: dict = {}
    awq = None
    if path.is_file() and path.suffix == ".gguf":
        from specserve.models.gguf_loader import read_gguf
        config, state, tokenizer, quantized = read_gguf(path, torch.float32)
    elif path.is_dir():
        import json

        from specserve.models.quantize import awq_quant_config
        from specserve.models.safetensors_loader import load_hf_dir
        awq = awq_quant_config(json.loads((path / "config.json").read_text()))
        if awq is not None and quantization is not None:
            raise ValueError(f"quantization: {path} is an AWQ checkpoint already; leave --quantization unset")
        config, state, tokenizer = load_hf_dir(path, torch.float32)
    else:
        raise ValueError(f"model: {path} is neither a .gguf file nor a Hugging Face directory")
    max_pos = min(config.max_position_embeddings, max_model_len or config.max_position_embeddings)
    net = build_model(config, max_pos, dtype, device)
    if awq is not None:  # 4-bit projections straight from the checkpoint (models/quantize.py)
        from specserve.models.quantize import load_awq_projections
        load_awq_projections(net, state, dtype)
    net.load_hf_state_dict(state)
    del state
    _quantize(net, quantization, quantize_lm_head)
    net.pack_weights()
    if quantized and quantized_cpu_kernels and quantization is None and device.type == "cpu" \
            and dtype == torch.float32:
        net.attach_quantized(quantized, cpu_activation_quant)
    return net, config, tokenizer


def _quantize(net: LlamaForCausalLM, quantization: str | None, lm_head: bool = False) -> None:
    if lm_head and quantization is None:
        raise ValueError("quantize_lm_head: needs a quantization method (--quantization fp8 or int4)")
    if quantization is not None:
        from specserve.models.quantize import quantize_model
        quantize_model(net, quantization, lm_head=lm_head)
