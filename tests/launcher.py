"""Launch N-rank torchrun jobs from pytest and fail (not hang) when any rank fails or stalls.

Each worker script runs a list of named checks on every rank (see `workers/rank_checks.py`) and writes one
report file per rank listing the checks that passed. `launch` asserts that torchrun exited cleanly and that
every rank reported every expected check, so a check that silently did not run fails the test.
"""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Tuple

from seeds import ENV_VAR as SEED_ENV_VAR
from seeds import session_seed

WORKERS = Path(__file__).resolve().parent / "workers"
REPO = WORKERS.parent.parent


def import_path() -> str:
    """A child's PYTHONPATH: the repository root, then this process's `sys.path` (which holds `$PYTHONPATH`), so
    a subprocess imports this checkout and whatever this process can import (a megatron-core on PYTHONPATH)."""
    entries: List[str] = []
    for p in (str(REPO), *sys.path):
        if p and p not in entries:
            entries.append(p)
    return os.pathsep.join(entries)


def child_env(gpus: bool = False, **overrides: str) -> Dict[str, str]:
    """The environment for a test's subprocess: a copy of this one, with one thread per process, unbuffered
    output, `import_path()`, the run's seed (FP8P_TEST_SEED), and CUDA hidden unless `gpus` (then NVLink
    multicast off); `overrides` last."""
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=import_path())
    env[SEED_ENV_VAR] = str(session_seed())
    if not gpus:
        env["CUDA_VISIBLE_DEVICES"] = ""
    else:  # never use NVLink multicast on shared machines
        env.update({"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"})
    env.update({k: str(v) for k, v in overrides.items()})
    return env


def job_argv(flags: Iterable[str]) -> List[str]:
    """The training job's flags for a test: a test that names its run's flags starts from megatron's defaults
    (`--preset none` first), unless it picks a preset itself; no flags at all is the job's default preset.
    A test that names flags gets `--no-plot` unless it names `--plot` (the end-of-run figure costs about 3 s of
    CPU per run; the tests of the figure ask for it)."""
    flags = list(flags)
    if not flags:
        return flags
    plot = [] if "--plot" in flags or "--no-plot" in flags else ["--no-plot"]
    if any(f == "--preset" or f.startswith("--preset=") for f in flags):
        return flags + plot
    return ["--preset", "none", *flags, *plot]


FORKED_TORCHRUN = Path(__file__).resolve().parent / "torchrun_forked.py"


def torchrun_command(gpus: bool = False, forked: bool = True) -> List[str]:
    """The command that starts torchrun for a test's ranks: with CUDA hidden, torchrun with its ranks forked
    from an agent that has imported torch and megatron-core once (`torchrun_forked.py`: a fraction of the CPU
    time of N fresh interpreters); with GPUs, or `forked=False` (tests of what a user sees of torchrun and of
    the job under it), `python -m torch.distributed.run`, one fresh interpreter per rank."""
    if gpus or not forked:
        return [sys.executable, "-m", "torch.distributed.run"]
    return [sys.executable, str(FORKED_TORCHRUN)]


def run_job_in_process(cwd: Path, flags: Iterable[str], env: Dict[str, str]) -> Tuple[int, str]:
    """`launch/pretrain_gpt.py`'s main as one rank, in this process: (exit status, stdout + stderr).

    What torchrun would give a one-rank job (RANK 0 of 1, a free MASTER_PORT) on top of `env`, run in `cwd`
    with this process's warning filters, environment and working directory restored afterwards. It saves the
    cost of a new interpreter importing torch and megatron-core (most of a one-rank job's time); a job that
    leaves torch.distributed or megatron's parallel state up fails the test. Not for what needs a process of
    its own (resource limits, signals, a terminal): use torchrun there."""
    import contextlib
    import io
    import traceback
    import warnings
    from unittest import mock

    import torch.distributed as dist

    from launch import pretrain_gpt

    rank_env = dict(env, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                    MASTER_PORT=str(_free_port()))
    buf = io.StringIO()
    with contextlib.chdir(cwd), mock.patch.dict(os.environ, rank_env, clear=True), warnings.catch_warnings(), \
            contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        try:
            rc = pretrain_gpt.main(job_argv(flags))
        except SystemExit as exit_:
            rc = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
        except Exception:  # what a rank would print before exiting 1
            traceback.print_exc()
            rc = 1
    out = buf.getvalue()
    left_up = dist.is_initialized()
    if left_up:  # tear it down so the next test starts clean, then fail this one
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
    assert not left_up, f"the job left torch.distributed initialized (exit {rc}):\n{out[-5000:]}"
    return rc, out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _port_was_taken(output: str) -> bool:
    text = output.lower()
    return "address already in use" in text or "eaddrinuse" in text


def _forked_rank_stuck(output: str) -> bool:
    """Whether torchrun_forked.py's startup watchdog fired (faulthandler's header, then the rank's stacks)."""
    return re.search(r"Timeout \(\d+:\d\d:\d\d\)!", output) is not None and "torchrun_forked.py" in output


def launch(
    script: str,
    nproc: int,
    args: Iterable[str] = (),
    timeout: float = 300.0,
    expect_checks: Optional[Iterable[str]] = None,
    env: Optional[Dict[str, str]] = None,
    gpus: bool = False,
) -> str:
    """Run `workers/<script>` under torchrun with `nproc` ranks; return its combined output.

    CPU/gloo by default (GPUs hidden, ranks forked: `torchrun_command`); `gpus=True` leaves the GPUs visible so
    workers pick NCCL.

    Raises AssertionError (with the output) on a non-zero exit, a timeout, or a missing check report.
    """
    full_env = child_env(gpus=gpus, **(env or {}))  # the run's seed unless `env` names another
    forked = True
    for attempt in range(3):  # a port taken between choosing it and torchrun binding it: choose another
        report_dir = tempfile.mkdtemp(prefix="fp8p-checks-")
        full_env["FP8P_REPORT_DIR"] = report_dir
        cmd = [*torchrun_command(gpus, forked=forked), f"--nproc_per_node={nproc}", "--nnodes=1",
               f"--master_port={_free_port()}", str(WORKERS / script), *args]
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=full_env, start_new_session=True
        )
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for pid in _descendants(proc.pid):  # torchrun's workers run in sessions of their own
                _kill(pid)
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
            raise AssertionError(f"{script} with {nproc} ranks timed out after {timeout}s:\n{out[-20000:]}")
        if proc.returncode != 0 and forked and _forked_rank_stuck(out):
            # a forked rank stuck before its process group (see torchrun_forked.py): the stacks are in the
            # output; once more on fresh interpreters
            print(f"{script}: a forked rank got stuck at startup; running again with torchrun's own ranks:\n"
                  f"{out[-20000:]}")
            forked = False
            continue
        if proc.returncode == 0 or not _port_was_taken(out):
            break
    if proc.returncode != 0:
        raise AssertionError(f"{script} with {nproc} ranks exited {proc.returncode}:\n{out[-20000:]}")
    if expect_checks is not None:
        missing = _missing_reports(Path(report_dir), nproc, expect_checks)
        if missing:
            raise AssertionError(f"{script}: checks not reported as passed: {missing}\n{out[-20000:]}")
    return out


def _descendants(pid: int) -> List[int]:
    """`pid`'s child processes, recursively (Linux `/proc`; none found elsewhere)."""
    try:
        children = [int(c) for t in Path(f"/proc/{pid}/task").iterdir() for c in (t / "children").read_text().split()]
    except OSError:
        return []
    return [d for c in children for d in [c, *_descendants(c)]]


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _missing_reports(report_dir: Path, nproc: int, checks: Iterable[str]) -> List[str]:
    passed = {}
    for r in range(nproc):
        f = report_dir / f"rank{r}.passed"
        passed[r] = set(f.read_text().split()) if f.exists() else set()
    return [f"rank {r}: {c}" for c in checks for r in range(nproc) if c not in passed[r]]
