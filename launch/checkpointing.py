"""Checkpoints of the training job: megatron-core `dist_checkpointing`, atomic and resumable.

    state = load_checkpoint(args.load, model, optimizer, scheduler, run_args)   # None: start fresh
    ...
    save_checkpoint(args.save, TrainState(iteration, consumed_samples), model, optimizer, scheduler, run_args)

Both calls are collective over all ranks. `model` is the list of model chunks as megatron's schedules take
them (possibly wrapped in megatron DDP / Float16Module); `optimizer` is what `get_megatron_optimizer`
returns and `scheduler` an `OptimizerParamScheduler`; either may be None.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional

import torch


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be saved or loaded (incomplete, corrupt, another model or layout)."""


@dataclasses.dataclass
class TrainState:
    """Where training stands: the iteration finished, samples consumed, and JSON-able extras."""

    iteration: int
    consumed_samples: int
    extra: Dict[str, Any] = dataclasses.field(default_factory=dict)


def save_checkpoint(
    save_dir: str,
    state: TrainState,
    model: List[torch.nn.Module],
    optimizer: Any,
    scheduler: Any,
    run_args: Dict[str, Any],
) -> None:
    """Save model, optimizer, scheduler, FP8 state, RNG states and `state` under `save_dir` (collective)."""
    raise NotImplementedError("save_checkpoint: being written (issue 12)")


def load_checkpoint(
    load_dir: str,
    model: List[torch.nn.Module],
    optimizer: Any,
    scheduler: Any,
    run_args: Dict[str, Any],
) -> Optional[TrainState]:
    """Load the latest complete checkpoint under `load_dir` into the given objects (collective).

    Returns None when `load_dir` holds no complete checkpoint. Raises CheckpointError naming the problem.
    """
    raise NotImplementedError("load_checkpoint: being written (issue 12)")
