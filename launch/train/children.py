"""Nothing a rank starts outlives it.

torchrun runs each rank in a session of its own and, when a rank dies, stops the other ranks, not what the dead
rank started. megatron-core's checkpoint writer starts helper processes: a `multiprocessing` manager (spawned
once, at the first save, and kept for the process's life), its resource tracker, and forked writers during
each save. A rank killed by a signal would leave them running, holding the job's output open, so that
`torchrun ... | tee log` never returned.

`tie_children_to_this_rank` makes every forked child and the writer's manager die with the rank (Linux's
parent-death signal); the resource tracker then ends by itself once no live process holds its pipe.
"""
from __future__ import annotations

import ctypes
import os
import pickle
import queue
import signal
import sys
from multiprocessing.managers import BaseProxy, SyncManager
from typing import Any, Optional

_PR_SET_PDEATHSIG = 1
_forking_pid = [0]


def die_with_parent(parent_pid: int) -> None:
    """In a child process: be SIGKILLed when `parent_pid` (the process that started it) ends; exit now if it
    already has. No-op outside Linux."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        return  # not allowed here: nothing else to do
    if os.getppid() != parent_pid:  # the parent died before the signal was armed
        os._exit(1)


def _before_fork() -> None:
    _forking_pid[0] = os.getpid()


def _after_fork_in_child() -> None:
    die_with_parent(_forking_pid[0])


class _PickledQueueProxy(BaseProxy):
    """A proxy of a queue in a manager process that hands the manager pickled bytes, not objects. The results
    megatron-core's writers queue are torch objects: a spawned manager holding them as objects would import
    torch to unpickle the first one (about 3 s of CPU per rank and run); as bytes it imports nothing."""

    _exposed_ = ("put", "put_nowait", "get", "get_nowait", "empty", "qsize")

    def put(self, obj: Any, block: bool = True, timeout: Optional[float] = None) -> None:
        self._callmethod("put", (pickle.dumps(obj), block, timeout))

    def put_nowait(self, obj: Any) -> None:
        self._callmethod("put_nowait", (pickle.dumps(obj),))

    def get(self, block: bool = True, timeout: Optional[float] = None) -> Any:
        return pickle.loads(self._callmethod("get", (block, timeout)))

    def get_nowait(self) -> Any:
        return pickle.loads(self._callmethod("get_nowait"))

    def empty(self) -> bool:
        return self._callmethod("empty")

    def qsize(self) -> int:
        return self._callmethod("qsize")


class _WriterManager(SyncManager):
    """The checkpoint writer's manager: its `PickledQueue` keeps what is queued as pickled bytes."""


_WriterManager.register("PickledQueue", queue.Queue, proxytype=_PickledQueueProxy)


def start_checkpoint_writer_queue() -> None:
    """Start megatron-core's checkpoint-writer results queue (what its first save would start) on a spawned
    manager that dies with this rank. megatron-core keeps that queue in a module global and creates it only
    while the global is unset; it puts each save's results and reads them with `get_nowait`. The manager holds
    pickled bytes and is started without this process's `__main__` (a spawned child imports the parent's main
    script: for a script that imports torch, seconds of CPU per rank). Idempotent; call from the main thread."""
    import multiprocessing
    import types

    try:
        from megatron.core.dist_checkpointing.strategies import filesystem_async
    except ImportError:
        return
    if getattr(filesystem_async, "_results_queue", None) is not None:
        return
    manager = _WriterManager(ctx=multiprocessing.get_context("spawn"))
    main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")  # what the spawned child is told to import: nothing
    try:
        manager.start(initializer=die_with_parent, initargs=(os.getpid(),))
    finally:
        sys.modules["__main__"] = main
    filesystem_async._results_queue = manager.PickledQueue()


_tied = [False]


def tie_children_to_this_rank(saves: bool) -> None:
    """From the main thread, before the job forks or saves: forked children get the parent-death signal, and
    with `saves` the checkpoint writer's manager is started with it too. Idempotent."""
    if not sys.platform.startswith("linux") or _tied[0]:
        return
    _tied[0] = True
    os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)
    if saves:
        start_checkpoint_writer_queue()
