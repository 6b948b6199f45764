"""The training job from parsed flags: groups, model, optimizer, data, checkpoints, steps, outputs."""
from __future__ import annotations

import dataclasses
import os
import sys
from typing import Optional

import torch
import torch.distributed as dist

import parallel_state as ps

from .arguments import RunArgs
from .children import tie_children_to_this_rank
from .elastic import init_process_group, report_error_to_torchrun


@dataclasses.dataclass
class Position:
    iteration: int = 0
    consumed_samples: int = 0


def _load(args: RunArgs, plan, model, optimizer, scheduler, say) -> Position:
    """Resume from the checkpoint directory the pre-flight checks chose (`plan.load`; None: iteration 0)."""
    if plan.note:
        say(plan.note)
    if plan.load is None:
        return Position()
    from launch.checkpointing import CheckpointError, load_checkpoint

    state = load_checkpoint(plan.load, model, optimizer, scheduler, args.as_dict(),
                            override_scheduler=args.override_opt_param_scheduler)
    if state is None:  # removed since the pre-flight checks
        raise CheckpointError(f"cannot load from {plan.load}: its checkpoint disappeared since the job started")
    say(f"resumed from {plan.load} at iteration {state.iteration} (sample {state.consumed_samples})")
    return Position(state.iteration, state.consumed_samples)


def _save(args: RunArgs, pos: Position, model, optimizer, scheduler, say, extra: dict) -> None:
    from launch.checkpointing import TrainState, save_checkpoint

    save_checkpoint(args.save, TrainState(pos.iteration, pos.consumed_samples, extra), model, optimizer, scheduler,
                    args.as_dict(), overwrite=args.overwrite, keep_last=args.keep_last)
    say(f"saved checkpoint at iteration {pos.iteration} to {args.save}")


def _checkpoint_failure(err: Exception) -> int:
    """A checkpoint that cannot be loaded or saved ends the job: one line (per machine), exit status 1.

    The checkpoint code raises it on every rank together, so every rank leaves cleanly."""
    text = "pretrain_gpt.py: error: " + " ".join(str(err).split())
    report_error_to_torchrun(text)
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        print(text, file=sys.stderr, flush=True)
    return 1


def _is_terminal(stream) -> bool:
    """A progress bar only on a terminal; piped output (a log file, CI) gets the plain interval lines alone."""
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def _logs_dir(args: RunArgs) -> Optional[str]:
    """`<save>/logs`: where a run with --save writes train.log, metrics.jsonl, TensorBoard events and its plot."""
    return os.path.join(args.save, "logs") if args.save else None


def _tensorboard_dir(args: RunArgs) -> Optional[str]:
    """--tensorboard-dir, else `<save>/logs/tensorboard` (None: a run without either writes no events)."""
    if args.tensorboard_dir:
        return args.tensorboard_dir
    return os.path.join(_logs_dir(args), "tensorboard") if args.save else None


def _open_text_log(args: RunArgs):
    """With --save: rank 0 and the logging rank copy what they print into `<save>/logs/train.log` (collective)."""
    from .metrics import TextLog, logging_rank

    log_rank = logging_rank()
    if not args.save or dist.get_rank() not in (0, log_rank):
        return None
    logs = _logs_dir(args)
    text_log = TextLog(os.path.join(logs, "train.log"))
    if dist.get_rank() == log_rank:
        beside = "metrics.jsonl and run.png (at the end)" if args.tensorboard_dir else \
            "metrics.jsonl, tensorboard/ and run.png (at the end)"
        elsewhere = f"; TensorBoard events in {args.tensorboard_dir}" if args.tensorboard_dir else ""
        print(f"log: {os.path.join(logs, 'train.log')}; {beside} beside it{elsewhere}", flush=True)
    return text_log


def _plot_run(args: RunArgs, say) -> None:
    """The end of a run with --save: `<save>/logs/run.png` from the run's metrics (`launch/plot_run.py`). A plot
    that cannot be drawn is one note; the checkpoint and logs stand."""
    from launch.plot_run import plot

    png = os.path.join(_logs_dir(args), "run.png")
    try:
        plot(os.path.join(_logs_dir(args), "metrics.jsonl"), png, title=f"run in {args.save}")
    except (ImportError, OSError, ValueError) as err:
        say(f"note: no plot of the run: {err}")
        return
    say(f"plot: {png}")


def _metrics_row(args: RunArgs, pos: Position, result, step_ms: float, flops: float, model, log_rank: int) -> dict:
    """One iteration's figures for the run's logs (collective: FP8 and memory figures come from every rank).

    FP8 figures only with FP8 on: health, per-role scale / amax ranges, and on log intervals `fp8_layers`."""
    from .metrics import fp8_health, fp8_role_summary, gather_layer_state, job_peak_memory_mib, tflops_per_s

    row = {"iteration": pos.iteration, "consumed_samples": pos.consumed_samples, "loss": result.loss,
           "lr": result.lr, "grad_norm": result.grad_norm,
           "tokens_per_s": args.global_batch_size * args.seq_length / (step_ms / 1e3),
           "tflops_per_s": tflops_per_s(flops, step_ms), "memory_peak_mib": job_peak_memory_mib(),
           "step_ms": step_ms, "update_successful": result.update_successful}
    if not args.fp8:
        return row
    row.update(fp8_health(model, result.scopes_opened, result.scopes_reduced))
    row.update(fp8_role_summary(model))
    if pos.iteration % args.log_interval == 0 or pos.iteration in (1, args.train_iters):
        layers = gather_layer_state(model, log_rank)
        if layers is not None:
            row["fp8_layers"] = layers
    return row


def _flops(args: RunArgs, vocab: int) -> float:
    """Model FLOPs of one iteration of this run (`metrics.training_flops_per_iteration`)."""
    from .metrics import training_flops_per_iteration
    from .model import padded_vocab_size

    return training_flops_per_iteration(
        args.num_layers, args.hidden_size, args.ffn_hidden_size, args.seq_length,
        padded_vocab_size(vocab, args.tensor_model_parallel_size), args.global_batch_size,
        experts=args.num_experts, topk=args.moe_router_topk)


def run(args: RunArgs, plan=None) -> int:
    """Train `args.train_iters` iterations from where `plan` (`preflight.plan_resume`) says; returns the exit
    code."""
    if plan is None:
        from .preflight import plan_resume

        plan = plan_resume(args)
    tie_children_to_this_rank(saves=bool(args.save))
    started = init_process_group()
    ps.initialize(
        tp=args.tensor_model_parallel_size, pp=args.pipeline_model_parallel_size,
        vpp=args.virtual_pipeline_model_parallel_size, cp=args.context_parallel_size,
        ep=args.expert_model_parallel_size, etp=args.expert_tensor_parallel_size,
    )
    from launch.checkpointing import CheckpointError

    text_log = None
    try:
        with ps.cpu_compat():
            text_log = _open_text_log(args)
            return _train(args, plan)
    except CheckpointError as err:
        return _checkpoint_failure(err)
    finally:
        if text_log is not None:
            text_log.close()
        ps.destroy()
        if started and dist.is_initialized():
            dist.destroy_process_group()


def _train(args: RunArgs, plan) -> int:  # noqa: C901
    from megatron.core import parallel_state as mpu

    from .data import StepBatches, build_train_dataset
    from .metrics import RunLog, StepTimer, logging_rank
    from .model import build_model, build_optimizer, fp8_settings, transformer_config, use_fused_torch_adam
    from .step import TrainStep
    from .tokenizer import build_tokenizer

    log_rank = logging_rank()
    is_logger = dist.get_rank() == log_rank

    def say(text: str) -> None:
        if is_logger:
            print(text, flush=True)

    tokenizer = build_tokenizer(args.tokenizer_file)
    vocab = args.vocab_size or tokenizer.vocab_size
    config = transformer_config(args)
    fp8 = fp8_settings(args)
    model = build_model(args, config, vocab)
    optimizer, scheduler = build_optimizer(args, model)
    dataset = build_train_dataset(args, tokenizer)
    batches = StepBatches(dataset, args.micro_batch_size, args.global_batch_size,
                          mpu.get_data_parallel_rank(), mpu.get_data_parallel_world_size())
    pos = _load(args, plan, model, optimizer, scheduler, say)
    # again: a loaded checkpoint's groups carry their own setting (and on the CPU no fused kernels are wanted)
    if use_fused_torch_adam(optimizer, fused=torch.cuda.is_available()):
        say("optimizer: torch's fused Adam kernels (megatron fell back to torch's Adam)")
    if not args.no_foreach_multi_tensor:
        from .multi_tensor import use_foreach_multi_tensor_ops

        if use_foreach_multi_tensor_ops():
            say("optimizer: megatron's multi-tensor fallbacks on torch's foreach kernels")

    wrap = graphed = None
    if args.cuda_graph:
        from fp8_parallel.pipeline import graph_megatron_layers

        graphed = graph_megatron_layers(model, config, num_microbatches=batches.num_microbatches,
                                        seq_length=args.seq_length, micro_batch_size=args.micro_batch_size,
                                        fp8_recipe=fp8.recipe)
        wrap = graphed.forward_step
    step = TrainStep(model, optimizer, scheduler, config, fp8, args.seq_length, args.micro_batch_size,
                     batches.num_microbatches, wrap_forward_step=wrap)
    say(f"job: {args.world_size} ranks, tp {args.tensor_model_parallel_size} pp {args.pipeline_model_parallel_size}"
        f" vpp {args.virtual_pipeline_model_parallel_size} cp {args.context_parallel_size} dp "
        f"{args.data_parallel_size} ep {args.expert_model_parallel_size} etp {args.expert_tensor_parallel_size}; "
        f"{args.num_layers} layers, hidden {args.hidden_size}, experts {args.num_experts}; fp8 "
        f"{args.fp8 or 'off'} ({args.fp8_recipe if args.fp8 else '-'}); {batches.num_microbatches} micro batches "
        f"of {args.micro_batch_size}; {len(dataset)} training samples")
    run_log = RunLog(is_logger, args.train_iters, pos.iteration, args.log_interval, _tensorboard_dir(args),
                     args.log_json, progress_bar=not args.no_progress_bar and _is_terminal(sys.stderr),
                     run_json=os.path.join(_logs_dir(args), "metrics.jsonl") if args.save else None)
    flops = _flops(args, vocab)
    saved_at = pos.iteration if plan.load else -1
    if pos.iteration >= args.train_iters:
        say(f"nothing to train: the checkpoint is at iteration {pos.iteration} = --train-iters; a larger "
            "--train-iters extends the run")
    last_loss = None
    stopped = False  # by --exit-interval
    try:
        while pos.iteration < args.train_iters:
            timer = StepTimer()
            result = step(batches.step(pos.consumed_samples))
            step_ms = timer.elapsed_ms()
            pos.iteration += 1
            pos.consumed_samples += args.global_batch_size
            row = _metrics_row(args, pos, result, step_ms, flops, model, log_rank)
            if is_logger and result.loss is not None:
                if not torch.isfinite(torch.tensor(result.loss)):
                    run_log.write(f"iteration {pos.iteration}: loss is {result.loss}")
                last_loss = result.loss
            run_log.record(row)
            exiting = args.exit_interval is not None and pos.iteration % args.exit_interval == 0
            interval = args.save_interval is not None and pos.iteration % args.save_interval == 0
            if args.save and (interval or exiting):
                _save(args, pos, model, optimizer, scheduler, run_log.write, {"loss": last_loss})
                saved_at = pos.iteration
            if exiting and pos.iteration < args.train_iters:
                run_log.write(f"exit interval: stopping after iteration {pos.iteration}")
                stopped = True
                break
        if args.save and saved_at != pos.iteration:
            _save(args, pos, model, optimizer, scheduler, run_log.write, {"loss": last_loss})
    finally:
        run_log.close()
        if graphed is not None:  # graphs holding NCCL collectives (TP) keep destroy_process_group waiting forever
            torch.cuda.synchronize()
            graphed.reset()
    if is_logger and args.save and args.plot:
        _plot_run(args, say)
    if not stopped:
        say(f"done: {pos.iteration} iterations, last loss {last_loss}")
    return 0
