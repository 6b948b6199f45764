"""TransformerEngine's activation-recompute entry point, `checkpoint(function, *args, **kwargs)`, on
torch's own checkpoint.

Both of torch's implementations are used as they are (reentrant: `torch.utils.checkpoint.CheckpointFunction`,
non-reentrant: its saved-tensor hooks), so the FP8 modules recognise the recompute from torch's machinery
(`modules/_recompute.py`) and cast with the first pass's scales, recording no amax twice. What this adds
to torch's checkpoint is TransformerEngine's interface: its keyword arguments, keyword arguments passed
through to `function` in both modes, and the RNG tracker's states restored for the recompute.
"""
from __future__ import annotations

import contextlib
import warnings
from typing import Any, Callable, Dict, Optional

import torch
import torch.distributed as dist
import torch.utils.checkpoint as torch_checkpoint

__all__ = ["checkpoint", "resolve_rng_tracker"]


def resolve_rng_tracker(get_rng_state_tracker: Any) -> Any:
    """The RNG states tracker behind a `get_rng_state_tracker` argument: a tracker itself (an object with
    `get_states` / `set_states`, as megatron's and TransformerEngine's `CudaRNGStatesTracker`), or a callable
    returning one (TransformerEngine's convention, e.g. megatron's `get_cuda_rng_tracker`). None stays None.

    Raises:
        TypeError: neither.
    """
    if get_rng_state_tracker is None:
        return None
    if hasattr(get_rng_state_tracker, "get_states") and hasattr(get_rng_state_tracker, "set_states"):
        return get_rng_state_tracker
    if callable(get_rng_state_tracker):
        tracker = get_rng_state_tracker()
        if hasattr(tracker, "get_states") and hasattr(tracker, "set_states"):
            return tracker
        raise TypeError(f"get_rng_state_tracker() returned {type(tracker).__name__}, which has no "
                        f"get_states / set_states (expected an RNG states tracker)")
    raise TypeError(f"get_rng_state_tracker={get_rng_state_tracker!r}: expected an RNG states tracker "
                    f"(get_states / set_states) or a callable returning one")


def _copy_state(value: Any) -> Any:
    """A copy of one tracker state that later RNG draws cannot advance: tensors (the classic states) are
    cloned, generators (CUDA-graph-safe states, advanced in place) get a new generator with the same state."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, torch.Generator):
        try:
            return value.clone_state()
        except (AttributeError, RuntimeError):
            copy = torch.Generator(device=value.device)
            copy.set_state(value.get_state())
            return copy
    return value


def _copy_states(states: Any) -> Any:
    if isinstance(states, dict):
        return {name: _copy_state(value) for name, value in states.items()}
    return _copy_state(states)


class _Recomputable:
    """`function` with its keyword arguments bound, called by torch's checkpoint twice: the first pass, then
    the recompute (once per backward that needs it). The first pass snapshots the tracker's states; every
    recompute runs from a copy of that snapshot and puts the tracker's states of that moment back after."""

    def __init__(self, function: Callable, kwargs: Dict[str, Any], tracker: Any, context_fn: Optional[Callable]):
        self.function, self.kwargs, self.tracker = function, kwargs, tracker
        self.forward_ctx, self.recompute_ctx = context_fn() if context_fn is not None else (None, None)
        self.forward_states: Any = None
        self.calls = 0

    def __call__(self, *args: Any) -> Any:
        first = self.calls == 0
        self.calls += 1
        if first:
            if self.tracker is not None:
                self.forward_states = _copy_states(self.tracker.get_states())
            with self.forward_ctx if self.forward_ctx is not None else contextlib.nullcontext():
                return self.function(*args, **self.kwargs)
        backward_states = self.tracker.get_states() if self.tracker is not None else None
        try:
            if self.tracker is not None:
                # a copy each time: the tracker advances (or replaces) the states it is given
                self.tracker.set_states(_copy_states(self.forward_states))
            with self.recompute_ctx if self.recompute_ctx is not None else contextlib.nullcontext():
                return self.function(*args, **self.kwargs)
        finally:
            if self.tracker is not None:
                self.tracker.set_states(backward_states)


def checkpoint(function: Callable, *args: Any, **kwargs: Any) -> Any:
    """TransformerEngine's `checkpoint` (`transformer_engine.pytorch.distributed.checkpoint`): run `function`
    without keeping its activations and recompute them in backward.

        out = te.checkpoint(layer, hidden, attention_mask=mask, get_rng_state_tracker=get_cuda_rng_tracker)

    Built on `torch.utils.checkpoint.checkpoint` (reentrant or not, as `use_reentrant` says). FP8 modules
    inside recognise the recompute and cast with the scales of the first pass, so results (outputs,
    gradients, amax histories) are bitwise those without checkpointing.

    Keyword arguments taken here (TransformerEngine's); every other keyword goes to `function`:
        use_reentrant: True (TransformerEngine's default) runs torch's reentrant checkpoint, False the
            non-reentrant one. Keyword arguments reach `function` in both modes; with the reentrant one (as in
            TransformerEngine) no gradient flows to tensors passed as keywords: pass those positionally.
        get_rng_state_tracker: an RNG states tracker (`get_states` / `set_states`, e.g. megatron's
            `CudaRNGStatesTracker`) or a callable returning one. Its states at the start of the first pass are
            restored for the recompute (dropout inside `tracker.fork()` draws the same masks) and put back
            afterwards. torch's checkpoint restores the default CPU and CUDA generators itself.
        distribute_saved_activations: False. True (keep only this rank's slice of the first argument,
            gathered over `tp_group` for the recompute) is not implemented with `use_reentrant=True`; with
            `use_reentrant=False` it has no effect and warns, as in TransformerEngine.
        tp_group: only used by `distribute_saved_activations`.
        context_fn: torch's `(forward_context, recompute_context)` factory, in both modes.
        determinism_check, debug: torch's (non-reentrant only; `debug=True` with `use_reentrant=True` raises).

    TransformerEngine's deprecated positional form `checkpoint(function, distribute_saved_activations,
    get_rng_state_tracker, tp_group, *args)` is accepted with a `DeprecationWarning`, as there.

    Raises:
        NotImplementedError: `distribute_saved_activations=True` with `use_reentrant=True`.
        ValueError: `debug=True` with `use_reentrant=True`.
        TypeError: `get_rng_state_tracker` is neither a tracker nor a callable returning one.
    """
    use_reentrant = kwargs.pop("use_reentrant", True)
    distribute_saved_activations = kwargs.pop("distribute_saved_activations", False)
    tp_group = kwargs.pop("tp_group", None)
    get_rng_state_tracker = kwargs.pop("get_rng_state_tracker", None)
    if (len(args) > 3 and isinstance(args[0], bool) and callable(args[1])
            and (args[2] is None or isinstance(args[2], dist.ProcessGroup))):
        warnings.warn(
            "checkpoint(function, distribute_saved_activations, get_rng_state_tracker, tp_group, *args) is "
            "TransformerEngine's deprecated positional form: pass those three as keyword arguments",
            DeprecationWarning, stacklevel=2)
        distribute_saved_activations, get_rng_state_tracker, tp_group = args[:3]
        args = args[3:]
    context_fn = kwargs.pop("context_fn", None)
    determinism_check = kwargs.pop("determinism_check", "default")
    debug = kwargs.pop("debug", False)
    del tp_group  # only distribute_saved_activations would use it

    if distribute_saved_activations:
        if use_reentrant:
            raise NotImplementedError(
                "checkpoint(distribute_saved_activations=True, use_reentrant=True) is not implemented: the "
                "checkpointed input is kept whole on every rank. Use distribute_saved_activations=False (the "
                "results are the same; only the memory the saved input takes differs).")
        warnings.warn("checkpoint: distribute_saved_activations=True has no effect with use_reentrant=False "
                      "(the non-reentrant checkpoint keeps no input of its own to distribute)", stacklevel=2)
    if debug and use_reentrant:
        raise ValueError("checkpoint(debug=True) needs use_reentrant=False (torch's rule)")

    tracker = resolve_rng_tracker(get_rng_state_tracker)
    if use_reentrant:  # torch's reentrant checkpoint takes no context_fn: the wrapper enters its contexts
        return torch_checkpoint.checkpoint(_Recomputable(function, kwargs, tracker, context_fn), *args,
                                           use_reentrant=True)
    extra = {} if context_fn is None else {"context_fn": context_fn}
    return torch_checkpoint.checkpoint(_Recomputable(function, kwargs, tracker, None), *args, use_reentrant=False,
                                       determinism_check=determinism_check, debug=debug, **extra)
