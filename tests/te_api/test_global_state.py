"""`FP8GlobalStateManager`'s queries as TransformerEngine's: FP8 on or off, recipe and group of the innermost
enabled scope, the FP8 dtypes, and `reset` after a failure left scopes open."""
from __future__ import annotations

import torch

import fp8_parallel as te
from fp8_parallel import recipe, testing

M = te.FP8GlobalStateManager


def test_queries_follow_the_scope_stack():
    assert not M.is_fp8_enabled() and M.get_fp8_recipe() == te.get_default_recipe() and M.get_fp8_group() is None
    outer = recipe.DelayedScaling(margin=1)
    with te.autocast(enabled=True, recipe=outer):
        assert M.is_fp8_enabled() and M.get_fp8_recipe() == outer
        with te.autocast(enabled=False):
            assert not M.is_fp8_enabled() and M.get_fp8_recipe() == outer  # the enabled scope's recipe
        inner = recipe.Float8CurrentScaling()
        with te.autocast(enabled=True, recipe=inner):
            assert M.get_fp8_recipe() == inner
    assert not M.is_fp8_enabled()
    assert not M.is_fp8_calibration() and not M.with_fp8_parameters() and not M.fp8_graph_capturing()
    hybrid = recipe.DelayedScaling()
    assert M.get_fp8_torch_dtype(hybrid) is torch.float8_e4m3fn
    assert M.get_fp8_torch_dtype(hybrid, fprop_tensor=False) is torch.float8_e5m2
    assert bool(M.is_fp8_available()) == bool(te.is_fp8_available())


def test_reset_drops_scopes_left_open():
    scope = te.autocast(enabled=True)
    scope.__enter__()  # a test that failed inside a scope without leaving it
    assert M.is_fp8_enabled() and testing.active_scopes()
    M.reset()
    assert not M.is_fp8_enabled() and testing.active_scopes() == ()
