"""FP8 modules with megatron-core's signatures."""
from ._core import FP8State, fp8_linear
from .linear import Linear

__all__ = ["FP8State", "Linear", "fp8_linear"]
