"""The FP8 linear core every module uses: its state, and one autograd Function for fprop/dgrad/wgrad."""
from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from ..scopes import current_scope
from ..gemm import fp8_gemm
from ..meta import FP8Meta
from ..quantize import quantize
from ..recipe import CurrentScaling, Recipe
from ..scaling import current_scale
from ..tensor import Float8Tensor
from ._recompute import RecomputeQueue, Snapshot, in_backward, recompute_will_follow

FWD_INPUT, FWD_WEIGHT = 0, 1
BWD_GRAD_OUTPUT = 0


def recipe_as_tensor(recipe: Recipe) -> torch.Tensor:
    """The recipe as plain data: [kind (1 delayed, 2 current), format (0 E4M3, 1 HYBRID), margin,
    history length, amax algo (0 max, 1 most_recent, 2 callable), reduce_amax]."""
    from ..recipe import Format

    fmt = 0 if recipe.fp8_format is Format.E4M3 else 1
    if isinstance(recipe, CurrentScaling):
        return torch.tensor([2, fmt, 0, 0, 0, 0], dtype=torch.int64)
    algo = {"max": 0, "most_recent": 1}.get(recipe.amax_compute_algo, 2) if isinstance(recipe.amax_compute_algo, str) else 2
    return torch.tensor([1, fmt, recipe.margin, recipe.amax_history_len, algo, int(recipe.reduce_amax)], dtype=torch.int64)


class FP8State(torch.nn.Module):
    """A module's FP8 state: forward meta (input, weight), backward meta (grad_output), weight cache.

    In the state dict: `fwd.amax_history [2, L]`, `fwd.scale [2]`, `bwd.amax_history [1, L]`, `bwd.scale [1]`,
    the non-finite counters, and `recipe` (the last recipe used, as plain integers; zeros if never used).
    All shapes are independent of the parallel layout, so the state loads across TP sizes.
    """

    def __init__(self, tag: str, device: Optional[torch.device] = None):
        super().__init__()
        self.fwd = FP8Meta(2, f"{tag}/fwd", device=device)
        self.bwd = FP8Meta(1, f"{tag}/bwd", device=device)
        self.register_buffer("recipe", torch.zeros(6, dtype=torch.int64, device=device))
        self.recompute = RecomputeQueue()
        self.weight_fp8: Optional[Float8Tensor] = None  # cached FP8 weight (is_first_microbatch)
        self._prepared_for: Optional[Recipe] = None

    def prepare(self, recipe: Recipe) -> None:
        if recipe is self._prepared_for:
            return
        if not isinstance(recipe, CurrentScaling):
            self.fwd.ensure_history_len(recipe.amax_history_len)
            self.bwd.ensure_history_len(recipe.amax_history_len)
        self.recipe.copy_(recipe_as_tensor(recipe))
        self._prepared_for = recipe


@dataclasses.dataclass
class _Plan:
    """How one call runs: recipe, scales to use, where amaxes go, which key state counts the backward."""

    recipe: Recipe
    forward_scale: Optional[torch.Tensor]  # [2] or None for current scaling
    forward_slots: Optional[torch.Tensor]  # [2] amax slots or None
    key_state: Optional[object]
    counts_backward: bool


def _plan(state: FP8State) -> Optional[_Plan]:
    """Decide how this call runs in FP8, or None for high precision."""
    scope = current_scope()
    if in_backward():
        snap = state.recompute.pop()
        if snap is not None:  # recompute of a checkpointed forward: the original scales, nothing registered
            return _Plan(snap.recipe, snap.forward_scale, None, snap.key_state, snap.recompute_counts_backward)
    if scope is None or not scope.enabled:
        return None
    recipe, key = scope.recipe, scope.state
    state.prepare(recipe)
    delayed = not isinstance(recipe, CurrentScaling)
    slots = key.forward.slots(state.fwd) if delayed else None
    scale = state.fwd.scale if delayed else None
    counts = scope.grad_enabled
    if counts:
        key.expect_backward()
        if not in_backward() and recompute_will_follow():
            grad = torch.is_grad_enabled()  # without grad (reentrant checkpoint) the recomputed graph counts
            state.recompute.push(Snapshot(key, recipe, scale.clone() if delayed else None, not grad))
    return _Plan(recipe, scale, slots, key, counts)


def _cast(x, recipe, scale, slot, fp8_dtype, out=None):
    if isinstance(recipe, CurrentScaling):
        from ..recipe import fp8_max

        scale = current_scale(x.detach().abs().amax(), fp8_max(fp8_dtype), recipe.eps).reshape(1)
    return quantize(x, scale, fp8_dtype, amax_out=slot, out=out)


def cast_weight(
    weight: torch.Tensor, state: FP8State, plan: _Plan, is_first_microbatch: Optional[bool]
) -> Float8Tensor:
    """The FP8 weight: cast now, or the cached cast (`is_first_microbatch` False) with its own scale_inv."""
    fmt = plan.recipe.fp8_format
    slot = plan.forward_slots[FWD_WEIGHT : FWD_WEIGHT + 1] if plan.forward_slots is not None else None
    scale = plan.forward_scale[FWD_WEIGHT : FWD_WEIGHT + 1] if plan.forward_scale is not None else None
    if isinstance(weight, Float8Tensor):  # an FP8 parameter
        return weight
    if is_first_microbatch is None:
        return _cast(weight, plan.recipe, scale, slot, fmt.forward_dtype)
    cached = state.weight_fp8
    if is_first_microbatch or cached is None or cached.shape != weight.shape:
        reuse = cached if cached is not None and cached.shape == weight.shape else None
        state.weight_fp8 = _cast(weight, plan.recipe, scale, slot, fmt.forward_dtype, out=reuse)
    elif slot is not None:  # reused cast: its amax still counts for this scope
        torch.maximum(slot, weight.detach().abs().amax().float().reshape(1), out=slot)
    return state.weight_fp8


class _FP8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, qweight, state, plan, wgrad_in_fp8):
        fmt = plan.recipe.fp8_format
        x2 = x.reshape(-1, x.shape[-1])
        slot = plan.forward_slots[FWD_INPUT : FWD_INPUT + 1] if plan.forward_slots is not None else None
        scale = plan.forward_scale[FWD_INPUT : FWD_INPUT + 1] if plan.forward_scale is not None else None
        qx = _cast(x2, plan.recipe, scale, slot, fmt.forward_dtype)
        y = fp8_gemm(qx, qweight, out_dtype=x.dtype, bias=None if bias is None else bias.to(x.dtype), use_fast_accum=True)
        # saved for backward: the FP8 input (1 byte/element, reused by the wgrad GEMM), unless wgrad runs in
        # high precision (megatron's fp8_wgrad=False), which needs the high-precision input
        ctx.wgrad_in_fp8 = wgrad_in_fp8
        hp_x = x2.detach() if not wgrad_in_fp8 else None
        ctx.save_for_backward(qx._data, qx._scale_inv, qweight._data, qweight._scale_inv, hp_x)
        ctx.x_shape, ctx.x_dtype, ctx.w_dtype = x.shape, x.dtype, weight.dtype
        ctx.has_bias = bias is not None
        ctx.state, ctx.plan, ctx.qweight = state, plan, qweight
        return y.reshape(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, grad_out):
        qx_data, qx_sinv, qw_data, qw_sinv, hp_x = ctx.saved_tensors
        qx = Float8Tensor(qx_data, qx_sinv, ctx.x_dtype)
        qw = ctx.qweight if ctx.qweight._data is qw_data else Float8Tensor(qw_data, qw_sinv, ctx.w_dtype)
        state, plan = ctx.state, ctx.plan
        fmt = plan.recipe.fp8_format
        g2 = grad_out.reshape(-1, grad_out.shape[-1])
        key = plan.key_state
        delayed = not isinstance(plan.recipe, CurrentScaling)
        slot = key.backward.slots(state.bwd) if (delayed and key is not None) else None
        qg = _cast(g2, plan.recipe, state.bwd.scale if delayed else None, slot, fmt.backward_dtype)
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = fp8_gemm(qg, qw.transpose_2d(), out_dtype=ctx.x_dtype).reshape(ctx.x_shape)
        if ctx.needs_input_grad[1]:
            if ctx.wgrad_in_fp8:
                grad_w = fp8_gemm(qg.transpose_2d(cache=False), qx.transpose_2d(cache=False), out_dtype=ctx.w_dtype)
            else:
                grad_w = (g2.t().float() @ hp_x.float()).to(ctx.w_dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = g2.sum(0).to(ctx.w_dtype)
        if plan.counts_backward and key is not None:
            key.backward_ran()
        return grad_x, grad_w, grad_b, None, None, None, None


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    state: FP8State,
    is_first_microbatch: Optional[bool] = None,
    wgrad_in_fp8: bool = True,
) -> torch.Tensor:
    """`x @ weight.T + bias`, in FP8 inside an enabled autocast scope and in high precision otherwise.

    `is_first_microbatch`: True casts the weight and caches the cast, False reuses the cache (gradient
    accumulation over microbatches), None casts every call and caches nothing.
    """
    plan = _plan(state)
    if plan is None:
        w = weight.dequantize() if isinstance(weight, Float8Tensor) else weight
        return F.linear(x, w.to(x.dtype), None if bias is None else bias.to(x.dtype))
    qweight = cast_weight(weight, state, plan, is_first_microbatch)
    return _FP8Linear.apply(x, weight, bias, qweight, state, plan, wgrad_in_fp8)
