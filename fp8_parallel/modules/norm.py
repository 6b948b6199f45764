"""`Norm`: LayerNorm / RMSNorm with megatron's norm signature, usable with sequence parallelism."""
from __future__ import annotations

import torch
import torch.nn.functional as F


class Norm(torch.nn.Module):
    """`config.normalization` ("LayerNorm" or "RMSNorm") over the last dim, megatron signature
    `(config, hidden_size, eps)`. Parameters carry `sequence_parallel` so megatron all-reduces their grads."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5):
        super().__init__()
        self.kind = getattr(config, "normalization", "LayerNorm")
        if self.kind not in ("LayerNorm", "RMSNorm"):
            raise ValueError(f"normalization={self.kind!r}: expected 'LayerNorm' or 'RMSNorm'")
        self.eps = eps
        device = None if config.use_cpu_initialization else torch.cuda.current_device() if torch.cuda.is_available() else None
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype, device=device))
        self.bias = (torch.nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype, device=device))
                     if self.kind == "LayerNorm" else None)
        for p in (self.weight, self.bias):
            if p is not None:
                setattr(p, "sequence_parallel", bool(config.sequence_parallel))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "RMSNorm":
            return F.rms_norm(x, (x.shape[-1],), self.weight.to(x.dtype), self.eps)
        return F.layer_norm(x, (x.shape[-1],), self.weight.to(x.dtype), self.bias.to(x.dtype), self.eps)
