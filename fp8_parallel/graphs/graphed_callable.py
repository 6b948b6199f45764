"""`GraphedCallable`: what a graphed module's `forward` becomes; `GraphedMicrobatch`: one microbatch of it."""
from __future__ import annotations

import warnings
from typing import Callable, List, Optional, Set, Tuple

import torch
import torch.distributed as dist

from ..recipe import Recipe
from ..scopes import current_scope
from .arguments import _unflatten_outputs
from .recording import _register_forward
from .runners import _Flight, _Replay, _Runner


def _describe_group(group: Optional[dist.ProcessGroup]) -> str:
    if group is None:
        return "no group"
    try:
        return f"the group of ranks {dist.get_process_group_ranks(group)}"
    except (RuntimeError, ValueError):
        return "another group"


class _Counts:
    replay_count: int
    eager_count: int


class GraphedCallable:
    """A callable whose calls replay its next microbatch's captured forward (and, through autograd, backward).

    It replays when the call matches the capture: training mode as captured, grad enabled, and FP8 as
    captured (with `fp8_enabled`: the caller's innermost scope enabled, with the captured recipe, and the
    captured `fp8_group` when one was given; without: FP8 off). Otherwise it runs the original callable
    eagerly, so a graphed module still runs with or without FP8; an FP8 mismatch is said once per reason (a
    warning naming both recipes), and `eager_count` counts every eager call. `is_first_microbatch`
    (keyword) drives the captured weight casts when `fp8_weight_caching`; without it, microbatch 0 casts.

    Attributes:
        num_microbatches: graphs per direction.
        next_microbatch: the microbatch whose graphs the next call replays (cycles; settable).
        replay_count: calls that replayed their graphs.
        eager_count: calls that ran the original callable eagerly.
    """

    def __init__(self, name: str, original: Callable, module: Optional[torch.nn.Module], runners: List[_Runner],
                 params: Tuple[torch.nn.Parameter, ...], training: bool,
                 fp8_enabled: bool, recipe: Optional[Recipe], group: Optional[dist.ProcessGroup],
                 flag: Optional[torch.Tensor], cached_weights: List[torch.Tensor]):
        self.name = name
        self.original = original
        self.module = module
        self.runners = runners
        self.params = params
        self.training = training
        self.fp8_enabled, self.recipe, self.group = fp8_enabled, recipe, group
        self.flag = flag
        self._flag_value = 0
        self.cached_weights = cached_weights
        self._cast_versions: Optional[List[int]] = None
        self.num_microbatches = len(runners)
        self.next_microbatch = 0
        self.replay_count = 0
        self.eager_count = 0
        self._warned: Set[str] = set()

    def eager_reason(self) -> Optional[str]:
        """Why a call now would run eagerly (None: it replays; see the class docstring)."""
        return self._mode_mismatch() or self._fp8_mismatch()

    def _mode_mismatch(self) -> Optional[str]:
        if self.module is not None and self.module.training != self.training:
            return f"the module is in {'training' if self.module.training else 'eval'} mode, captured in the other"
        if not torch.is_grad_enabled():
            return "grad mode is off"
        return None

    def replays(self) -> bool:
        """Whether a call now replays the graphs (see the class docstring)."""
        return self.eager_reason() is None

    def _fp8_mismatch(self) -> Optional[str]:
        scope = current_scope()
        fp8_on = scope is not None and scope.enabled
        if fp8_on != self.fp8_enabled:
            if self.fp8_enabled:
                return f"it was captured with FP8 recipe {self.recipe} but is called with FP8 off (no enabled scope)"
            return (f"it was captured without FP8 but is called inside an enabled FP8 scope with recipe "
                    f"{scope.recipe}")
        if fp8_on and scope.recipe != self.recipe:
            return f"it was captured with FP8 recipe {self.recipe} but is called in a scope with recipe {scope.recipe}"
        if fp8_on and self.group is not None and scope.group is not self.group:
            return (f"it was captured for amax reduction over {_describe_group(self.group)} but is called in a "
                    f"scope reducing over {_describe_group(scope.group)}")
        return None

    def __call__(self, *args, **kwargs):
        mb = self.next_microbatch
        out, replayed = self._call(mb, args, kwargs, None)
        if replayed:
            self.next_microbatch = (mb + 1) % self.num_microbatches
        return out

    def microbatch(self, mb: int) -> "GraphedMicrobatch":
        """A callable that always replays microbatch `mb`'s graphs (TransformerEngine's per-microbatch
        callables); it shares this object's weight cache, warnings and counts."""
        if not 0 <= mb < self.num_microbatches:
            raise IndexError(f"{self.name}: microbatch {mb} of {self.num_microbatches}")
        return GraphedMicrobatch(self, mb)

    def _call(self, mb: int, args: tuple, kwargs: dict, counts: Optional[_Counts]):
        """Replay microbatch `mb` (or run eagerly, see the class docstring); returns (outputs, replayed)."""
        runner = self.runners[mb]
        reason = "its graphs were released by reset()" if runner.released else self._mode_mismatch()
        fp8_reason = self._fp8_mismatch() if reason is None else None
        if reason is not None or fp8_reason is not None:
            self.eager_count += 1
            if counts is not None:
                counts.eager_count += 1
            if fp8_reason is not None:
                self._say_once(fp8_reason)
            return self.original(*args, **kwargs), False
        is_first = kwargs.pop("is_first_microbatch", None)
        inputs = runner.signature.tensors_of(args, kwargs, self.name)
        if self.flag is not None:
            self._set_weight_flag(mb == 0 if is_first is None else bool(is_first))
        flight = _Flight()
        flight.runner, flight.num_inputs, flight.pairs = runner, len(inputs), []
        outputs = _Replay.apply(flight, *inputs, *self.params)
        if runner.options.check_held_outputs and hasattr(runner, "held"):
            runner.held.remember(outputs)
        _, recorder, _ = flight.state
        flight.pairs = _register_forward(recorder)
        self.replay_count += 1
        if counts is not None:
            counts.replay_count += 1
        return _unflatten_outputs(outputs, *flight.state[0]), True

    def _say_once(self, reason: str) -> None:
        """Warn once per reason about FP8 mismatches (eval mode and no-grad calls are eager by design)."""
        if reason in self._warned:
            return
        self._warned.add(reason)
        warnings.warn(f"fp8_parallel: {self.name} runs eagerly, not from its CUDA graphs: {reason}. Call it "
                      f"under the scope it was captured for to replay it (replay_count / eager_count count the "
                      f"calls)", stacklevel=4)

    def _set_weight_flag(self, first: bool) -> None:
        versions = [w._version for w in self.cached_weights]
        cast = first or versions != self._cast_versions  # a weight written since its last cast: cast again
        value = 0 if cast else 1
        if value != self._flag_value:
            self.flag.fill_(value)
            self._flag_value = value
        if cast:
            self._cast_versions = versions

    def rewind(self) -> None:
        """Start the next call at microbatch 0 (e.g. after an interrupted step)."""
        self.next_microbatch = 0

    def reset(self) -> None:
        """Release the graphs of every microbatch (their memory returns to the pool, as TransformerEngine's
        `reset`); later calls run the original callable eagerly, and a module gets its own `forward` back.
        Call it between steps, not while a backward of a replayed call is still pending."""
        for runner in self.runners:
            runner.release()
        module = self.module
        if module is not None and module.__dict__.get("forward") is self:
            own = getattr(self.original, "__func__", None) is getattr(type(module), "forward", None)
            if own and getattr(self.original, "__self__", None) is module:
                del module.forward  # the class's forward again
            else:
                module.forward = self.original
        if module is not None and module.__dict__.get("reset") == self.reset:
            del module.reset


class GraphedMicrobatch:
    """The graphs of one microbatch of a `GraphedCallable`: every call replays them (or runs eagerly where
    the parent would). What `make_graphed_callables(..., _order=...)` returns, one per (chunk, microbatch,
    layer), like TransformerEngine.

    Attributes:
        graphed: the `GraphedCallable` this belongs to.
        microbatch: its microbatch index.
        replay_count, eager_count: calls through this object that replayed / ran eagerly.
    """

    def __init__(self, graphed: GraphedCallable, microbatch: int):
        self.graphed = graphed
        self.microbatch = microbatch
        self.replay_count = 0
        self.eager_count = 0

    def __call__(self, *args, **kwargs):
        return self.graphed._call(self.microbatch, args, kwargs, self)[0]

    def reset(self) -> None:
        """Release this microbatch's graphs (TransformerEngine's `reset`); later calls run eagerly."""
        self.graphed.runners[self.microbatch].release()

    def __repr__(self) -> str:
        return f"GraphedMicrobatch({self.graphed.name}, microbatch {self.microbatch})"
