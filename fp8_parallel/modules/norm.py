"""`Norm`: LayerNorm / RMSNorm with megatron's norm signature, usable with sequence parallelism; and the
normalization function and parameters the standalone TransformerEngine-style modules use."""
from __future__ import annotations

from typing import Optional, Tuple

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
                p.sequence_parallel = bool(config.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return normalize(x, self.kind, self.weight, self.bias, self.eps)


NORMALIZATIONS = ("LayerNorm", "RMSNorm")


def check_normalization(owner: str, normalization: str) -> None:
    """A clear error for a normalization other than "LayerNorm" / "RMSNorm"."""
    if normalization not in NORMALIZATIONS:
        raise ValueError(f"{owner}(normalization={normalization!r}): expected 'LayerNorm' or 'RMSNorm'")


def normalize(
    x: torch.Tensor,
    normalization: str,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    eps: float,
    zero_centered_gamma: bool = False,
    shape: Optional[Tuple[int, ...]] = None,
) -> torch.Tensor:
    """LayerNorm (`weight`, `bias`) or RMSNorm (`weight`) over the trailing `shape` (default: the last dim), in
    `x`'s dtype.

    `zero_centered_gamma`: the gain is `1 + weight` (TransformerEngine's option; the weight starts at 0)."""
    shape = tuple(shape) if shape is not None else (x.shape[-1],)
    if x.dtype in (torch.bfloat16, torch.float16) and x.device.type != "cuda":
        # torch's CPU kernels reduce the gain / bias gradients (sums over all tokens) in the input's dtype: in
        # bfloat16 the LayerNorm bias gradient came out 7 % off. Compute in float32 and round once, as TE's
        # kernels and torch's CUDA kernels (float32 accumulation) do; CUDA keeps the native low-precision path
        xf = x.float()
        gain = weight.float() + 1 if zero_centered_gamma else weight.float()
        if normalization == "RMSNorm":
            return F.rms_norm(xf, shape, gain, eps).to(x.dtype)
        return F.layer_norm(xf, shape, gain, None if bias is None else bias.float(), eps).to(x.dtype)
    gain = (weight + 1 if zero_centered_gamma else weight).to(x.dtype)
    if normalization == "RMSNorm":
        return F.rms_norm(x, shape, gain, eps)
    return F.layer_norm(x, shape, gain, None if bias is None else bias.to(x.dtype), eps)


def make_norm_parameters(
    hidden_size: int, normalization: str, zero_centered_gamma: bool, dtype: torch.dtype, device: torch.device
) -> Tuple[torch.nn.Parameter, Optional[torch.nn.Parameter]]:
    """`(layer_norm_weight, layer_norm_bias or None)`: gain 1 (0 when zero-centered), bias 0, no bias for
    RMSNorm."""
    weight = torch.nn.Parameter(torch.full((hidden_size,), 0.0 if zero_centered_gamma else 1.0, dtype=dtype, device=device))
    bias = torch.nn.Parameter(torch.zeros(hidden_size, dtype=dtype, device=device)) if normalization == "LayerNorm" else None
    return weight, bias
