"""Checkpoints of the training job (launch/checkpointing.py): files and atomicity in-process; exact resume,
resharding (TP, PP, EP), FP8 interchange, bad inputs (4 ranks) and a SIGKILL during a save (2 ranks) under
torchrun, gloo. Through the job itself (resume after --exit-interval, torchrun restarts, errors): test_checkpointing_job.py."""
from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import time
from pathlib import Path

import pytest

from launcher import WORKERS, _free_port, child_env, launch, torchrun_command
from launch import checkpoint_files as cf

HEAVY = pytest.mark.xdist_group("heavy")  # 4+ torchrun ranks: one at a time (--dist loadgroup)

TIMEOUT = 1800.0  # the machine is shared and loaded: generous, but a hang still fails


def _fake_checkpoint(root: Path, iteration: int, payload: bytes = b"tensor bytes") -> Path:
    tmp = root / f"{cf.checkpoint_name(iteration)}.tmp"
    tmp.mkdir(parents=True)
    (tmp / "__0_0.distcp").write_bytes(payload)
    (tmp / cf.RUN_META).write_text(json.dumps({"format": cf.FORMAT, "iteration": iteration}))
    cf.write_manifest(tmp)
    cf.publish(tmp, root / cf.checkpoint_name(iteration))
    return root / cf.checkpoint_name(iteration)


def test_publish_latest_and_incomplete_saves(tmp_path):
    assert cf.find_current(tmp_path / "missing") == (None, [])
    first = _fake_checkpoint(tmp_path, 5)
    assert cf.read_latest(tmp_path) == "iter_0000005"
    # a save killed before its manifest: never chosen, reported
    (tmp_path / "iter_0000010.tmp").mkdir()
    (tmp_path / "iter_0000010.tmp" / "__0_0.distcp").write_bytes(b"half")
    path, notes = cf.find_current(tmp_path)
    assert path == first and any("iter_0000010.tmp" in n for n in notes), notes
    cf.verify(path)
    # re-saving the same iteration replaces it; nothing else is left behind
    second = _fake_checkpoint(tmp_path, 5, b"new bytes")
    assert second == first and (second / "__0_0.distcp").read_bytes() == b"new bytes"
    assert not (tmp_path / "iter_0000005.old").exists()
    # a re-save of the same iteration killed between its two renames: the moved-aside copy is still found
    os.rename(second, tmp_path / "iter_0000005.old")
    path, notes = cf.find_current(tmp_path)
    assert path == tmp_path / "iter_0000005.old" and notes
    os.rename(path, second)
    # without `latest`, the newest complete directory; one without a manifest is reported, not chosen
    (tmp_path / cf.LATEST).unlink()
    (tmp_path / "iter_0000020").mkdir()
    path, notes = cf.find_current(tmp_path)
    assert path == first and any("iter_0000020" in n for n in notes)


def test_publish_renames_the_finished_save(tmp_path):
    """Publishing moves the finished directory into place in one rename: the files under `iter_N` are the very
    files written under `iter_N.tmp` (same inodes: never a copy, which a kill could leave half done), the
    `.tmp` directory is gone, and `latest` is replaced as a new file (a reader holding the old one keeps it)."""
    tmp = tmp_path / f"{cf.checkpoint_name(7)}.tmp"
    tmp.mkdir()
    (tmp / "__0_0.distcp").write_bytes(b"tensor bytes")
    (tmp / cf.RUN_META).write_text(json.dumps({"format": cf.FORMAT, "iteration": 7}))
    cf.write_manifest(tmp)
    written = {p.name: p.stat().st_ino for p in tmp.iterdir()}
    cf.write_atomic(tmp_path / cf.LATEST, "iter_0000003\n")
    with open(tmp_path / cf.LATEST) as old_latest:
        cf.publish(tmp, tmp_path / cf.checkpoint_name(7))
        assert old_latest.read() == "iter_0000003\n"
    final = tmp_path / cf.checkpoint_name(7)
    assert not tmp.exists()
    assert {p.name: p.stat().st_ino for p in final.iterdir()} == written
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([cf.LATEST, final.name])
    assert cf.read_latest(tmp_path) == final.name
    cf.verify(final)


def test_verify_names_the_damage(tmp_path):
    ck = _fake_checkpoint(tmp_path, 3, bytes(range(256)) * 4)
    f = ck / "__0_0.distcp"
    data = bytearray(f.read_bytes())
    data[100] ^= 1
    f.write_bytes(bytes(data))
    with pytest.raises(cf.CheckpointFileError, match=r"__0_0.distcp is corrupt"):
        cf.verify(ck)
    f.write_bytes(bytes(data[:10]))
    with pytest.raises(cf.CheckpointFileError, match=r"__0_0.distcp has 10 bytes.*truncated"):
        cf.verify(ck)
    f.unlink()
    with pytest.raises(cf.CheckpointFileError, match=r"__0_0.distcp is missing"):
        cf.verify(ck)
    (ck / cf.MANIFEST).unlink()
    with pytest.raises(cf.CheckpointFileError, match="incomplete"):
        cf.verify(ck)
    (tmp_path / cf.LATEST).write_text("../../etc\n")
    with pytest.raises(cf.CheckpointFileError, match="not a checkpoint directory"):
        cf.find_current(tmp_path)


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo this must never run",))


def test_pickles_are_checked_before_loading(tmp_path):
    (tmp_path / ".metadata").write_bytes(pickle.dumps(_Evil()))
    with pytest.raises(cf.CheckpointFileError, match=r"refusing to load (posix|nt)\.system"):
        cf.check_pickles(tmp_path)
    (tmp_path / ".metadata").unlink()
    (tmp_path / "common.pt").write_bytes(pickle.dumps(_Evil()))
    with pytest.raises(cf.CheckpointFileError, match="weights_only"):
        cf.check_pickles(tmp_path)


@HEAVY
def test_dense_resume_reshard_interchange_bad_inputs(tmp_path):
    checks = ["ckpt_exact_resume_tp2_pp2_fp8", "ckpt_reshard_tp2pp2_to_tp1pp2_and_tp2pp1",
              "ckpt_interchange_fp8_nofp8_localspec", "ckpt_bad_inputs_named"]
    out = launch("checkpoint_checks.py", 4, ["dense", str(tmp_path)], timeout=TIMEOUT, expect_checks=checks)
    assert "FP8 state starts fresh" in out and "ignores it" in out


@HEAVY
def test_moe_resume_and_ep_reshard(tmp_path):
    """TP2 x PP2 x EP2 MoE with FP8: bitwise exact resume; EP2 -> EP1 -> EP2 reshards (losses within FP8
    tolerance of the run in the saved layout); megatron's chained dense + expert optimizers into one."""
    checks = ["ckpt_exact_resume_moe_tp2_pp2_ep2", "ckpt_reshard_moe_ep2_to_ep1_and_back",
              "ckpt_moe_chained_optimizers_into_one"]
    out = launch("checkpoint_checks.py", 4, ["moe", str(tmp_path)], timeout=TIMEOUT, expect_checks=checks)
    assert "resharded to tp=2 pp=2 ep=1" in out and "resharded to tp=2 pp=2 ep=2" in out


def _descendants(pid: int) -> list:
    """`pid`'s child processes, recursively (torchrun starts its workers in sessions of their own)."""
    out = []
    try:
        children = [int(c) for t in Path(f"/proc/{pid}/task").iterdir() for c in (t / "children").read_text().split()]
    except OSError:
        return out
    for child in children:
        out += [child] + _descendants(child)
    return out


def _kill_tree(pid: int) -> list:
    """SIGKILL torchrun and every process under it, as a node failure would; returns their ids."""
    victims = _descendants(pid) + [pid]
    for victim in victims:
        try:
            os.kill(victim, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return victims


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


STAGES = ("tensors", "metadata", "manifest", "publish")
KILL_RANKS = 2  # the kill test's layout is TP2 (checkpoint_checks.py KILL_OPTS): each rank writes its own shards


def _kill_save_at(root: Path, stage: str) -> None:
    """Run the save worker in `root` and SIGKILL every rank when the second save reaches `stage`."""
    env = child_env(FP8P_CHECKPOINT_TEST_PAUSE=f"{stage}:600")
    cmd = [*torchrun_command(), f"--nproc_per_node={KILL_RANKS}", "--nnodes=1",
           f"--master_port={_free_port()}", str(WORKERS / "checkpoint_checks.py"), "save", str(root)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    lines, saving, killed, victims = [], False, False, []
    deadline = time.time() + TIMEOUT
    try:
        for line in proc.stdout:
            lines.append(line)
            saving = saving or "SAVING-ITERATION-2" in line
            if saving and f"checkpoint save stage {stage}" in line:
                victims = _kill_tree(proc.pid)
                killed = True
                break
            if time.time() > deadline:
                break
    finally:
        if not killed:
            _kill_tree(proc.pid)
        proc.wait()
    settle = time.time() + 10  # until the kernel has ended them all (it was a fixed 2 s sleep)
    while time.time() < settle and [v for v in victims if _alive(v)]:
        time.sleep(0.1)
    assert killed, f"the save never reached stage {stage}:\n" + "".join(lines[-200:])
    assert len(victims) > KILL_RANKS and not [v for v in victims if _alive(v)], f"a rank survived the kill at {stage}"
    assert (root / "iter_0000001" / cf.MANIFEST).is_file(), stage
    assert cf.read_latest(root) == "iter_0000001", stage


def test_sigkill_during_save_leaves_previous_checkpoint(tmp_path):
    """A SIGKILL at each stage of a save (tensors written, metadata, manifest, publishing): the previous
    checkpoint stays `latest` and loads exactly, and the next save over the leftovers completes. Every stage
    on every run; one verifying launch for all four."""
    roots = [tmp_path / stage for stage in STAGES]
    for root, stage in zip(roots, STAGES):
        root.mkdir()
        _kill_save_at(root, stage)
    out = launch("checkpoint_checks.py", KILL_RANKS, ["verify", ",".join(map(str, roots))], timeout=TIMEOUT,
                 expect_checks=[f"ckpt_killed_save_leaves_previous_{stage}" for stage in STAGES])
    for stage in STAGES[1:]:  # past the tensors, an incomplete save is left, and loading says it ignores it
        notes = [line for line in out.splitlines() if "ignoring incomplete checkpoint" in line]
        if stage != "publish" or not (tmp_path / stage / "iter_0000002.tmp").exists():
            assert any(str(tmp_path / stage) in line for line in notes), (stage, notes, out[-3000:])

