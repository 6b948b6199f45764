"""The experts' FP8 linears as autograd Functions on torch's grouped FP8 GEMM (`torch._scaled_grouped_mm`).

Forward: one grouped GEMM. Each expert's input is cast with its own scale into its rows of one FP8 buffer
(with delayed scaling all experts in one launch, `quantize_row_blocks`), the experts' FP8 weights are taken
as one stack (`ExpertWeightStack`, where the weight casts are cached; else stacked per call), and the
per-tensor scales become the GEMM's row-wise scales (one per token row, one per expert output feature).

Backward, with delayed scaling and FP8 weight gradients (`GroupedSharedCastsLinear`): all experts'
grad_outputs are cast in one launch. The GEMMs are grouped when their operands are E4M3 (the E4M3 format)
and every expert's weight takes a bfloat16 gradient: the input gradient as one grouped GEMM over the rows,
the weight gradients as one grouped GEMM contracting over each expert's rows (its operands, the inputs' and
grad_outputs' transposes, stored as one matrix each with every expert's rows padded to 16 with zeros).
torch's grouped FP8 GEMM takes no E5M2, so HYBRID's gradients run one GEMM per expert, issued straight from
the casts' buffers (`_direct_expert_backward`). Under current scaling or with high-precision weight
gradients (`GroupedFP8Linear`) each expert runs `fp8_linear`'s backward (`linear_backward`).
"""
from __future__ import annotations

import dataclasses
import functools
import types
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from .. import gemm as _gemm
from .. import native
from ..device_tables import device_table
from ..gemm import _scale_operand
from ..native import DTYPE_CODES
from ..quantize import SINV_STRIDE, RowBlocks, quantize_row_blocks
from ..tensor import Float8Tensor
from ._core import (SAVED_PER_LINEAR, _backward_slot, _weight_operand, _weight_transposed, backward_outside_autocast,
                    experts_backward_done, linear_backward, linear_operands)
from ._main_grad import add_into_main_grads, grad_after_main_grad


def device_has_grouped_gemm(device: torch.device) -> bool:
    """Whether torch's grouped FP8 GEMM runs on `device` (CUDA, compute capability 9.0 or 10.0)."""
    return device.type == "cuda" and _cuda_has_grouped_gemm(device.index if device.index is not None
                                                             else torch.cuda.current_device())


def device_has_bf16_grouped_gemm(device: torch.device) -> bool:
    """Whether torch's bfloat16 grouped GEMM (`torch._grouped_mm`) serves the experts on `device` (CUDA, compute
    capability 9.0 or 10.0; elsewhere the experts run one GEMM each)."""
    return hasattr(torch, "_grouped_mm") and device_has_grouped_gemm(device)


@functools.lru_cache(maxsize=None)
def _cuda_has_grouped_gemm(index: int) -> bool:
    return hasattr(torch, "_scaled_grouped_mm") and torch.cuda.get_device_capability(index) in ((9, 0), (10, 0))


def cumulative(splits: Sequence[int]) -> Iterator[int]:
    """The running sums of `splits` (each block's end)."""
    total = 0
    for m in splits:
        total += m
        yield total


class ExpertWeightStack:
    """The experts' cached FP8 weights in one home: data `[E, N, K]`, transposes `[E, K, N]` and scale_invs
    (16 bytes apart), each expert's cache (`FP8State.weight_fp8`) a Float8Tensor viewing its slices. The
    weight casts write into the views in place (as into any cache), and the grouped GEMMs take the stacks as
    they are: no copy of every expert's FP8 weight per call. Kept on the first expert's state
    (`FP8State.expert_stack`); it serves a call only while every expert's cache is still its view."""

    def __init__(self, weights: Sequence[torch.Tensor], fp8_dtype: torch.dtype):
        e, (n, k), device = len(weights), weights[0].shape, weights[0].device
        self.data = torch.empty((e, n, k), dtype=fp8_dtype, device=device)
        self.transposes = torch.empty((e, k, n), dtype=fp8_dtype, device=device)
        self.sinv = torch.ones(e * SINV_STRIDE, dtype=torch.float32, device=device)
        self.views = []
        for i in range(e):
            view = Float8Tensor(_own_version(self.data, i), self.sinv[i * SINV_STRIDE], weights[i].dtype)
            view._transpose_cache.buffer = self.transposes[i]
            self.views.append(view)
        self._columns: Dict[int, Tuple[int, torch.Tensor]] = {}  # n -> (casts written, [E, n] scales)

    def fits(self, weights: Sequence[torch.Tensor], fp8_dtype: torch.dtype) -> bool:
        """Whether these weights' casts can live here (count, shape, device, FP8 dtype)."""
        same_kind = self.data.dtype == fp8_dtype and self.data.device == weights[0].device
        return (same_kind and len(weights) == len(self.views)
                and all(w.shape == v.shape for w, v in zip(weights, self.views)))

    def serves(self, qweights: Sequence[Any]) -> bool:
        """Whether `qweights` are exactly this stack's views (the casts a call uses)."""
        return len(qweights) == len(self.views) and all(q is v for q, v in zip(qweights, self.views))

    def column_scales(self, n: int) -> torch.Tensor:
        """`[E, n]` contiguous: each expert's weight scale_inv repeated per output feature, made again only
        after a weight cast wrote the views (counted by their casts: a kernel's writes bump no version)."""
        written = sum(v._transpose_cache.writes for v in self.views)
        cached = self._columns.get(n)
        if cached is None or cached[0] != written:
            cols = self.sinv[::SINV_STRIDE].unsqueeze(1).expand(len(self.views), n).contiguous()
            self._columns[n] = cached = (written, cols)
        return cached[1]


def _own_version(stack: torch.Tensor, i: int) -> torch.Tensor:
    """`stack[i]` as a tensor on the same memory with its own version counter: a view would share the
    stack's, so writing one expert's cast would make every other cache's transpose look stale."""
    part = stack[i]
    t = torch.empty(0, dtype=stack.dtype, device=stack.device)
    return t.set_(stack.untyped_storage(), part.storage_offset(), part.shape, part.stride())


def stacked_weights(weights: Sequence[torch.Tensor], states: Sequence[Any], fp8_dtype: torch.dtype) -> None:
    """Before a grouped call's cached weight casts: give the experts' caches one `ExpertWeightStack` home
    (once; again when the weights' shapes or FP8 dtype change). A new home's views are stale, so the casts
    that follow fill them."""
    stack = states[0].expert_stack
    if stack is not None and stack.fits(weights, fp8_dtype):
        if stack.serves([s.weight_fp8 for s in states]):
            return
    stack = ExpertWeightStack(weights, fp8_dtype)
    for state, view in zip(states, stack.views):
        state.weight_fp8, state.weight_version = view, None
    states[0].expert_stack = stack


def grouped_gemm(a: torch.Tensor, row_sinv: torch.Tensor, weights: Sequence[torch.Tensor],
                 weight_sinvs: Sequence[torch.Tensor], ends: torch.Tensor, use_fast_accum: bool = True,
                 stacked: Optional[Tuple[torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
    """`[rows, N]` bfloat16: each expert's rows of `a` times its FP8 weight (`weights[i]`: `[N, K]`, K
    contiguous; `a @ W.T` per expert), as one `torch._scaled_grouped_mm`. `a`: the experts' FP8 rows,
    `row_sinv [rows]` each row's scale_inv; `ends`: the experts' row ends (int32, on the device). The per-tensor
    weight scales (`weight_sinvs[i]`, one element each) become row-wise scales of the second operand (each expert's
    scale_inv per output feature). `stacked`: the weights already as one `[E, N, K]` tensor and their `[E, N]`
    column scales (`ExpertWeightStack`), used instead of stacking `weights`."""
    n = stacked[0].shape[1] if stacked is not None else weights[0].shape[0]
    if a.shape[0] == 0:
        return torch.zeros((0, n), dtype=torch.bfloat16, device=a.device)
    if stacked is not None:
        b, col_scale = stacked[0].transpose(1, 2), stacked[1]
    else:
        b = torch.stack(weights).transpose(1, 2)  # [E, K, N], column-major
        sinvs = torch.stack([s if s.dim() == 0 else s.reshape(()) for s in weight_sinvs])
        col_scale = sinvs.unsqueeze(1).expand(len(weights), n).contiguous()
    return torch._scaled_grouped_mm(a, b, row_sinv, col_scale, offs=ends, out_dtype=torch.bfloat16,
                                    use_fast_accum=use_fast_accum)


def grouped_wgrad(g_t: RowBlocks, x_t: RowBlocks) -> torch.Tensor:
    """`[E, N, K]` bfloat16: every expert's `g_e^T @ x_e` as one grouped GEMM contracting over its rows, from
    the grad_outputs' and the inputs' transposes in the one-matrix layout (`[N, padded]`, `[K, padded]`;
    both blocks' rows padded alike, with zeros)."""
    e = len(g_t.rows)
    n, k = g_t.data.shape[1], x_t.data.shape[1]
    scale_a = g_t.sinv[::SINV_STRIDE].unsqueeze(1).expand(e, n).reshape(-1)
    scale_b = x_t.sinv[::SINV_STRIDE].unsqueeze(1).expand(e, k).reshape(-1)
    ends = (g_t.table[3] + g_t.table[4]).to(torch.int32)  # padded starts + padded rows, already on the device
    return torch._scaled_grouped_mm(g_t.transposed_matrix(), x_t.transposed_matrix().t(), scale_a, scale_b,
                                    offs=ends, out_dtype=torch.bfloat16)


def _delayed(plans: Sequence[Any]) -> bool:
    return all(p.forward_scale is not None for p in plans)


def _grouped_backward(plans: Sequence[Any], weights: Sequence[torch.Tensor], wgrad_in_fp8: bool) -> bool:
    """Whether the backward GEMMs are grouped (see the module docstring)."""
    return (_delayed(plans) and plans[0].recipe.fp8_format.backward_dtype == torch.float8_e4m3fn and wgrad_in_fp8
            and all(w.requires_grad and w.dtype == torch.bfloat16 for w in weights))


def shares_casts(plans: Sequence[Any], wgrad_in_fp8: bool) -> bool:
    """Whether a grouped call runs as `GroupedSharedCastsLinear` (delayed scaling and FP8 weight gradients,
    megatron's and TransformerEngine's defaults) rather than `GroupedFP8Linear`."""
    return wgrad_in_fp8 and _delayed(plans)


class GroupedSharedCastsLinear(torch.autograd.Function):
    """Experts' FP8 linears with delayed scaling and FP8 weight gradients. `apply(meta, x, *weights)` with
    `meta = (splits, qweights, states, plans)` (as `fp8_linear` takes them per expert), `x` the whole 2-d
    input: returns the `[rows, N]` bfloat16 output, and its backward the whole input gradient. `meta` may end
    with `into`: per expert whether its weight gradient goes into its `main_grad` (fused accumulation).

    Forward: every expert's input cast (and transpose) in one launch, one grouped GEMM. Kept for backward:
    the inputs' transposes and scale_invs (`ctx.x_blocks`, the row-major data freed), and per expert a record
    and its weight's dgrad operand (`_weight_operand`: the cached FP8 transpose, or the weight to re-cast; 4
    saved tensors per expert). Backward: one grad cast for all experts, then grouped GEMMs (E4M3) or the
    per-expert GEMMs issued directly (HYBRID)."""

    @staticmethod
    def forward(ctx, meta: Tuple, x: torch.Tensor, *weights: torch.Tensor) -> torch.Tensor:
        splits, qweights, states, plans = meta[:4]
        into = meta[4] if len(meta) > 4 else [False] * len(weights)
        ctx.splits = splits
        ctx.grouped_backward = _grouped_backward(plans, weights, True)
        fmt = plans[0].recipe.fp8_format
        fp8_wgrad = any(w.requires_grad for w in weights)
        blocks = quantize_row_blocks(x, splits, [p.forward_scale for p in plans], [p.forward_slots for p in plans],
                                     fmt.forward_dtype, fp8_wgrad, one_matrix=ctx.grouped_backward)
        ctx.ends = blocks.table[2].to(torch.int32)
        stack = states[0].expert_stack
        ctx.stack = stack if stack is not None and stack.serves(qweights) else None
        n = qweights[0].shape[0]
        y = grouped_gemm(blocks.data, blocks.row_sinv, [q._data for q in qweights], [q._scale_inv for q in qweights],
                         ctx.ends, stacked=None if ctx.stack is None else (ctx.stack.data, ctx.stack.column_scales(n)))
        ctx.x_blocks = dataclasses.replace(blocks, data=blocks.data.new_empty((0, blocks.data.shape[1])),
                                           row_sinv=blocks.row_sinv.new_empty(0))
        records, saved = [], []
        for w, qw, state, plan, fused in zip(weights, qweights, states, plans, into):
            w_saved, cached = _weight_operand(w, qw, state, plan) if x.requires_grad else ([None] * 4, None)
            saved.extend(w_saved)
            records.append(types.SimpleNamespace(plan=plan, state=state, cached_weight=cached, w_dtype=w.dtype,
                                                 main_grad_of=w if fused else None))
        ctx.x_dtype = x.dtype
        ctx.save_for_backward(*saved)
        ctx.records = records
        return y

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        def run():
            saved = ctx.saved_tensors
            grads = (_grouped_backward_gemms if ctx.grouped_backward else _direct_expert_backward)(ctx, saved, grad_out)
            return (None, *grads)

        return backward_outside_autocast(run, grad_out.device.type)


class GroupedFP8Linear(torch.autograd.Function):
    """Experts' FP8 linears under current scaling or with high-precision weight gradients. `apply(meta,
    *blocks, *weights)` with `meta = (x, splits, qweights, states, plans, wgrad_in_fp8)`: `x` the whole 2-d
    input, `blocks` its row blocks (autograd inputs), the rest as `fp8_linear` takes them per expert (`meta`
    may end with `into`, as for `GroupedSharedCastsLinear`). One
    grouped forward GEMM; each expert keeps `fp8_linear`'s record and runs `linear_backward` (with delayed
    scaling from one grad cast for all experts). Returns the `[rows, N]` bfloat16 output."""

    @staticmethod
    def forward(ctx, meta: Tuple, *tensors: torch.Tensor) -> torch.Tensor:
        x2, splits, qweights, states, plans, wgrad_in_fp8 = meta[:6]
        n = len(splits)
        into = meta[6] if len(meta) > 6 else [False] * n
        chunks, weights = tensors[:n], tensors[n:]
        ctx.splits = splits
        fmt = plans[0].recipe.fp8_format
        if _delayed(plans):  # high-precision weight gradients: no transposes
            blocks = quantize_row_blocks(x2, splits, [p.forward_scale for p in plans],
                                         [p.forward_slots for p in plans], fmt.forward_dtype, False)
            casts = [(blocks.block(i), None) for i in range(n)]
        else:  # current scaling: each expert's scale comes from its own amax first
            casts = [None] * n
        records, saved, qxs = [], [], []
        for chunk, w, qw, state, plan, cast, fused in zip(chunks, weights, qweights, states, plans, casts, into):
            record = types.SimpleNamespace()
            qx, to_save, _ = linear_operands(record, chunk, w, qw, state, plan, wgrad_in_fp8, False, input_cast=cast,
                                             into_main_grad=fused)
            records.append(record)
            saved.extend(to_save)
            qxs.append(qx)
        if casts[0] is not None:
            a, row_sinv, ends = blocks.data, blocks.row_sinv, blocks.table[2]
        else:
            a = torch.cat([q._data for q in qxs])
            row_sinv = torch.cat([q._scale_inv.reshape(1).expand(m) for q, m in zip(qxs, splits)])
            ends = device_table(list(cumulative(splits)), torch.int64, x2.device)
        y = grouped_gemm(a, row_sinv, [q._data for q in qweights], [q._scale_inv for q in qweights],
                         ends.to(torch.int32))
        del a, qxs, casts
        ctx.save_for_backward(*saved)
        ctx.records = records
        return y

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        n = len(ctx.splits)
        return backward_outside_autocast(lambda: GroupedFP8Linear._backward(ctx, grad_out, n), grad_out.device.type)

    @staticmethod
    def _backward(ctx, grad_out: torch.Tensor, n: int):
        saved = ctx.saved_tensors
        records, splits = ctx.records, ctx.splits
        grads_out = torch.split(grad_out, splits, dim=0)
        casts = _grad_casts(records, grad_out, splits)
        grad_x: List[Optional[torch.Tensor]] = [None] * n
        grad_w: List[Optional[torch.Tensor]] = [None] * n
        # the last expert first, as autograd runs the per-expert calls' nodes (newest first)
        for i in reversed(range(n)):
            needs = (ctx.needs_input_grad[1 + i], ctx.needs_input_grad[1 + n + i], False)
            mine = saved[i * SAVED_PER_LINEAR : (i + 1) * SAVED_PER_LINEAR]
            grad_x[i], grad_w[i], _ = linear_backward(records[i], mine, grads_out[i], needs, casts[i])
        return (None, *grad_x, *grad_w)


def _backward_blocks(records: Sequence[Any], grad_out: torch.Tensor, splits: Sequence[int], with_transpose: bool,
                     one_matrix: bool) -> RowBlocks:
    """Every expert's grad_output cast in one launch (delayed scaling). The experts' backward amax slots are
    registered last expert first, as the per-expert calls' backward nodes run."""
    key = records[0].plan.key_state
    if key is not None:
        slots = key.backward.slots_of([r.state.bwd for r in reversed(records)])[::-1]
    else:
        slots = [_backward_slot(r.plan, r.state) for r in records]
    g2 = grad_out.reshape(-1, grad_out.shape[-1])
    return quantize_row_blocks(g2, splits, [r.state.bwd.scale for r in records], slots,
                               records[0].plan.recipe.fp8_format.backward_dtype, with_transpose, one_matrix=one_matrix)


def _grad_casts(records: Sequence[Any], grad_out: torch.Tensor, splits: Sequence[int]):
    """`(qg, None)` per expert for `linear_backward` from one cast launch (delayed scaling, high-precision weight
    gradients); `[None] * E` (each expert casts its own) under current scaling."""
    if not _delayed([r.plan for r in records]):
        return [None] * len(records)
    blocks = _backward_blocks(records, grad_out, splits, False, one_matrix=False)
    return [(blocks.block(i), None) for i in range(len(records))]


def _dgrad_operands(ctx, saved) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """Per expert its weight's FP8 transpose `[K, N]` and scale_inv (the cached pair, or a re-cast)."""
    out = []
    for i, r in enumerate(ctx.records):
        if r.cached_weight is not None and r.cached_weight[0] is not None:
            out.append(r.cached_weight)
        else:
            w_t = _weight_transposed(saved[4 * i : 4 * i + 4], r.cached_weight, r.plan, r.w_dtype)
            out.append((w_t._data, w_t._scale_inv))
    return out


def _grouped_backward_gemms(ctx, saved, grad_out: torch.Tensor):
    """E4M3 gradients: the input gradient and the weight gradients as one grouped GEMM each."""
    records = ctx.records
    g = _backward_blocks(records, grad_out, ctx.splits, with_transpose=True, one_matrix=True)
    grad_x = None
    if ctx.needs_input_grad[1]:
        stack = ctx.stack
        w_t = _dgrad_operands(ctx, saved) if stack is None else [(None, None)]
        stacked = None if stack is None else (stack.transposes, stack.column_scales(stack.transposes.shape[1]))
        grad_x = grouped_gemm(g.data, g.row_sinv, [w for w, _ in w_t], [s for _, s in w_t], ctx.ends,
                              use_fast_accum=False, stacked=stacked)
    dw = grouped_wgrad(g, ctx.x_blocks).unbind(0)
    fused = [i for i, r in enumerate(records) if r.main_grad_of is not None]
    grad_w = list(dw)
    for i, placeholder in zip(fused, add_into_main_grads([records[i].main_grad_of for i in fused],
                                                         [dw[i] for i in fused])):
        grad_w[i] = placeholder
    experts_backward_done([r.plan for r in records])
    return (grad_x, *grad_w)


def _direct_expert_backward(ctx, saved, grad_out: torch.Tensor):
    """The per-expert backward GEMMs (HYBRID: E5M2 gradients, which torch's grouped GEMM does not take) issued
    straight from the one-launch grad cast and the forward's shared input casts (`direct_expert_gemms`): the
    GEMMs, operands, scales and order of `linear_backward` per expert (so the same bytes), each expert's input
    gradient written into its rows of the whole one, without a Float8Tensor or an `fp8_gemm` check per
    operand. The grouped path guarantees what that generality is for here: aligned features and 16-byte
    aligned views (`RowBlocks`), no biases, no sequence parallelism, no delayed weight gradients."""
    records, splits = ctx.records, ctx.splits
    needs_x, needs_w = ctx.needs_input_grad[1], ctx.needs_input_grad[2:]
    g = _backward_blocks(records, grad_out, splits, any(needs_w), one_matrix=False)
    owners = [r.main_grad_of if need else None for r, need in zip(records, needs_w)]
    grad_x, grad_w = direct_expert_gemms(
        g, ctx.x_blocks, splits, _dgrad_operands(ctx, saved) if needs_x else None, needs_w, ctx.x_dtype,
        [r.w_dtype for r in records], [None if o is None else o.main_grad for o in owners])
    for i, owner in enumerate(owners):
        if owner is not None:
            grad_w[i] = grad_after_main_grad(owner)
    experts_backward_done([r.plan for r in records])
    return (grad_x, *grad_w)


def direct_expert_gemms(g: RowBlocks, x: RowBlocks, splits: Sequence[int],
                        w_t: Optional[Sequence[Tuple[torch.Tensor, torch.Tensor]]], needs_w: Sequence[bool],
                        x_dtype: torch.dtype, w_dtypes: Sequence[torch.dtype],
                        main_grads: Sequence[Optional[torch.Tensor]]
                        ) -> Tuple[Optional[torch.Tensor], List[Optional[torch.Tensor]]]:
    """The experts' backward GEMMs from their grad_outputs' casts `g` (with transposes where a weight gradient
    is needed) and their inputs' transposes `x`, the last expert first: the input gradient `[rows, K]` in
    `x_dtype` (given `w_t`, each expert's weight FP8 transpose `[K, N]` and scale_inv), and per expert with
    `needs_w[i]` its weight gradient in `w_dtypes[i]` (zeros without rows) or, given `main_grads[i]`, added
    into it (float32 accumulation, one rounding; None returned). One compiled call where the extension runs
    on the device (the same GEMMs; a fused add in the GEMM's epilogue on CUDA), else a Python loop."""
    n = len(splits)
    n_out, k = g.data.shape[1], x.data.shape[1]
    device = g.data.device
    ext = native.for_device(device)
    codes = [DTYPE_CODES.get(d) for d in (x_dtype, *w_dtypes)]
    if ext is not None and None not in codes:
        out = ext.experts_bwd(
            n_out, k, g.data if w_t is not None else None, g.sinv[::SINV_STRIDE], list(splits),
            [w for w, _ in w_t] if w_t is not None else [], [s for _, s in w_t] if w_t is not None else [],
            codes[0], g.transposes if any(needs_w) else None, x.transposes if any(needs_w) else None,
            x.sinv[::SINV_STRIDE], list(g.padded_starts), list(g.padded_rows), [bool(b) for b in needs_w],
            codes[1:], list(main_grads))
        return (out[0] if w_t is not None else None), list(out[1:])
    g_sinv = g.sinv[::SINV_STRIDE].unbind(0)  # 0-d views, 16 bytes apart
    grad_x = None
    grad_w: List[Optional[torch.Tensor]] = [None] * n
    if w_t is not None:
        grad_x = torch.empty((g.data.shape[0], k), dtype=x_dtype, device=device)
        g_rows, dx_rows = g.data.split(list(splits)), grad_x.split(list(splits))
        for i in reversed(range(n)):  # the last expert first, as autograd runs the per-expert calls' nodes
            if splits[i]:
                qw_t, qw_sinv = w_t[i]
                _gemm.scaled_mm(g_rows[i], qw_t.t(), scale_a=g_sinv[i], scale_b=_scale_operand(qw_sinv),
                                out_dtype=x_dtype, out=dx_rows[i])
    if any(needs_w):
        x_sinv = x.sinv[::SINV_STRIDE].unbind(0)
        for i in reversed(range(n)):
            if not needs_w[i]:
                continue
            ps, pm = g.padded_starts[i], g.padded_rows[i]
            if pm == 0:
                if main_grads[i] is None:
                    grad_w[i] = torch.zeros((n_out, k), dtype=w_dtypes[i], device=device)
                continue
            # block i's transposes, [N, padded] row-major and [K, padded] as its column-major transpose
            g_t = g.transposes.as_strided((n_out, pm), (pm, 1), n_out * ps)
            x_t = x.transposes.as_strided((pm, k), (1, pm), k * ps)
            if main_grads[i] is not None:
                main_grads[i].add_(_gemm.scaled_mm(g_t, x_t, scale_a=g_sinv[i], scale_b=x_sinv[i],
                                                   out_dtype=torch.float32))
            else:
                grad_w[i] = _gemm.scaled_mm(g_t, x_t, scale_a=g_sinv[i], scale_b=x_sinv[i], out_dtype=w_dtypes[i])
    return grad_x, grad_w
