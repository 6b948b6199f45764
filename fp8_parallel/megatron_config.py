"""FP8 settings from megatron's `TransformerConfig`: the recipe its fields describe, the layers kept in high
precision, and the autocast scope of a block, a layer or the experts. Shared by the layer spec
(`fp8_parallel.megatron`) and the FP8 transformer block (`megatron_block`), which both import it."""
from __future__ import annotations

from typing import Optional

import torch.distributed as dist

from .expert_scope import expert_amax_group as _expert_group
from .recipe import CurrentScaling, DelayedScaling, Format, Recipe
from .scopes import autocast

__all__ = ["fp8_context", "is_bf16_layer", "recipe_from_config"]

_FORMATS = {"e4m3": Format.E4M3, "hybrid": Format.HYBRID}


def recipe_from_config(config) -> Optional[Recipe]:
    """The recipe that megatron's FP8 fields describe, or None when `config.fp8` is off.

    Raises:
        ValueError: an `fp8` format or `fp8_recipe` this package does not implement.
    """
    if not getattr(config, "fp8", None):
        return None
    fmt = _FORMATS.get(str(config.fp8).lower())
    if fmt is None:
        raise ValueError(f"config.fp8={config.fp8!r}: expected one of {sorted(_FORMATS)}")
    kind = str(getattr(config, "fp8_recipe", "delayed")).lower().split(".")[-1]
    if kind == "delayed":
        return DelayedScaling(
            margin=config.fp8_margin, fp8_format=fmt, amax_history_len=config.fp8_amax_history_len,
            amax_compute_algo=config.fp8_amax_compute_algo,
        )
    if kind == "tensorwise":
        return CurrentScaling(fp8_format=fmt)
    raise ValueError(f"config.fp8_recipe={config.fp8_recipe!r}: supported are 'delayed' and 'tensorwise'")


def _dense_group(config) -> Optional[dist.ProcessGroup]:
    import parallel_state
    from megatron.core import parallel_state as mpu

    tp_only = bool(getattr(config, "tp_only_amax_red", False))
    if parallel_state.is_initialized():
        return parallel_state.dense_amax_group(tp_only=tp_only)
    if mpu.model_parallel_is_initialized():
        return mpu.get_amax_reduction_group(with_context_parallel=True, tp_only_amax_red=tp_only)
    return None


def is_bf16_layer(config, layer_no: int) -> bool:
    """Whether global layer `layer_no` (0-based) stays in high precision under `first_last_layers_bf16`."""
    if layer_no < 0 or not getattr(config, "first_last_layers_bf16", False):
        return False
    start, end = config.num_layers_at_start_in_bf16, config.num_layers_at_end_in_bf16
    return layer_no < start or layer_no >= config.num_layers - end


def fp8_context(config, layer_no: int = -1, is_expert: bool = False) -> autocast:
    """The autocast scope for a block (`layer_no=-1`), one layer, or MoE experts, from `config`.
    (Experts inside an enabled scope use `expert_scope()`, which follows that scope's recipe.)"""
    recipe = recipe_from_config(config)
    if recipe is None or is_bf16_layer(config, layer_no):
        return autocast(enabled=False)
    return autocast(recipe=recipe, group=_expert_group() if is_expert else _dense_group(config))
