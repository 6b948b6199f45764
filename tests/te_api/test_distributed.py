"""`fp8_parallel.distributed`: TransformerEngine's `transformer_engine.pytorch.distributed` names (one process;
the all-gather on 2 gloo ranks is in tests/workers/te_tp_checks.py)."""
from __future__ import annotations

import pytest
import torch

import fp8_parallel as te
from fp8_parallel import distributed
from fp8_parallel import recipe
from te_testing import seed_for


def test_names_and_single_process_helpers():
    from fp8_parallel.distributed import checkpoint, gather_along_first_dim, get_distributed_world_size

    assert checkpoint is te.checkpoint and distributed.CudaRNGStatesTracker is te.CudaRNGStatesTracker
    assert get_distributed_world_size() == 1
    x = torch.randn(3, 4)
    out, handle = gather_along_first_dim(x, None)
    assert out is x and handle is None
    with pytest.raises(NotImplementedError, match="quantizer"):
        gather_along_first_dim(x, None, quantizer=object())
    with pytest.raises(TypeError, match="expected the root FullyShardedDataParallel module, got Linear"):
        distributed.prepare_te_modules_for_fsdp(te.Linear(4, 4, device="cpu"))


def test_recompute_queries_inside_a_checkpointed_region():
    seed = seed_for("recompute-queries")
    torch.manual_seed(seed)
    lin = te.Linear(16, 16, params_dtype=torch.float32, device="cpu")
    seen = []

    def body(t):
        seen.append((distributed.is_fp8_activation_recompute_enabled(), distributed.in_fp8_activation_recompute_phase()))
        return lin(t)

    x = torch.randn(4, 16, requires_grad=True)
    assert not distributed.is_fp8_activation_recompute_enabled() and not distributed.in_fp8_activation_recompute_phase()
    with te.fp8_autocast(enabled=True, fp8_recipe=recipe.DelayedScaling()):
        y = te.checkpoint(body, x)
        assert not distributed.is_fp8_activation_recompute_enabled()  # outside the region
    y.sum().backward()
    assert seen == [(True, False), (True, True)], (seen, f"seed {seed}")  # first pass, then the recompute
    seen.clear()
    y = te.checkpoint(body, x)  # no FP8 scope: recompute is not "FP8 activation recompute"
    y.sum().backward()
    assert seen == [(False, False), (False, True)], seen
