"""The training job refuses what would lose or mix up work, and says so once: `--load` paths that are no
checkpoint directory, resuming from `--save` by default, saves that would replace newer checkpoints, the LR
schedule on resume, refused resumes, `--save` checked at start, checkpoint retention, checkpoint write faults,
and argument errors (real torchrun launches of launch/pretrain_gpt.py on CPU/gloo, tiny models)."""
from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from launcher import REPO, _free_port

JOB = REPO / "launch" / "pretrain_gpt.py"
TINY = ["--num-layers", "1", "--hidden-size", "32", "--ffn-hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "2", "--lr-warmup-iters", "1",
        "--fp8-format", "hybrid", "--fp8-amax-history-len", "4", "--log-interval", "1", "--no-progress-bar"]
ERROR = "pretrain_gpt.py: error:"


def _env(tmp_path: Path) -> Dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", CUDA_VISIBLE_DEVICES="",
               FP8P_DATA_CACHE=str(tmp_path.parent / "fp8p-data-cache"))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    return env


def _job(tmp_path: Path, flags: List[str], nproc: int = 1, expect_rc: Optional[int] = 0,
         file_size_limit: Optional[int] = None) -> Tuple[int, str]:
    """Run the job under torchrun; returns (exit status, output). `file_size_limit` (bytes): RLIMIT_FSIZE of
    the job, so that a write past it fails with EFBIG (Python ignores SIGXFSZ), a real I/O fault."""
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (file_size_limit, file_size_limit))

    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--nnodes=1",
           f"--master_port={_free_port()}", str(JOB), *flags]
    proc = subprocess.run(cmd, cwd=tmp_path, env=_env(tmp_path), capture_output=True, text=True, timeout=600,
                          preexec_fn=limit if file_size_limit else None)
    out = proc.stdout + proc.stderr
    if expect_rc is not None:
        assert proc.returncode == expect_rc, f"exit {proc.returncode}, expected {expect_rc}:\n{out[-8000:]}"
    return proc.returncode, out


def _refused(tmp_path: Path, flags: List[str], *needles: str, nproc: int = 1) -> str:
    """The job exits before training with one error line naming `needles` (exit status 2 from the rank)."""
    rc, out = _job(tmp_path, flags, nproc=nproc, expect_rc=None)
    assert rc != 0, out[-5000:]
    lines = [line for line in out.splitlines() if line.startswith(ERROR)]
    assert len(lines) == 1, f"expected one error line, got {lines}:\n{out[-5000:]}"
    for needle in needles:
        assert needle in lines[0], f"{needle!r} not in {lines[0]!r}"
    assert "exitcode  : 2" in out or rc == 2, out[-5000:]
    assert "| loss " not in out and "job:" not in out, f"it trained:\n{out[-5000:]}"
    job_frames = [line for line in out.splitlines() if line.strip().startswith('File "') and str(REPO) in line]
    assert not job_frames, f"a traceback from the job:\n{out[-5000:]}"
    return lines[0]


def _rows(log: Path) -> List[dict]:
    return [json.loads(line) for line in log.read_text().splitlines() if line.strip()]


def _latest(root: Path) -> str:
    return (root / "latest").read_text().strip()


def test_load_path_must_be_a_checkpoint_directory(tmp_path):
    """--load of a missing path, a parent directory, one checkpoint's own directory or an empty directory is
    an error (exit 2, one line) instead of a run from scratch; --load-optional starts from iteration 0 where
    nothing is there."""
    ck = tmp_path / "runs" / "ck"
    _job(tmp_path, TINY + ["--train-iters", "2", "--save", str(ck)])
    (tmp_path / "empty").mkdir()
    print(_refused(tmp_path, TINY + ["--train-iters", "4", "--load", str(tmp_path / "ckk")], "no such directory",
                   "--load-optional"))
    print(_refused(tmp_path, TINY + ["--train-iters", "4", "--load", str(tmp_path / "runs")],
                   f"did you mean --load {ck}?"))
    print(_refused(tmp_path, TINY + ["--train-iters", "4", "--load", str(ck / "iter_0000002")],
                   "is one checkpoint", f"--load {ck}"))
    print(_refused(tmp_path, TINY + ["--train-iters", "4", "--load", str(tmp_path / "empty"), "--save", str(ck)],
                   "not a checkpoint directory"))
    assert _latest(ck) == "iter_0000002"
    _, out = _job(tmp_path, TINY + ["--train-iters", "2", "--load", str(tmp_path / "fresh"), "--load-optional",
                                    "--save", str(tmp_path / "fresh")])
    assert "no complete checkpoint there (--load-optional): starting from iteration 0" in out, out[-3000:]
    _, out = _job(tmp_path, TINY + ["--train-iters", "3", "--load", str(ck), "--load-optional", "--save", str(ck)])
    assert "resumed from" in out and "at iteration 2" in out, out[-3000:]
