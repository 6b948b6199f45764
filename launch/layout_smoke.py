"""Smoke run of the parallel layout: start megatron's groups, print each rank's groups and amax domains,
and check one MAX all-reduce per domain.

    torchrun --nproc_per_node=4 launch/layout_smoke.py --tp 2 --pp 2
"""
from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

import parallel_state as ps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    for name in ("tp", "pp", "cp", "ep"):
        parser.add_argument(f"--{name}", type=int, default=1)
    parser.add_argument("--vpp", type=int, default=None)
    args = parser.parse_args()
    sizes = ps.initialize(tp=args.tp, pp=args.pp, vpp=args.vpp, cp=args.cp, ep=args.ep)
    rank = dist.get_rank()
    rows = [f"{dim}={ps.get_ranks(dim)}" for dim in ps.DIMENSIONS]
    domains = {"dense": ps.dense_amax_group(), "expert": ps.expert_amax_group()}
    for name, group in domains.items():
        rows.append(f"amax[{name}]={dist.get_process_group_ranks(group)}")
        value = torch.tensor([float(rank)])
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
        assert value.item() == max(dist.get_process_group_ranks(group)), (name, value)
    for r in range(dist.get_world_size()):
        if r == rank:
            print(f"rank {rank}: " + "  ".join(rows), flush=True)
        dist.barrier()
    if rank == 0:
        print(f"layout ok: {sizes.describe()}, dp={sizes.dp}, expert_dp={sizes.expert_dp}")
    ps.destroy()


if __name__ == "__main__":
    main()
