"""TransformerEngine's `transformer_engine.pytorch.distributed` names that user code imports.

`checkpoint` and `CudaRNGStatesTracker` are the package's own (`fp8_parallel.checkpoint`, megatron-core's
tracker); the rest are small helpers with TransformerEngine's signatures. FSDP needs no preparation here:
these modules keep no FP8 weight copies or activations that would have to be scattered over FSDP's group, and
their amaxes are reduced over the autocast scope's group (by default the world group when torch.distributed
is initialized), which holds FSDP's data-parallel ranks.
"""
from __future__ import annotations

import importlib
from typing import Any, Optional, Tuple

import torch
import torch.distributed as dist

from .modules._recompute import Phase, checkpoint_region
from .scopes import current_scope
from .te_checkpoint import checkpoint

__all__ = ["checkpoint", "gather_along_first_dim", "get_distributed_world_size",
           "in_fp8_activation_recompute_phase", "is_fp8_activation_recompute_enabled", "prepare_te_modules_for_fsdp"]


def __getattr__(name: str) -> Any:
    if name == "CudaRNGStatesTracker":  # megatron-core's class, imported on first access
        return importlib.import_module("megatron.core.tensor_parallel.random").CudaRNGStatesTracker
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def get_distributed_world_size(group: Optional[dist.ProcessGroup] = None) -> int:
    """The size of `group` (default: the world), 1 without torch.distributed."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def gather_along_first_dim(inp: torch.Tensor, process_group: Optional[dist.ProcessGroup], async_op: bool = False,
                           quantizer: Any = None) -> Tuple[torch.Tensor, Optional[Any]]:
    """All-gather `inp` over `process_group` along its first dimension, in rank order: `(output, handle)`, the
    handle None unless `async_op` (then wait on it before reading the output). `quantizer`: only None."""
    if quantizer is not None:
        raise NotImplementedError("gather_along_first_dim(quantizer=...): only None here (gather high-precision "
                                  "tensors, or all-gather a Float8Tensor's data and scale_inv yourself)")
    world = get_distributed_world_size(process_group)
    if world == 1:
        return inp, None
    out = torch.empty((inp.shape[0] * world, *inp.shape[1:]), dtype=inp.dtype, device=inp.device)
    handle = dist.all_gather_into_tensor(out, inp.contiguous(), group=process_group, async_op=async_op)
    return out, handle


def is_fp8_activation_recompute_enabled() -> bool:
    """True inside an activation-checkpointed region under an enabled FP8 autocast scope, and in the recompute of
    such a region (which runs in backward, outside the scope) once its first pass made FP8 calls."""
    region = checkpoint_region()
    if region is None:
        return False
    if region.phase is Phase.RECOMPUTE:
        return region.first_pass_ran_fp8()
    scope = current_scope()
    return scope is not None and scope.enabled


def in_fp8_activation_recompute_phase() -> bool:
    """True while a checkpointed region's forward is recomputed (in backward)."""
    region = checkpoint_region()
    return region is not None and region.phase is Phase.RECOMPUTE


def prepare_te_modules_for_fsdp(fsdp_root: torch.nn.Module) -> None:
    """TransformerEngine's preparation of an FSDP-wrapped model (call it after wrapping): checks that
    `fsdp_root` is torch's `FullyShardedDataParallel` and returns; nothing else is needed here (see the
    module docstring)."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    if not isinstance(fsdp_root, FullyShardedDataParallel):
        raise TypeError(f"prepare_te_modules_for_fsdp: expected the root FullyShardedDataParallel module, got "
                        f"{type(fsdp_root).__name__}")
