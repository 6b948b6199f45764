"""The per-expert FP8 compute both grouped linears share: TransformerEngine's `GroupedLinear`
(`te_grouped_linear.py`) and megatron's expert linear (`grouped.py`). Imports no megatron-core.

One FP8 state per GEMM; expert `i` runs `fp8_linear` on the i-th block of rows. Every expert runs every call,
also with no rows (its input and grad_output amaxes are then 0, which leaves their histories unrolled), so the
amax slots a module registers depend on the model only, never on routing: all ranks of an amax domain
register the same slots in the same order whatever tokens each expert got.

Grouped GEMM (`grouped_gemm=True`: megatron's expert layer; TransformerEngine's `GroupedLinear` only with
`use_grouped_gemm`, since TransformerEngine promises per-GEMM results bit for bit). Where torch's grouped FP8 GEMM runs (CUDA compute capability 9.0 or 10.0; bfloat16 input,
no biases, features multiples of 16, no delayed weight gradients, outside checkpointed regions, no FP8
weights) the experts run as one autograd Function (`_grouped_gemm.py`): the forward GEMMs as one grouped
GEMM, and with delayed scaling each direction's casts in one launch. Which path runs never depends on
routing, so the slot layout is the same on every rank. Without FP8 (no enabled scope; bfloat16 input and
weights, no biases, features multiples of 16, no delayed weight gradients, outside checkpointed regions, at
least one row) the same devices run the experts as one bfloat16 grouped GEMM per direction
(`torch._grouped_mm`), as megatron's grouped expert layer does with its grouped-GEMM kernels; the weights are
stacked per GEMM and not kept stacked from forward to backward (no copy of every expert weight held per call).
"""
from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

import torch

from ..device_tables import device_table
from ..scopes import current_scope
from ..tensor import Float8Tensor
from ._core import FP8State, cast_weight, expert_plans, features_unaligned, fp8_linear, settle_experts_backward
from ._grouped_gemm import (GroupedFP8Linear, GroupedSharedCastsLinear, cumulative, device_has_bf16_grouped_gemm,
                            device_has_grouped_gemm, shares_casts, stacked_weights)
from ._main_grad import add_into_main_grads
from ._recompute import checkpoint_region

GROUPED_GEMM = True  # False: never the grouped FP8 GEMM, whatever a module asks for (per-expert GEMMs)


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
    grouped_gemm: bool = False,
    into_main_grad: Optional[Sequence[bool]] = None,
) -> torch.Tensor:
    """Expert `i` (`weights[i]`, `biases[i]`, `states[i]`) on rows `sum(splits[:i]) : sum(splits[:i+1])` of `x`
    (split along its first dimension; `splits` checked by `check_splits`), the blocks concatenated again.

    Every expert runs, also one without rows (see the module docstring): its output block is empty and its
    weight and bias gradients zero. `is_first_microbatch` caches each expert's weight cast as `fp8_linear` does;
    `wgrad_stores[i]` delays expert `i`'s weight gradient (see `fp8_linear`). `grouped_gemm`: run as one
    grouped FP8 GEMM where it applies (see the module docstring); its results differ from the per-expert
    GEMMs' by rounding. `into_main_grad[i]`: expert `i`'s weight gradient is added into `weights[i].main_grad`
    (fused accumulation, checked by the caller with `_main_grad.accumulates_into_main_grad`; see `fp8_linear`),
    in the per-expert GEMM's epilogue where the compiled path runs, else added after the (grouped) GEMM.
    """
    stores = list(wgrad_stores) if wgrad_stores is not None else [None] * len(weights)
    into = tuple(bool(f) for f in into_main_grad) if into_main_grad is not None else (False,) * len(weights)
    path = _grouped_path(x, weights, biases, stores) if grouped_gemm else None
    if path == "fp8":
        return _grouped_fp8_forward(x, splits, weights, states, is_first_microbatch, wgrad_in_fp8, into)
    if path == "bf16":
        ends = device_table(list(cumulative(splits)), torch.int32, x.device)
        stack = stacked_bf16_weights(weights, states[0], is_first_microbatch)
        return _GroupedBF16Linear.apply(x, ends, into, stack, *weights)
    outs = [fp8_linear(chunk, w, b, st, is_first_microbatch, wgrad_in_fp8, wgrad_store=store,
                       fuse_wgrad_accumulation=fused)
            for chunk, w, b, st, store, fused in zip(torch.split(x, list(splits), dim=0), weights, biases, states,
                                                     stores, into)]
    return torch.cat(outs, dim=0)


def _grouped_path(x: torch.Tensor, weights: Sequence[torch.Tensor], biases: Sequence[Optional[torch.Tensor]],
                  stores: Sequence[Any]) -> Optional[str]:
    """Which grouped GEMM serves this call (see the module docstring): "fp8" inside an enabled FP8 scope,
    "bf16" outside one, None for one GEMM per expert. Depends on the model, the input's dtype and device and
    the FP8 scope (and for "bf16" on the input having rows), never on routing under FP8."""
    scope = current_scope()
    fp8 = scope is not None and scope.enabled
    if scope is not None and scope.calibrating and not fp8:  # each expert records its amaxes (`fp8_linear`)
        return None
    if fp8 and scope.recipe.backward_override is not None:  # per expert: `fp8_linear`'s high-precision backward
        return None
    if fp8:
        served = device_has_grouped_gemm(x.device)
    else:
        served = x.dim() == 2 and x.shape[0] > 0 and device_has_bf16_grouped_gemm(x.device)
    if not (GROUPED_GEMM and served and x.dtype == torch.bfloat16 and x.dim() == 2):
        return None
    if any(b is not None for b in biases) or any(s is not None for s in stores):
        return None
    if any(isinstance(w, Float8Tensor) or features_unaligned(w) or (not fp8 and w.dtype != torch.bfloat16)
           for w in weights):
        return None
    if checkpoint_region() is not None:
        return None
    return "fp8" if fp8 else "bf16"


class _GroupedBF16Linear(torch.autograd.Function):
    """`apply(x, ends, into, stack, *weights)`: expert `i`'s rows of `x` (up to `ends[i]`) times `weights[i].T`, as
    one `torch._grouped_mm` per GEMM; `into[i]`: expert `i`'s weight gradient is added into its `main_grad`.
    `stack`: the weights as one cached `[E, N, K]` tensor (`stacked_bf16_weights`), used by the forward and the
    input gradient; None: stacked here for this call, and again in backward (the weights themselves are saved,
    not a copy of them)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, ends: torch.Tensor, into: Sequence[bool], stack: Optional[torch.Tensor],
                *weights: torch.Tensor) -> torch.Tensor:
        ctx.into, ctx.cached = into, stack is not None
        ctx.save_for_backward(x, ends, *weights, *((stack,) if stack is not None else ()))
        return torch._grouped_mm(x, (stack if stack is not None else torch.stack(weights)).transpose(1, 2), offs=ends)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, ends, *weights = ctx.saved_tensors
        stack = weights.pop() if ctx.cached else None
        grad_out = grad_out.contiguous()
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:  # dx_e = dy_e @ W_e: the weights stacked row-major [E, N, K]
            grad_x = torch._grouped_mm(grad_out, stack if stack is not None else torch.stack(weights), offs=ends)
        needs_w = ctx.needs_input_grad[4:]
        if any(needs_w):  # dW_e = dy_e^T @ x_e: groups along the contracted rows
            grad_w = list(torch._grouped_mm(grad_out.t(), x, offs=ends).unbind(0))
            fused = [i for i, (f, need) in enumerate(zip(ctx.into, needs_w)) if f and need]
            for i, placeholder in zip(fused, add_into_main_grads([weights[i] for i in fused], [grad_w[i] for i in fused])):
                grad_w[i] = placeholder
        return (grad_x, None, None, None, *(grad_w if grad_w is not None else [None] * len(weights)))


def stacked_bf16_weights(weights: Sequence[torch.Tensor], state: FP8State,
                         is_first_microbatch: Optional[bool]) -> Optional[torch.Tensor]:
    """The experts' bfloat16 weights as one `[E, N, K]` tensor, kept on the first expert's state and reused across
    a step's microbatches as the FP8 weight casts are (megatron's `is_first_microbatch` protocol): True stacks
    them again (into the same buffer), False reuses the stack unless a weight was replaced or updated in place
    since (its version counter moved). None: no cache (the caller stacks per call)."""
    if is_first_microbatch is None:
        return None
    versions = tuple(w._version for w in weights)
    kept = state.bf16_stack
    if (is_first_microbatch is False and kept is not None and len(kept[0]) == len(weights)
            and all(a is b for a, b in zip(kept[0], weights)) and kept[1] == versions):
        return kept[2]
    buffer = kept[2] if kept is not None else None
    shape = (len(weights), *weights[0].shape)
    if buffer is None or buffer.shape != shape or buffer.dtype != weights[0].dtype or buffer.device != weights[0].device:
        buffer = torch.empty(shape, dtype=weights[0].dtype, device=weights[0].device)
    with torch.no_grad():
        torch.stack([w.detach() for w in weights], out=buffer)
    state.bf16_stack = (tuple(weights), versions, buffer)
    return buffer


def _grouped_fp8_forward(x: torch.Tensor, splits: List[int], weights: Sequence[torch.Tensor],
                         states: Sequence[FP8State], is_first_microbatch: Optional[bool],
                         wgrad_in_fp8: bool, into: Tuple[bool, ...]) -> torch.Tensor:
    """The experts' FP8 linears with one grouped forward GEMM; the same plans, casts, amax slots and backward
    as the per-expert calls."""
    plans = expert_plans(states)
    if is_first_microbatch is not None:  # cached casts: written into one stacked home the grouped GEMMs take
        stacked_weights(weights, states, plans[0].recipe.fp8_format.forward_dtype)
    qweights = [cast_weight(w, state, plan, is_first_microbatch) for w, state, plan in zip(weights, states, plans)]
    if shares_casts(plans, wgrad_in_fp8):
        out = GroupedSharedCastsLinear.apply((splits, qweights, states, plans, into), x, *weights)
    else:
        chunks = torch.split(x, splits, dim=0)
        out = GroupedFP8Linear.apply((x, splits, qweights, states, plans, wgrad_in_fp8, into), *chunks, *weights)
    settle_experts_backward(plans, out)
    return out
