"""FP8 modules with megatron-core's signatures."""
from ._core import FP8State, fp8_linear
from .layernorm_linear import LayerNormColumnParallelLinear
from .linear import Linear
from .parallel_linear import ColumnParallelLinear, RowParallelLinear

__all__ = [
    "ColumnParallelLinear",
    "FP8State",
    "LayerNormColumnParallelLinear",
    "Linear",
    "RowParallelLinear",
    "fp8_linear",
]
