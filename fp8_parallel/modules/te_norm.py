"""`LayerNorm` and `RMSNorm` with TransformerEngine's signatures (high precision; parameters `weight`, `bias`)."""
from __future__ import annotations

from typing import Iterable, Optional, Tuple, Union

import torch

from ._deferred_init import ResetParameters, check_materialized, record_norm_inits
from ._te_options import in_autocast_dtype, resolve_device, resolve_dtype
from .norm import normalize

Shape = Union[int, Iterable[int]]


def _shape(owner: str, normalized_shape: Optional[Shape], hidden_size: Optional[int]) -> Tuple[int, ...]:
    if normalized_shape is None and hidden_size is None:
        raise ValueError(f"{owner}: give normalized_shape (or TransformerEngine's older name hidden_size)")
    if normalized_shape is not None and hidden_size is not None:
        raise ValueError(f"{owner}: give normalized_shape or hidden_size, not both")
    shape = normalized_shape if normalized_shape is not None else hidden_size
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    if not shape or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in shape):
        raise ValueError(f"{owner}(normalized_shape={normalized_shape!r}): expected positive integers")
    return shape


class _Norm(ResetParameters, torch.nn.Module):
    _owner = "norm"
    _with_bias = True

    def __init__(self, normalized_shape: Optional[Shape] = None, eps: float = 1e-5,
                 sequence_parallel: Optional[bool] = None, params_dtype: Optional[torch.dtype] = None,
                 zero_centered_gamma: bool = False, hidden_size: Optional[int] = None, *,
                 device: Optional[Union[str, torch.device]] = None, dtype: Optional[torch.dtype] = None,
                 sm_margin: Union[int, dict] = 0):
        super().__init__()
        owner = self._owner
        self.normalized_shape = _shape(owner, normalized_shape, hidden_size)
        if params_dtype is not None and dtype is not None:
            raise ValueError(f"{owner}: give dtype or params_dtype, not both")
        if not eps > 0:
            raise ValueError(f"{owner}(eps={eps!r}): expected a positive number")
        dtype = resolve_dtype(owner, dtype if dtype is not None else params_dtype)
        device = resolve_device(device)
        self.eps, self.zero_centered_gamma, self.sequence_parallel = eps, zero_centered_gamma, sequence_parallel
        del sm_margin  # SMs left free for overlapping kernels: a scheduling hint, no effect on any result
        gain = 0.0 if zero_centered_gamma else 1.0
        self.weight = torch.nn.Parameter(torch.full(self.normalized_shape, gain, dtype=dtype, device=device))
        self.bias = (torch.nn.Parameter(torch.zeros(self.normalized_shape, dtype=dtype, device=device))
                     if self._with_bias else None)
        record_norm_inits(self, "weight", "bias", zero_centered_gamma)
        if sequence_parallel is not None:
            for p in (self.weight, self.bias):
                if p is not None:
                    p.sequence_parallel = sequence_parallel

    def _input(self, inp: torch.Tensor) -> torch.Tensor:
        """The input made contiguous (results independent of its strides: torch reduces in stride order) and,
        inside `torch.autocast`, cast to the autocast dtype, as TransformerEngine's norms and our linear
        modules do (torch's own autocast would run layer_norm / rms_norm in float32)."""
        check_materialized(self._owner, self.weight)
        return in_autocast_dtype(inp.contiguous())

    def _normalize(self, inp: torch.Tensor, normalization: str) -> torch.Tensor:
        """`normalize` (float32 statistics and gain/bias gradients, rounded once, as TE's kernels) of the
        prepared input, outside torch's autocast (which would run the norm in float32 and return that)."""
        inp = self._input(inp)
        with torch.autocast(inp.device.type, enabled=False):
            return normalize(inp, normalization, self.weight, self.bias, self.eps, self.zero_centered_gamma,
                             shape=self.normalized_shape)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, zero_centered_gamma={self.zero_centered_gamma}"


class LayerNorm(_Norm):
    """TransformerEngine's `LayerNorm`: `(x - mean) / sqrt(var + eps) * gamma + beta` over the trailing
    `normalized_shape` dims, computed in float32 and returned in the input's dtype (inside `torch.autocast`:
    the autocast dtype), as TE.

    Args:
        normalized_shape: the normalized trailing dims (TransformerEngine's older `hidden_size` also works).
        eps: added to the variance.
        sequence_parallel: sets the parameters' `sequence_parallel` attribute (megatron sums their gradients
            over TP), as TransformerEngine does.
        params_dtype / dtype: parameter dtype (give one); default `torch.get_default_dtype()`.
        zero_centered_gamma: the gain is `1 + weight`, the weight starting at 0.
        device: parameter device; default CUDA when available, else the CPU.
        sm_margin: accepted; a kernel-scheduling hint with no effect on the result.

    Parameters: `weight`, `bias`.
    """

    _owner = "LayerNorm"

    def forward(self, inp: torch.Tensor) -> torch.Tensor:
        """The normalized input."""
        return self._normalize(inp, "LayerNorm")


class RMSNorm(_Norm):
    """TransformerEngine's `RMSNorm`: `x / sqrt(mean(x**2) + eps) * gamma` over the trailing
    `normalized_shape` dims, in the input's dtype. Arguments as for `LayerNorm`; parameter: `weight`."""

    _owner = "RMSNorm"
    _with_bias = False

    def forward(self, inp: torch.Tensor) -> torch.Tensor:
        """The normalized input."""
        return self._normalize(inp, "RMSNorm")
