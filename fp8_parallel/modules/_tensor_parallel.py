"""Tensor parallelism of the TransformerEngine-style modules, with TransformerEngine's options and semantics.

`parallel_mode="column"` splits the output features over the `tp_group` ranks: the input is replicated (its
gradient all-reduced in backward) or, with `sequence_parallel`, sharded along its first dimension and
all-gathered before the GEMM (gradient reduce-scattered). `"row"` splits the input features: each rank's
partial output is all-reduced, or reduce-scattered along the first dimension with `sequence_parallel`, and
the (unsplit) bias is added after that. The collectives run in high precision through torch.distributed;
the GEMMs run in FP8 inside an enabled autocast scope, whose amax group should contain the TP ranks (the
default group does) so that the shards of one tensor share their scales.
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from ._collectives import all_gather_single, reduce_scatter_single

MODES = (None, "column", "row")


@dataclasses.dataclass
class TensorParallel:
    """A module's tensor-parallel set-up: `group` (None until set when only `tp_size` was given), `size`,
    `mode` (None, "column" or "row") and `sequence_parallel` (only with size > 1, as in TransformerEngine)."""

    owner: str
    group: Optional[dist.ProcessGroup]
    size: int
    mode: Optional[str]
    sequence_parallel: bool

    @classmethod
    def resolve(cls, owner: str, tp_group: Optional[dist.ProcessGroup], tp_size: int, parallel_mode: Optional[str],
                sequence_parallel: bool, modes: Sequence[Optional[str]] = MODES) -> "TensorParallel":
        """Validate TransformerEngine's `tp_group`, `tp_size`, `parallel_mode`, `sequence_parallel`.

        Raises:
            ValueError: a mode not in `modes`, a size that is not a positive integer.
            TypeError: a `tp_group` that is not a ProcessGroup.
        """
        if parallel_mode not in modes:
            raise ValueError(f"{owner}(parallel_mode={parallel_mode!r}): expected one of {list(modes)}")
        if tp_group is not None:
            if not isinstance(tp_group, dist.ProcessGroup):
                raise TypeError(f"{owner}(tp_group={tp_group!r}): expected a torch.distributed ProcessGroup or None")
            size = dist.get_world_size(tp_group)
        else:
            if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
                raise ValueError(f"{owner}(tp_size={tp_size!r}): expected a positive integer")
            size = tp_size
        return cls(owner, tp_group, size, parallel_mode, size > 1 and bool(sequence_parallel))

    def split(self, features: int, label: str) -> int:
        """This rank's share of `features` (the split dimension)."""
        if features % self.size != 0:
            raise ValueError(f"{self.owner}({label}={features}): not divisible by the tensor-parallel size {self.size}")
        return features // self.size

    def set_group(self, tp_group: Optional[dist.ProcessGroup]) -> None:
        """TransformerEngine's `set_tensor_parallel_group`: the group of a module built with `tp_size` only."""
        if tp_group is not None and not isinstance(tp_group, dist.ProcessGroup):
            raise TypeError(f"{self.owner}.set_tensor_parallel_group({tp_group!r}): expected a ProcessGroup or None")
        size = 1 if tp_group is None else dist.get_world_size(tp_group)
        if size != self.size:
            raise ValueError(f"{self.owner}.set_tensor_parallel_group: the group has {size} ranks, the module was "
                             f"built for tensor-parallel size {self.size}")
        self.group = tp_group

    def require_group(self) -> dist.ProcessGroup:
        if self.group is None:
            raise RuntimeError(f"{self.owner}: built with tp_size={self.size} and no tp_group; call "
                               "set_tensor_parallel_group(group) before the forward")
        return self.group

    @property
    def active(self) -> bool:
        """Whether this module communicates over TP (size > 1 and a parallel mode)."""
        return self.size > 1 and self.mode is not None

    def column_input(self, x: torch.Tensor) -> torch.Tensor:
        """The GEMM input of a column-parallel layer: all-gathered (sequence parallel) or replicated with its
        gradient all-reduced."""
        if not self.active:
            return x
        group = self.require_group()
        return _GatherFirstDim.apply(x, group) if self.sequence_parallel else _CopyToGroup.apply(x, group)

    def row_output(self, y: torch.Tensor) -> torch.Tensor:
        """The output of a row-parallel layer: partial outputs summed (reduce-scattered along the first
        dimension with sequence parallelism)."""
        if not self.active:
            return y
        group = self.require_group()
        return _ReduceScatterFirstDim.apply(y, group) if self.sequence_parallel else _AllReduce.apply(y, group)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """`x` all-gathered along its first dimension under sequence parallelism (else `x`)."""
        return _GatherFirstDim.apply(x, self.require_group()) if self.active and self.sequence_parallel else x


def mark_partitioned(param: Optional[torch.nn.Parameter], dim: int) -> None:
    """megatron's tensor-parallel attributes (`tensor_model_parallel`, `partition_dim`, `partition_stride`)."""
    if param is not None:
        param.tensor_model_parallel, param.partition_dim, param.partition_stride = True, dim, 1


def mark_sequence_parallel(params, sequence_parallel: bool) -> None:
    """The `sequence_parallel` attribute megatron's gradient reduction reads (grads summed over TP)."""
    for p in params:
        if p is not None:
            p.sequence_parallel = sequence_parallel


def _all_gather_first_dim(x: torch.Tensor, group) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty((x.shape[0] * dist.get_world_size(group), *x.shape[1:]), dtype=x.dtype, device=x.device)
    all_gather_single(out, x, group=group)
    return out


def _reduce_scatter_first_dim(x: torch.Tensor, group) -> torch.Tensor:
    size = dist.get_world_size(group)
    if x.shape[0] % size != 0:
        raise ValueError(f"sequence parallel: first dimension {x.shape[0]} is not divisible by the tensor-parallel "
                         f"size {size}")
    out = torch.empty((x.shape[0] // size, *x.shape[1:]), dtype=x.dtype, device=x.device)
    reduce_scatter_single(out, x.contiguous(), group=group)
    return out


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    x = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(x, group=group)
    return x


class _CopyToGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):  # noqa: ARG004
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):  # noqa: ARG004
        return grad, None


class _GatherFirstDim(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather_first_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_first_dim(grad, ctx.group), None


class _ReduceScatterFirstDim(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_first_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_first_dim(grad, ctx.group), None
