"""Nested FP8 autocast scopes. Amax reductions belong to the scope, not to the modules.

Each enabled scope has a recipe and a process group; its key is (recipe, group). Modules that run inside a
scope take amax slots from the innermost enabled scope's key state (forward: input and weight; backward:
grad_output) and write into them; they never talk to process groups. Per key and direction the slots form
one buffer that costs one all-reduce(MAX) and one batched history/scale update (see `AmaxTable`):

* forward: when the outermost scope that holds the key exits (keys opened inside another scope belong to the
  outermost one, so sibling scopes with one key share it), after a training forward (grad enabled, or a reentrant
  checkpoint's first pass; not a recompute, not while a CUDA graph is captured);
* backward: in the same iteration, as soon as every FP8 module call of the scope has run its backward. The
  key state counts the calls whose backward will really run (autograd made a node: the output requires
  grad) and the backward nodes that ran; a `torch.no_grad()` call or a frozen layer on a non-grad input
  expects nothing. Activation checkpointing is recognised from the checkpoint machinery, reentrant or not
  (see `modules/_recompute.py`).

The key state lives only as long as the iteration needs it (held by the scope and by the autograd graph);
the persistent state (histories, scales) is in the modules' `FP8Meta` buffers. The scope stack below is the
package's one global.
"""
from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Iterator, List, Optional

import torch
import torch.distributed as dist

from .amax_table import AmaxTable
from .recipe import DelayedScaling, Recipe, snapshot


def _default_group() -> Optional[dist.ProcessGroup]:
    import parallel_state

    if parallel_state.is_initialized():
        return parallel_state.dense_amax_group()
    if dist.is_available() and dist.is_initialized():
        return dist.group.WORLD
    return None


def _group_name(group: Optional[dist.ProcessGroup]) -> str:
    if group is None:
        return "no group"
    try:
        return f"group of ranks {dist.get_process_group_ranks(group)}"
    except Exception:
        return "group"


class KeyState:
    """Amax tables of one (recipe, group) key for one activation of a scope (one iteration's worth)."""

    def __init__(self, recipe: Recipe, group: Optional[dist.ProcessGroup], device: torch.device):
        self.recipe = recipe
        self.group = group
        self.device = device
        self.forward = AmaxTable("forward", device)
        self.backward = AmaxTable("backward", device)
        self.pending_backward = 0
        self.forward_done = False
        self.backward_done = False
        self._lock = threading.Lock()  # CUDA backward runs on autograd's device thread

    @property
    def name(self) -> str:
        return f"fp8 autocast scope ({self.recipe}, {_group_name(self.group)})"

    def expect_backward(self, count: int = 1) -> None:
        """`count` more FP8 calls will run their backward (a grouped call counts each of its experts)."""
        with self._lock:
            self.pending_backward += count

    def backward_ran(self, count: int = 1) -> None:
        """Called by each FP8 module backward after writing its grad amax (`count`: that many calls, a grouped
        call's experts); the last one reduces."""
        with self._lock:
            self.pending_backward -= count
            ready = self.pending_backward == 0 and self.forward_done and not self.backward_done
            if ready:
                self.backward_done = True
        if ready:
            self.reduce_backward()

    def reduce_forward(self) -> None:
        """Reduce the forward amaxes. The ranks also agree here on whether a backward reduction follows (some
        call expects a backward, or one already ran), so no rank waits in one that another never starts."""
        if isinstance(self.recipe, DelayedScaling):
            fmt = self.recipe.fp8_format
            with self._lock:
                follows = self.pending_backward > 0 or len(self.backward) > 0
            self.forward.reduce_and_update(self.recipe, self.group, fmt.forward_max, self.name,
                                           backward_follows=follows)

    def reduce_backward(self) -> None:
        if isinstance(self.recipe, DelayedScaling):
            fmt = self.recipe.fp8_format
            self.backward.reduce_and_update(self.recipe, self.group, fmt.backward_max, self.name)

    def close_forward(self, reduce: bool) -> None:
        """The opening scope exited: reduce forward amaxes; reduce backward ones now if none are pending."""
        if reduce:
            self.reduce_forward()
        with self._lock:
            self.forward_done = True
            ready = self.pending_backward == 0 and len(self.backward) > 0 and not self.backward_done
            if ready:
                self.backward_done = True
        if ready:
            self.reduce_backward()


class RecordingKey(KeyState):
    """A key state that only collects amaxes (warm-up and capture of graphed callables): never reduces.

    `caller` marks the key of the capture scope itself (replay registers it with the caller's scope);
    other recording keys stand for scopes opened inside the recorded function (replay re-opens them).
    `expected_backward` counts module calls that expect a backward; `weight_noop_flag` is the device flag
    captured weight casts read (non-zero: keep the cached FP8 weight).
    """

    def __init__(self, recipe: Recipe, group: Optional[dist.ProcessGroup], device: torch.device, caller: bool,
                 weight_noop_flag: Optional[torch.Tensor]):
        super().__init__(recipe, group, device)
        self.caller = caller
        self.expected_backward = 0
        self.weight_noop_flag = weight_noop_flag
        self.cached_weights: List[torch.Tensor] = []

    def expect_backward(self, count: int = 1) -> None:
        super().expect_backward(count)
        self.expected_backward += count

    def reduce_forward(self) -> None:
        pass

    def reduce_backward(self) -> None:
        pass


class Recorder:
    """The recording keys of one recorded call, in the order their scopes were first opened."""

    def __init__(self, device: torch.device, weight_noop_flag: Optional[torch.Tensor] = None):
        self.device = device
        self.weight_noop_flag = weight_noop_flag
        self.keys: List[RecordingKey] = []
        self.cached_weights: List[torch.Tensor] = []  # weights cast under the noop flag (graph weight cache)

    def key(self, recipe: Recipe, group: Optional[dist.ProcessGroup], caller: bool) -> RecordingKey:
        for k in self.keys:
            if k.caller == caller and k.recipe == recipe and k.group is group:
                return k
        k = RecordingKey(recipe, group, self.device, caller, self.weight_noop_flag)
        k.cached_weights = self.cached_weights
        self.keys.append(k)
        return k


@dataclasses.dataclass
class _Scope:
    enabled: bool
    recipe: Optional[Recipe]
    group: Optional[dist.ProcessGroup]
    state: Optional[KeyState]
    owns_state: bool
    training: bool  # a training forward: grad enabled, or the first pass of a reentrant checkpoint
    recorder: Optional[Recorder] = None
    # TransformerEngine's calibration: with `enabled` False the modules compute in high precision and record their
    # forward amaxes in `state`; either way the scope's exit reduces them and updates the scales, also without grad
    calibrating: bool = False
    # keys opened by nested scopes of another (recipe, group) while this outermost owning scope is open:
    # siblings with the same key share them, and they are closed when this scope exits (e.g. the expert
    # scope of every MoE layer of one pass: one key, one collective per direction, not one per layer)
    companions: List["_Scope"] = dataclasses.field(default_factory=list)


_SCOPE_STACK: List[_Scope] = []  # the one global: the stack of open autocast scopes


def current_scope() -> Optional[_Scope]:
    """The innermost open scope (enabled or not), or None outside any scope."""
    return _SCOPE_STACK[-1] if _SCOPE_STACK else None


def _training_forward() -> bool:
    """Whether FP8 calls here are a training forward (their forward amaxes are reduced at scope exit): grad
    enabled, or the first pass of a reentrant checkpoint (which disables grad); never a recompute (it repeats
    a forward that was already reduced)."""
    from .modules._recompute import Phase, checkpoint_region  # not at import: modules import this module

    region = checkpoint_region()
    if region is not None and (region.reentrant or region.phase is Phase.RECOMPUTE):
        return region.phase is Phase.FIRST_PASS
    return torch.is_grad_enabled()


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _owned_or_companion_scope(recipe: Recipe, group: Optional[dist.ProcessGroup], training: bool,
                              enabled: bool = True, calibrating: bool = False) -> _Scope:
    """A scope with a new key. Inside an outermost owning scope the key belongs to that scope (shared by later
    scopes with the same key within it, closed when it exits); otherwise this scope owns and closes it."""
    anchor = next((s for s in _SCOPE_STACK if s.owns_state and s.recorder is None), None)
    if anchor is not None:
        for c in anchor.companions:
            if c.recipe == recipe and c.group is group and c.training == training:
                return _Scope(enabled, recipe, group, c.state, False, training, calibrating=calibrating)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    state = KeyState(recipe, group, device)
    if anchor is None:
        return _Scope(enabled, recipe, group, state, True, training, calibrating=calibrating)
    anchor.companions.append(_Scope(enabled, recipe, group, state, False, training, calibrating=calibrating))
    return _Scope(enabled, recipe, group, state, False, training, calibrating=calibrating)


class autocast:
    """Run FP8 modules inside this block in FP8 with `recipe`, reducing amaxes over `amax_reduction_group`.

    TransformerEngine 2.x's `te.autocast`, with its argument names and order.

    Args:
        enabled: False runs the enclosed FP8 modules in high precision (also inside an FP8 scope).
        calibrating: TransformerEngine's calibration mode. With `enabled=False` the FP8 modules inside compute
            in high precision and record the amaxes of their forward inputs and weights; with either value of
            `enabled` the scope's exit reduces those amaxes and updates the delayed-scaling scales, also under
            `torch.no_grad()` (where an FP8 inference scope updates nothing). A later FP8 scope casts with
            the calibrated scales. With current scaling there is nothing to calibrate.
        recipe: `DelayedScaling` (default) or `CurrentScaling` from `fp8_parallel.recipe`.
        amax_reduction_group: the amax reduction group. Default: the dense amax domain of `parallel_state`
            when initialized, else the world group when torch.distributed is initialized, else no reduction.
        group: the same as `amax_reduction_group` (give one of them).

    Scopes nest to any depth; each enabled scope has its own recipe and group. Within one outermost scope, all
    scopes with the same (recipe, group) share one key: nested in each other or side by side (e.g. the expert
    scopes of all MoE layers of a pass), so each key costs one collective per direction. A key's forward
    amaxes are reduced when the outermost scope exits (TransformerEngine's rule); a key opened outside any
    other scope is reduced when its own scope exits. An instance can be entered only once at a time.

    Raises:
        TypeError: a recipe that is not one of ours (e.g. TransformerEngine's own), a recipe passed where
            `enabled` or `calibrating` goes, or a group that is not a ProcessGroup.
        ValueError: both `amax_reduction_group` and `group`.
    """

    def __init__(
        self,
        enabled: bool = True,
        calibrating: bool = False,
        recipe: Optional[Recipe] = None,
        amax_reduction_group: Optional[dist.ProcessGroup] = None,
        *,
        group: Optional[dist.ProcessGroup] = None,
    ):
        for name, value in (("enabled", enabled), ("calibrating", calibrating)):
            if isinstance(value, Recipe):
                raise TypeError(f"autocast({name}={value!r}): positional arguments are (enabled, calibrating, "
                                f"recipe, amax_reduction_group), as in TransformerEngine; pass the recipe as "
                                f"recipe=...")
            if value is not None and not isinstance(value, (bool, int)):
                raise TypeError(f"autocast({name}={value!r}): expected a bool")
        if recipe is not None and not isinstance(recipe, Recipe):
            raise TypeError(
                f"autocast(recipe={recipe!r}): expected a recipe from fp8_parallel.recipe (DelayedScaling or "
                "Float8CurrentScaling); TransformerEngine's recipe objects are not accepted"
            )
        if amax_reduction_group is not None and group is not None:
            raise ValueError("autocast: give amax_reduction_group or group, not both")
        group = amax_reduction_group if amax_reduction_group is not None else group
        if group is not None and not isinstance(group, dist.ProcessGroup):
            raise TypeError(f"autocast(amax_reduction_group={group!r}): expected a torch.distributed ProcessGroup "
                            "or None")
        self.enabled = bool(enabled)
        self.calibrating = bool(calibrating)
        keyed = self.enabled or self.calibrating
        self.recipe = (recipe if recipe is not None else DelayedScaling()) if keyed else None
        if self.recipe is not None:
            snapshot(self.recipe)  # a field set to a refused value is named here (checked only after a change)
        self.group = group
        self._scope: Optional[_Scope] = None

    @property
    def amax_reduction_group(self) -> Optional[dist.ProcessGroup]:
        """The group given (TransformerEngine's name for `group`)."""
        return self.group

    def __enter__(self) -> "autocast":
        if self._scope is not None:
            raise RuntimeError("this fp8_parallel.autocast instance is already active; create a new one")
        grad = _training_forward()
        recorder = _SCOPE_STACK[-1].recorder if _SCOPE_STACK else None
        if self.calibrating and recorder is None:  # its own key, reduced and updated at exit even without grad
            group = self.group if self.group is not None else _default_group()
            scope = _owned_or_companion_scope(snapshot(self.recipe), group, True, self.enabled, True)
        elif not self.enabled:
            scope = _Scope(False, None, None, None, False, grad, recorder)
        else:
            recipe = snapshot(self.recipe)  # the recipe as it is at entry: later assignments to it start a new key
            group = self.group if self.group is not None else _default_group()
            shared = next(
                (s for s in reversed(_SCOPE_STACK)
                 if s.enabled and s.recipe == recipe and s.group is group and s.training == grad
                 and s.recorder is recorder),  # a recording never shares keys from outside it
                None,
            )
            if shared is not None:
                scope = _Scope(True, recipe, group, shared.state, False, grad, recorder)
            elif recorder is not None:  # recording a graphed callable: collect, never reduce
                scope = _Scope(True, recipe, group, recorder.key(recipe, group, caller=False), False,
                               grad, recorder)
            else:
                scope = _owned_or_companion_scope(recipe, group, grad)
        _SCOPE_STACK.append(scope)
        self._scope = scope
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        scope, self._scope = self._scope, None
        try:
            popped = _SCOPE_STACK.pop()
            assert popped is scope, "fp8_parallel.autocast scopes exited out of order"
        finally:
            if scope.owns_state and exc_type is None:
                capturing = _capturing()
                for closing in (scope, *scope.companions):
                    closing.state.close_forward(reduce=closing.training and not capturing)


# TransformerEngine's `fp8_autocast` (its keyword names) is in `te_compat.py`.


@contextlib.contextmanager
def recording_scope(recorder: Recorder, enabled: bool, recipe: Optional[Recipe]) -> Iterator[None]:
    """Run a graphed callable's warm-up or capture: FP8 modules inside collect amaxes in `recorder`'s keys
    (the capture scope's own key, and one per scope opened inside), and nothing is reduced."""
    grad = torch.is_grad_enabled()
    if enabled:
        recipe = snapshot(recipe if recipe is not None else DelayedScaling())
        scope = _Scope(True, recipe, None, recorder.key(recipe, None, caller=True), False, grad, recorder)
    else:
        scope = _Scope(False, None, None, None, False, grad, recorder)
    _SCOPE_STACK.append(scope)
    try:
        yield
    finally:
        popped = _SCOPE_STACK.pop()
        assert popped is scope, "fp8_parallel.autocast scopes exited out of order"


def nonfinite_amax_count(module: torch.nn.Module) -> torch.Tensor:
    """Total non-finite amaxes seen by the FP8 tensors of `module` (a device tensor; reading it syncs)."""
    from .meta import FP8Meta

    counts = [m.nonfinite_count.sum() for m in module.modules() if isinstance(m, FP8Meta)]
    return torch.stack(counts).sum() if counts else torch.zeros((), dtype=torch.int64)
