"""fp8_parallel: FP8 training for Megatron-style parallelism."""
from .amax_table import AmaxLayoutMismatch
from .graphs import GraphedCallable, make_graphed_callables
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
    "GraphedCallable",
    "Linear",
    "autocast",
    "fp8_autocast",
    "fp8_max",
    "make_graphed_callables",
    "nonfinite_amax_count",
]
