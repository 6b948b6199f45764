"""Activation recompute, recognised from the checkpoint machinery itself (never from grad mode).

A checkpointed forward runs twice: a first pass that keeps no activations, and a recompute in backward that
must cast with the scales of the first pass (the scope's update may have changed them in between). Each
checkpoint invocation has an object that lives exactly as long as its recompute may still run; the first
pass records what every FP8 call decided on that object (`RegionRecord`), the recompute replays it. Nothing
is kept on the modules, so a record can never leak or outlive its region.

Recognised regions (private details of torch and megatron-core, checked by the tests):
* torch `checkpoint(use_reentrant=False)`: its saved-tensor hooks. The first pass runs under the
  `_checkpoint_hook` of its frame object, the recompute under the `_recomputation_hook` pointing at it.
* reentrant checkpoints (torch `use_reentrant=True`, megatron `tensor_parallel.checkpoint`, megatron
  `CheckpointWithoutOutput`): the first pass runs inside the autograd Function's `forward` (grad disabled),
  the recompute inside its `backward` (or megatron's `_recompute` hook); the record lives on the Function's
  context. Found by walking the Python stack, which is done only when grad is disabled or in backward.

Backward accounting. A non-reentrant first pass builds the autograd nodes that run in backward, so those
count as usual. A reentrant first pass builds none; its recompute's nodes run instead. They are counted at
the first pass (so the scope's backward reduction waits for the recompute), only when the checkpoint's
own node exists, and the recompute settles any call whose recomputed output turns out not to need grad.
"""
from __future__ import annotations

import dataclasses
import enum
import sys
from typing import Any, Dict, List, Optional, Tuple

import torch

_RECORD_ATTR = "_fp8_parallel_record"


def in_backward() -> bool:
    """True while the autograd engine runs a backward pass (where recomputation happens)."""
    return torch._C._current_graph_task_id() != -1


@dataclasses.dataclass
class Snapshot:
    """What one FP8 call of a first pass decided, for its recompute to repeat."""

    key_state: Any  # scopes.KeyState the call registered with
    recipe: Any
    forward_scale: Optional[torch.Tensor]  # copy of the forward scales used (None: current scaling)
    counted: bool  # a backward was counted for the recompute's node (reentrant regions)


class RegionRecord:
    """The FP8 calls of one checkpointed region's first pass, per module state, in call order.

    A recompute replays them in the same order; each recompute pass (a backward graph task, or a
    non-reentrant checkpoint's recompute group) starts from the beginning, so `retain_graph` re-runs see the
    same snapshots. `None` entries are calls that ran in high precision.
    """

    def __init__(self) -> None:
        self._calls: Dict[torch.nn.Module, List[Optional[Snapshot]]] = {}
        self._pass: Any = None
        self._next: Dict[torch.nn.Module, int] = {}

    def add(self, state: torch.nn.Module, snapshot: Optional[Snapshot]) -> None:
        self._calls.setdefault(state, []).append(snapshot)

    def has_fp8_calls(self) -> bool:
        """Whether the first pass made any FP8 call."""
        return any(snap is not None for calls in self._calls.values() for snap in calls)

    def replay(self, state: torch.nn.Module, recompute_pass: Any) -> Optional[Snapshot]:
        """The next recorded decision of `state` in this recompute pass; None (high precision) when the first
        pass made no such call."""
        if recompute_pass != self._pass:
            self._pass, self._next = recompute_pass, {}
        i = self._next.get(state, 0)
        calls = self._calls.get(state, ())
        if i >= len(calls):
            return None
        self._next[state] = i + 1
        return calls[i]


class Phase(enum.Enum):
    FIRST_PASS = 1
    RECOMPUTE = 2


@dataclasses.dataclass(frozen=True)
class Region:
    """The checkpointed region the current call runs in, and in which of its two passes."""

    phase: Phase
    reentrant: bool
    holder: Any  # the object whose lifetime bounds the region's recompute
    recompute_pass: Any = None  # identifies one recompute pass (RECOMPUTE only)
    backward_will_run: bool = True  # FIRST_PASS of a reentrant region: the checkpoint's node exists

    def add(self, state: torch.nn.Module, snapshot: Optional[Snapshot]) -> None:
        """First pass: record one call's decision on the region."""
        record = getattr(self.holder, _RECORD_ATTR, None)
        if record is None:
            record = RegionRecord()
            setattr(self.holder, _RECORD_ATTR, record)
        record.add(state, snapshot)

    def first_pass_ran_fp8(self) -> bool:
        """Recompute: whether the first pass made FP8 calls (it runs outside the autocast scope it had)."""
        record = getattr(self.holder, _RECORD_ATTR, None)
        return record is not None and record.has_fp8_calls()

    def replay(self, state: torch.nn.Module) -> Optional[Snapshot]:
        """Recompute: the matching first-pass decision (None: high precision)."""
        record = getattr(self.holder, _RECORD_ATTR, None)
        return record.replay(state, self.recompute_pass) if record is not None else None


_TORCH = "torch/utils/checkpoint.py"
_MEGATRON = "megatron/core/tensor_parallel/random.py"
# qualified name -> (file suffix, phase) of the frames of reentrant checkpoint implementations; an empty
# suffix: torch's or megatron's file (both name their autograd Function `CheckpointFunction`)
_REENTRANT_FRAMES: Dict[str, Tuple[str, Phase]] = {
    "CheckpointFunction.forward": ("", Phase.FIRST_PASS),  # torch's and megatron's (file checked below)
    "CheckpointFunction.backward": ("", Phase.RECOMPUTE),
    "CheckpointWithoutOutputFunction.forward": (_MEGATRON, Phase.FIRST_PASS),
    "CheckpointWithoutOutput._recompute": (_MEGATRON, Phase.RECOMPUTE),
}


def _closure_value(fn: Any, name: str) -> Any:
    """The value of closure variable `name` of a (possibly wrapped) hook function, or None."""
    fn = getattr(fn, "__wrapped__", fn)
    code = getattr(fn, "__code__", None)
    if code is None or name not in code.co_freevars or fn.__closure__ is None:
        return None
    return fn.__closure__[code.co_freevars.index(name)].cell_contents


def _non_reentrant_region() -> Optional[Region]:
    """torch's non-reentrant checkpoint, from the innermost saved-tensor hooks."""
    try:
        hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    except (AttributeError, RuntimeError):
        return None
    if not hooks or hooks[0] is None:
        return None
    pack = getattr(hooks[0], "__wrapped__", hooks[0])
    qualname = getattr(pack, "__qualname__", "")
    if qualname.startswith("_checkpoint_hook."):
        frame = _closure_value(pack, "frame")
        return Region(Phase.FIRST_PASS, False, frame) if frame is not None else None
    if qualname.startswith("_recomputation_hook."):
        ref = _closure_value(pack, "target_frame_ref")
        frame = ref() if ref is not None else None
        if frame is not None:
            return Region(Phase.RECOMPUTE, False, frame, recompute_pass=("gid", _closure_value(pack, "gid")))
    return None


def _reentrant_region() -> Optional[Region]:
    """The innermost reentrant checkpoint frame on the Python stack, if any."""
    f = sys._getframe(1)
    while f is not None:
        code = f.f_code
        entry = _REENTRANT_FRAMES.get(code.co_qualname)
        if entry is not None:
            suffix, phase = entry
            filename = code.co_filename.replace("\\", "/")
            if filename.endswith(suffix) if suffix else filename.endswith((_TORCH, _MEGATRON)):
                local = f.f_locals
                ctx = getattr(local.get("self"), "ctx", None) if phase is Phase.RECOMPUTE and suffix else local.get("ctx")
                if ctx is None:
                    return None
                if phase is Phase.FIRST_PASS:
                    return Region(phase, True, ctx, backward_will_run=len(ctx.next_functions) > 0)
                return Region(phase, True, ctx, recompute_pass=("task", torch._C._current_graph_task_id()))
        f = f.f_back
    return None


def checkpoint_region() -> Optional[Region]:
    """The checkpointed region this FP8 call runs in, or None outside any.

    Precedence (innermost wins where regions nest): a reentrant first pass (it disables grad, and torch's
    non-reentrant checkpoint installs no hooks without grad, so a hook seen there is from outside); then
    torch's non-reentrant hooks (a backward pass runs without the forward's hooks, so a hook seen during a
    reentrant recompute was installed inside it); then a reentrant recompute. The stack is walked only when
    grad is disabled or inside backward: a plain `torch.no_grad()` call walks it and finds nothing.
    """
    frame_region = None
    if not torch.is_grad_enabled() or in_backward():
        frame_region = _reentrant_region()
        if frame_region is not None and frame_region.phase is Phase.FIRST_PASS and not torch.is_grad_enabled():
            return frame_region
    region = _non_reentrant_region()
    if region is not None:
        return region
    if frame_region is not None and frame_region.phase is Phase.RECOMPUTE and in_backward():
        return frame_region
    return None
