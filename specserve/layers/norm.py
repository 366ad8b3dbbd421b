"""RMSNorm (Zhang & Sennrich, arXiv 1910.07467): the weight holder. The computation lives in
``layers/ops.py`` (``rms_norm`` / ``fused_add_rms_norm``) so that it can fuse with the residual add."""

from __future__ import annotations

import torch


class RMSNorm(torch.nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
