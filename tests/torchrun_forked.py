"""torchrun, with ranks forked from a process that has already imported torch, megatron-core and fp8_parallel.

    python tests/torchrun_forked.py [torchrun's options] SCRIPT [SCRIPT's arguments]

This is torchrun itself (`torch.distributed.run`'s arguments, rendezvous and elastic agent) run with its own
`--run-path --start-method fork`: each rank runs SCRIPT with `runpy.run_path` in a process forked from the
agent, so no rank imports torch and megatron-core again (about 4 s of CPU per rank, most of a short multi-rank
check on a 2-core machine). Ranks see what torchrun's ranks see (RANK, WORLD_SIZE, MASTER_ADDR, ...), SCRIPT's
directory first on `sys.path`, and `__name__ == "__main__"`.

The tests that check what a user sees of torchrun (the README's commands, usage errors, the launcher wrapper,
a killed rank's restart) run the `torchrun` command itself; this is for the rest. CPU only: a forked process
must not inherit a CUDA context, so CUDA must be hidden (the tests' `child_env` hides it).
"""
from __future__ import annotations

import gc
import os
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import List, Optional


def _preimport(script: str) -> None:
    """Import what the ranks will import, once, here; SCRIPT's directory goes first on `sys.path`."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for path in (repo, os.path.dirname(script)):
        if path not in sys.path:
            sys.path.insert(0, path)
    with warnings.catch_warnings():  # dropped here: a forked rank imports nothing again and never sees them
        warnings.simplefilter("ignore")
        _import_modules()
        _import_for_the_job(script)


def _import_modules() -> None:
    import importlib.util

    import torch.distributed  # noqa: F401

    import fp8_parallel  # noqa: F401
    from fp8_parallel.startup import import_megatron_core

    if importlib.util.find_spec("megatron.core") is not None:
        import_megatron_core()
        import fp8_parallel.megatron  # noqa: F401
        # the job's modules, which several checks run
        import launch.train.arguments  # noqa: F401
        import launch.train.loop  # noqa: F401


# scripts whose ranks build a torch optimizer: torch's optimizers import Dynamo at their first construction
_BUILD_OPTIMIZERS = {"pretrain_gpt.py", "module_checks.py", "checkpoint_checks.py", "gpt_cpu_checks.py",
                     "attention_checks.py"}


def _import_for_the_job(script: str) -> None:
    """What the ranks of the training job and of the test scripts that train import at their first optimizer
    (Dynamo: about 0.8 s of CPU per rank, once here instead)."""
    if os.path.basename(script) in _BUILD_OPTIMIZERS:
        import torch._dynamo  # noqa: F401


# from a rank's fork to its process group: seconds normally, minutes on a loaded machine
STARTUP_TIMEOUT_S = float(os.environ.get("FP8P_FORKED_STARTUP_TIMEOUT_S", "300"))


def _forks_of(pid: int) -> int:
    """How many child processes `pid` has (Linux `/proc`); OSError where that is not readable."""
    return sum(len((task / "children").read_text().split()) for task in Path(f"/proc/{pid}/task").iterdir())


def _wait_until_all_ranks_are_forked(local_world_size: int, timeout_s: float = 60.0) -> None:
    """Hold this rank until the agent has forked all `local_world_size` of them.

    The agent has a second thread, its TCPStore server, which serves the ranks that already run. A fork
    copies the memory of every thread, so a rank forked while that thread held a lock (serving an earlier
    rank's `init_process_group`) starts with the lock held and no thread to release it: it hangs before its
    own process group. With no rank talking to the store until the last fork is done, the server is idle
    during every fork. Where `/proc` is not readable this does not wait."""
    agent = os.getppid()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if _forks_of(agent) >= local_world_size:
                return
        except OSError:
            return
        time.sleep(0.002)


def _rank_with_a_startup_watchdog(run_script_path):
    """torchrun's `run_script_path` in a forked rank, with a watchdog: a rank that has not finished
    `init_process_group` within STARTUP_TIMEOUT_S prints every thread's stack and exits 1 (a fork of a process
    with threads can deadlock, and a rank stuck there would leave the others waiting for their store's
    timeout). The launcher (tests/launcher.py) then runs the launch again on fresh interpreters."""
    import faulthandler

    import torch.distributed as dist

    def rank(script: str, *args) -> None:
        _wait_until_all_ranks_are_forked(int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        init = dist.init_process_group

        def init_watched(*a, **kw):
            try:
                return init(*a, **kw)
            finally:
                faulthandler.cancel_dump_traceback_later()

        faulthandler.dump_traceback_later(STARTUP_TIMEOUT_S, exit=True)
        dist.init_process_group = init_watched
        try:
            return run_script_path(script, *args)
        finally:
            faulthandler.cancel_dump_traceback_later()
            dist.init_process_group = init

    return rank


def main(argv: Optional[List[str]] = None) -> None:
    from torch.distributed import run

    argv = list(sys.argv[1:] if argv is None else argv)
    args = run.get_args_parser().parse_args(argv)
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) != "":
        raise SystemExit("torchrun_forked.py: CUDA must be hidden (CUDA_VISIBLE_DEVICES=''): ranks are forked")
    script = os.path.abspath(args.training_script)
    _preimport(script)
    gc.freeze()  # what is imported stays out of the ranks' garbage collections (megatron's save collects twice)
    # a forked rank of a process with threads (the agent's store): the fork is safe here, the warning is noise
    warnings.filterwarnings("ignore", message=r".*use of fork\(\) may lead to deadlocks", category=DeprecationWarning)
    run.run_script_path = _rank_with_a_startup_watchdog(run.run_script_path)  # looked up when torchrun plans ranks
    i = argv.index(args.training_script)
    try:
        run.main([*argv[:i], "--run-path", "--start-method", "fork", script, *argv[i + 1:]])
    except Exception as err:  # a failed rank: torchrun's own traceback, as `python -m torch.distributed.run`'s
        traceback.print_exception(type(err), err, err.__traceback__.tb_next)  # (without this wrapper's frame)
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
