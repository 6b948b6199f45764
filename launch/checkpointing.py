"""Checkpoints of the training job: megatron-core `dist_checkpointing`, atomic and resumable.

    state = load_checkpoint(args.load, model, optimizer, scheduler, run_args)   # None: start fresh
    ...
    save_checkpoint(args.save, TrainState(iteration, consumed_samples), model, optimizer, scheduler, run_args)

Both calls are collective over all ranks. `model` is the list of model chunks as megatron's schedules take
them (possibly wrapped in megatron DDP / Float16Module); `optimizer` is what `get_megatron_optimizer`
returns and `scheduler` an `OptimizerParamScheduler`; either may be None.

A checkpoint holds the model's sharded state (FP8 state included), the optimizer's master weights and
moments (fully reshardable), every rank's RNG states, and in `run.json` the iteration, consumed samples,
scheduler state, run arguments and parallel layout. Files and atomicity: `checkpoint_files`; what is saved:
`checkpoint_state`.

Loading across layouts goes through dist_checkpointing's resharding (TP, PP, EP may change); RNG states are
restored only on the layout they were saved with. FP8 state loads when both sides run FP8; a checkpoint
without FP8 state starts it fresh, and a run without FP8 ignores saved FP8 state.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from . import checkpoint_files as files
from . import checkpoint_state as cs
from .train.children import start_checkpoint_writer_queue

# Run arguments that fix tensor shapes: a checkpoint with other values cannot load (named in the error).
SHAPE_ARGS = (
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
    "num_experts", "moe_ffn_hidden_size", "vocab_size", "padded_vocab_size", "max_position_embeddings",
    "position_embedding_type", "normalization", "add_bias_linear", "swiglu", "untie_embeddings_and_output_weights",
)
PAUSE_ENV = "FP8P_CHECKPOINT_TEST_PAUSE"  # test only, "STAGE:SECONDS": sleep at one save stage (kill tests)


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be saved or loaded (incomplete, corrupt, another model or layout)."""


@dataclasses.dataclass
class TrainState:
    """Where training stands: the iteration finished, samples consumed, and JSON-able extras."""

    iteration: int
    consumed_samples: int
    extra: Dict[str, Any] = dataclasses.field(default_factory=dict)


def _log(message: str) -> None:
    if dist.get_rank() == 0:
        print(f"checkpoint: {message}", flush=True)


def _test_pause(stage: str) -> None:
    """Test hook: with PAUSE_ENV set, announce each save stage and sleep at the named one, so a test can kill
    a save there (stages: tensors, metadata, manifest, publish)."""
    setting = os.environ.get(PAUSE_ENV)
    if setting:
        print(f"checkpoint save stage {stage} (rank {dist.get_rank()})", flush=True)
        name, _, seconds = setting.partition(":")
        if name == stage:
            time.sleep(float(seconds or 600))


def _io_failures() -> tuple:
    """What checkpoint I/O may raise: every Exception, and torch.distributed.checkpoint's CheckpointException,
    which derives from BaseException (KeyboardInterrupt and SystemExit still propagate)."""
    from torch.distributed.checkpoint.api import CheckpointException

    return (Exception, CheckpointException)


_IO_FAILURES = _io_failures()


def _describe_failure(err: BaseException) -> str:
    """`Type: message`, for DCP's CheckpointException each failed rank's first error (it names the file)."""
    failures = getattr(err, "failures", None)
    if isinstance(failures, dict) and failures:
        parts = []
        for rank, exc in sorted(failures.items())[:2]:
            inner = exc.exc if hasattr(exc, "exc") else exc  # a wrapped remote exception
            if isinstance(inner, tuple) and inner and isinstance(inner[0], BaseException):
                inner = inner[0]  # (exception, traceback frames), as DCP keeps a rank's failure
            parts.append(f"rank {rank}: {type(inner).__name__}: {_text(inner)}")
        more = f" (and {len(failures) - 2} more ranks)" if len(failures) > 2 else ""
        return f"{type(err).__name__}: " + "; ".join(parts) + more
    return f"{type(err).__name__}: {_text(err)}"


def _text(err: BaseException) -> str:
    filename = getattr(err, "filename", None)
    text = " ".join(str(err).split())
    return text if not filename or str(filename) in text else f"{text} ({filename})"


def _agree(error: Optional[str]) -> None:
    """Collective: raise CheckpointError on every rank if any rank reports an error (rank 0's text first)."""
    flag = torch.tensor([1 if error else 0], dtype=torch.int32, device=cs.collective_device())
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if flag.item():
        text = _broadcast_text(error if dist.get_rank() == 0 else None)
        raise CheckpointError(error or text or "another rank failed (see its log)")


def _broadcast_text(text: Optional[str]) -> str:
    """Rank 0's `text` on every rank, sent as bytes in tensors (no pickling)."""
    device = cs.collective_device()
    data = (text or "").encode()
    n = torch.tensor([len(data)], dtype=torch.int64, device=device)
    dist.broadcast(n, src=0)
    buf = torch.zeros(int(n.item()), dtype=torch.uint8, device=device)
    if dist.get_rank() == 0 and data:
        buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    dist.broadcast(buf, src=0)
    return bytes(buf.cpu().tolist()).decode()


def _on_rank0(fn: Callable[[], None]) -> None:
    """Run `fn` on rank 0; every rank raises CheckpointError if it failed."""
    error = None
    if dist.get_rank() == 0:
        try:
            fn()
        except _IO_FAILURES as e:  # reported on every rank
            error = _describe_failure(e)
    _agree(error)


def _validate_save_args(save_dir: str, state: TrainState, run_args: Dict[str, Any]) -> None:
    if not save_dir:
        raise CheckpointError(f"save_dir={save_dir!r}: a directory is required")
    if not isinstance(state.iteration, int) or state.iteration < 0:
        raise CheckpointError(f"TrainState.iteration={state.iteration!r}: expected an int >= 0")
    if not isinstance(state.consumed_samples, int) or state.consumed_samples < 0:
        raise CheckpointError(f"TrainState.consumed_samples={state.consumed_samples!r}: expected an int >= 0")
    for name, value in (("TrainState.extra", state.extra), ("run_args", run_args)):
        try:
            json.dumps(value)
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"{name} is not JSON-serialisable: {e}") from None


def _optimizers(optimizer: Any) -> List[Any]:
    return list(getattr(optimizer, "chained_optimizers", [optimizer])) if optimizer is not None else []


def save_checkpoint(
    save_dir: str,
    state: TrainState,
    model: List[torch.nn.Module],
    optimizer: Any,
    scheduler: Any,
    run_args: Dict[str, Any],
    overwrite: bool = False,
    keep_last: Optional[int] = None,
) -> None:
    """Save model, optimizer, scheduler, FP8 state, RNG states and `state` under `save_dir` (collective).

    Written to `iter_N.tmp`, then made current (renamed to `iter_N`, `latest` updated) only when complete.
    A save older than the checkpoint `latest` names is refused unless `overwrite` (it would move `latest`
    back). After a save, leftovers of killed saves are removed, and with `keep_last` all but the newest
    `keep_last` complete checkpoints.

    Raises:
        CheckpointError: invalid arguments, a save older than `latest` without `overwrite`, or a write that
            failed on any rank (on every rank); the previous checkpoint stays current and loadable.
    """
    from megatron.core import dist_checkpointing

    from parallel_state import cpu_compat

    _validate_save_args(save_dir, state, run_args)
    start_checkpoint_writer_queue()  # megatron's own would start at its first save, importing torch in a child
    root = Path(save_dir)
    final = root / files.checkpoint_name(state.iteration)
    tmp = root / f"{final.name}.tmp"

    def prepare() -> None:
        root.mkdir(parents=True, exist_ok=True)
        current = files.read_latest(root)
        if current is not None and files.iteration_of(current) > state.iteration and not overwrite:
            raise CheckpointError(f"{root / files.LATEST} names {current}, newer than iteration {state.iteration}: "
                                  "saving would move it back (pass overwrite=True / --overwrite)")
        if tmp.exists():  # left by a save that was killed
            shutil.rmtree(tmp)
        tmp.mkdir()

    try:
        _on_rank0(prepare)
    except CheckpointError as e:
        raise CheckpointError(f"cannot save to {save_dir}: {e}") from None
    blob = cs.rng_blob()
    rng_len = cs.rng_length(blob)
    with cpu_compat():
        sharded, _ = cs.model_sharded(model)
        sd: Dict[str, Any] = dict(sharded)
        if optimizer is not None:
            cs.ensure_optimizer_state(optimizer)  # a save before the first step
            sd["optimizer"] = optimizer.sharded_state_dict(sharded, metadata=dict(cs.OPTIMIZER_SHARDING))
        sd["rng"] = cs.rng_sharded(blob, rng_len)
        _test_pause("tensors")
        error = None
        try:
            dist_checkpointing.save(sd, str(tmp), validate_access_integrity=True)
        except _IO_FAILURES as e:  # DCP's CheckpointException is a BaseException; reported on every rank
            error = f"dist_checkpointing.save into {tmp} failed: {_describe_failure(e)}"
        _agree(error)
    lay = cs.layout()
    meta = {
        "format": files.FORMAT,
        "iteration": state.iteration,
        "consumed_samples": state.consumed_samples,
        "extra": state.extra,
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "run_args": run_args,
        "layout": lay,
        "fp8": _run_fp8(model, run_args),
        "num_chunks": len(model),
        "has_optimizer": optimizer is not None,
        "rng_length": rng_len,
        "saved_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }

    def finish() -> None:
        _test_pause("metadata")
        files.write_atomic(tmp / files.RUN_META, json.dumps(meta, indent=1, sort_keys=True))
        _test_pause("manifest")
        files.write_manifest(tmp)
        _test_pause("publish")
        files.publish(tmp, final)

    try:
        _on_rank0(finish)
    except CheckpointError as e:
        raise CheckpointError(f"cannot save to {save_dir}: {e}") from None
    _log(f"saved iteration {state.iteration} to {final} ({cs.describe(lay)})")
    if dist.get_rank() == 0:
        for note in files.clean(root, keep_last):
            _log(note)
    dist.barrier()


def load_checkpoint(  # noqa: C901
    load_dir: str,
    model: List[torch.nn.Module],
    optimizer: Any,
    scheduler: Any,
    run_args: Dict[str, Any],
    override_scheduler: bool = False,
) -> Optional[TrainState]:
    """Load the latest complete checkpoint under `load_dir` into the given objects (collective).

    Returns None when `load_dir` holds no complete checkpoint (incomplete saves are reported and skipped).

    Raises:
        CheckpointError: (on every rank) a corrupt, truncated or unsafe checkpoint, another model's shape,
            or a layout change dist_checkpointing cannot reshard; the message names the problem.
    """
    from megatron.core import dist_checkpointing

    from parallel_state import cpu_compat

    if not load_dir:
        raise CheckpointError(f"load_dir={load_dir!r}: a directory is required")
    found: Dict[str, Any] = {}

    def locate() -> None:
        path, notes = files.find_current(Path(load_dir))
        for note in notes:
            _log(note)
        if path is not None:
            files.verify(path)
            files.check_pickles(path)
            files.read_run_meta(path)
        found["path"] = str(path) if path is not None else ""

    try:
        _on_rank0(locate)
    except CheckpointError as e:
        raise CheckpointError(f"cannot load from {load_dir}: {e}") from None
    path_text = _broadcast_text(found.get("path"))
    if not path_text:
        _log(f"no complete checkpoint in {load_dir}; starting from scratch")
        return None
    ckpt = Path(path_text)
    meta = files.read_run_meta(ckpt)
    saved_layout, here = meta["layout"], cs.layout()
    layouts = f"saved with {cs.describe(saved_layout)}, loading into {cs.describe(here)}"
    _check_shapes(ckpt, meta["run_args"], run_args)

    with cpu_compat():
        sharded, fp8_keys = cs.model_sharded(model)
        saved_fp8 = meta.get("fp8") or (meta.get("run_args") or {}).get("fp8")
        run_fp8 = _run_fp8(model, run_args)
        ckpt_tensors = dist_checkpointing.load_tensors_metadata(str(ckpt))
        skip = set()
        if fp8_keys and not (saved_fp8 and run_fp8):
            skip = fp8_keys
            if run_fp8:
                _log(f"checkpoint {ckpt.name} was saved without FP8: FP8 state starts fresh")
            elif saved_fp8:
                _log(f"checkpoint {ckpt.name} holds FP8 state; this run has FP8 off and ignores it")
        elif fp8_keys:
            stale = {ck for ck in fp8_keys if not _matches(sharded[ck[0]][ck[1]], ckpt_tensors)}
            if stale == fp8_keys:
                _log(f"checkpoint {ckpt.name} has no FP8 state of this model's shape: FP8 state starts fresh")
                skip = fp8_keys
            elif stale:
                raise CheckpointError(f"checkpoint {ckpt}: FP8 state {sorted(k for _, k in stale)[:3]} differs in "
                                      f"shape from this model's ({_history_change(meta['run_args'], run_args)}"
                                      f"{layouts})")
        for chunk_key, key in skip:
            del sharded[chunk_key][key]
        _check_tensors(ckpt, sharded, ckpt_tensors, layouts)
        sd: Dict[str, Any] = dict(sharded)
        load_opt = optimizer is not None and meta["has_optimizer"]
        if load_opt:
            full, _ = cs.model_sharded(model)  # the optimizer maps its params through the whole model
            cs.ensure_optimizer_state(optimizer)
            sd["optimizer"] = optimizer.sharded_state_dict(full, is_loading=True, metadata=dict(cs.OPTIMIZER_SHARDING))
        same_layout = saved_layout == here
        if same_layout:
            sd["rng"] = cs.rng_sharded(None, meta["rng_length"])
        error = None
        try:
            loaded = dist_checkpointing.load(sd, str(ckpt), validate_access_integrity=True)
        except _IO_FAILURES as e:  # DCP's CheckpointException is a BaseException; reported on every rank
            error = f"cannot load checkpoint {ckpt} ({layouts}): {_describe_failure(e)}"
        _agree(error)
        try:
            for i, chunk in enumerate(model):
                _load_chunk(cs.unwrap(chunk), loaded[f"model{i}"], {k for c, k in skip if c == f"model{i}"}, ckpt)
            if load_opt:
                cs.load_optimizer(optimizer, loaded["optimizer"])
        except (CheckpointError, ValueError, KeyError, RuntimeError) as e:
            error = f"cannot load checkpoint {ckpt} ({layouts}): {type(e).__name__}: {e}"
        _agree(error)
    if optimizer is not None and not meta["has_optimizer"]:
        _log(f"checkpoint {ckpt.name} has no optimizer state: the optimizer starts fresh")
    if scheduler is not None and meta.get("scheduler") is not None:
        _log_schedule_choice(scheduler, meta["scheduler"], override_scheduler)
        scheduler.load_state_dict(meta["scheduler"])
    if same_layout:
        cs.restore_rng(cs.rng_row_to_blob(loaded["rng"]))
    else:
        _log(f"layout changed ({layouts}): RNG states are not restored")
    _log(f"loaded iteration {meta['iteration']} from {ckpt} ({layouts})")
    return TrainState(meta["iteration"], meta["consumed_samples"], dict(meta.get("extra") or {}))


# OptimizerParamScheduler's values that megatron checks against the checkpoint's (its state_dict keys)
_SCHEDULE_KEYS = ("max_lr", "min_lr", "lr_warmup_steps", "lr_decay_steps", "lr_decay_style", "start_wd", "end_wd",
                  "wd_incr_steps", "wd_incr_style")


def _log_schedule_choice(scheduler: Any, saved: Dict[str, Any], override: bool) -> None:
    """Say which LR / weight-decay schedule values differ between this run and the checkpoint, and whose win
    (megatron's `override_opt_param_scheduler` / `use_checkpoint_opt_param_scheduler`)."""
    mine = scheduler.state_dict()
    diffs = [f"{k} {saved[k]!r} (this run {mine[k]!r})" for k in _SCHEDULE_KEYS
             if k in saved and k in mine and saved[k] != mine[k]]
    if not diffs:
        return
    if override:
        _log("LR schedule: this run's values replace the checkpoint's (--override-opt-param-scheduler): checkpoint "
             + ", ".join(diffs))
    else:
        _log("LR schedule: the checkpoint's values win over this run's flags: " + ", ".join(diffs)
             + "; --override-opt-param-scheduler uses this run's")


def _run_fp8(model: List[torch.nn.Module], run_args: Dict[str, Any]) -> Optional[str]:
    """The FP8 format the run trains with: the model's `config.fp8`, else megatron's `fp8` argument in
    `run_args` (the job keeps FP8 out of megatron's config and opens the FP8 scope itself)."""
    return cs.fp8_enabled(model) or run_args.get("fp8") or None


def _history_change(saved: Dict[str, Any], current: Dict[str, Any]) -> str:
    """'amax history length: checkpoint 16, this run 1024; ' when it differs (the history's shape), else ''."""
    key = "fp8_amax_history_len"
    a, b = (saved or {}).get(key), current.get(key)
    return f"--fp8-amax-history-len: checkpoint {a}, this run {b}; " if a is not None and a != b else ""


def _matches(sh_ten, ckpt_tensors: Dict[str, Any]) -> bool:
    saved = ckpt_tensors.get(sh_ten.key)
    return saved is not None and tuple(saved.global_shape) == tuple(sh_ten.global_shape)


def _check_shapes(ckpt: Path, saved: Dict[str, Any], current: Dict[str, Any]) -> None:
    diffs = [f"{k}: checkpoint {saved[k]!r}, this run {current[k]!r}"
             for k in SHAPE_ARGS if k in saved and k in current and saved[k] != current[k]]
    if diffs:
        raise CheckpointError(f"checkpoint {ckpt} is of another model shape: " + "; ".join(diffs))


def _check_tensors(ckpt: Path, sharded: Dict[str, Dict], ckpt_tensors: Dict[str, Any], layouts: str) -> None:
    """Every requested tensor exists in the checkpoint with the same global shape (clear errors first)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    for sd in sharded.values():
        for sh in sd.values():
            if not isinstance(sh, ShardedTensor):
                continue
            saved = ckpt_tensors.get(sh.key)
            if saved is None:
                raise CheckpointError(f"checkpoint {ckpt} has no tensor {sh.key!r} (another model? {layouts})")
            if tuple(saved.global_shape) != tuple(sh.global_shape):
                raise CheckpointError(
                    f"checkpoint {ckpt}: tensor {sh.key!r} has shape {tuple(saved.global_shape)}, this model "
                    f"{tuple(sh.global_shape)} (another model shape; {layouts})")


def _load_chunk(inner: torch.nn.Module, state: Dict[str, Any], skipped: set, ckpt: Path) -> None:
    result = inner.load_state_dict(state, strict=False)
    missing = [k for k in result.missing_keys if k not in skipped and not k.endswith("_extra_state")]
    if missing or result.unexpected_keys:
        raise CheckpointError(f"checkpoint {ckpt}: missing model keys {missing[:5]}, unexpected "
                              f"{list(result.unexpected_keys)[:5]}")
