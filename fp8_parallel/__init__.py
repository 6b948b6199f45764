"""fp8_parallel: FP8 training for Megatron-style parallelism.

Importing the package is cheap: the megatron-core integrations (`fp8_parallel.megatron`,
`fp8_parallel.pipeline`, and the tensor-parallel linears) are imported on first access.

TransformerEngine users: `import fp8_parallel as te` and `from fp8_parallel import recipe` stand in for
`import transformer_engine.pytorch as te` and `from transformer_engine.common import recipe`.
"""
from __future__ import annotations

import importlib
from typing import Any, List

from . import ops, recipe
from .amax_table import AmaxLayoutMismatch
from .global_state import FP8GlobalStateManager
from .graphs import GraphedCallable, make_graphed_callables
from .quantizers import Float8CurrentScalingQuantizer, Float8Quantizer, QuantizedTensor, Quantizer
from .modules import (DotProductAttention, FP8State, GroupedLinear, LayerNorm, LayerNormLinear, LayerNormMLP, Linear,
                      MultiheadAttention, RMSNorm, TransformerLayer)
from .recipe import CurrentScaling, DelayedScaling, Float8CurrentScaling, Format, fp8_max
from .scopes import autocast, nonfinite_amax_count
from .te_compat import (
    TE_NAMES_NOT_PROVIDED,
    FP8Availability,
    fp8_autocast,
    fp8_model_init,
    get_cudnn_version,
    get_default_recipe,
    get_device_compute_capability,
    is_bf16_available,
    is_fp8_available,
    is_fp8_block_scaling_available,
    is_mxfp8_available,
    is_nvfp4_available,
    quantized_model_init,
)
from .te_checkpoint import checkpoint
from .te_dtype import DType
from .tensor import Float8Tensor

# name -> module it lives in; imported on first access because these import megatron-core
_LAZY = {
    "megatron": None,
    "pipeline": None,
    "distributed": None,  # TransformerEngine's `transformer_engine.pytorch.distributed` names
    "ColumnParallelLinear": ".modules",
    "RowParallelLinear": ".modules",
    "LayerNormColumnParallelLinear": ".modules",
    # TransformerEngine's RNG tracker API (add, fork, get_states, set_states, reset) is megatron-core's class
    "CudaRNGStatesTracker": "megatron.core.tensor_parallel.random",
}

__all__ = [
    "AmaxLayoutMismatch",
    "ColumnParallelLinear",
    "CudaRNGStatesTracker",
    "CurrentScaling",
    "DType",
    "DelayedScaling",
    "DotProductAttention",
    "FP8Availability",
    "FP8GlobalStateManager",
    "FP8State",
    "Float8CurrentScaling",
    "Float8CurrentScalingQuantizer",
    "Float8Quantizer",
    "Float8Tensor",
    "Format",
    "GraphedCallable",
    "GroupedLinear",
    "LayerNorm",
    "LayerNormColumnParallelLinear",
    "LayerNormLinear",
    "LayerNormMLP",
    "Linear",
    "MultiheadAttention",
    "QuantizedTensor",
    "Quantizer",
    "RMSNorm",
    "RowParallelLinear",
    "TransformerLayer",
    "autocast",
    "checkpoint",
    "fp8_autocast",
    "fp8_max",
    "fp8_model_init",
    "get_cudnn_version",
    "get_default_recipe",
    "get_device_compute_capability",
    "is_bf16_available",
    "is_fp8_available",
    "is_fp8_block_scaling_available",
    "is_mxfp8_available",
    "is_nvfp4_available",
    "make_graphed_callables",
    "megatron",
    "nonfinite_amax_count",
    "ops",
    "pipeline",
    "quantized_model_init",
    "recipe",
]


def __getattr__(name: str) -> Any:
    """`megatron`, `pipeline` and the megatron-signature linears, imported on first access; TransformerEngine
    names that are not provided raise AttributeError saying what to use instead."""
    if name in _LAZY:
        where = _LAZY[name]
        value = importlib.import_module(f".{name}", __name__) if where is None else getattr(
            importlib.import_module(where, __name__), name)
        globals()[name] = value
        return value
    if name in TE_NAMES_NOT_PROVIDED:
        raise AttributeError(f"fp8_parallel has no {name} (a TransformerEngine name): {TE_NAMES_NOT_PROVIDED[name]}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> List[str]:
    return sorted(set(globals()) | set(__all__))
