"""Run the GPU tests as several pytest processes at once and print one summary.

    python3 benchmarks/gpu_test_shards.py [--shards-per-gpu 3] [--timeout 540] [--junit-dir DIR] [pytest -k expr]

Single-GPU tests are spread round-robin over ``shards-per-gpu`` processes per visible GPU, each process seeing one
GPU; each test that needs several GPUs (it launches torchrun itself) runs in a process of its own that sees them
all. A shard that runs past ``--timeout`` is stopped and reported with the tests it had finished.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MULTI_GPU_FILES = ("test_gpu_job_layouts.py", "test_layout_agreement.py", "test_parallel_state_gpu.py",
                   "test_pretrain_gpt.py")
MULTI_GPU_TESTS = ("two_gpus", "test_pp2_schedule_replays_graphs_on_both_ranks")


def _collect(k_expr: str | None) -> list[str]:
    cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "gpu", "-n", "0", "tests",
           "-p", "no:cacheprovider"]
    if k_expr:
        cmd += ["-k", k_expr]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True).stdout
    return [line.strip() for line in out.splitlines() if "::" in line]


def _needs_several_gpus(node_id: str) -> bool:
    return node_id.split("::")[0].endswith(MULTI_GPU_FILES) or any(m in node_id for m in MULTI_GPU_TESTS)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards-per-gpu", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=540.0)
    parser.add_argument("--junit-dir", default=None)
    parser.add_argument("-k", dest="k_expr", default=None)
    args = parser.parse_args()

    import torch

    gpus = torch.cuda.device_count()
    if gpus == 0:
        print("no CUDA GPU visible: nothing to run")
        return 1
    ids = _collect(args.k_expr)
    single = [i for i in ids if not _needs_several_gpus(i)]
    multi = [i for i in ids if _needs_several_gpus(i)]
    n_single = max(1, gpus * args.shards_per_gpu)
    shards: list[tuple[str | None, list[str]]] = [(str(s % gpus), single[s::n_single]) for s in range(n_single)]
    if gpus >= 2 and multi:
        shards += [(None, [test]) for test in multi]
    print(f"{len(ids)} GPU tests on {gpus} GPU(s): {len(single)} single-GPU in {n_single} shards, "
          f"{len(multi)} multi-GPU" + ("" if gpus >= 2 else " (skipped: one GPU)"), flush=True)

    junit_dir = Path(args.junit_dir or REPO / "gpu_junit")
    junit_dir.mkdir(parents=True, exist_ok=True)
    procs = []
    for n, (device, tests) in enumerate(shards):
        if not tests:
            continue
        env = dict(os.environ)
        if device is not None:
            env["CUDA_VISIBLE_DEVICES"] = device
        log = open(junit_dir / f"shard{n}.log", "w")
        # -n 0: this script shards the tests itself (pytest.ini adds xdist workers by default)
        cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-n", "0", "-v", "-rA", "--tb=short",
               "-p", "no:cacheprovider", f"--junitxml={junit_dir / f'shard{n}.xml'}", *tests]
        procs.append((n, subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    deadline = time.monotonic() + args.timeout
    for n, proc, log in procs:
        try:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            print(f"shard {n}: stopped after {args.timeout:.0f} s; its last lines:", flush=True)
            log.flush()
            print("\n".join((junit_dir / f"shard{n}.log").read_text(errors="replace").splitlines()[-4:]))
        log.close()
    return _summarise(junit_dir, [n for n, _, _ in procs], [p.returncode for _, p, _ in procs])


def _summarise(junit_dir: Path, shard_numbers: list[int], codes: list[int]) -> int:
    counts = {"PASSED": 0, "FAILED": 0, "ERROR": 0, "SKIPPED": 0}
    for n in shard_numbers:
        text = (junit_dir / f"shard{n}.log").read_text(errors="replace")
        seen = dict.fromkeys(counts, 0)  # from the per-test lines, for a shard stopped before its summary
        for line in text.splitlines():
            word = line.split(" ", 1)[0]
            if word in counts:
                seen[word] += 1
                if word != "PASSED":
                    print(line[:400])
        for block in _failure_blocks(text):
            print(block[:4000])
        tail = [line for line in text.splitlines() if " in " in line and ("passed" in line or "failed" in line)]
        if tail:  # pytest's own totals (one SKIPPED line can stand for several tests)
            seen = dict.fromkeys(counts, 0)
            for number, word in re.findall(r"(\d+) (passed|failed|errors?|skipped)", tail[-1]):
                seen[{"errors": "ERROR", "error": "ERROR"}.get(word, word.upper())] += int(number)
        for key in counts:
            counts[key] += seen[key]
        print(f"shard {n}: exit {codes[shard_numbers.index(n)]}: {tail[-1] if tail else 'no summary (stopped?)'}")
    print("total: " + ", ".join(f"{v} {k.lower()}" for k, v in counts.items()), flush=True)
    return 0 if counts["FAILED"] == counts["ERROR"] == 0 and all(c == 0 for c in codes) else 1


def _failure_blocks(log: str) -> list[str]:
    """The traceback sections pytest printed for failed tests (between its `____ name ____` headers)."""
    lines = log.splitlines()
    first = next((i for i, line in enumerate(lines) if line.startswith("=") and " FAILURES " in line), None)
    if first is None:
        return []
    last = next((i for i in range(first + 1, len(lines)) if lines[i].startswith("====")), len(lines))
    lines = lines[first + 1 : last]
    starts = [i for i, line in enumerate(lines) if re.fullmatch(r"_+ \S.* _+", line.rstrip())]
    blocks = []
    for i in starts:
        end = min([j for j in starts if j > i] or [len(lines)])
        blocks.append("\n".join(lines[i:end]))
    return blocks


if __name__ == "__main__":
    sys.exit(main())
