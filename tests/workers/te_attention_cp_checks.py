"""Context parallelism of the TransformerEngine-style `DotProductAttention` (2 gloo ranks).

Every rank builds the same full query/key/value sequences (same seed), runs the module without `cp_group` on
the whole sequence as the reference, and the module with `cp_group` on its two load-balanced chunks (`r` and
`2 * cp - 1 - r` of `2 * cp`, TransformerEngine's and megatron's layout). Outputs and query/key/value gradients
of the local chunks must equal the reference's rows of those chunks (float64: to 1e-12).

Usage (under torchrun, 2 ranks): te_attention_cp_checks.py
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from rank_checks import run_checks, test_seed, exit_now

import fp8_parallel as te
from fp8_parallel.testing import chunk_indices

HEADS, GROUPS, DIM, SEQ, BATCH = 4, 2, 8, 12, 2
TOL = 1e-12


def _local(full: torch.Tensor, seq_dim: int) -> torch.Tensor:
    """This rank's two chunks of a full sequence, in the order it holds them."""
    cp, rank = dist.get_world_size(), dist.get_rank()
    chunks = full.chunk(2 * cp, dim=seq_dim)
    return torch.cat([chunks[i] for i in chunk_indices(cp, rank)], dim=seq_dim)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def check_cp2_matches_cp1():
    group = dist.group.WORLD
    for fmt in ("sbhd", "bshd"):
        seq_dim = 0 if fmt == "sbhd" else 1
        for mask_type in ("no_mask", "causal", "causal_bottom_right"):
            for ckpt in (False, True):
                gen = torch.Generator().manual_seed(test_seed() % 100_000)
                shape = (SEQ, BATCH) if fmt == "sbhd" else (BATCH, SEQ)
                q = torch.randn(*shape, HEADS, DIM, generator=gen, dtype=torch.float64)
                k = torch.randn(*shape, GROUPS, DIM, generator=gen, dtype=torch.float64)
                v = torch.randn(*shape, GROUPS, DIM, generator=gen, dtype=torch.float64)
                grad = torch.randn(*shape, HEADS * DIM, generator=gen, dtype=torch.float64)
                full = te.DotProductAttention(HEADS, DIM, num_gqa_groups=GROUPS, qkv_format=fmt,
                                              attn_mask_type=mask_type)
                xs = [t.clone().requires_grad_() for t in (q, k, v)]
                ref = full(*xs)
                ref.backward(grad)
                cp = te.DotProductAttention(HEADS, DIM, num_gqa_groups=GROUPS, qkv_format=fmt, attn_mask_type=mask_type,
                                            cp_group=group, cp_global_ranks=[0, 1], cp_comm_type="p2p")
                ls = [_local(t, seq_dim).requires_grad_() for t in (q, k, v)]
                out = cp(*ls, checkpoint_core_attention=ckpt)
                out.backward(_local(grad, seq_dim))
                where = f"{fmt}/{mask_type}/ckpt={ckpt}"
                assert out.shape == _local(ref, seq_dim).shape, where
                assert _rel(out, _local(ref.detach(), seq_dim)) < TOL, where
                for x, lx, name in zip(xs, ls, "qkv"):
                    assert _rel(lx.grad, _local(x.grad, seq_dim)) < TOL, (where, name)


def check_cp_refusals():
    group = dist.group.WORLD
    q = torch.randn(4, BATCH, HEADS, DIM)
    k = torch.randn(4, BATCH, GROUPS, DIM)
    for kwargs in ({"attn_mask_type": "padding", "attention_mask": torch.zeros(BATCH, 1, 1, 4, dtype=torch.bool)},
                   {"attn_mask_type": "arbitrary", "attention_mask": torch.zeros(1, 1, 4, 4, dtype=torch.bool)},
                   {"attn_mask_type": "causal", "window_size": (1, 0)}):
        cp = te.DotProductAttention(HEADS, DIM, num_gqa_groups=GROUPS, cp_group=group, cp_comm_type="all_gather")
        with pytest.raises(NotImplementedError, match="cp_group"):
            cp(q, k, k, **kwargs)
    cp = te.DotProductAttention(HEADS, DIM, num_gqa_groups=GROUPS, qkv_format="thd", attn_mask_type="padding",
                                cp_group=group)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(NotImplementedError, match="cp_group"):
        cp(q[:, 0], k[:, 0], k[:, 0], cu_seqlens_q=cu, cu_seqlens_kv=cu)


if __name__ == "__main__":
    dist.init_process_group("gloo")
    print(f"seed {test_seed()}", flush=True)
    run_checks([
        ("cp2_matches_cp1", check_cp2_matches_cp1),
        ("cp_refusals", check_cp_refusals),
    ])
    dist.destroy_process_group()
    exit_now()  # skip finalization: see exit_now
