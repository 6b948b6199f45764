"""Reduce-and-update of N FP8 tensors: one batched update (eager and graph-captured) vs a per-module loop."""
from __future__ import annotations


import torch

import fp8_parallel as fp
from common import cli, bench_ms, dump, graph_ms, record
from fp8_parallel.amax_table import AmaxTable
from fp8_parallel.meta import FP8Meta

HISTORY = 1024


def per_module_loop(histories, scales, amaxes, fp8_max: float) -> None:
    """float8_experimental-style sync: for each tensor roll its history, take the max, compute the scale."""
    for hist, scale, amax in zip(histories, scales, amaxes):
        hist.copy_(torch.roll(hist, 1))
        hist[0] = amax
        new_amax = torch.max(hist)
        scale.copy_(fp8_max / torch.clamp(new_amax, min=1e-12))


def main(out_path: str) -> None:
    recipe = fp.DelayedScaling(amax_history_len=HISTORY)
    for n in (10, 100, 300, 1000):
        histories = [torch.zeros(HISTORY, device="cuda") for _ in range(n)]
        scales = [torch.ones((), device="cuda") for _ in range(n)]
        amaxes = [torch.rand((), device="cuda") for _ in range(n)]
        loop = bench_ms(lambda: per_module_loop(histories, scales, amaxes, 448.0), warmup=2, iters=10)
        record("amax_update", f"{n} tensors per-module loop", "ms", loop)
        metas = [FP8Meta(1, f"t{i}", history_len=HISTORY, device="cuda") for i in range(n)]
        table = AmaxTable("forward", torch.device("cuda"))
        for m in metas:
            table.slots(m).fill_(1.0)
        eager = bench_ms(lambda: table.reduce_and_update(recipe, None, 448.0, "bench"))
        record("amax_update", f"{n} tensors batched eager", "us", eager * 1e3, "per-module loop", loop / eager)
        graphed = graph_ms(lambda: table.reduce_and_update(recipe, None, 448.0, "bench"))
        record("amax_update", f"{n} tensors batched graph", "us", graphed * 1e3, "per-module loop", loop / graphed)
    dump(out_path)


if __name__ == "__main__":
    main(cli(__doc__).results)
