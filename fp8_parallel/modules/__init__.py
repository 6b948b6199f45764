"""FP8 modules: ones with TransformerEngine's signatures (`Linear`, `LayerNormLinear`, `LayerNormMLP`,
`GroupedLinear`, `MultiheadAttention`, `TransformerLayer`, and the high-precision `LayerNorm` / `RMSNorm` / `DotProductAttention`), and tensor-parallel
ones with megatron-core's signatures (`ColumnParallelLinear`, `RowParallelLinear`, `LayerNormColumnParallelLinear`;
they import megatron-core on first access). megatron's MoE expert layers are in `modules.grouped`."""
from __future__ import annotations

import importlib
from typing import Any, List

from ._core import FP8State, fp8_linear
from .layernorm_mlp import LayerNormMLP
from .linear import Linear
from .te_attention import DotProductAttention
from .te_grouped_linear import GroupedLinear
from .te_layernorm_linear import LayerNormLinear
from .te_multihead_attention import MultiheadAttention
from .te_transformer_layer import TransformerLayer
from .te_norm import LayerNorm, RMSNorm

_MEGATRON_MODULES = {
    "ColumnParallelLinear": ".parallel_linear",
    "RowParallelLinear": ".parallel_linear",
    "LayerNormColumnParallelLinear": ".layernorm_linear",
}

__all__ = [
    "ColumnParallelLinear",
    "DotProductAttention",
    "FP8State",
    "GroupedLinear",
    "LayerNorm",
    "LayerNormColumnParallelLinear",
    "LayerNormLinear",
    "LayerNormMLP",
    "Linear",
    "MultiheadAttention",
    "RMSNorm",
    "RowParallelLinear",
    "TransformerLayer",
    "fp8_linear",
]


def __getattr__(name: str) -> Any:
    """The megatron-signature modules, imported on first access (importing megatron-core takes seconds)."""
    if name in _MEGATRON_MODULES:
        value = getattr(importlib.import_module(_MEGATRON_MODULES[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> List[str]:
    return sorted(set(globals()) | set(__all__))
