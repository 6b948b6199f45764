"""The FP8 linear core every module uses: its state, and one autograd Function for fprop/dgrad/wgrad."""
from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Callable, List, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .. import native
from ..native import DTYPE_CODES
from ..recipe import Format
from ..scopes import current_scope
from ..gemm import fp8_gemm
from ..meta import FP8Meta
from ..quantize import padded_fp8, quantize, quantize_transposed
from ..recipe import CurrentScaling, Recipe
from ..scaling import current_scale
from ._delayed_wgrad import WgradStore, high_precision_linear
from ._main_grad import grad_after_main_grad, linear_into_main_grad
from ..tensor import Float8Tensor
from ._recompute import Phase, Snapshot, checkpoint_region, in_backward
from ._sequence_parallel import all_gather_fp8, reduce_scatter_rows, scales_shared_over


def history_len_of(config) -> Optional[int]:
    """megatron's `fp8_amax_history_len`, when a config carries one."""
    return getattr(config, "fp8_amax_history_len", None)

FWD_INPUT, FWD_WEIGHT = 0, 1
BWD_GRAD_OUTPUT = 0
_NATIVE_FORMATS = (Format.E4M3, Format.HYBRID)  # the formats whose forward is E4M3 (no E5M2 x E5M2 dgrad)


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

    def __init__(self, tag: str, device: Optional[torch.device] = None, history_len: Optional[int] = None):
        super().__init__()
        # sized up front, so a fresh module's state dict has the shapes of a trained one (checkpoint loading);
        # a recipe with another length resizes it on first use
        if history_len is None:
            from ..recipe import DelayedScaling

            history_len = DelayedScaling().amax_history_len
        self._fresh_state(f"{tag}/fwd", f"{tag}/bwd", history_len, device)

    def _fresh_state(self, fwd_tag: str, bwd_tag: str, history_len: int, device: Optional[torch.device]) -> None:
        """Histories zero, scales one, no recipe recorded, nothing cached."""
        self.fwd = FP8Meta(2, fwd_tag, history_len=history_len, device=device)
        self.bwd = FP8Meta(1, bwd_tag, history_len=history_len, device=device)
        self.register_buffer("recipe", torch.zeros(6, dtype=torch.int64, device=device))
        self.weight_fp8: Optional[Float8Tensor] = None  # cached FP8 weight (is_first_microbatch)
        self.weight_version: Optional[int] = None  # the weight's version counter when it was cached
        self.expert_stack = None  # first expert of a grouped linear: all experts' weight caches in one home
        self.bf16_stack = None  # first expert, without FP8: (weights, their versions, their [E, N, K] stack)
        self._native_key: Optional[tuple] = None  # the layer conditions `_native_layer` last decided, and for what
        self._native_ok = False
        self._prepared_for: Optional[Recipe] = None
        # delayed scaling: whether the scales come from somewhere (a training forward, whose amaxes its scope
        # reduces, or a loaded state dict); an inference call before that casts with scale 1 (see `_plan`)
        self.scales_known = False
        self.warned_unscaled = False  # the warning of `_note_scales_source` was given

    def reset(self, device: torch.device) -> None:
        """Fresh state on `device`, the history length kept: deferred initialization (`reset_parameters` of a
        module built on "meta")."""
        self._fresh_state(self.fwd.tag, self.bwd.tag, self.fwd.amax_history.shape[1], device)

    def prepare(self, recipe: Recipe) -> None:
        if recipe is self._prepared_for or recipe == self._prepared_for:  # no host-to-device copy (capturable)
            return
        if not isinstance(recipe, CurrentScaling):
            self.fwd.ensure_history_len(recipe.amax_history_len)
            self.bwd.ensure_history_len(recipe.amax_history_len)
        self.recipe.copy_(recipe_as_tensor(recipe))
        self._prepared_for = recipe

    def _load_from_state_dict(self, *args: Any, **kwargs: Any) -> None:
        super()._load_from_state_dict(*args, **kwargs)
        self._prepared_for = None  # the loaded `recipe` record and history lengths are re-checked on next use
        self.scales_known = True


@dataclasses.dataclass
class _Plan:
    """How one call runs: recipe, scales to use, where amaxes go, and its backward accounting.

    `counts_backward`: this call's backward node decrements `key_state`'s pending count when it runs (set
    once autograd has made the node, see `_settle_backward`). `phase`: None for an ordinary call (including
    a non-reentrant checkpoint's first pass, whose nodes are the ones that run backward); FIRST_PASS for a
    reentrant first pass and RECOMPUTE for any recompute, whose accounting comes from the snapshot."""

    recipe: Recipe
    forward_scale: Optional[torch.Tensor]  # [2] or None for current scaling
    _forward_slots: Optional[torch.Tensor]  # [2] amax slots or None (see `forward_slots`)
    key_state: Optional[object]
    counts_backward: bool = False
    phase: Optional[Phase] = None
    _saved_scale: Optional[torch.Tensor] = None
    meta: Optional[FP8Meta] = None  # the forward meta whose scale buffer `forward_scale` is (None: a copy)
    checkpointed: bool = False  # called inside an activation-checkpointed region (first pass or recompute)
    slot_address: Optional[tuple] = None  # (table buffer, index) of the forward slots, their view made on demand

    @property
    def forward_slots(self) -> Optional[torch.Tensor]:
        """The `[2]` forward amax slots (a view into the scope's table, made on first use), or None."""
        if self._forward_slots is None and self.slot_address is not None:
            buffer, index = self.slot_address
            self._forward_slots = buffer[index : index + 2]
        return self._forward_slots

    def saved_forward_scale(self, index: int) -> torch.Tensor:
        """`[1]`: forward scale `index` as this call casts with it, kept for a re-cast in backward (the scope's
        update may rewrite the buffer before backward). One copy of both scales per call, made on first use."""
        if self._saved_scale is None:
            self._saved_scale = self.forward_scale.clone()
        return self._saved_scale[index : index + 1]


def _plan(state: FP8State) -> Optional[_Plan]:
    """Decide how this call runs in FP8, or None for high precision.

    A recompute of a checkpointed forward repeats its first pass (same scales, nothing registered); a first
    pass records its decision on the region. Backward expectations are counted from facts: see
    `_settle_backward` and `modules/_recompute.py`."""
    scope = current_scope()
    enabled = scope is not None and scope.enabled
    # with grad disabled, finding a reentrant region walks the stack: skipped for a high-precision call
    # outside backward (eval without FP8), which then is not recorded (a recompute of it finds no record and
    # runs in high precision as well)
    region = checkpoint_region() if enabled or torch.is_grad_enabled() or in_backward() else None
    if region is not None and region.phase is Phase.RECOMPUTE:
        snap = region.replay(state)
        if snap is None:
            return None
        counted, snap.counted = snap.counted, False  # settled by this recompute (a retained graph's next: none)
        return _Plan(snap.recipe, snap.forward_scale, None, snap.key_state, counted, Phase.RECOMPUTE,
                     _saved_scale=snap.forward_scale, checkpointed=True)
    plan = None
    if enabled:
        recipe, key = scope.recipe, scope.state
        state.prepare(recipe)
        plan = _scope_plan(state, recipe, key, None)
        if not isinstance(recipe, CurrentScaling):  # the slots' view is made when a cast needs it
            plan.slot_address = key.forward.slot_address(state.fwd)
            if not state.scales_known:
                _note_scales_source(state, region)
    if region is not None:  # a first pass: its recompute repeats this decision
        snap = None
        if plan is not None:
            plan.checkpointed = True
            # a reentrant region's backward runs through its recompute: counted now, so the scope's backward
            # reduction waits for it, when the checkpoint's own node exists (else no recompute will run)
            counted = region.reentrant and region.backward_will_run
            if counted:
                plan.key_state.expect_backward()
            if region.reentrant:
                plan.phase = Phase.FIRST_PASS
            scale = None
            if plan.forward_scale is not None:  # one copy, also the one backward re-casts with
                scale = plan._saved_scale = plan.forward_scale.clone()
            snap = Snapshot(plan.key_state, plan.recipe, scale, counted)
        region.add(state, snap)
    return plan


def record_calibration_amaxes(state: FP8State, x: torch.Tensor, weight: torch.Tensor) -> None:
    """In a calibrating scope that computes in high precision (`autocast(enabled=False, calibrating=True)`),
    the amaxes of this call's input and weight go into the scope's forward slots of `state`, as an FP8 call's
    casts would record them; the scope's exit reduces them and updates the scales. Elsewhere: nothing."""
    scope = current_scope()
    if scope is None or not scope.calibrating or scope.enabled or isinstance(scope.recipe, CurrentScaling):
        return
    state.prepare(scope.recipe)
    buffer, index = scope.state.forward.slot_address(state.fwd)
    w = weight.dequantize() if isinstance(weight, Float8Tensor) else weight
    with torch.no_grad():
        slots = buffer[index : index + 2]
        torch.maximum(slots, torch.stack([_amax(x).float(), _amax(w).float()]), out=slots)
    state.scales_known = True


def _note_scales_source(state: FP8State, region) -> None:
    """First delayed-scaling calls of a state without scales: a training forward gives it scales (its scope
    reduces the amaxes and updates them at exit); an inference call (grad disabled, not a reentrant
    checkpoint's first pass) warns once, since it casts with the initial scale of 1 and its amaxes are not
    reduced, as in TransformerEngine."""
    training = region.phase is Phase.FIRST_PASS if region is not None and region.reentrant else torch.is_grad_enabled()
    if training:
        state.scales_known = True
    elif not state.warned_unscaled:
        state.warned_unscaled = True
        warnings.warn(
            f"fp8_parallel: {state.fwd.tag.removesuffix('/fwd')}: delayed scaling without grad, before any training forward or loaded "
            f"FP8 state: its casts use the initial scale 1, and inference calls do not update scales (as in "
            f"TransformerEngine), so the result may be far from high precision. Run inference with the scales "
            f"from training (a training step or a checkpoint with FP8 state), or with current scaling "
            f"(`Float8CurrentScaling`), which scales every call from its own amax", stacklevel=4)


def expert_plans(states: Sequence[FP8State]) -> List[_Plan]:
    """`_plan` of each expert of a grouped call inside an enabled scope and outside checkpointed regions (the
    grouped FP8 path's conditions): the scope looked up once, the forward amax slots registered in expert
    order, as per-expert calls register them, and taken as one view."""
    scope = current_scope()
    recipe, key = scope.recipe, scope.state
    for state in states:
        state.prepare(recipe)
    current = isinstance(recipe, CurrentScaling)
    slots = [None] * len(states) if current else key.forward.slots_of([state.fwd for state in states])
    if not current:
        for state in states:
            if not state.scales_known:
                _note_scales_source(state, None)
    return [_scope_plan(state, recipe, key, slot) for state, slot in zip(states, slots)]


def _scope_plan(state: FP8State, recipe: Recipe, key, slots: Optional[torch.Tensor]) -> _Plan:
    """The plan of an ordinary call in an enabled scope: delayed scaling casts with the state's own scale
    buffer into `slots`; current scaling has neither."""
    if isinstance(recipe, CurrentScaling):
        return _Plan(recipe, None, None, key)
    return _Plan(recipe, state.fwd.scale, slots, key, meta=state.fwd)


def settle_experts_backward(plans: Sequence[_Plan], out: torch.Tensor) -> None:
    """`_settle_backward` of every plan of `expert_plans` (one output, one key): one count for all."""
    key = plans[0].key_state if plans else None
    if key is None or not out.requires_grad:
        return
    for plan in plans:
        plan.counts_backward = True
    key.expect_backward(len(plans))


def experts_backward_done(plans: Sequence[_Plan]) -> None:
    """`_backward_done` of every plan of `expert_plans`: their counts settled in one step."""
    count = 0
    for plan in plans:
        if plan.counts_backward:
            plan.counts_backward = False
            count += 1
    if count and plans[0].key_state is not None:
        plans[0].key_state.backward_ran(count)


def _settle_backward(plan: _Plan, out: torch.Tensor) -> None:
    """After the call: count its backward with the scope key when autograd will run one.

    Whether a backward is expected is a fact of the output: it requires grad exactly when autograd made a
    node for the call (frozen weight with a grad-requiring input included; `torch.no_grad()` calls and frozen
    layers on non-grad inputs excluded). A reentrant first pass counted through its snapshot instead; its
    recompute settles a count whose node does not exist after all."""
    key = plan.key_state
    if key is None:
        return
    if plan.phase is None:
        if out.requires_grad:
            plan.counts_backward = True
            key.expect_backward()
    elif plan.phase is Phase.RECOMPUTE and plan.counts_backward and not out.requires_grad:
        plan.counts_backward = False
        key.backward_ran()


def _amax(t: torch.Tensor) -> torch.Tensor:
    """`max |t|` as a 0-d tensor; 0 for an empty tensor (an expert without tokens)."""
    return t.detach().abs().amax() if t.numel() else torch.zeros((), dtype=t.dtype, device=t.device)


def _cast(x, recipe, scale, slot, fp8_dtype, out=None, with_transpose=False, noop_flag=None):
    if isinstance(recipe, CurrentScaling):
        from ..recipe import fp8_max

        scale = current_scale(_amax(x), fp8_max(fp8_dtype), recipe.eps).reshape(1)
    return quantize(x, scale, fp8_dtype, amax_out=slot, out=out, with_transpose=with_transpose, noop_flag=noop_flag)


def _input_scale(x: torch.Tensor, plan: _Plan, fp8_dtype: torch.dtype) -> torch.Tensor:
    """The scale an input is cast with, kept for a re-cast in backward: a copy of the delayed scale, or the
    input's current scale."""
    if isinstance(plan.recipe, CurrentScaling):
        from ..recipe import fp8_max

        return current_scale(_amax(x), fp8_max(fp8_dtype), plan.recipe.eps).reshape(1)
    return plan.saved_forward_scale(FWD_INPUT)


def _weight_out(weight: torch.Tensor, fmt_dtype: torch.dtype, reuse: Optional[Float8Tensor],
                with_transpose: bool) -> Optional[Float8Tensor]:
    """Where a weight cast goes: `reuse` (the cache, rewritten in place); for a layer with unaligned features
    a new Float8Tensor in zero-padded aligned buffers (data, and transpose when cached), so its GEMMs use the
    weight as cast, never padding it per call; else None (a fresh, dense cast)."""
    if reuse is not None or not features_unaligned(weight):
        return reuse
    return padded_fp8(weight.shape[0], weight.shape[1], fmt_dtype, weight.dtype, weight.device, with_transpose)


def cast_weight(
    weight: torch.Tensor, state: FP8State, plan: _Plan, is_first_microbatch: Optional[bool]
) -> Float8Tensor:
    """The FP8 weight (with its transpose, for dgrad): cast now, or the cached cast (`is_first_microbatch`
    False) with the scale_inv it was cast with. The cache holds data + transpose (2 bytes per parameter;
    a layer with unaligned features holds them in zero-padded aligned buffers, see `features_unaligned`)."""
    if isinstance(weight, Float8Tensor):  # an FP8 parameter
        return weight
    cached = state.weight_fp8
    noop_flag = getattr(plan.key_state, "weight_noop_flag", None)
    # a cache is never used stale: a weight updated in place since it was cached (an optimizer step without
    # a new first microbatch) is cast again
    current = cached is not None and state.weight_version == weight._version and cached.shape == weight.shape
    if is_first_microbatch is False and noop_flag is None and current:
        return cached  # checked first: the common call of a step's later microbatches
    fmt = plan.recipe.fp8_format
    slot = _forward_slot(plan, FWD_WEIGHT)
    scale = _forward_scale(plan, FWD_WEIGHT)
    if noop_flag is not None:  # recorded for a graphed callable with weight caching: the flag decides on replay
        return _cast_weight_under_flag(weight, state, plan, noop_flag, scale, slot)
    if is_first_microbatch is None:  # transpose re-cast in backward
        return _cast(weight, plan.recipe, scale, slot, fmt.forward_dtype,
                     out=_weight_out(weight, fmt.forward_dtype, None, with_transpose=False))
    if is_first_microbatch or not current:
        reuse = cached if cached is not None and cached.shape == weight.shape else None
        state.weight_fp8 = _cast(weight, plan.recipe, scale, slot, fmt.forward_dtype,
                                 out=_weight_out(weight, fmt.forward_dtype, reuse, with_transpose=True),
                                 with_transpose=True)
        state.weight_version = weight._version
    # a reused cast registers no weight amax (the weight is unchanged since its cast, whose amax was
    # recorded), so its history is not rolled again and no pass over the weight is spent per microbatch
    return state.weight_fp8


def _cast_weight_under_flag(weight, state: FP8State, plan: _Plan, noop_flag: torch.Tensor, scale, slot) -> Float8Tensor:
    """Cast into the persistent weight cache unless the device flag `noop_flag` is set (then the cache, its
    transpose, scale_inv and the weight's amax slot are left as they are)."""
    cached = state.weight_fp8
    reuse = cached if cached is not None and cached.shape == weight.shape else None
    fp8_dtype = plan.recipe.fp8_format.forward_dtype
    out = _weight_out(weight, fp8_dtype, reuse, with_transpose=True)
    state.weight_fp8 = _cast(weight, plan.recipe, scale, slot, fp8_dtype, out=out, with_transpose=True,
                             noop_flag=noop_flag)
    state.weight_version = None  # eager calls re-cast before trusting a cache written under a device flag
    plan.key_state.cached_weights.append(weight)
    return state.weight_fp8


def _forward_slot(plan: _Plan, index: int) -> Optional[torch.Tensor]:
    """Forward amax slot `index` of the plan (`[1]`; None under current scaling)."""
    return plan.forward_slots[index : index + 1] if plan.forward_slots is not None else None


def _forward_scale(plan: _Plan, index: int) -> Optional[torch.Tensor]:
    """`plan.forward_scale[index : index + 1]` (None under current scaling): a view kept by the meta when the
    plan's scales are the meta's own buffer, so the common call makes no view."""
    if plan.meta is not None:
        return plan.meta.scale_of(index)
    return plan.forward_scale[index : index + 1] if plan.forward_scale is not None else None


def _input_operand(x, x2, plan: _Plan, fp8_wgrad: bool, leaf: bool):
    """Cast a (non-sequence-parallel) input for fprop. Returns the FP8 input and what backward needs for the
    wgrad operand, `[qx_t, x_ref, x_scale]` (see `_input_transposed`).

    A `leaf` input (no autograd history: a batch, a pipeline stage's received activation, a graph's static
    input) stays alive anyway: it is kept by reference and its transpose re-cast in backward with the
    forward's scale (the same bytes), instead of a second, FP8 copy held from forward to backward. Otherwise
    one fused pass writes the FP8 input and its transpose, and only the transpose (1 byte/element) is kept.
    """
    fmt = plan.recipe.fp8_format
    slot = _forward_slot(plan, FWD_INPUT)
    if fp8_wgrad and leaf:
        x_scale = _input_scale(x2, plan, fmt.forward_dtype)
        return _cast(x2, plan.recipe, x_scale, slot, fmt.forward_dtype), [None, x, x_scale]
    scale = _forward_scale(plan, FWD_INPUT)
    qx = _cast(x2, plan.recipe, scale, slot, fmt.forward_dtype, with_transpose=fp8_wgrad)
    return qx, [qx._transpose_cache.buffer if fp8_wgrad else None, None, None]  # the transpose just written


def _input_transposed(saved, qx_sinv: torch.Tensor, plan: _Plan, x_dtype: torch.dtype) -> Float8Tensor:
    """The wgrad operand (the input's FP8 transpose) from what `_input_operand` saved."""
    qx_t, x_ref, x_scale = saved
    if x_ref is not None:
        x_ref = x_ref.detach()
        qx_t = quantize_transposed(x_ref.reshape(-1, x_ref.shape[-1]), x_scale, plan.recipe.fp8_format.forward_dtype)._data
    return Float8Tensor(qx_t, qx_sinv, x_dtype)


def _weight_operand(weight, qweight: Float8Tensor, state: FP8State, plan: _Plan):
    """What backward needs for the dgrad operand (the weight's FP8 transpose): `([qw_t, qw_sinv, weight to
    re-cast, its scale], cached)`. A cached or FP8 weight has its transpose already; a fresh cast is not
    held from forward to backward (1 byte per parameter across the whole model) but re-cast there with a copy
    of the forward scale (current scaling recomputes its deterministic scale). The weight cache is rewritten
    in place only by a later first microbatch or a changed weight (never while this backward is pending in a
    training step), so a cached pair `(qw_t, qw_sinv)` is returned apart, to be held outside autograd's
    version checks."""
    qw_t = w_scale = recast = None
    if qweight.has_current_transpose():
        qw_t = qweight._transpose_cache.buffer
    elif isinstance(weight, Float8Tensor):
        qw_t = qweight.transpose_2d()._data
    else:
        recast = weight
        if plan.forward_scale is not None:
            w_scale = plan.saved_forward_scale(FWD_WEIGHT)
    if qweight is state.weight_fp8:
        return [None, None, recast, w_scale], (qw_t, qweight._scale_inv)
    return [qw_t, qweight._scale_inv, recast, w_scale], None


def _weight_transposed(saved, cached, plan: _Plan, w_dtype: torch.dtype) -> Float8Tensor:
    """The dgrad operand from what `_weight_operand` returned."""
    qw_t, qw_sinv, weight, w_scale = saved
    if cached is not None:
        qw_t, qw_sinv = cached
    if weight is None:
        return Float8Tensor(qw_t, qw_sinv, w_dtype)
    fmt = plan.recipe.fp8_format
    if w_scale is None:
        from ..recipe import fp8_max

        w_scale = current_scale(_amax(weight), fp8_max(fmt.forward_dtype), plan.recipe.eps).reshape(1)
    return quantize_transposed(weight.detach(), w_scale, fmt.forward_dtype, padded=features_unaligned(weight))


def _backward_slot(plan: _Plan, state: FP8State):
    """The grad_output amax slot of `state` in its scope key (delayed scaling), or None."""
    key = plan.key_state
    if isinstance(plan.recipe, CurrentScaling) or key is None:
        return None
    return key.backward.slots(state.bwd)


def _backward_done(plan: _Plan) -> None:
    """This call's backward wrote its grad amax: settle its count once (a retained graph's second backward
    has nothing left to settle)."""
    if plan.counts_backward and plan.key_state is not None:
        plan.counts_backward = False
        plan.key_state.backward_ran()


def features_unaligned(weight: torch.Tensor) -> bool:
    """Whether a layer's (per-rank) features, `weight: [out, in]`, are not both multiples of 16, the FP8
    GEMMs' alignment. Fixed by the layer's shape; zero padding is exact. Such a layer casts its FP8 weight and
    the weight's transpose into zero-padded aligned buffers (`quantize.padded_fp8`), once per cast (a cached
    weight: once per first microbatch), so the GEMMs never pad the weight. What they pad per call is the
    other operand, a fresh tensor every call: the FP8 input in forward (in-features columns) and the FP8
    grad_output in dgrad (out-features columns), and in wgrad both transposed operands (features rows; tokens
    columns when the count is unaligned: the token count is free, and the wgrad GEMM of an aligned layer pads
    alone when it is not a multiple of 16). An FP8 parameter (the weight stored as a Float8Tensor) is padded
    per call. An aligned layer's GEMMs never pad (wgrad aside, as said)."""
    from ..gemm import ALIGN

    return weight.shape[0] % ALIGN != 0 or weight.shape[-1] % ALIGN != 0


def linear_operands(rec, x, weight, qweight: Float8Tensor, state: FP8State, plan: _Plan, wgrad_in_fp8: bool,
                    has_bias: bool, sp_group=None, wgrad_store=None, input_cast=None, into_main_grad: bool = False):
    """The FP8 input of one linear's fprop, and what its backward needs: sets `rec`'s attributes (an autograd
    ctx, or a record of one expert of a grouped call) and returns `(qx, tensors to save, out_shape)`; the
    saved tensors, in order, are what `linear_backward` takes. `input_cast`: `(qx, its transpose's data or
    None)`, the input already cast (no sequence parallelism). `into_main_grad`: backward adds the weight
    gradient into `weight.main_grad` (see `fp8_linear`)."""
    fmt = plan.recipe.fp8_format
    x2 = x.reshape(-1, x.shape[-1])
    fp8_wgrad = wgrad_in_fp8 and weight.requires_grad
    rec.sp_group = sp_group
    out_shape = x.shape[:-1]
    if input_cast is not None:
        qx, x_saved = input_cast[0], [input_cast[1] if fp8_wgrad else None, None, None]
    elif sp_group is None:
        qx, x_saved = _input_operand(x, x2, plan, fp8_wgrad, x.grad_fn is None)
    else:
        # sequence parallel: cast the local shard, all-gather FP8 bytes (half of bf16's), transpose after
        slot = _forward_slot(plan, FWD_INPUT)
        scale = _forward_scale(plan, FWD_INPUT)
        qx = all_gather_fp8(_cast(x2, plan.recipe, scale, slot, fmt.forward_dtype), sp_group)
        x_saved = [qx.transpose_2d()._data if fp8_wgrad else None, None, None]
        out_shape = (x.shape[0] * dist.get_world_size(sp_group), *x.shape[1:-1])
    rec.pad = features_unaligned(weight)
    rec.wgrad_in_fp8 = wgrad_in_fp8
    hp_x = x2.detach() if not wgrad_in_fp8 and weight.requires_grad else None  # megatron's fp8_wgrad=False
    w_saved, rec.cached_weight = ([None] * 4, None)
    if x.requires_grad:
        w_saved, rec.cached_weight = _weight_operand(weight, qweight, state, plan)
    rec.x_shape, rec.x_dtype, rec.w_dtype = x.shape, x.dtype, weight.dtype
    rec.has_bias = has_bias
    rec.state, rec.plan, rec.wgrad_store = state, plan, wgrad_store
    rec.main_grad_of = weight if into_main_grad else None
    return qx, (*x_saved, qx._scale_inv, *w_saved, hp_x), out_shape


SAVED_PER_LINEAR = 9  # tensors `linear_operands` returns for saving, per linear


def _weight_gradient(compute: Callable[[], torch.Tensor], into: Optional[torch.Tensor],
                     wgrad_store: Optional[WgradStore], device_type: str) -> Optional[torch.Tensor]:
    """What backward returns for the weight: `compute()`'s gradient, or with fused accumulation (`into`, the
    weight) that gradient added into its `main_grad` and megatron's placeholder; None when `wgrad_store`
    delays it (TransformerEngine's delay_wgrad_compute: run by backward_dw())."""
    if wgrad_store is not None:
        wgrad_store.put(compute, device_type)
        return None
    grad_w = compute()
    if into is not None:
        into.main_grad.add_(grad_w)
        grad_w = grad_after_main_grad(into)
    return grad_w


def linear_backward(rec, saved, grad_out: torch.Tensor, needs_input_grad, grad_cast=None):
    """One FP8 linear's backward from `linear_operands`' record and saved tensors: `(grad_x, grad_w,
    grad_b)` for `needs_input_grad` (x, weight, bias). `grad_cast`: `(qg, its transpose or None)`, grad_out
    already cast (its amax recorded)."""
    x_saved, qx_sinv, w_saved, hp_x = saved[0:3], saved[3], saved[4:8], saved[8]
    del saved
    plan = rec.plan
    fmt = plan.recipe.fp8_format
    g2 = grad_out.reshape(-1, grad_out.shape[-1])
    delayed = not isinstance(plan.recipe, CurrentScaling)
    fp8_wgrad = rec.wgrad_in_fp8 and needs_input_grad[1]
    if grad_cast is not None:
        qg, qg_t = grad_cast
    else:
        qg = _cast(g2, plan.recipe, rec.state.bwd.scale if delayed else None, _backward_slot(plan, rec.state),
                   fmt.backward_dtype, with_transpose=fp8_wgrad)
        qg_t = qg.transpose_2d(update_cache=False) if fp8_wgrad else None
    grad_x = grad_w = grad_b = None
    # dgrad first; its operands (the row-major grad cast, the weight's transpose) are released before the
    # wgrad GEMM allocates the weight gradient, so the two sets never coexist (lower peak memory)
    if needs_input_grad[0]:
        grad_x = fp8_gemm(qg, _weight_transposed(w_saved, rec.cached_weight, plan, rec.w_dtype), out_dtype=rec.x_dtype,
                          pad=rec.pad)
        if rec.sp_group is not None:  # the gathered input's gradient: reduce-scatter over the sequence
            grad_x = reduce_scatter_rows(grad_x, rec.sp_group)
        grad_x = grad_x.reshape(rec.x_shape)
    del qg, w_saved
    if needs_input_grad[1]:
        into = rec.main_grad_of  # the weight whose main_grad takes the gradient, or None
        w_dtype = torch.float32 if into is not None else rec.w_dtype  # fused: added to main_grad unrounded
        if fp8_wgrad:
            x_dtype, pad = rec.x_dtype, rec.pad or qg_t._data.shape[1] % 16 != 0

            def compute_wgrad():
                return fp8_gemm(qg_t, _input_transposed(x_saved, qx_sinv, plan, x_dtype), out_dtype=w_dtype,
                                pad=pad)
        else:
            def compute_wgrad():
                return (g2.t().float() @ hp_x.float()).to(w_dtype)
        grad_w = _weight_gradient(compute_wgrad, into, rec.wgrad_store, g2.device.type)
        del compute_wgrad
    if rec.has_bias and needs_input_grad[2]:
        grad_b = g2.sum(0).to(rec.w_dtype)
    _backward_done(plan)
    return grad_x, grad_w, grad_b


def backward_outside_autocast(fn: Callable[[], Any], device_type: str) -> Any:
    """`fn()` outside any torch.autocast region the caller runs backward in (torch's autocast would otherwise
    recast ops of the FP8 path), as TransformerEngine's kernels are."""
    if not torch.is_autocast_enabled(device_type):  # the usual case: no context manager per call
        return fn()
    with torch.autocast(device_type, enabled=False):
        return fn()


class _FP8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, qweight, options):
        # the non-tensor arguments travel as one tuple: autograd's apply visits every argument on every call
        state, plan, wgrad_in_fp8, sp_group, wgrad_store, into_main_grad = options
        qx, to_save, out_shape = linear_operands(ctx, x, weight, qweight, state, plan, wgrad_in_fp8,
                                                 bias is not None, sp_group, wgrad_store,
                                                 into_main_grad=into_main_grad)
        y = fp8_gemm(qx, qweight, out_dtype=x.dtype, bias=None if bias is None else bias.to(x.dtype), use_fast_accum=True,
                     pad=ctx.pad)
        del qx  # the row-major FP8 input is not needed past fprop
        ctx.save_for_backward(*to_save)
        return y.reshape(*out_shape, y.shape[-1])

    @staticmethod
    def backward(ctx, grad_out):
        grads = backward_outside_autocast(
            lambda: linear_backward(ctx, ctx.saved_tensors, grad_out, ctx.needs_input_grad), grad_out.device.type)
        return (*grads, None, None)


class _FP8ForwardHPBackward(torch.autograd.Function):
    """The FP8 forward GEMM of `fp8_linear` with a high-precision backward, for a recipe's `backward_override`:
    "high_precision" keeps the input and weight as they came, "dequantized" their FP8 casts dequantized; the
    gradient is not cast (no backward amax is recorded). The input and weight gradients are GEMMs in the
    input's dtype, the weight gradient accumulated in float32 (into `main_grad` with fused accumulation)."""

    @staticmethod
    def forward(ctx, x, weight, bias, options):
        qweight, plan, override, into, wgrad_store = options
        x2 = x.reshape(-1, x.shape[-1])
        qx = _cast(x2, plan.recipe, _forward_scale(plan, FWD_INPUT), _forward_slot(plan, FWD_INPUT),
                   plan.recipe.fp8_format.forward_dtype)
        y = fp8_gemm(qx, qweight, out_dtype=x.dtype, bias=None if bias is None else bias.to(x.dtype),
                     use_fast_accum=True, pad=features_unaligned(weight))
        if override == "dequantized":
            x_keep, w_keep = qx.dequantize().to(x.dtype), qweight.dequantize().to(x.dtype)
        else:
            w_keep = weight.dequantize() if isinstance(weight, Float8Tensor) else weight.detach()
            x_keep = x2.detach()
        ctx.save_for_backward(x_keep, w_keep)
        ctx.x_shape, ctx.w_dtype, ctx.has_bias = x.shape, weight.dtype, bias is not None
        ctx.main_grad_of, ctx.wgrad_store = (weight if into else None), wgrad_store
        return y.reshape(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, grad_out):
        x_keep, w_keep = ctx.saved_tensors
        g2 = grad_out.reshape(-1, grad_out.shape[-1])
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = (g2.to(x_keep.dtype) @ w_keep.to(x_keep.dtype)).reshape(ctx.x_shape)
        if ctx.needs_input_grad[1]:
            into = ctx.main_grad_of
            w_dtype = torch.float32 if into is not None else ctx.w_dtype

            def compute_wgrad():
                return (g2.t().float() @ x_keep.float()).to(w_dtype)
            grad_w = _weight_gradient(compute_wgrad, into, ctx.wgrad_store, g2.device.type)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = g2.sum(0).to(ctx.w_dtype)
        return grad_x, grad_w, grad_b, None


class _NativeFP8Linear(torch.autograd.Function):
    """`_FP8Linear` for its common call (see `_native_linear`): forward and backward one compiled call each,
    computing the same bytes with the same GEMMs; the scope bookkeeping stays in Python. `qweight`: the cached
    FP8 weight, or None to cast the weight in the forward call (and re-cast its transpose in backward). With
    `into_main_grad` the wgrad GEMM adds into `weight.main_grad` in its epilogue."""

    @staticmethod
    def forward(ctx, x, weight, bias, qweight, options):
        ext, state, plan, into_main_grad = options
        wgrad, dgrad = weight.requires_grad, x.requires_grad
        leaf = x.grad_fn is None  # kept by reference, its transpose re-cast in backward (`_input_operand`)
        fresh = qweight is None  # the weight cast here, its transpose re-cast in backward (`_weight_operand`)
        slots, index = plan.slot_address
        y, qx_t, x_sinv, scales, cast_sinv = ext.linear_fwd(
            x, plan.forward_scale, slots, index + FWD_INPUT, wgrad and not leaf, (wgrad and leaf) or (fresh and dgrad),
            None if fresh else qweight._data, None if fresh else qweight._scale_inv, weight if fresh else None, bias)
        ctx.save_for_backward(qx_t, x if wgrad and leaf else None, weight if fresh and dgrad else None, scales, x_sinv,
                              cast_sinv if dgrad else None)
        # the cache is rewritten in place only by a later first microbatch (see `_weight_operand`)
        w_t, w_sinv = (qweight._transpose_cache.buffer, qweight._scale_inv) if dgrad and not fresh else (None, None)
        ctx.native = (ext, state, plan, w_t, w_sinv, bias is not None, DTYPE_CODES[x.dtype],
                      DTYPE_CODES[weight.dtype], weight if into_main_grad else None)
        return y

    @staticmethod
    def backward(ctx, grad_out):
        qx_t, x_ref, w_ref, scales, x_sinv, cast_sinv = ctx.saved_tensors
        ext, state, plan, w_t, w_sinv, has_bias, x_code, w_code, into = ctx.native
        need = ctx.needs_input_grad
        e5m2 = plan.recipe.fp8_format.backward_dtype == torch.float8_e5m2
        slots, index = plan.key_state.backward.slot_address(state.bwd)
        main_grad = into.main_grad if into is not None and need[1] else None
        args = (grad_out, state.bwd.scale, slots, index + BWD_GRAD_OUTPUT, e5m2, w_t, w_ref,
                w_sinv if cast_sinv is None else cast_sinv, qx_t, x_ref, scales, x_sinv, need[0], need[1],
                has_bias and need[2], x_code, w_code, main_grad)
        grads = backward_outside_autocast(lambda: ext.linear_bwd(*args), grad_out.device.type)
        _backward_done(plan)
        grad_w = grad_after_main_grad(into) if main_grad is not None else grads[1]
        return grads[0], grad_w, grads[2], None, None


def _native_linear(x: torch.Tensor, weight: torch.Tensor, qweight: Optional[Float8Tensor], state: FP8State,
                   plan: _Plan, wgrad_in_fp8: bool, sequence_parallel: bool, wgrad_store) -> Optional[Any]:
    """The compiled extension when it can run this call as `_NativeFP8Linear`, else None: delayed scaling
    outside checkpointed regions, the weight aligned and either cached (its transpose current) or, with
    `qweight=None`, cast per call, FP8 weight gradients, no sequence-parallel FP8 gather or delayed wgrad, and
    a token count that is a non-zero multiple of 16 (the wgrad GEMM's contraction, unpadded)."""
    if plan.slot_address is None or plan.meta is None or plan.checkpointed or plan.phase is not None:
        return None
    if sequence_parallel or wgrad_store is not None or not wgrad_in_fp8:
        return None
    if qweight is not None and (qweight is not state.weight_fp8 or not qweight.has_current_transpose()):
        return None
    ext = native.for_device(x.device)
    if ext is None or not _native_layer(state, weight, plan.recipe.fp8_format) or x.dtype not in DTYPE_CODES:
        return None
    k = weight.shape[1]
    tokens = x.numel() // k if x.dim() and x.shape[-1] == k else 0
    if tokens == 0 or tokens % 16:
        return None
    return ext


def _native_layer(state: FP8State, weight: torch.Tensor, fmt: Format) -> bool:
    """The layer-level conditions of `_native_linear` (weight dtype, aligned features, an E4M3 forward),
    decided once per weight shape, dtype and format."""
    key = (weight.shape, weight.dtype, fmt, type(weight))
    if state._native_key != key:
        state._native_key = key
        state._native_ok = (fmt in _NATIVE_FORMATS and weight.dtype in DTYPE_CODES and weight.dim() == 2
                            and not isinstance(weight, Float8Tensor) and not features_unaligned(weight))
    return state._native_ok


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    state: FP8State,
    is_first_microbatch: Optional[bool] = None,
    wgrad_in_fp8: bool = True,
    sp_group: Optional[dist.ProcessGroup] = None,
    hp_gather: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
    wgrad_store: Optional[WgradStore] = None,
    fuse_wgrad_accumulation: bool = False,
) -> torch.Tensor:
    """`x @ weight.T + bias`, in FP8 inside an enabled autocast scope and in high precision otherwise.

    `sp_group`: `x` is this rank's sequence shard, to be all-gathered over the group before the GEMM (its
    gradient reduce-scattered). With delayed scaling, when the scope's amax domain covers the group (so the
    scales agree), the shard is cast first and FP8 bytes are gathered; otherwise `hp_gather(x)` (an
    autograd-aware high-precision gather) runs first.

    `is_first_microbatch`: True casts the weight and caches the cast, False reuses the cache (gradient
    accumulation over microbatches), None casts every call and caches nothing.

    `wgrad_store`: backward leaves the weight-gradient computation there instead of running it
    (TransformerEngine's `delay_wgrad_compute`; the caller runs it later and assigns the gradient).

    `fuse_wgrad_accumulation`: the weight gradient is accumulated in float32 and added into `weight.main_grad`
    (checked by the caller, see `_main_grad.accumulates_into_main_grad`) instead of returned, as megatron's
    `gradient_accumulation_fusion` and TransformerEngine's option do: in FP8 the compiled path's wgrad GEMM
    adds in its epilogue; under megatron's protocol autograd gets `_main_grad.placeholder_grad`. With
    `wgrad_store` the delayed computation keeps the float32 gradient (the high-precision path adds it itself)
    and its `backward_dw` adds it, so delaying changes no bit of `main_grad` on the paths both take.
    """
    plan = _plan(state)
    into = fuse_wgrad_accumulation  # with `wgrad_store`: its delayed computation yields float32 (see above)
    override = plan.recipe.backward_override if plan is not None else None
    if override is not None:  # FP8 forward, high-precision backward (TransformerEngine's `backward_override`)
        if sp_group is not None:
            x = hp_gather(x)
        qweight = cast_weight(weight, state, plan, is_first_microbatch)
        return _FP8ForwardHPBackward.apply(x, weight, bias, (qweight, plan, override, into, wgrad_store))
    fp8_gather = (
        sp_group is not None and plan is not None and plan.forward_scale is not None and wgrad_in_fp8
        and plan.key_state is not None and scales_shared_over(plan.key_state.group, sp_group)
    )
    if sp_group is not None and not fp8_gather:
        x = hp_gather(x)
    if plan is None:
        record_calibration_amaxes(state, x, weight)  # (a calibrating scope only: amaxes of the gathered input)
        w = weight.dequantize() if isinstance(weight, Float8Tensor) else weight
        if wgrad_store is not None:
            return high_precision_linear(x, w, bias, wgrad_store, owner=weight if into else None)
        if into:  # `weight` itself, or an FP8 parameter's dequantized value
            return linear_into_main_grad(x, w, bias, owner=weight)
        return F.linear(x, w.to(x.dtype), None if bias is None else bias.to(x.dtype))
    if is_first_microbatch is None and getattr(plan.key_state, "weight_noop_flag", None) is None:
        ext = _native_linear(x, weight, None, state, plan, wgrad_in_fp8, fp8_gather, wgrad_store)
        if ext is not None:  # the weight is cast inside the compiled call (as `cast_weight` would, uncached)
            out = _NativeFP8Linear.apply(x, weight, bias, None, (ext, state, plan, into))
            _settle_backward(plan, out)
            return out
    qweight = cast_weight(weight, state, plan, is_first_microbatch)
    ext = _native_linear(x, weight, qweight, state, plan, wgrad_in_fp8, fp8_gather, wgrad_store)
    if ext is not None:
        out = _NativeFP8Linear.apply(x, weight, bias, qweight, (ext, state, plan, into))
    else:
        out = _FP8Linear.apply(x, weight, bias, qweight,
                               (state, plan, wgrad_in_fp8, sp_group if fp8_gather else None, wgrad_store, into))
    _settle_backward(plan, out)
    return out
