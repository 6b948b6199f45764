"""`Linear`: a plain (non-parallel) FP8 linear layer with megatron's `(output, bias)` convention."""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

from ._core import FP8State, fp8_linear


class Linear(torch.nn.Module):
    """FP8 linear layer: `y = x @ W.T (+ b)`.

    Args:
        in_features, out_features: sizes.
        bias: learnable bias.
        skip_bias_add: return the bias separately instead of adding it (megatron's convention).
        params_dtype, device: parameter dtype and device.
    Returns (forward):
        `(output, bias or None)`, like megatron-core's tensor-parallel layers.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        skip_bias_add: bool = False,
        params_dtype: torch.dtype = torch.float32,
        device: Optional[torch.device] = None,
    ):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.skip_bias_add = skip_bias_add
        self.weight = torch.nn.Parameter(torch.empty(out_features, in_features, dtype=params_dtype, device=device))
        self.bias = torch.nn.Parameter(torch.zeros(out_features, dtype=params_dtype, device=device)) if bias else None
        torch.nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        self.fp8 = FP8State(f"Linear({in_features},{out_features})", device=device)

    def forward(self, x: torch.Tensor, is_first_microbatch: Optional[bool] = None) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        if self.skip_bias_add:
            return fp8_linear(x, self.weight, None, self.fp8, is_first_microbatch), self.bias
        return fp8_linear(x, self.weight, self.bias, self.fp8, is_first_microbatch), None
