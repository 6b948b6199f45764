"""The part of TransformerEngine's fusible-operations API (`te.ops`) that is provided: `L2Normalization`.

Other `te.ops` names raise an AttributeError saying so: build models from the modules
(`Linear`, `LayerNormLinear`, `LayerNormMLP`, ...) instead.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

__all__ = ["L2Normalization"]


class L2Normalization(torch.nn.Module):
    """TransformerEngine's `ops.L2Normalization`: `y = x / sqrt(sum(x**2) + eps)` over the last dimension, no
    parameters (query-key normalization). The sum of squares is taken in float32 whatever `x`'s dtype; the
    result has `x`'s dtype.

    Args:
        eps: added to the sum of squares.
        seq_length, micro_batch_size: TransformerEngine's JIT warm-up hints; no effect here.
    """

    def __init__(self, eps: float = 1e-6, seq_length: Optional[int] = None,
                 micro_batch_size: Optional[int] = None) -> None:
        super().__init__()
        if not eps >= 0:
            raise ValueError(f"L2Normalization(eps={eps!r}): eps must be non-negative")
        self.eps = float(eps)
        self.seq_length, self.micro_batch_size = seq_length, micro_batch_size

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 (TransformerEngine's argument name)
        return input * torch.rsqrt(input.float().square().sum(-1, keepdim=True) + self.eps).to(input.dtype)


def __getattr__(name: str) -> Any:
    raise AttributeError(f"fp8_parallel.ops has no {name} (a TransformerEngine name): only L2Normalization of "
                         f"TransformerEngine's fusible-operations API is provided; use the modules "
                         f"(fp8_parallel.Linear, LayerNormLinear, LayerNormMLP, ...)")
