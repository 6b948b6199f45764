"""RNG states around graph capture: megatron's RNG tracker, when the program uses it.

Code that forks megatron's tracker (`get_cuda_rng_tracker().fork()`, e.g. dropout in a `TransformerLayer`)
swaps the CUDA generator's state. Inside a CUDA graph that works only for graph-safe states (generators the
graphs register); a tracker built without `use_cudagraphable_rng` holds plain state tensors, and setting one
during capture fails deep inside torch. So: graph-safe states are registered with every graph, and a plain
tracker that the callables fork during warm-up is refused before capture, with the fix in the message.
"""
from __future__ import annotations

import sys
from typing import Any, Dict, List, Optional

import torch

_FIX = ("seed megatron's tracker with graph-safe states before graphing: "
        "megatron.core.tensor_parallel.model_parallel_cuda_manual_seed(seed, use_cudagraphable_rng=True, "
        "force_reset_rng=True)")


def _tracker() -> Optional[Any]:
    """megatron's RNG tracker if megatron is imported and the tracker holds states, else None (never imports
    megatron)."""
    random = sys.modules.get("megatron.core.tensor_parallel.random")
    # megatron's module global, read directly: its getter would create a plain tracker as a side effect
    tracker = getattr(random, "_CUDA_RNG_STATE_TRACKER", None) if random is not None else None
    if tracker is None or not tracker.is_initialized() or not tracker.get_states():
        return None
    return tracker


def _graph_safe(tracker: Any) -> bool:
    states = tracker.get_states().values()
    return bool(states) and all(isinstance(s, torch.Generator) for s in states)


def graph_safe_generators() -> List[torch.Generator]:
    """The tracker's graph-safe generators, which every graph must register (torch registers its default
    generator itself); empty without a graph-safe tracker."""
    tracker = _tracker()
    if tracker is None or not _graph_safe(tracker):
        return []
    return list(tracker.get_states().values())


class TrackerWatch:
    """Notes the state objects of a plain (not graph-safe) tracker, to tell afterwards whether the callables
    forked it (each fork stores a new state object under its name)."""

    def __init__(self):
        tracker = _tracker()
        self._tracker = tracker if tracker is not None and not _graph_safe(tracker) else None
        self._before: Dict[str, int] = (
            {name: id(s) for name, s in self._tracker.get_states().items()} if self._tracker is not None else {})
        self._held = list(self._tracker.get_states().values()) if self._tracker is not None else []  # ids stay unique

    def forked(self) -> List[str]:
        """Names of the tracker states the callables used since construction."""
        if self._tracker is None:
            return []
        now = self._tracker.get_states()
        return sorted(name for name in set(now) | set(self._before) if id(now.get(name)) != self._before.get(name))

    def refuse_capture_if_forked(self) -> None:
        """Raises RuntimeError (before any capture) when the callables forked a plain tracker."""
        names = self.forked()
        if names:
            raise RuntimeError(f"make_graphed_callables: the callables fork megatron's RNG tracker (states {names}), "
                               f"whose states are not graph-safe, so CUDA graph capture would fail; {_FIX}")


class RngSnapshot:
    """CUDA RNG states (torch's default generator and the tracker's graph-safe ones) saved before warm-up and
    restored after capture, so graphing does not move the random streams the program sees."""

    def __init__(self, generators: List[torch.Generator]):
        self._default = torch.cuda.get_rng_state()
        self._generators = generators
        self._states = [g.get_state() for g in generators]

    def restore(self) -> None:
        torch.cuda.set_rng_state(self._default)
        for g, s in zip(self._generators, self._states):
            g.set_state(s)
