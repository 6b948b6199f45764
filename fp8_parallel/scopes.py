"""Nested FP8 autocast scopes. Amax reductions belong to the scope, not to the modules.

Each enabled scope has a recipe and a process group; its key is (recipe, group). Modules that run inside a
scope take amax slots from the innermost enabled scope's key state (forward: input and weight; backward:
grad_output) and write into them; they never talk to process groups. Per key and direction the slots form
one buffer that costs one all-reduce(MAX) and one batched history/scale update (see `AmaxTable`):

* forward: when the scope that opened the key exits (grad enabled, not while a CUDA graph is captured);
* backward: in the same iteration, as soon as every FP8 module call of the scope has run its backward. The
  key state counts module calls that expect a backward and the backward nodes that ran (this also covers
  forwards inside activation checkpointing, reentrant or not: see `modules/_recompute.py`).

The key state lives only as long as the iteration needs it (held by the scope and by the autograd graph);
the persistent state (histories, scales) is in the modules' `FP8Meta` buffers. The scope stack below is the
package's one global.
"""
from __future__ import annotations

import dataclasses
import threading
from typing import List, Optional

import torch
import torch.distributed as dist

from .amax_table import AmaxTable
from .recipe import DelayedScaling, Recipe


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

    def expect_backward(self) -> None:
        with self._lock:
            self.pending_backward += 1

    def backward_ran(self) -> None:
        """Called by each FP8 module backward after writing its grad amax; the last one reduces."""
        with self._lock:
            self.pending_backward -= 1
            ready = self.pending_backward == 0 and self.forward_done and not self.backward_done
            if ready:
                self.backward_done = True
        if ready:
            self.reduce_backward()

    def reduce_forward(self) -> None:
        if isinstance(self.recipe, DelayedScaling):
            fmt = self.recipe.fp8_format
            self.forward.reduce_and_update(self.recipe, self.group, fmt.forward_max, self.name)

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


@dataclasses.dataclass
class _Scope:
    enabled: bool
    recipe: Optional[Recipe]
    group: Optional[dist.ProcessGroup]
    state: Optional[KeyState]
    owns_state: bool
    grad_enabled: bool


_SCOPE_STACK: List[_Scope] = []  # the one global: the stack of open autocast scopes


def current_scope() -> Optional[_Scope]:
    """The innermost open scope (enabled or not), or None outside any scope."""
    return _SCOPE_STACK[-1] if _SCOPE_STACK else None


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class autocast:
    """Run FP8 modules inside this block in FP8 with `recipe`, reducing amaxes over `group`.

    Args:
        enabled: False runs the enclosed FP8 modules in high precision (also inside an FP8 scope).
        recipe: `DelayedScaling` (default) or `CurrentScaling`.
        group: amax reduction group. Default: the dense amax domain of `parallel_state` when initialized,
            else the world group when torch.distributed is initialized, else no reduction.

    Scopes nest to any depth; each enabled scope has its own recipe and group, and the same (recipe, group)
    opened inside itself shares one key. An instance can be entered only once at a time.
    """

    def __init__(self, enabled: bool = True, recipe: Optional[Recipe] = None, group: Optional[dist.ProcessGroup] = None):
        self.enabled = enabled
        self.recipe = (recipe if recipe is not None else DelayedScaling()) if enabled else None
        self.group = group
        self._scope: Optional[_Scope] = None

    def __enter__(self) -> "autocast":
        if self._scope is not None:
            raise RuntimeError("this fp8_parallel.autocast instance is already active; create a new one")
        grad = torch.is_grad_enabled()
        if not self.enabled:
            scope = _Scope(False, None, None, None, False, grad)
        else:
            group = self.group if self.group is not None else _default_group()
            shared = next(
                (s for s in reversed(_SCOPE_STACK)
                 if s.enabled and s.recipe == self.recipe and s.group is group and s.grad_enabled == grad),
                None,
            )
            if shared is not None:
                scope = _Scope(True, self.recipe, group, shared.state, False, grad)
            else:
                device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
                scope = _Scope(True, self.recipe, group, KeyState(self.recipe, group, device), True, grad)
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
                reduce = scope.grad_enabled and not _capturing()
                scope.state.close_forward(reduce=reduce)


fp8_autocast = autocast


def nonfinite_amax_count(module: torch.nn.Module) -> torch.Tensor:
    """Total non-finite amaxes seen by the FP8 tensors of `module` (a device tensor; reading it syncs)."""
    from .meta import FP8Meta

    counts = [m.nonfinite_count.sum() for m in module.modules() if isinstance(m, FP8Meta)]
    return torch.stack(counts).sum() if counts else torch.zeros((), dtype=torch.int64)
