"""Activation recompute support: a recomputed forward sees the scales of the original forward.

A forward's scales can change before its recompute (the scope's forward update runs at scope exit, and in
pipeline schedules other microbatches' updates run in between). So when a module's forward will be
recomputed, it queues a snapshot of the scales it used (and the scope it ran in); the recompute pops it.

A forward will be recomputed when it runs under activation checkpointing inside a training scope:
reentrant checkpointing (megatron's `tensor_parallel.checkpoint`, torch's `use_reentrant=True`) runs the
original forward with grad disabled; torch's non-reentrant checkpointing runs it under its saved-tensor
hook, recognised by the hook's name (private torch detail: if it changes, non-reentrant recompute falls back
to the current scales). A recompute is recognised by running inside a backward pass.
"""
from __future__ import annotations

import collections
import dataclasses
from typing import Deque, Optional

import torch


def in_backward() -> bool:
    """True while the autograd engine runs a backward pass (where recomputation happens)."""
    return torch._C._current_graph_task_id() != -1


def _non_reentrant_checkpoint_active() -> bool:
    try:
        hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    except (AttributeError, RuntimeError):
        return False
    return bool(hooks) and hooks[0] is not None and "_checkpoint_hook" in getattr(hooks[0], "__qualname__", "")


def recompute_will_follow() -> bool:
    return not torch.is_grad_enabled() or _non_reentrant_checkpoint_active()


@dataclasses.dataclass
class Snapshot:
    key_state: object  # scopes.KeyState
    recipe: object
    forward_scale: torch.Tensor  # copy of the forward scales used
    recompute_counts_backward: bool  # reentrant: only the recomputed graph runs backward


class RecomputeQueue:
    """FIFO of snapshots of one module (pipeline schedules recompute microbatches in forward order)."""

    def __init__(self) -> None:
        self._queue: Deque[Snapshot] = collections.deque()

    def push(self, snapshot: Snapshot) -> None:
        self._queue.append(snapshot)

    def pop(self) -> Optional[Snapshot]:
        return self._queue.popleft() if self._queue else None

    def __len__(self) -> int:
        return len(self._queue)
