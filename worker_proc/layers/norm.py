"""RMSNorm with an optional fused residual add (one kernel call where HF makes three)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from worker_proc.layers.fused_cpu import FusedCpuOps


class RMSNorm(nn.Module):
    """Normalises the last dim; the weight is replicated on every rank."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.shape = (hidden_size,)
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        self.fused: FusedCpuOps | None = None  # set by pack_for_cpu where it serves (fp32 CPU)

    @staticmethod
    def weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        param.data.copy_(loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused is not None:
            return self.fused.rms_norm(x, self.weight, self.eps)
        return F.rms_norm(x, self.shape, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor,
                    residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (norm(x + residual), x + residual): the new residual stream and its normalisation."""
        if self.fused is not None:
            return self.fused.add_rms_norm(x, residual, self.weight, self.eps)
        residual = x.add_(residual)
        return F.rms_norm(residual, self.shape, self.weight, self.eps), residual
