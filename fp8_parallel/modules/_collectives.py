"""Single-tensor all-gather and reduce-scatter under their current torch names.

torch 2.13 renamed `all_gather_into_tensor` / `reduce_scatter_tensor` to `all_gather_single` /
`reduce_scatter_single` and warns (FutureWarning) on every call of the old names; older torch has only the old
ones. The name is looked up per call, so a test that wraps `torch.distributed.all_gather_single` sees the calls.
"""
from __future__ import annotations

import torch.distributed as dist


def all_gather_single(output, input, group=None, async_op: bool = False):
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(output, input, group=group, async_op=async_op)


def reduce_scatter_single(output, input, op=dist.ReduceOp.SUM, group=None, async_op: bool = False):
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(output, input, op=op, group=group, async_op=async_op)
