"""RMSNorm (Zhang & Sennrich, arXiv 1910.07467): the weight holder; the computation lives in
``layers/ops.py`` so that it can fuse with the residual add."""

from __future__ import annotations

import torch

from specserve.layers.ops import TorchOps


class RMSNorm(torch.nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden_size]
    ) -> torch.Tensor:
        return TorchOps.rms_norm(x, self.weight, self.eps)
