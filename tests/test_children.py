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


_SCRIPT_THAT_IMPORTS_TORCH = """
import sys
from pathlib import Path

import torch  # this script is __main__: a spawned child told to import it would load torch

from fp8_parallel.startup import import_megatron_core

import_megatron_core()
from megatron.core.dist_checkpointing.strategies import filesystem_async
from launch.train import children

children.start_checkpoint_writer_queue()
q = filesystem_async._results_queue
children.start_checkpoint_writer_queue()  # idempotent: the same queue, no second manager
assert filesystem_async._results_queue is q
q.put({"t": torch.arange(3)})
assert torch.equal(q.get_nowait()["t"], torch.arange(3))
pids = [int(c) for t in Path("/proc/self/task").iterdir() for c in (t / "children").read_text().split()]
assert pids, "no manager process"
print("LIBTORCH", any("libtorch" in Path(f"/proc/{p}/maps").read_text() for p in pids))
"""


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads child processes from Linux's /proc")
def test_writer_queue_manager_does_not_import_the_main_script(tmp_path):
    """A spawned process imports its parent's `__main__` script; the writer queue's manager is started without
    it, so a rank whose script imports torch does not load torch again in the manager."""
    import subprocess
    import sys

    pytest.importorskip("megatron.core")
    script = tmp_path / "rank_script.py"
    script.write_text(_SCRIPT_THAT_IMPORTS_TORCH)
    from launcher import child_env

    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=child_env(), timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "LIBTORCH False" in out.stdout, out.stdout + out.stderr
