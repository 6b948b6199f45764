"""Checkpoints through the training job itself (launch/pretrain_gpt.py under torchrun, CPU/gloo): exact resume
from a --save-interval checkpoint and after --exit-interval (TP2 with sequence parallelism, PP2 x DP2, the MoE
default layout TP2 x PP2 x EP2), a rank
SIGKILLed under `torchrun --max-restarts=1`, and checkpoint errors that end the job with one line."""
from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import pytest

from launcher import REPO, _free_port, child_env, job_argv, torchrun_command
from seeds import session_seed
from launch import checkpoint_files as cf

HEAVY = pytest.mark.xdist_group("heavy")  # 4+ torchrun ranks: one at a time (--dist loadgroup)

JOB = REPO / "launch" / "pretrain_gpt.py"
TIMEOUT = 900.0  # per launch; a launch takes ~20-60 s on 2 shared cores, a hang still fails
TINY = ["--num-layers", "2", "--hidden-size", "32", "--ffn-hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4", "--lr-warmup-iters", "2",
        "--fp8-format", "hybrid", "--fp8-amax-history-len", "4", "--log-interval", "1", "--no-progress-bar"]


def _moe_default() -> List[str]:
    """The no-flag run's flags on 4 CPU ranks (TP2 x PP2, MoE with EP2, FP8), with a tinier model."""
    from launch.train.arguments import embedded_default_argv

    argv = embedded_default_argv(4, gpu=False)
    i = argv.index("--save")
    del argv[i:i + 2]  # the test chooses where to save
    return argv + ["--hidden-size", "32", "--ffn-hidden-size", "64", "--num-layers", "2", "--global-batch-size", "4",
                   "--log-interval", "1", "--no-progress-bar"]


LAYOUTS = {
    "tp2_sp": (2, TINY + ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    "pp2_dp2": (4, TINY + ["--pipeline-model-parallel-size", "2", "--global-batch-size", "8"]),
    "moe_default_tp2_pp2_ep2": (4, None),  # filled in the test (needs the job's arguments module)
}


def _seed() -> int:
    """The run's seed (`--seed N` or FP8P_TEST_SEED=N reproduces one)."""
    seed = session_seed()
    print(f"seed {seed} (FP8P_TEST_SEED={seed} reproduces)")
    return seed


def _env(tmp_path: Path) -> Dict[str, str]:
    return child_env(FP8P_DATA_CACHE=str(tmp_path.parent / "fp8p-data-cache"))


def _start(tmp_path: Path, nproc: int, flags: List[str], restarts: int = 0) -> subprocess.Popen:
    # a restart test kills a rank as a user's torchrun would see it: fresh interpreters; the rest forked ranks
    cmd = [*torchrun_command(forked=restarts == 0), f"--nproc_per_node={nproc}", "--nnodes=1",
           f"--max-restarts={restarts}", f"--master_port={_free_port()}", str(JOB), *job_argv(flags)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(tmp_path),
                            start_new_session=True, cwd=str(tmp_path))


def _finish(proc: subprocess.Popen, what: str, expect_rc: Optional[int] = 0, helpers: Sequence[int] = ()) -> str:
    """Wait for torchrun to exit and return its output (read on a thread, as `torchrun ... | tee` reads it).

    `helpers`: processes a SIGKILLed rank had started (see the restart test). Once torchrun has exited, the
    output pipe must close and every helper must have ended by itself within 30 s; whatever is left of the
    launch is killed in any case."""
    started, chunks = time.time(), []
    reader = threading.Thread(target=lambda: chunks.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        proc.wait(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise AssertionError(f"{what} timed out:\n{''.join(chunks)[-20000:]}")
    finally:
        reader.join(timeout=30)  # before anything is killed: the pipe closes when the last holder ends
        open_after = reader.is_alive()
        left = _still_running(helpers)
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # leftovers of this launch only (its own session)
        except ProcessLookupError:
            pass
        _kill_all(left)
        reader.join(timeout=60)
    out = "".join(chunks)
    print(f"{what}: {time.time() - started:.1f} s, exit {proc.returncode}" +
          (f"; {len(helpers)} helper process(es) of the killed rank, {len(left)} outlived it" if helpers else ""))
    if expect_rc is not None:
        assert proc.returncode == expect_rc, f"{what} exited {proc.returncode}:\n{out[-20000:]}"
    assert not open_after, f"{what}: the output stayed open 30 s after torchrun exited:\n{out[-5000:]}"
    assert not left, f"{what}: processes {left} started by the killed rank outlived it"
    return out


def _job(tmp_path: Path, nproc: int, flags: List[str], what: str, expect_rc: Optional[int] = 0) -> str:
    return _finish(_start(tmp_path, nproc, flags), what, expect_rc)


def _rows(log_json: Path) -> List[dict]:
    return [json.loads(line) for line in log_json.read_text().splitlines() if line.strip()]


def _losses(log_json: Path) -> Dict[int, float]:
    return {r["iteration"]: r["loss"] for r in _rows(log_json)}


def _tensors(ckpt: Path) -> Dict[str, object]:
    """Every tensor of a checkpoint (model with FP8 state, optimizer, RNG), flattened by key. Reading our own
    test's files: torch.load without weights_only is fine here."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = ckpt.parent / (ckpt.name + ".pt")
    dcp_to_torch_save(str(ckpt), str(out))
    flat = {}

    def walk(prefix: str, value) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}{k}.", v)
        elif isinstance(value, torch.Tensor):
            flat[prefix[:-1]] = value

    walk("", torch.load(out, weights_only=False))
    return flat


def _same_checkpoint(want_dir: Path, got_dir: Path) -> int:
    """Assert two checkpoints hold bitwise equal tensors, optimizer common state and train state; returns the
    number of tensors compared."""
    import torch

    want, got = _tensors(want_dir), _tensors(got_dir)
    assert want.keys() == got.keys(), sorted(want.keys() ^ got.keys())[:10]
    assert any(".fp8." in k and "amax_history" in k for k in want), "no FP8 state in the checkpoint"
    assert any("exp_avg_sq" in k for k in want) and any(k.startswith("optimizer.state.param") for k in want)
    fp8 = [v for k, v in want.items() if k.endswith("fp8.fwd.amax_history")]
    assert fp8 and all(float(h.abs().sum()) > 0 for h in fp8), "FP8 histories empty: the comparison proves little"
    differ = [k for k in want if want[k].dtype != got[k].dtype or not torch.equal(want[k], got[k])]
    assert not differ, f"{len(differ)} of {len(want)} tensors differ after resume, e.g. {differ[:5]}"
    common = [torch.load(d / "common.pt", weights_only=True) for d in (want_dir, got_dir)]
    assert common[0] == common[1], "optimizer param groups (lr, step) differ"
    meta = [cf.read_run_meta(d) for d in (want_dir, got_dir)]
    for key in ("iteration", "consumed_samples", "scheduler", "layout"):
        assert meta[0][key] == meta[1][key], (key, meta[0][key], meta[1][key])
    return len(want)


ITERS, HALF = 6, 3  # the exact-resume runs: ITERS uninterrupted; HALF, exit, resume to ITERS


EXIT_INTERVAL_LAYOUT = "tp2_sp"  # the layout whose interrupted run stops by --exit-interval (the others resume
                                 # from the uninterrupted run's --save-interval checkpoint: one launch fewer)


@HEAVY
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_job_exact_resume_bitwise(tmp_path, layout):
    """Train 6 iterations, saving at 3 (`--save-interval 3`); resume from the iteration-3 checkpoint (--load)
    to 6: the losses after the resume and every tensor of the final checkpoint (parameters, FP8 state,
    optimizer, RNG) equal the uninterrupted run bitwise. In the TP2 layout the interrupted run is a separate
    launch that stops itself by `--exit-interval 3` and saves there. (3 + 3 iterations: the resume comes after
    the 2 warmup iterations, and each launch costs seconds per iteration on 2 cores.)"""
    nproc, flags = LAYOUTS[layout]
    flags = _moe_default() if flags is None else flags
    seed = _seed() % 100_000 + 1
    print(f"layout {layout}, job seed {seed}")
    flags = flags + ["--seed", str(seed), "--train-iters", str(ITERS)]
    a, b = tmp_path / "a", tmp_path / "b"
    half = cf.checkpoint_name(HALF)
    _job(tmp_path, nproc, flags + ["--save", str(a), "--save-interval", str(HALF), "--log-json",
                                   str(tmp_path / "a.jsonl")], "uninterrupted run")
    assert cf.read_latest(a) == cf.checkpoint_name(ITERS) and (a / half / cf.MANIFEST).is_file()
    if layout == EXIT_INTERVAL_LAYOUT:
        out = _job(tmp_path, nproc, flags + ["--exit-interval", str(HALF), "--save", str(b), "--log-json",
                                             str(tmp_path / "b1.jsonl")], "run to the exit interval")
        assert f"exit interval: stopping after iteration {HALF}" in out, out[-5000:]
        assert cf.read_latest(b) == half and sorted(p.name for p in b.iterdir()) == [half, "latest", "logs"]
        first = _losses(tmp_path / "b1.jsonl")
    else:  # the uninterrupted run's iteration-3 checkpoint, alone in a directory of its own
        b.mkdir()
        shutil.copytree(a / half, b / half)
        cf.write_atomic(b / cf.LATEST, half + "\n")
        first = None
    out = _job(tmp_path, nproc, flags + ["--load", str(b), "--save", str(b), "--log-json", str(tmp_path / "b2.jsonl")],
               "resumed run")
    assert "resumed from" in out and f"at iteration {HALF} (sample" in out, out[-5000:]
    ref, resumed = _losses(tmp_path / "a.jsonl"), _losses(tmp_path / "b2.jsonl")
    assert sorted(ref) == list(range(1, ITERS + 1)), ref
    if first is not None:
        assert sorted(first) == list(range(1, HALF + 1)), first
        assert [first[i] for i in range(1, HALF + 1)] == [ref[i] for i in range(1, HALF + 1)], (first, ref)
    assert sorted(resumed) == list(range(HALF + 1, ITERS + 1)), resumed
    assert [resumed[i] for i in range(HALF + 1, ITERS + 1)] == [ref[i] for i in range(HALF + 1, ITERS + 1)], (
        resumed, ref)
    assert ref[ITERS] < ref[1], f"the loss did not fall: {ref}"
    n = _same_checkpoint(a / cf.checkpoint_name(ITERS), b / cf.checkpoint_name(ITERS))
    print(f"{layout}: losses {HALF + 1}..{ITERS} and {n} checkpoint tensors bitwise equal")


def _children(pid: int) -> List[int]:
    try:
        return [int(c) for t in Path(f"/proc/{pid}/task").iterdir() for c in (t / "children").read_text().split()]
    except OSError:
        return []


def _descendants(pid: int) -> List[int]:
    out = []
    for child in _children(pid):
        out += [child] + _descendants(child)
    return out


def _still_running(pids: Sequence[int]) -> List[int]:
    """Those of `pids` alive (not zombies) 15 s from now at the latest: whatever is left then."""
    deadline = time.time() + 15
    while True:
        alive = []
        for pid in pids:
            try:
                if Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z":
                    alive.append(pid)
            except OSError:
                pass
        if not alive or time.time() > deadline:
            return alive
        time.sleep(0.2)


def _kill_all(pids: Sequence[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _worker_ranks(agent_pid: int) -> Dict[int, int]:
    """The torchrun agent's worker processes (the job's ranks): {rank: pid}."""
    out = {}
    for pid in _children(agent_pid):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_text(errors="replace").replace("\0", " ")
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        rank = [int(e[5:]) for e in environ if e.startswith(b"RANK=")]
        if str(JOB) in cmdline and rank:
            out[rank[0]] = pid
    return out


@HEAVY
def test_job_restarts_after_a_rank_is_killed(tmp_path):
    """SIGKILL one rank mid-training under `torchrun --max-restarts=1` with --load equal to --save: torchrun
    restarts the job, which finds its latest complete checkpoint by itself, resumes there and finishes the
    planned iterations; iterations run twice give bitwise the same loss. Nothing the killed rank started
    (megatron's checkpoint-writer manager, its resource tracker) outlives it, and the output pipe closes when
    torchrun exits, as `torchrun ... | tee log` needs."""
    seed = _seed() % 100_000 + 1
    victim_rank = random.Random(seed).randrange(4)
    print(f"job seed {seed}: killing rank {victim_rank}")
    ck, log = tmp_path / "ck", tmp_path / "run.jsonl"
    flags = TINY + ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--seed", str(seed),
                    "--train-iters", "8", "--save-interval", "2", "--save", str(ck), "--load", str(ck),
                    "--load-optional", "--log-json", str(log)]
    proc = _start(tmp_path, 4, flags, restarts=1)
    deadline, killed, helpers = time.time() + TIMEOUT, None, []
    while time.time() < deadline and proc.poll() is None and killed is None:
        if log.exists() and 3 in _losses(log):  # iteration 2 is saved; training goes on
            workers = _worker_ranks(proc.pid)
            if victim_rank in workers:
                killed = workers[victim_rank]
                helpers = _descendants(killed)  # megatron's checkpoint writer's manager and resource tracker
                assert helpers, "the rank had started no helper processes: nothing to check"
                os.kill(killed, signal.SIGKILL)
        time.sleep(0.2)
    assert killed is not None, "never reached iteration 3 with 4 workers"
    out = _finish(proc, "job with a killed rank", helpers=helpers)
    assert "no complete checkpoint" in out, "the first attempt should have started fresh"
    resumed_at = [int(m) for m in re.findall(r"resumed from \S+ at iteration (\d+) ", out)]
    assert len(resumed_at) == 1 and resumed_at[0] >= 2 and resumed_at[0] % 2 == 0, (resumed_at, out[-5000:])
    rows = _rows(log)
    iterations = [r["iteration"] for r in rows]
    restart = next(i for i in range(1, len(iterations)) if iterations[i] <= iterations[i - 1])
    assert iterations[:restart] == list(range(1, restart + 1)), iterations
    assert iterations[restart:] == list(range(resumed_at[0] + 1, 9)), iterations
    twice = {r["iteration"]: r["loss"] for r in rows[:restart] if r["iteration"] > resumed_at[0]}
    again = {r["iteration"]: r["loss"] for r in rows[restart:] if r["iteration"] in twice}
    assert twice and again == twice, (twice, again)
    assert cf.read_latest(ck) == "iter_0000008" and cf.find_current(ck)[0] == ck / "iter_0000008"
    print(f"killed rank {victim_rank} (pid {killed}) after iteration {iterations[restart - 1]}; resumed at "
          f"{resumed_at[0]}; iterations {sorted(twice)} ran twice with equal losses")


def _one_line_error(out: str, *needles: str) -> str:
    """The job's single error line (one machine: one line), naming `needles`, and no traceback from the job."""
    lines = [line for line in out.splitlines() if line.startswith("pretrain_gpt.py: error:")]
    assert len(lines) == 1, f"expected one error line, got {lines}:\n{out[-5000:]}"
    for needle in needles:
        assert needle in lines[0], f"error does not name {needle!r}: {lines[0]}"
    job_frames = [line for line in out.splitlines() if line.strip().startswith('File "') and str(REPO) in line]
    assert not job_frames, f"a traceback from the job:\n{out[-5000:]}"
    return lines[0]


def test_checkpoint_errors_end_the_job_with_one_line(tmp_path):
    """Corrupt, truncated and other-shape checkpoints given to --load end the job with exit status 1 and one
    line naming the problem; the checkpoint is left unchanged. (A --save that cannot be written is refused
    at start: tests/test_job_trust.py.)"""
    flags = TINY + ["--tensor-model-parallel-size", "2", "--train-iters", "1"]
    good = tmp_path / "good"
    _job(tmp_path, 2, flags + ["--save", str(good)], "run that saves")
    before = {p.name: p.read_bytes() for p in (good / "iter_0000001").iterdir()}

    def damaged(name: str, damage) -> Path:
        d = tmp_path / name
        shutil.copytree(good, d)
        damage(sorted((d / "iter_0000001").glob("*.distcp"))[0])
        return d

    def flip(f: Path) -> None:
        data = bytearray(f.read_bytes())
        data[len(data) // 2] ^= 0xFF
        f.write_bytes(bytes(data))

    def truncate(f: Path) -> None:
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])

    cases = [
        ("corrupt", flags + ["--load", str(damaged("flipped", flip))], ["cannot load from", "is corrupt", ".distcp"]),
        ("truncated", flags + ["--load", str(damaged("cut", truncate))], ["truncated", ".distcp"]),
        ("other shape", flags + ["--load", str(good), "--hidden-size", "64"],
         ["another model shape", "hidden_size: checkpoint 32, this run 64"]),
    ]
    for what, argv, needles in cases:
        out = _job(tmp_path, 2, argv, what, expect_rc=1)
        print(f"{what}: {_one_line_error(out, *needles)}")
        assert "done:" not in out
    assert {p.name: p.read_bytes() for p in (good / "iter_0000001").iterdir()} == before, "a load changed the files"
