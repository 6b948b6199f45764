"""Rank-side half of the test launcher: run many named checks in one launch, fail together."""
from __future__ import annotations

import os
import sys
import time
import traceback
from typing import Callable, Sequence, Tuple

import torch
import torch.distributed as dist

from fp8_parallel.startup import import_megatron_core

import_megatron_core()  # before the checks import megatron-core: without torch's compiler (2 s less per rank)

Check = Tuple[str, Callable[[], None]]


def test_seed() -> int:
    """The pytest run's seed (passed by the launcher as FP8P_TEST_SEED), identical on every rank."""
    return int(os.environ.get("FP8P_TEST_SEED", "0"))


def run_checks(checks: Sequence[Check], group_getter: Callable[[], dist.ProcessGroup] = lambda: None) -> None:
    """Run each check on every rank; after each, agree on failure with an all-reduce(MAX) so no rank hangs.

    Appends each passed check's name to `$FP8P_REPORT_DIR/rank<r>.passed` (read by the launcher), prints
    failures with their traceback, and exits 1 on every rank if any rank failed.
    """
    rank = dist.get_rank()
    if os.environ.get("FP8P_DUMP_STACKS_AFTER"):  # diagnose a hang: every thread's stack, then exit
        import faulthandler

        faulthandler.dump_traceback_later(float(os.environ["FP8P_DUMP_STACKS_AFTER"]), exit=True)
    failed_any = False
    for name, fn in checks:
        local_failed, started = 0, time.perf_counter()
        try:
            fn()
        except Exception:  # report, then fail together
            local_failed = 1
            print(f"CHECK-FAILED {rank} {name}\n{traceback.format_exc()}", flush=True)
        flag = torch.tensor([local_failed], dtype=torch.int32)
        if dist.get_backend() == "nccl":
            flag = flag.cuda()
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item():
            failed_any = True
            if not local_failed:
                print(f"CHECK-FAILED-ELSEWHERE {rank} {name}", flush=True)
        else:
            print(f"CHECK-PASSED {rank} {name} in {time.perf_counter() - started:.1f} s", flush=True)
            report_dir = os.environ.get("FP8P_REPORT_DIR")
            if report_dir:
                with open(os.path.join(report_dir, f"rank{rank}.passed"), "a") as f:
                    f.write(name + "\n")
    dist.barrier()
    if failed_any:
        sys.exit(1)


def exit_now(code: int = 0) -> None:
    """End the rank after its teardown without running interpreter finalization.

    Call after `destroy_process_group`: modules that still hold the group would otherwise destroy gloo's
    worker threads during finalization, which at times aborts a rank whose checks all passed. The rank's
    multiprocessing children (megatron's checkpoint-writer manager) are stopped first, as finalization would
    have; they would otherwise outlive it and hold the launch's output open.

    A rank that torchrun forked (`--start-method fork`) raises SystemExit instead: torchrun takes a 0 as the
    script's return and then ends the process itself without finalization (an `os._exit` there would leave
    torchrun waiting for that return).
    """
    import multiprocessing

    for child in multiprocessing.active_children():
        child.terminate()
        child.join(timeout=10)
    sys.stdout.flush()
    sys.stderr.flush()
    if multiprocessing.current_process().name != "MainProcess" and "TORCHELASTIC_RUN_ID" in os.environ:
        raise SystemExit(code)
    os._exit(code)
