"""Where the caching allocator's reserve comes from: which call sites made the segments of the ordinary pool that
sit partly unused. Needs `torch.cuda.memory._record_memory_history()` running while the segments are made."""
from __future__ import annotations

import os
from typing import Dict, List

import torch

_OWN_FRAMES = ("fp8_parallel", "megatron", "launch", "bench_e2e")


def start_recording(max_entries: int = 500_000) -> None:
    """Record every allocator event with its Python stack from now on."""
    torch.cuda.memory._record_memory_history(max_entries=max_entries, stacks="python")


def stop_recording() -> None:
    torch.cuda.memory._record_memory_history(enabled=None)


def _site(frames: List[dict], depth: int = 3) -> str:
    """The innermost `depth` frames from this project, megatron or the benchmark (torch's own are skipped)."""
    own = [f for f in frames if any(k in f.get("filename", "") for k in _OWN_FRAMES)]
    picked = own[:depth] or frames[:depth]
    return " < ".join(f"{os.path.basename(f['filename'])}:{f['line']} {f['name']}" for f in picked) or "?"


def segment_report(when: str, rows: int = 12) -> None:
    """Print the ordinary pool's segments grouped by the call site whose allocation made them: how many bytes
    each site's segments hold and how many of those are free now (the cached reserve)."""
    snap = torch.cuda.memory._snapshot()
    made_by: Dict[int, str] = {}
    for trace in snap.get("device_traces", []):
        for e in trace:
            if e.get("action") == "segment_alloc":
                made_by[e["addr"]] = _site(e.get("frames", []))
    sites: Dict[str, List[float]] = {}
    for seg in snap["segments"]:
        if tuple(seg.get("segment_pool_id", (0, 0))) != (0, 0):
            continue
        site = made_by.get(seg["address"], "made before recording")
        entry = sites.setdefault(site, [0, 0.0, 0.0, 0.0])
        entry[0] += 1
        entry[1] += seg["total_size"] / 2**30
        entry[2] += (seg["total_size"] - seg["allocated_size"]) / 2**30
        free_blocks = [b["size"] for b in seg["blocks"] if b["state"] == "inactive"]
        entry[3] = max(entry[3], max(free_blocks, default=0) / 2**30)
    total_free = sum(v[2] for v in sites.values())
    print(f"---- ordinary pool {when}: {sum(v[1] for v in sites.values()):.2f} GiB reserved, {total_free:.2f} GiB "
          f"free, by the call site that made each segment", flush=True)
    print(f"{'segments':>8s} {'GiB':>7s} {'free GiB':>8s} {'largest free':>12s}  site")
    for site, (count, total, free, largest) in sorted(sites.items(), key=lambda kv: -kv[1][2])[:rows]:
        print(f"{count:8d} {total:7.2f} {free:8.2f} {largest:12.3f}  {site}")
