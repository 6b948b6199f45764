"""Sequence-parallel communication of the FP8 linear: FP8 bytes gathered over the TP group, and when that is
allowed (every rank of the group holds the same delayed scales)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from ._collectives import all_gather_single, reduce_scatter_single

from ..group_state import PerGroup
from ..tensor import Float8Tensor


def all_gather_fp8(local: Float8Tensor, group) -> Float8Tensor:
    """All-gather an FP8 tensor's rows over `group` as uint8 bytes (every rank cast with the same scale)."""
    data = local._data.reshape(-1, local._data.shape[-1])
    full = torch.empty((data.shape[0] * dist.get_world_size(group), data.shape[1]), dtype=torch.uint8,
                       device=data.device)
    all_gather_single(full, data.view(torch.uint8).contiguous(), group=group)
    return Float8Tensor(full.view(data.dtype), local._scale_inv, local.dtype)


def reduce_scatter_rows(t: torch.Tensor, group) -> torch.Tensor:
    out = torch.empty((t.shape[0] // dist.get_world_size(group), *t.shape[1:]), dtype=t.dtype, device=t.device)
    reduce_scatter_single(out, t.contiguous(), group=group)
    return out


_SCALES_SHARED: PerGroup[PerGroup[bool]] = PerGroup()  # scope group -> SP group -> SP ranks within its domain


def scales_shared_over(scope_group, sp_group) -> bool:
    """Whether every rank of `sp_group` reduces amaxes with this rank (then all of them hold the same delayed
    scales, and shards cast separately gather into one correctly scaled FP8 tensor)."""
    if scope_group is None:
        return False
    by_sp_group = _SCALES_SHARED.get_or_compute(scope_group, None, PerGroup)
    return by_sp_group.get_or_compute(sp_group, None, lambda: set(dist.get_process_group_ranks(sp_group)) <= set(
        dist.get_process_group_ranks(scope_group)))
