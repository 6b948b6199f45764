"""FP8 formats and scaling recipes: plain, frozen, hashable configuration."""
from __future__ import annotations

import dataclasses
import enum
from typing import Callable, Union

import torch

AmaxComputeAlgo = Union[str, Callable[[torch.Tensor], torch.Tensor]]
""""max" (max over the history), "most_recent" (the newest amax), or a callable mapping a
`[num_tensors, history_len]` history (newest in column 0) to `[num_tensors]` amaxes."""

_ALGOS = ("max", "most_recent")


class Format(enum.Enum):
    """Which FP8 encodings are used in the forward and the backward pass."""

    E4M3 = "e4m3"  # E4M3 everywhere
    HYBRID = "hybrid"  # E4M3 forward (activations, weights), E5M2 backward (gradients)

    @property
    def forward_dtype(self) -> torch.dtype:
        return torch.float8_e4m3fn

    @property
    def backward_dtype(self) -> torch.dtype:
        return torch.float8_e4m3fn if self is Format.E4M3 else torch.float8_e5m2

    @property
    def forward_max(self) -> float:
        return fp8_max(self.forward_dtype)

    @property
    def backward_max(self) -> float:
        return fp8_max(self.backward_dtype)


def fp8_max(dtype: torch.dtype) -> float:
    """Largest finite value of an FP8 dtype (448 for E4M3, 57344 for E5M2)."""
    return float(torch.finfo(dtype).max)


@dataclasses.dataclass(frozen=True)
class DelayedScaling:
    """Delayed scaling: each tensor's scale comes from a history of past amaxes (TransformerEngine's rule).

    `scale = fp8_max / amax / 2**margin`, with `amax` taken from the history by `amax_compute_algo`.
    An amax that is <= 0, inf or NaN keeps the previous scale; a scale that overflows becomes float32 max.

    Args:
        margin: extra power-of-two headroom.
        fp8_format: E4M3 or HYBRID.
        amax_history_len: how many past amaxes each tensor keeps.
        amax_compute_algo: "max", "most_recent", or a callable (see `AmaxComputeAlgo`). Part of the
            recipe's identity: two recipes that differ only here are different autocast scope keys.
        reduce_amax: all-reduce (MAX) amaxes over the scope's group before updating.
    """

    margin: int = 0
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: AmaxComputeAlgo = "max"
    reduce_amax: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.fp8_format, Format):
            raise ValueError(f"fp8_format={self.fp8_format!r} must be a Format (E4M3 or HYBRID)")
        if not isinstance(self.margin, int) or self.margin < 0:
            raise ValueError(f"margin={self.margin!r} must be a non-negative integer")
        if not isinstance(self.amax_history_len, int) or self.amax_history_len < 1:
            raise ValueError(f"amax_history_len={self.amax_history_len!r} must be a positive integer")
        algo = self.amax_compute_algo
        if not callable(algo) and algo not in _ALGOS:
            raise ValueError(f"amax_compute_algo={algo!r} must be one of {_ALGOS} or a callable")

    @property
    def delayed(self) -> bool:
        return True


@dataclasses.dataclass(frozen=True)
class CurrentScaling:
    """Current (just-in-time) scaling: each cast takes its scale from the tensor being cast, no history.

    `scale = fp8_max / max(amax, eps)`, the same as torchao.float8's tensorwise dynamic scaling. No amax is
    registered with the autocast scope: each cast needs its scale before it runs, so each rank scales from
    its local tensor.
    """

    fp8_format: Format = Format.HYBRID
    eps: float = 1e-12

    def __post_init__(self) -> None:
        if not isinstance(self.fp8_format, Format):
            raise ValueError(f"fp8_format={self.fp8_format!r} must be a Format (E4M3 or HYBRID)")
        if not self.eps > 0:
            raise ValueError(f"eps={self.eps!r} must be positive")

    @property
    def delayed(self) -> bool:
        return False

    @property
    def reduce_amax(self) -> bool:
        return False


Recipe = Union[DelayedScaling, CurrentScaling]
