"""parallel_state on megatron-core: multi-rank gloo launches, every rank asserts."""
import pytest

from parallel_state import ParallelLayoutError, ParallelSizes
from launcher import launch

HEAVY = pytest.mark.xdist_group("heavy")  # 4+ torchrun ranks: one at a time (--dist loadgroup)

CHECKS = ["bad_sizes", "sizes", "getters", "amax_domains", "max_all_reduce", "schedule_matches_single_process"]


@HEAVY
@pytest.mark.parametrize(
    "nproc,tp,pp,vpp,ep,cp",
    [(8, 2, 2, 0, 2, 1), (4, 2, 2, 2, 1, 1), (8, 2, 2, 0, 1, 2)],
    ids=["tp2-pp2-ep2", "tp2-pp2-vpp2", "tp2-pp2-cp2"],
)
def test_parallel_state_multirank(nproc, tp, pp, vpp, ep, cp):
    """Getters and amax domains against megatron's rank layout computed independently; with CP the dense
    domain spans TP x CP x DP (TP x CP with tp_only)."""
    checks = CHECKS if cp == 1 else [c for c in CHECKS if c != "schedule_matches_single_process"]
    launch("parallel_state_checks.py", nproc, [str(tp), str(pp), str(vpp), str(ep), str(cp)], expect_checks=checks)


@pytest.mark.parametrize(
    "kwargs,words",
    [
        (dict(world=6, tp=4), ["world size 6", "tp=4"]),
        (dict(world=8, tp=2, pp=1, vpp=2), ["vpp=2", "pp=1"]),
        (dict(world=8, tp=2, ep=8), ["etp*ep*pp", "ep=8"]),
        (dict(world=8, tp=2, etp=3), ["etp=3"]),
        (dict(world=8, cp=-1), ["cp=-1"]),
    ],
)
def test_bad_sizes_name_the_values(kwargs, words):
    with pytest.raises(ParallelLayoutError) as info:
        ParallelSizes(**kwargs)
    for w in words:
        assert w in str(info.value)


def test_derived_sizes():
    s = ParallelSizes(world=16, tp=2, pp=2, cp=2, ep=4, etp=1)
    assert (s.dp, s.expert_dp, s.expert_tp) == (2, 2, 1)


@HEAVY
def test_megatron_gpt_dense_and_moe_train_on_cpu():
    launch(
        "gpt_cpu_checks.py", 4, expect_checks=["gpt_dense_trains_on_cpu", "gpt_moe_ep2_trains_on_cpu"], timeout=400
    )


UNGUARDED_SCRIPT = """
import sys
import torch
import torch.distributed as dist
import parallel_state as ps
from parallel_state import cpu_compat
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.mapping import ShardedTensor

ps.initialize(tp=1)  # no `if __name__ == "__main__":` guard
sd = {"w": ShardedTensor.from_rank_offsets("w", torch.randn(4, 4), replica_id=dist.get_rank())}
with cpu_compat():
    dist_checkpointing.save(sd, sys.argv[1])
print("SAVED", flush=True)
"""


def test_unguarded_script_fails_instead_of_hanging(tmp_path):
    """megatron's checkpoint writer starts a helper process with the spawn method, which re-runs a main script
    without an `if __name__ == "__main__":` guard; its `initialize` joined the rank's rendezvous and both hung
    (seen: 18 minutes). It now refuses in the helper, naming the guard, and the job exits within seconds."""
    import subprocess

    from launcher import _free_port, child_env, torchrun_command

    script = tmp_path / "unguarded.py"
    script.write_text(UNGUARDED_SCRIPT)
    (tmp_path / "ckpt").mkdir()
    env = child_env()
    cmd = [*torchrun_command(), "--nproc_per_node=2", f"--master_port={_free_port()}", str(script),
           str(tmp_path / "ckpt")]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "SAVED" not in out, out[-5000:]
    assert "if __name__ == \"__main__\":" in out and "SyncManager" in out, out[-5000:]
