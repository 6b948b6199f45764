"""`GraphedCallable`: what a graphed module's `forward` becomes."""
from __future__ import annotations

from typing import Callable, List, Optional, Tuple

import torch
import torch.distributed as dist

from ..recipe import Recipe
from ..scopes import current_scope
from .arguments import _unflatten_outputs
from .recording import _register_forward
from .runners import _Flight, _Replay, _Runner


class GraphedCallable:
    """A callable whose calls replay its next microbatch's captured forward (and, through autograd, backward).

    It replays when the call matches the capture (training mode, grad enabled, the caller's FP8 scope enabled
    with the captured recipe exactly when `fp8_enabled`); otherwise it runs the original callable eagerly,
    so a graphed module can still run with or without FP8. `is_first_microbatch` (keyword) drives the
    captured weight casts when `fp8_weight_caching`; without it, microbatch 0 of a step casts.

    Attributes:
        num_microbatches: graphs per direction.
        next_microbatch: the microbatch whose graphs the next call replays (cycles; settable).
        replayed: calls that replayed (the others ran eagerly).
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
        self.replayed = 0

    def replays(self) -> bool:
        """Whether a call now replays the graphs (see the class docstring)."""
        if self.module is not None and self.module.training != self.training:
            return False
        if not torch.is_grad_enabled():
            return False
        scope = current_scope()
        fp8_on = scope is not None and scope.enabled
        if fp8_on != self.fp8_enabled:
            return False
        if fp8_on and (scope.recipe != self.recipe or (self.group is not None and scope.group is not self.group)):
            return False
        return True

    def __call__(self, *args, **kwargs):
        if not self.replays():
            return self.original(*args, **kwargs)
        is_first = kwargs.pop("is_first_microbatch", None)
        mb = self.next_microbatch
        runner = self.runners[mb]
        signature = runner.signature
        inputs = signature.tensors_of(args, kwargs, self.name)
        if self.flag is not None:
            self._set_weight_flag(mb == 0 if is_first is None else bool(is_first))
        flight = _Flight()
        flight.runner, flight.num_inputs, flight.pairs = runner, len(inputs), []
        outputs = _Replay.apply(flight, *inputs, *self.params)
        _, recorder, _ = flight.state
        flight.pairs = _register_forward(recorder)
        self.next_microbatch = (mb + 1) % self.num_microbatches
        self.replayed += 1
        return _unflatten_outputs(outputs, *flight.state[0])

    def _set_weight_flag(self, first: bool) -> None:
        versions = [w._version for w in self.cached_weights]
        cast = first or versions != self._cast_versions  # a weight written since its last cast: cast again
        value = 0 if cast else 1
        if value != self._flag_value:
            self.flag.fill_(value)
            self._flag_value = value
        if cast:
            self._cast_versions = versions

    def reset(self) -> None:
        """Start the next call at microbatch 0 (e.g. after an interrupted step)."""
        self.next_microbatch = 0
