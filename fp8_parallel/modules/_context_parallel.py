"""Context-parallel sequence layout of megatron-core, and the key/value all-gather of core attention.

megatron splits a sequence of length `S` into `2 * cp` equal chunks and gives CP rank `r` chunks `r` and
`2 * cp - 1 - r` (in that order), so that under a causal mask every rank has the same amount of work
(`megatron.core.utils.get_batch_on_this_cp_rank`). Core attention then needs every rank's keys and values:
`gather_sequence` all-gathers them over the CP group and puts the chunks back into sequence order; its
backward reduce-scatters the gradients (each rank keeps the sum, over all ranks' queries, of the gradient of
its own chunks).
"""
from __future__ import annotations

from typing import List, Tuple

import torch
import torch.distributed as dist

from ._collectives import all_gather_single, reduce_scatter_single


def chunk_indices(cp_size: int, cp_rank: int) -> Tuple[int, int]:
    """The two sequence chunks (of `2 * cp_size`) that CP rank `cp_rank` holds, in the order it holds them."""
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank={cp_rank} is outside a context-parallel group of size {cp_size}")
    return cp_rank, 2 * cp_size - 1 - cp_rank


def _sequence_order(cp_size: int) -> List[int]:
    """For each chunk in sequence order, its index in the gathered `[rank, half]` chunk list."""
    source = [0] * (2 * cp_size)
    for rank in range(cp_size):
        first, second = chunk_indices(cp_size, rank)
        source[first], source[second] = 2 * rank, 2 * rank + 1
    return source


class _AllGatherRows(torch.autograd.Function):
    """All-gather along dim 0 over `group`; backward reduce-scatters the gradient (sum) back to the owners."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        world = dist.get_world_size(group)
        out = local.new_empty((world * local.shape[0], *local.shape[1:]))
        all_gather_single(out, local.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        world = dist.get_world_size(ctx.group)
        out = grad.new_empty((grad.shape[0] // world, *grad.shape[1:]))
        reduce_scatter_single(out, grad.contiguous(), op=dist.ReduceOp.SUM, group=ctx.group)
        return out, None


def gather_sequence(local: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The full sequence (dim 0) in sequence order from every CP rank's two load-balanced chunks.

    Args:
        local: `[2 * c, ...]`, this rank's chunks `r` and `2 * cp - 1 - r`, `c` rows each.
        group: the context-parallel group (rank order = CP rank).

    Returns:
        `[2 * cp * c, ...]`. Differentiable: the backward is one reduce-scatter over `group`.
    """
    cp = dist.get_world_size(group)
    if local.shape[0] % 2:
        raise ValueError(f"context parallel: local sequence length {local.shape[0]} is not two equal chunks")
    chunk = local.shape[0] // 2
    gathered = _AllGatherRows.apply(local, group)  # [cp * 2 * c, ...]: rank 0 (both chunks), rank 1, ...
    chunks = gathered.view(2 * cp, chunk, *local.shape[1:])
    return torch.cat([chunks[i] for i in _sequence_order(cp)])  # slices and one copy: no index tensor
