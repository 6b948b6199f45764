"""fp8_parallel: FP8 training for Megatron-style parallelism."""
from .amax_table import AmaxLayoutMismatch
from .scopes import autocast, fp8_autocast, nonfinite_amax_count
from .modules import ColumnParallelLinear, LayerNormColumnParallelLinear, Linear, RowParallelLinear
from .recipe import CurrentScaling, DelayedScaling, Format, fp8_max
from .tensor import Float8Tensor

__all__ = [
    "AmaxLayoutMismatch",
    "ColumnParallelLinear",
    "LayerNormColumnParallelLinear",
    "RowParallelLinear",
    "CurrentScaling",
    "DelayedScaling",
    "Float8Tensor",
    "Format",
    "Linear",
    "autocast",
    "fp8_autocast",
    "fp8_max",
    "nonfinite_amax_count",
]
