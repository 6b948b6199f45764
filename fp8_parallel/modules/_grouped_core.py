"""The per-expert FP8 compute both grouped linears share: TransformerEngine's `GroupedLinear`
(`te_grouped_linear.py`) and megatron's expert linear (`grouped.py`). Imports no megatron-core.

One FP8 state per GEMM; expert `i` runs `fp8_linear` on the i-th block of rows. Every expert runs every call,
also with no rows (its input and grad_output amaxes are then 0, which leaves their histories unrolled), so the
amax slots a module registers depend on the model only, never on routing: all ranks of an amax domain
register the same slots in the same order whatever tokens each expert got.

Grouped GEMM. Where torch's grouped FP8 GEMM runs (`torch._scaled_grouped_mm`: CUDA compute capability 9.0 or
10.0, E4M3 operands, bfloat16 output), the experts' forward GEMMs are one grouped GEMM: each expert's input is
cast with its own scale into its rows of one FP8 buffer, the experts' FP8 weights are stacked, and the
per-tensor scales become the GEMM's row-wise scales (one per token row, one per expert output feature). The
backward stays per expert: its gradient operands are E5M2 under the HYBRID format, which the grouped GEMM
does not take. Calls the grouped GEMM cannot serve (biases, layers whose features are not multiples of 16,
other input dtypes, delayed weight gradients, checkpointed regions, FP8 weights) run the per-expert GEMMs.
Which path runs never depends on routing, so the slot layout is the same on every rank.
"""
from __future__ import annotations

import functools
import types
from typing import Any, List, Optional, Sequence, Tuple

import torch

from ..quantize import quantize_row_blocks
from ..scopes import current_scope
from ..tensor import Float8Tensor
from ._core import (SAVED_PER_LINEAR, FP8State, _backward_slot, _plan, _settle_backward, backward_outside_autocast,
                    cast_weight, features_unaligned, fp8_linear, linear_backward, linear_operands)
from ._recompute import checkpoint_region

GROUPED_GEMM = True  # the experts' forward as one grouped FP8 GEMM where it applies (False: per-expert GEMMs)


def expert_states(num_gemms: int, tag: str, device: Optional[torch.device],
                  history_len: Optional[int] = None) -> torch.nn.ModuleList:
    """One `FP8State` per GEMM, tagged `tag.format(i=i)` (the local index: identical on an expert's replicas)."""
    return torch.nn.ModuleList(FP8State(tag.format(i=i), device=device, history_len=history_len)
                               for i in range(num_gemms))


def check_splits(owner: str, m_splits: Sequence[int], num_gemms: int, rows: int, rows_label: str = "") -> List[int]:
    """`m_splits` as a list of ints: one per GEMM, non-negative, summing to the input's `rows`.

    Raises:
        ValueError: naming the splits and the row count (`rows_label` says what the rows are).
    """
    if torch.is_tensor(m_splits):
        if m_splits.dim() != 1:
            raise ValueError(f"{owner}: m_splits of shape {tuple(m_splits.shape)}: expected one split per GEMM "
                             f"({num_gemms})")
        m_splits = m_splits.tolist()
    splits = [int(m) for m in m_splits]
    if len(splits) != num_gemms:
        raise ValueError(f"{owner}: {len(splits)} splits for {num_gemms} GEMMs")
    if any(m < 0 for m in splits) or sum(splits) != rows:
        raise ValueError(f"{owner}: m_splits={splits} must be non-negative and sum to the {rows} input rows"
                         f"{rows_label}")
    return splits


def grouped_fp8_linear(
    x: torch.Tensor,
    splits: Sequence[int],
    weights: Sequence[torch.Tensor],
    biases: Sequence[Optional[torch.Tensor]],
    states: Sequence[FP8State],
    is_first_microbatch: Optional[bool] = None,
    wgrad_in_fp8: bool = True,
    wgrad_stores: Optional[Sequence[Any]] = None,
) -> torch.Tensor:
    """Expert `i` (`weights[i]`, `biases[i]`, `states[i]`) on rows `sum(splits[:i]) : sum(splits[:i+1])` of `x`
    (split along its first dimension; `splits` checked by `check_splits`), the blocks concatenated again.

    Every expert runs, also one without rows (see the module docstring): its output block is empty and its
    weight and bias gradients zero. `is_first_microbatch` caches each expert's weight cast as `fp8_linear` does;
    `wgrad_stores[i]` delays expert `i`'s weight gradient (see `fp8_linear`).
    """
    stores = list(wgrad_stores) if wgrad_stores is not None else [None] * len(weights)
    if _grouped_gemm_applies(x, weights, biases, stores):
        return _grouped_fp8_forward(x, splits, weights, states, is_first_microbatch, wgrad_in_fp8)
    outs = [fp8_linear(chunk, w, b, st, is_first_microbatch, wgrad_in_fp8, wgrad_store=store)
            for chunk, w, b, st, store in zip(torch.split(x, list(splits), dim=0), weights, biases, states, stores)]
    return torch.cat(outs, dim=0)


def device_has_grouped_gemm(device: torch.device) -> bool:
    """Whether torch's grouped FP8 GEMM runs on `device` (CUDA, compute capability 9.0 or 10.0)."""
    return device.type == "cuda" and _cuda_has_grouped_gemm(device.index if device.index is not None
                                                             else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _cuda_has_grouped_gemm(index: int) -> bool:
    return hasattr(torch, "_scaled_grouped_mm") and torch.cuda.get_device_capability(index) in ((9, 0), (10, 0))


def _grouped_gemm_applies(x: torch.Tensor, weights: Sequence[torch.Tensor], biases: Sequence[Optional[torch.Tensor]],
                          stores: Sequence[Any]) -> bool:
    """Whether this call's forward runs as one grouped GEMM (see the module docstring). Depends on the model,
    the input's dtype and device and the FP8 scope, never on routing."""
    if not (GROUPED_GEMM and x.dtype == torch.bfloat16 and device_has_grouped_gemm(x.device)):
        return False
    if any(b is not None for b in biases) or any(s is not None for s in stores):
        return False
    if any(isinstance(w, Float8Tensor) or features_unaligned(w) for w in weights):
        return False
    scope = current_scope()
    return scope is not None and scope.enabled and checkpoint_region() is None  # forward operands: E4M3


def _grouped_fp8_forward(x: torch.Tensor, splits: List[int], weights: Sequence[torch.Tensor],
                         states: Sequence[FP8State], is_first_microbatch: Optional[bool],
                         wgrad_in_fp8: bool) -> torch.Tensor:
    """The experts' FP8 linears with one grouped forward GEMM; the same plans, casts, amax slots and backward
    as the per-expert calls."""
    plans = [_plan(state) for state in states]
    qweights = [cast_weight(w, state, plan, is_first_microbatch) for w, state, plan in zip(weights, states, plans)]
    chunks = torch.split(x, splits, dim=0)
    out = _GroupedFP8Linear.apply((x, splits, qweights, states, plans, wgrad_in_fp8), *chunks, *weights)
    for plan in plans:
        _settle_backward(plan, out)
    return out


def grouped_gemm(a: Float8Tensor, row_sinv: torch.Tensor, qweights: Sequence[Float8Tensor], ends: torch.Tensor) -> torch.Tensor:
    """`[rows, N]` bfloat16: each expert's rows of `a` times its weight, as one `torch._scaled_grouped_mm`.

    `a`: the experts' FP8 inputs stacked by rows, `row_sinv [rows]` each row's input scale_inv; `qweights[i]`:
    expert i's FP8 weight `[N, K]`; `ends`: the experts' row ends (int32, on the device). The per-tensor weight
    scales become row-wise scales of the second operand (each expert's scale_inv per output feature)."""
    n = qweights[0].shape[0]
    if a.shape[0] == 0:
        return torch.zeros((0, n), dtype=torch.bfloat16, device=a.device)
    b = torch.stack([q._data for q in qweights]).transpose(1, 2)  # [E, K, N], column-major
    col_scale = torch.stack([q._scale_inv.reshape(()) for q in qweights]).unsqueeze(1).expand(len(qweights), n)
    return torch._scaled_grouped_mm(a._data, b, row_sinv, col_scale.contiguous(), offs=ends, out_dtype=torch.bfloat16,
                                    use_fast_accum=True)


def _delayed(plans: Sequence[Any]) -> bool:
    return all(p.forward_scale is not None for p in plans)


class _GroupedFP8Linear(torch.autograd.Function):
    """Experts' FP8 linears over row blocks (inputs: the blocks, then the weights): one grouped forward GEMM;
    with delayed scaling one cast launch for all experts' inputs and one for their grad_outputs; the
    per-expert backward GEMMs of `linear_backward`, as `fp8_linear`'s."""

    @staticmethod
    def forward(ctx, meta: Tuple, *tensors: torch.Tensor) -> torch.Tensor:
        x2, splits, qweights, states, plans, wgrad_in_fp8 = meta
        n = len(splits)
        chunks, weights = tensors[:n], tensors[n:]
        fmt = plans[0].recipe.fp8_format
        fp8_wgrad = wgrad_in_fp8 and any(w.requires_grad for w in weights)
        if _delayed(plans):
            blocks = quantize_row_blocks(x2, splits, [p.forward_scale[0:1] for p in plans],
                                         [p.forward_slots[0:1] for p in plans], fmt.forward_dtype, fp8_wgrad)
            casts = [(blocks.block(i), blocks.block_transposed(i)._data if fp8_wgrad else None) for i in range(n)]
            a, row_sinv = Float8Tensor(blocks.data, blocks.sinv[0], x2.dtype), blocks.row_sinv
            ends = blocks.table[2]
        else:  # current scaling: each expert's scale comes from its own amax first
            casts = [None] * n
            a, row_sinv, ends = None, None, None
        records, saved, qxs = [], [], []
        for chunk, w, qw, state, plan, cast in zip(chunks, weights, qweights, states, plans, casts):
            record = types.SimpleNamespace()
            qx, to_save, _ = linear_operands(record, chunk, w, qw, state, plan, wgrad_in_fp8, False, input_cast=cast)
            records.append(record)
            saved.extend(to_save)
            qxs.append(qx)
        if a is None:
            a = Float8Tensor(torch.cat([q._data for q in qxs]), qxs[0]._scale_inv, x2.dtype)
            row_sinv = torch.cat([q._scale_inv.reshape(1).expand(m) for q, m in zip(qxs, splits)])
            ends = torch.tensor(list(_cumulative(splits)), dtype=torch.int64).to(x2.device, non_blocking=True)
        y = grouped_gemm(a, row_sinv, qweights, ends.to(torch.int32))
        del a, qxs, casts
        ctx.save_for_backward(*saved)
        ctx.records, ctx.splits = records, splits
        return y

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        n = len(ctx.splits)
        return backward_outside_autocast(lambda: _GroupedFP8Linear._backward(ctx, grad_out, n), grad_out.device.type)

    @staticmethod
    def _backward(ctx, grad_out: torch.Tensor, n: int):
        saved = ctx.saved_tensors
        records, splits = ctx.records, ctx.splits
        grads_out = torch.split(grad_out, splits, dim=0)
        casts = _grad_casts(records, grad_out, splits, ctx.needs_input_grad[1 + n :])
        grad_x: List[Optional[torch.Tensor]] = [None] * n
        grad_w: List[Optional[torch.Tensor]] = [None] * n
        # the last expert first, as autograd runs the per-expert calls' nodes (newest first)
        for i in reversed(range(n)):
            needs = (ctx.needs_input_grad[1 + i], ctx.needs_input_grad[1 + n + i], False)
            mine = saved[i * SAVED_PER_LINEAR : (i + 1) * SAVED_PER_LINEAR]
            grad_x[i], grad_w[i], _ = linear_backward(records[i], mine, grads_out[i], needs, casts[i])
        return (None, *grad_x, *grad_w)


def _grad_casts(records: Sequence[Any], grad_out: torch.Tensor, splits: Sequence[int], needs_weight_grad):
    """Every expert's grad_output cast in one launch (delayed scaling), as `(qg, qg_t or None)` per expert;
    `[None] * E` (each expert casts its own) otherwise. The experts' backward amax slots are registered last
    expert first, as the per-expert calls' backward nodes run."""
    plans = [r.plan for r in records]
    if not _delayed(plans):
        return [None] * len(records)
    slots = {i: _backward_slot(records[i].plan, records[i].state) for i in reversed(range(len(records)))}
    fp8_wgrad = [r.wgrad_in_fp8 and need for r, need in zip(records, needs_weight_grad)]
    g2 = grad_out.reshape(-1, grad_out.shape[-1])
    blocks = quantize_row_blocks(g2, splits, [r.state.bwd.scale for r in records], [slots[i] for i in range(len(records))],
                                 plans[0].recipe.fp8_format.backward_dtype, any(fp8_wgrad))
    return [(blocks.block(i), blocks.block_transposed(i) if fp8_wgrad[i] else None) for i in range(len(records))]


def _cumulative(splits: Sequence[int]):
    total = 0
    for m in splits:
        total += m
        yield total
