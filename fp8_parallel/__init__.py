"""fp8_parallel: FP8 training for Megatron-style parallelism."""
from .recipe import CurrentScaling, DelayedScaling, Format, fp8_max
from .tensor import Float8Tensor

__all__ = ["CurrentScaling", "DelayedScaling", "Float8Tensor", "Format", "fp8_max"]
