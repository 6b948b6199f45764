"""tests/torchrun_forked.py: a forked rank stuck before its process group ends the launch, with its stacks."""
import subprocess
import sys
import time

from launcher import FORKED_TORCHRUN, _forked_rank_stuck, _free_port, child_env

STUCK_RANK = """
import os, time
import torch.distributed as dist
if os.environ["RANK"] == "1":
    time.sleep(3600)  # as a rank deadlocked after its fork: never reaches its process group
dist.init_process_group("gloo")
"""


def test_a_rank_stuck_at_startup_ends_the_launch_with_its_stacks(tmp_path):
    script = tmp_path / "stuck.py"
    script.write_text(STUCK_RANK)
    start = time.monotonic()
    proc = subprocess.run([sys.executable, str(FORKED_TORCHRUN), "--nproc_per_node=2",
                           f"--master_port={_free_port()}", str(script)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=240, env=child_env(FP8P_FORKED_STARTUP_TIMEOUT_S="4"))
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-5000:]
    assert time.monotonic() - start < 120, "the watchdog did not end the launch"
    assert _forked_rank_stuck(out), out[-5000:]
    assert "Timeout (0:00:04)!" in out and 'stuck.py", line 5' in out, out[-5000:]  # the stuck rank's stack
