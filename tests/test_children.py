"""The training job's helper processes (`launch/train/children.py`): the checkpoint writer's results queue."""
import os
import queue
import multiprocessing
from pathlib import Path

import pytest
import torch

from launch.train import children


def test_writer_queue_round_trips_torch_objects_and_its_manager_never_imports_torch():
    """The spawned manager behind megatron-core's writer results queue holds pickled bytes: torch objects go
    through it unchanged (put / get_nowait, as megatron-core calls them; empty raises queue.Empty), and the
    manager process never loads torch (a spawned manager that unpickled them would: seconds of CPU per rank)."""
    manager = children._WriterManager(ctx=multiprocessing.get_context("spawn"))
    manager.start(initializer=children.die_with_parent, initargs=(os.getpid(),))
    try:
        q = manager.PickledQueue()
        sent = [{"rank": 3, "w": torch.randn(5, 7, generator=torch.Generator().manual_seed(11))}, ValueError("x")]
        q.put(sent)
        assert q.qsize() == 1 and not q.empty()
        got = q.get_nowait()
        assert got[0]["rank"] == 3 and torch.equal(got[0]["w"], sent[0]["w"]) and str(got[1]) == "x"
        with pytest.raises(queue.Empty):
            q.get_nowait()
        q.put_nowait(1.5)
        assert q.get(timeout=5) == 1.5
        maps = Path(f"/proc/{manager._process.pid}/maps")
        if maps.exists():
            assert "libtorch" not in maps.read_text(), "the writer queue's manager loaded torch"
    finally:
        manager.shutdown()
