"""On-disk layout of the job's checkpoints: atomic directories, the `latest` pointer, completion manifests.

    <dir>/latest                         name of the current checkpoint, replaced atomically (temp + os.replace)
    <dir>/iter_0000005/                  a complete checkpoint: dist_checkpointing files, run.json, complete.json
    <dir>/iter_0000010.tmp/              a save in progress (or one killed mid-way): never loaded

A save writes everything into `iter_N.tmp`, then `complete.json` (every file's size and SHA-256) last, then
renames the directory to `iter_N` and points `latest` at it. A checkpoint is loadable only when its manifest
exists and every file matches it. Nothing here unpickles anything: `.metadata` pickles are checked against
an allow-list of plain classes before megatron's loader is allowed to read them.
"""
from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
import shutil
from pathlib import Path
from typing import Dict, List, Optional, Tuple

MANIFEST = "complete.json"
RUN_META = "run.json"
LATEST = "latest"
FORMAT = "fp8_parallel-checkpoint/1"
_NAME = re.compile(r"^iter_(\d{7,})$")


class CheckpointFileError(RuntimeError):
    """A checkpoint directory that is incomplete, truncated, corrupt or unsafe to read."""


def checkpoint_name(iteration: int) -> str:
    """Directory name of the checkpoint after `iteration` iterations."""
    return f"iter_{iteration:07d}"


def iteration_of(name: str) -> int:
    """The iteration in a checkpoint directory name (`iter_0000005` -> 5)."""
    match = _NAME.match(name)
    if not match:
        raise CheckpointFileError(f"{name!r} is not a checkpoint directory name (iter_NNNNNNN)")
    return int(match.group(1))


def write_atomic(path: Path, text: str) -> None:
    """Write `text` to `path` so that a reader sees the old file or the new one, never a partial one."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def fsync_dir(path: Path) -> None:
    """Make a rename or file creation inside `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _files(root: Path) -> List[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and p.name != MANIFEST)


def write_manifest(ckpt_dir: Path) -> None:
    """Record every file of `ckpt_dir` (size, SHA-256) in its completion marker, written last and atomically."""
    for p in _files(ckpt_dir):
        with open(p, "rb+") as f:
            os.fsync(f.fileno())
    entries = {str(p.relative_to(ckpt_dir)): {"size": p.stat().st_size, "sha256": _sha256(p)} for p in _files(ckpt_dir)}
    write_atomic(ckpt_dir / MANIFEST, json.dumps({"format": FORMAT, "files": entries}, indent=1, sort_keys=True))


def verify(ckpt_dir: Path, checksums: bool = True) -> None:
    """Check that `ckpt_dir` is complete and unchanged since its manifest was written.

    Raises:
        CheckpointFileError: no manifest (an incomplete save), a missing, extra-truncated or altered file.
    """
    manifest = ckpt_dir / MANIFEST
    if not manifest.is_file():
        raise CheckpointFileError(f"checkpoint {ckpt_dir} is incomplete: no {MANIFEST} (the save did not finish)")
    try:
        entries = json.loads(manifest.read_text())["files"]
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointFileError(f"checkpoint {ckpt_dir}: unreadable {MANIFEST} ({e})") from None
    for rel, want in sorted(entries.items()):
        path = ckpt_dir / rel
        if not path.is_file():
            raise CheckpointFileError(f"checkpoint {ckpt_dir}: file {rel} is missing")
        size = path.stat().st_size
        if size != want["size"]:
            raise CheckpointFileError(
                f"checkpoint {ckpt_dir}: file {rel} has {size} bytes, {want['size']} were written (truncated?)")
        if checksums and _sha256(path) != want["sha256"]:
            raise CheckpointFileError(f"checkpoint {ckpt_dir}: file {rel} is corrupt (SHA-256 differs from {MANIFEST})")


def read_latest(root: Path) -> Optional[str]:
    """The checkpoint name in `root/latest`, or None when there is no pointer."""
    path = root / LATEST
    if not path.is_file():
        return None
    name = path.read_text().strip()
    if not _NAME.match(name):
        raise CheckpointFileError(f"{path} names {name!r}, not a checkpoint directory (iter_NNNNNNN)")
    return name


def find_current(root: Path) -> Tuple[Optional[Path], List[str]]:
    """The checkpoint to resume from under `root` (or None) and notes on what was skipped.

    `latest` decides when present; otherwise the newest directory with a completion marker. Saves left
    incomplete (`*.tmp`) are reported in the notes and never chosen.
    """
    notes = [f"ignoring incomplete checkpoint {p} (a save that did not finish)"
             for p in sorted(root.glob("iter_*.tmp")) if p.is_dir()]
    if not root.is_dir():
        return None, notes
    name = read_latest(root)
    if name is not None:
        if (root / name).is_dir():
            return root / name, notes
        aside = root / f"{name}.old"  # a re-save of the same iteration killed between its two renames
        if (aside / MANIFEST).is_file():
            return aside, notes + [f"{root / LATEST} points to {name}, which a killed re-save moved to {aside.name}"]
        raise CheckpointFileError(f"{root / LATEST} points to {name}, which does not exist")
    complete = sorted((p for p in root.iterdir() if _NAME.match(p.name) and (p / MANIFEST).is_file()),
                      key=lambda p: int(_NAME.match(p.name).group(1)))
    for p in root.iterdir():
        if _NAME.match(p.name) and not (p / MANIFEST).is_file():
            notes.append(f"ignoring incomplete checkpoint {p} (no {MANIFEST})")
    return (complete[-1] if complete else None), notes


def publish(tmp_dir: Path, final_dir: Path) -> None:
    """Make the finished save in `tmp_dir` current: rename it to `final_dir`, then point `latest` at it.

    A complete checkpoint of the same iteration is moved aside first and removed only after `latest` is
    written, so a kill at any point leaves `latest` naming a complete directory or one that the loader
    reports."""
    root = final_dir.parent
    aside = None
    if final_dir.exists():
        aside = root / f"{final_dir.name}.old"
        if aside.exists():
            shutil.rmtree(aside)
        os.rename(final_dir, aside)
    os.rename(tmp_dir, final_dir)
    fsync_dir(root)
    write_atomic(root / LATEST, final_dir.name + "\n")
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)


def clean(root: Path, keep_last: Optional[int] = None) -> List[str]:
    """After a save made `latest` current: remove what killed saves left (`iter_N.tmp` directories, `iter_N.old`
    copies, `.latest.tmp-PID` files) and, with `keep_last`, all but the newest `keep_last` complete checkpoints
    (never the one `latest` names). Returns a note per removal. Call it on one rank, with no other save running
    into `root` (one job per save directory)."""
    current = read_latest(root)
    if current is None or not (root / current / MANIFEST).is_file():
        return []  # nothing is safely current: keep everything
    notes = []
    for p in sorted(root.iterdir()):
        leftover = (p.is_dir() and (p.name.endswith(".tmp") or p.name.endswith(".old"))
                    and _NAME.match(p.name[:-4])) or (p.is_file() and p.name.startswith(f".{LATEST}.tmp-"))
        if leftover:
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
            notes.append(f"removed {p.name} (left by a save that did not finish)")
    if keep_last:
        complete = sorted((p for p in root.iterdir() if _NAME.match(p.name) and (p / MANIFEST).is_file()),
                          key=lambda p: iteration_of(p.name))
        for p in complete[:-keep_last]:
            if p.name != current:
                shutil.rmtree(p, ignore_errors=True)
                notes.append(f"removed {p.name} (--keep-last {keep_last})")
    return notes


# ---- pickles megatron's loader would read: allow only plain data classes ----------------------------------

_ALLOWED = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "MetadataIndex", "StorageMeta", "ChunkStorageMetadata", "TensorProperties",
        "TensorStorageMetadata", "BytesStorageMetadata", "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.planner": {"SavePlan", "WriteItem", "WriteItemType", "TensorWriteData"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset"},
}


class _PlainUnpickler(pickle.Unpickler):
    """Unpickles only DCP's metadata dataclasses, torch sizes, dtypes, layouts and memory formats."""

    def find_class(self, module: str, name: str):
        import torch

        plain_torch = module == "torch" and (
            name == "Size" or isinstance(getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)))
        if not plain_torch and name not in _ALLOWED.get(module, ()):
            raise CheckpointFileError(f"refusing to load {module}.{name} from a checkpoint pickle")
        return super().find_class(module, name)


def check_pickles(ckpt_dir: Path) -> None:
    """Check that every pickle megatron's loader reads in `ckpt_dir` holds only allow-listed plain classes
    (the `.metadata` files of torch.distributed.checkpoint), and that no object (non-tensor) shards exist.

    Raises:
        CheckpointFileError: a pickle naming anything else; object shards that would be unpickled freely.
    """
    for path in sorted(ckpt_dir.glob("*.metadata")):
        try:
            with open(path, "rb") as f:
                meta = _PlainUnpickler(f).load()
        except CheckpointFileError as e:
            raise CheckpointFileError(f"checkpoint file {path}: {e}") from None
        except Exception as e:  # truncated or garbage bytes
            raise CheckpointFileError(f"checkpoint file {path} is not a readable metadata pickle ({e})") from None
        from torch.distributed.checkpoint.metadata import BytesStorageMetadata

        objects = [k for k, v in getattr(meta, "state_dict_metadata", {}).items() if isinstance(v, BytesStorageMetadata)]
        if objects:
            raise CheckpointFileError(
                f"checkpoint {ckpt_dir} holds pickled object shards {objects[:3]}; only tensors are loaded")
    for path in sorted(ckpt_dir.rglob("*.pt")):  # megatron's common state (and any object shards)
        import torch

        try:
            torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:
            raise CheckpointFileError(f"checkpoint file {path} does not load as plain data (weights_only): {e}") from None


def read_run_meta(ckpt_dir: Path) -> Dict:
    """The checkpoint's JSON metadata (train state, scheduler, run arguments, layout)."""
    path = ckpt_dir / RUN_META
    try:
        meta = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointFileError(f"checkpoint {ckpt_dir} has no {RUN_META}") from None
    except ValueError as e:
        raise CheckpointFileError(f"checkpoint {ckpt_dir}: {RUN_META} is not valid JSON ({e})") from None
    if meta.get("format") != FORMAT:
        raise CheckpointFileError(f"checkpoint {ckpt_dir}: format {meta.get('format')!r}, expected {FORMAT!r}")
    return meta
