"""Shared helpers for GPU benchmarks: timing with CUDA events, bandwidth ceiling, result rows."""
from __future__ import annotations

import argparse
import json
import os
from typing import Callable, Dict, List

import torch

RESULTS: List[Dict] = []


def cli(doc: str, *flags: str, results: bool = True) -> argparse.Namespace:
    """A benchmark's command line: `--help` prints `doc` (its module docstring); `results` adds the optional
    positional JSONL path results are appended to; each `flags` entry ("--name: help") is a boolean switch."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    if results:
        parser.add_argument("results", nargs="?", default="bench_results.jsonl",
                            help="JSONL file the result rows are appended to (default: %(default)s)")
    for flag in flags:
        name, _, text = flag.partition(":")
        parser.add_argument(name, action="store_true", help=text.strip())
    return parser.parse_args()


def bench_ms(fn: Callable[[], object], warmup: int = 5, iters: int = 50, inner: int = 1) -> float:
    """Median milliseconds per call of `fn`, timed with CUDA events over `inner` back-to-back calls (so host
    launch overhead overlaps device work when the device is the bottleneck), after `warmup` calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / inner)
    times.sort()
    return times[len(times) // 2]


def graph_ms(fn: Callable[[], object], iters: int = 100) -> float:
    """Median milliseconds of one replay of `fn` captured in a CUDA graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return bench_ms(g.replay, warmup=5, iters=iters)


def copy_bandwidth_gbs(nbytes: int = 4 << 30) -> float:
    """Device-to-device copy bandwidth (bytes read + written), the memory ceiling of this run."""
    a = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    ms = bench_ms(lambda: b.copy_(a), iters=20)
    return 2 * a.numel() / (ms * 1e-3) / 1e9


def record(bench: str, case: str, metric: str, value: float, baseline: str = "", ratio: float = float("nan")) -> None:
    row = dict(bench=bench, case=case, metric=metric, value=value, baseline=baseline, ratio=ratio)
    RESULTS.append(row)
    print(f"{bench:14s} {case:34s} {metric:14s} {value:12.4f}  {baseline:24s} {ratio:8.3f}", flush=True)


def dump(path: str) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "a") as f:
        for row in RESULTS:
            f.write(json.dumps(row) + "\n")


def run_on_two_gpus(script: str, out: str, flag: str, timeout: float = 500) -> bool:
    """Start `script out flag` under torchrun with 2 ranks (NVLink multicast off); False without 2 GPUs."""
    import subprocess
    import sys

    if torch.cuda.device_count() < 2:
        return False
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", script, out, flag],
                   check=True, timeout=timeout, env=env)
    return True


def slowest_rank_ms(*times_ms: float) -> List[float]:
    """Each time as the slowest rank's (all-reduce MAX): a pipeline or TP step takes the slowest rank's time."""
    both = torch.tensor(times_ms, device="cuda")
    torch.distributed.all_reduce(both, op=torch.distributed.ReduceOp.MAX)
    return both.tolist()
