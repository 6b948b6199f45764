"""One training step on megatron's pipeline schedule: forward/backward over the step's micro batches
(1F1B, or interleaved with virtual stages), gradient reduction by `finalize_model_grads`, optimizer and
LR-scheduler step. Every micro batch runs inside the FP8 scope of the run's settings."""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from megatron.core import parallel_state as mpu
from megatron.core.distributed import finalize_model_grads
from megatron.core.pipeline_parallel import get_forward_backward_func

from fp8_parallel.megatron import fp8_context
from fp8_parallel.scopes import current_scope


@dataclasses.dataclass
class StepResult:
    loss: Optional[float]          # mean over the global batch (last pipeline stage only, else None)
    lr: float                      # the learning rate this step used
    grad_norm: Optional[float]
    update_successful: bool
    scopes_opened: int             # FP8 scopes the forward step opened (one per micro batch and chunk)
    scopes_reduced: int            # ... whose forward and backward amax reductions both ran


def _loss_func(loss_mask: torch.Tensor, output: torch.Tensor):
    losses = output.float().reshape(-1)
    mask = loss_mask.float().reshape(-1)
    loss = torch.sum(losses * mask) / mask.sum().clamp(min=1)
    return loss, {"lm loss": loss.detach().clone()}


class TrainStep:
    """Runs steps of the model chunks `model` with `optimizer` / `scheduler` under megatron's schedule.

    `wrap_forward_step` (e.g. a graphed pipeline's `forward_step`) wraps the forward step function.
    """

    def __init__(self, model: List[torch.nn.Module], optimizer, scheduler, config, fp8, seq_length: int,
                 micro_batch_size: int, num_microbatches: int,
                 wrap_forward_step: Optional[Callable[[Callable], Callable]] = None):
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.config = config
        self.fp8 = fp8
        self.seq_length = seq_length
        self.mbs = micro_batch_size
        self.num_microbatches = num_microbatches
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        config.finalize_model_grads_func = finalize_model_grads
        config.grad_scale_func = optimizer.scale_loss
        config.no_sync_func = [m.no_sync for m in model] if len(model) > 1 else model[0].no_sync
        self._scope_states: list = []
        forward = self._forward_step
        self.forward_step = wrap_forward_step(forward) if wrap_forward_step else forward

    def _forward_step(self, data_iterator, model):
        batch = {k: v.to(self.device, non_blocking=True) for k, v in next(data_iterator).items()}
        scope = fp8_context(self.fp8) if self.fp8.fp8 else contextlib.nullcontext()
        with scope:
            state = current_scope()
            if state is not None and state.enabled:
                self._scope_states.append(state.state)
            output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
        return output, lambda out: _loss_func(batch["loss_mask"], out)

    def __call__(self, microbatches: List[Dict[str, torch.Tensor]]) -> StepResult:
        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        self._scope_states = []
        iterators = [iter(microbatches) for _ in self.model]
        losses = get_forward_backward_func()(
            forward_step_func=self.forward_step,
            data_iterator=iterators if len(self.model) > 1 else iterators[0],
            model=self.model if len(self.model) > 1 else self.model[0],
            num_microbatches=self.num_microbatches, seq_length=self.seq_length, micro_batch_size=self.mbs,
            forward_only=False,
        )
        lr = self.lr
        update_successful, grad_norm, _ = self.optimizer.step()
        if update_successful:
            self.scheduler.step(increment=1)
        loss = None
        if mpu.is_pipeline_last_stage(ignore_virtual=True):
            mean = torch.stack([d["lm loss"] for d in losses]).mean().reshape(1).to(self.device)
            dist.all_reduce(mean, group=mpu.get_data_parallel_group(with_context_parallel=True))
            loss = mean.item() / mpu.get_data_parallel_world_size(with_context_parallel=True)
        reduced = sum(1 for s in self._scope_states if s.forward_done and s.backward_done)
        return StepResult(loss=loss, lr=lr, grad_norm=None if grad_norm is None else float(grad_norm),
                          update_successful=bool(update_successful), scopes_opened=len(self._scope_states),
                          scopes_reduced=reduced)

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])
