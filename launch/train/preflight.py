"""Checks of `--load` and `--save` before any process group starts (every rank runs them; rank 0 reports).

What the job resumes from:

* `--load DIR`: DIR must be a checkpoint directory (a `latest` pointer or `iter_NNNNNNN` checkpoints, as a
  `--save` directory holds) with a complete checkpoint. A missing path, a file, one checkpoint's own
  directory, a directory above checkpoint directories, or one with nothing to load is an error, unless
  `--load-optional` says to start from iteration 0 when nothing is there.
* no `--load`: a `--save` directory that holds a complete checkpoint is resumed from (Megatron-LM's `--save` and
  `--load` on one path), so re-running a command continues it, and a larger `--train-iters` extends it.
  `--overwrite` starts from scratch instead.

What saves may do: a save never replaces a checkpoint newer than the run's start or moves `latest` back
unless `--overwrite`; `--train-iters` below the checkpoint's iteration and a changed FP8 format or recipe are
refused. `--save` must be writable (checked by writing a probe file).
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Dict, List, Optional

from launch import checkpoint_files as files


class PathError(ValueError):
    """`--load` / `--save` paths, or a resume, that the run cannot use; the message names the path."""


@dataclasses.dataclass
class ResumePlan:
    """Where the run starts: `load` (a checkpoint directory, or None for iteration 0), the checkpoint's
    iteration and metadata, and a line for the log."""

    load: Optional[str] = None
    iteration: int = 0
    meta: Optional[Dict[str, Any]] = None
    note: Optional[str] = None


def _checkpoint_children(path: Path) -> List[Path]:
    try:
        return sorted(p for p in path.iterdir() if p.is_dir() and _is_root(p))
    except OSError:
        return []


def _is_root(path: Path) -> bool:
    """A directory that holds a `latest` pointer or checkpoint directories (complete or not)."""
    try:
        return (path / files.LATEST).is_file() or any(
            p.is_dir() and p.name.startswith("iter_") for p in path.iterdir())
    except OSError:
        return False


def _current(path: Path, flag: str):
    """The complete checkpoint under `path` and its metadata, or (None, None)."""
    try:
        ckpt, _ = files.find_current(path)
        if ckpt is None:
            return None, None
        return ckpt, files.read_run_meta(ckpt)
    except files.CheckpointFileError as e:
        raise PathError(f"{flag} {path}: {e}") from None


LOGS = "logs"  # the job's text log and metrics in a --save directory (no checkpoint)


def _nothing_there(path: Path) -> bool:
    return all(p.name == LOGS for p in path.iterdir())


def _load_dir_error(path: Path, optional: bool) -> Optional[str]:
    """Why `path` is no `--load` directory (None: it is one, or it is empty and --load-optional allows that)."""
    hint = "; --load-optional starts from iteration 0 when nothing is there"
    if not path.exists():
        return None if optional else f"--load {path}: no such directory{hint}"
    if not path.is_dir():
        return f"--load {path} is a file, not a checkpoint directory"
    if files._NAME.match(path.name.removesuffix(".old")) and (path / files.MANIFEST).is_file():
        return (f"--load {path} is one checkpoint; give the directory that holds it and its `latest`: "
                f"--load {path.parent}")
    if _is_root(path):
        return None
    below = _checkpoint_children(path)
    if below:
        names = ", ".join(str(p) for p in below[:3])
        return f"--load {path} holds no checkpoint, but {names} do{'es' if len(below) == 1 else ''}: did you mean --load {below[0]}?"
    if optional and _nothing_there(path):
        return None
    return (f"--load {path} is not a checkpoint directory (no `{files.LATEST}` and no iter_NNNNNNN "
            f"checkpoints){hint if _nothing_there(path) else ''}")


def plan_resume(args) -> ResumePlan:
    """Decide where the run starts and check that its saves are allowed (see the module docstring).

    Raises:
        PathError: the message names the flag, the path and what to do instead.
    """
    plan = ResumePlan()
    if args.load:
        load = Path(args.load)
        error = _load_dir_error(load, args.load_optional)
        if error:
            raise PathError(error)
        ckpt, meta = _current(load, "--load") if load.is_dir() else (None, None)
        if ckpt is None:
            if not args.load_optional:
                raise PathError(f"--load {load}: no complete checkpoint there (only saves that did not finish); "
                                "--load-optional starts from iteration 0 when nothing is there")
            plan.note = f"--load {load}: no complete checkpoint there (--load-optional): starting from iteration 0"
        else:
            plan = ResumePlan(str(load), int(meta["iteration"]), meta)
    elif args.save and not args.overwrite and Path(args.save).is_dir():
        ckpt, meta = _current(Path(args.save), "--save")
        if ckpt is not None:
            plan = ResumePlan(args.save, int(meta["iteration"]), meta,
                              f"resuming from --save {args.save} (its checkpoint {ckpt.name}); --load chooses "
                              "another checkpoint, --overwrite starts from scratch")
    if plan.meta is not None:
        _check_resume(args, plan)
    if args.save:
        _check_save(args, plan)
    return plan


def _check_resume(args, plan: ResumePlan) -> None:
    saved = plan.meta.get("run_args") or {}
    where = f"the checkpoint in {plan.load} (iteration {plan.iteration})"
    if args.train_iters < plan.iteration:
        raise PathError(f"--train-iters={args.train_iters} is below the iteration of {where}: give "
                        f"--train-iters >= {plan.iteration} to resume (or another --save to start over)")
    if saved.get("fp8") and args.fp8:
        for flag, key, mine in (("--fp8-format", "fp8", args.fp8), ("--fp8-recipe", "fp8_recipe", args.fp8_recipe)):
            theirs = saved.get(key)
            if theirs is not None and theirs != mine:
                raise PathError(f"{flag} {mine}: {where} was trained with {flag} {theirs}; its FP8 scales and "
                                f"amax histories belong to that setting. Resume with {flag} {theirs}, or start a "
                                "new run (another --save)")


def _check_save(args, plan: ResumePlan) -> None:
    save = Path(args.save)
    if save.exists() and not save.is_dir():
        raise PathError(f"--save {save} is a file, not a directory")
    probe = save / f".write-test-{os.getpid()}"
    try:
        save.mkdir(parents=True, exist_ok=True)
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise PathError(f"--save {save} is not writable: {e.strerror or e}") from None
    if args.overwrite or (plan.load is not None and save.resolve() == Path(plan.load).resolve()):
        return
    ckpt, meta = _current(save, "--save")
    if ckpt is not None and int(meta["iteration"]) > plan.iteration:
        raise PathError(
            f"--save {save} holds checkpoint {ckpt.name}, newer than where this run starts (iteration "
            f"{plan.iteration}{' from ' + plan.load if plan.load else ''}): its saves would replace it and move "
            f"`latest` back. Resume from it (no --load, or --load {save}), choose another --save, or pass "
            "--overwrite")
