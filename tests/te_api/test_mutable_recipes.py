"""TransformerEngine's recipes are plain dataclasses that user code and TE's tests assign to
(`recipe.margin = 1`, `recipe.amax_compute_algo = ...`) and that take a custom `scaling_factor_compute_algo`.
Here: assignments between steps take effect at the next autocast entry, an assignment inside an open scope
does not change that scope, two settings never share one scope key, a refused value is named at entry, and a
custom scale rule sets the scales as TE's `(amax, scale, fp8_max, recipe)` call does. Each scale is checked
against a float64 reference computed from the module's own amax history.
"""
from __future__ import annotations

import pytest
import torch

import fp8_parallel as fp
from fp8_parallel import recipe, testing
from seeds import session_seed

FWD_MAX, BWD_MAX = 448.0, 57344.0  # HYBRID


def _layer(seed: int) -> fp.Linear:
    torch.manual_seed(seed)
    return fp.Linear(48, 32, params_dtype=torch.float32, device="cpu")  # (on a GPU machine it defaults to CUDA)


def _step(lin: fp.Linear, r: recipe.DelayedScaling, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(24, 48, generator=gen) * 3 + 0.5
    with fp.autocast(enabled=True, recipe=r):
        y = lin(x.requires_grad_())
    (y * torch.randn(y.shape, generator=gen)).sum().backward()


def _expected_scales(state, fmax: float, margin: int, algo: str) -> torch.Tensor:
    """float64 reference: fp8_max / amax / 2**margin, amax from the history by `algo`."""
    h = state.amax_history.double()
    amax = h.amax(dim=1) if algo == "max" else h[:, 0]
    return (fmax / amax / 2.0**margin).float()


def test_assigned_fields_apply_from_the_next_autocast_entry():
    seed = session_seed()
    print("seed", seed)
    lin = _layer(seed)
    r = recipe.DelayedScaling(amax_history_len=4)
    _step(lin, r, seed + 1)
    torch.testing.assert_close(lin.fp8.fwd.scale, _expected_scales(lin.fp8.fwd, FWD_MAX, 0, "max"), rtol=1e-6, atol=0)
    r.margin = 2
    r.amax_compute_algo = "most_recent"
    _step(lin, r, seed + 2)
    for state, fmax in ((lin.fp8.fwd, FWD_MAX), (lin.fp8.bwd, BWD_MAX)):
        assert (state.amax_history[:, :2] > 0).all()
        torch.testing.assert_close(state.scale, _expected_scales(state, fmax, 2, "most_recent"), rtol=1e-6, atol=0)


def test_an_assignment_inside_an_open_scope_does_not_change_that_scope():
    seed = session_seed()
    print("seed", seed)
    lin = _layer(seed)
    r = recipe.DelayedScaling(amax_history_len=4)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(24, 48, generator=gen).requires_grad_()
    with fp.autocast(enabled=True, recipe=r):
        y = lin(x)
        r.margin = 3  # this scope keeps margin 0: its key was taken at entry
        assert testing.current_key().recipe.margin == 0
    y.sum().backward()
    torch.testing.assert_close(lin.fp8.fwd.scale, _expected_scales(lin.fp8.fwd, FWD_MAX, 0, "max"), rtol=1e-6, atol=0)
    torch.testing.assert_close(lin.fp8.bwd.scale, _expected_scales(lin.fp8.bwd, BWD_MAX, 0, "max"), rtol=1e-6, atol=0)
    assert r.margin == 3


def test_one_recipe_object_with_two_settings_gives_two_scope_keys():
    r = recipe.DelayedScaling()
    with fp.autocast(enabled=True, recipe=r):
        outer = testing.current_key()
        r.margin = 1
        with fp.autocast(enabled=True, recipe=r):
            inner = testing.current_key()
        r.margin = 0
        with fp.autocast(enabled=True, recipe=r):
            again = testing.current_key()
    assert inner is not outer and inner.recipe.margin == 1
    assert again is outer  # the same settings share the key, as equal recipes always did


def test_snapshot_is_reused_while_nothing_changes():
    r = recipe.DelayedScaling()
    first = recipe.snapshot(r)
    assert recipe.snapshot(r) is first and first == r and first is not r
    r.amax_history_len = 16
    second = recipe.snapshot(r)
    assert second is not first and second.amax_history_len == 16 and first.amax_history_len == 1024
    rule = lambda h: h.max(dim=0).values  # noqa: E731
    r.amax_compute_algo = rule
    assert recipe.snapshot(r).amax_compute_algo is rule
    r.amax_compute_algo = lambda h: h.max(dim=0).values  # an equal-looking new rule is a new setting
    assert recipe.snapshot(r).amax_compute_algo is not rule


@pytest.mark.parametrize("field, value, error", [
    ("margin", -1, ValueError), ("amax_history_len", 0, ValueError), ("amax_compute_algo", "mean", ValueError),
    ("fp8_format", recipe.Format.E5M2, ValueError), ("scaling_factor_compute_algo", 2.0, ValueError),
    ("fp8_dpa", True, NotImplementedError),
])
def test_a_refused_assignment_is_named_at_autocast_entry(field, value, error):
    r = recipe.DelayedScaling()
    setattr(r, field, value)
    with pytest.raises(error, match=field):
        with fp.autocast(enabled=True, recipe=r):
            pass
    c = recipe.Float8CurrentScaling()
    c.eps = 0.0
    with pytest.raises(ValueError, match="eps=0.0"):
        fp.autocast(enabled=True, recipe=c)


def test_custom_scaling_factor_compute_algo_sets_the_scales():
    seed = session_seed()
    print("seed", seed)
    calls = []

    def quarter(amax, scale, fp8_max, rec):  # TE's call: reduced amaxes, current scales, the format's max, recipe
        calls.append((tuple(amax.shape), tuple(scale.shape), fp8_max, rec.margin))
        return fp8_max / amax / 4.0

    lin = _layer(seed)
    r = recipe.DelayedScaling(amax_history_len=4, margin=1, scaling_factor_compute_algo=quarter)
    for step in range(2):
        _step(lin, r, seed + step)
    for state, fmax in ((lin.fp8.fwd, FWD_MAX), (lin.fp8.bwd, BWD_MAX)):
        # the rule replaces fp8_max / amax / 2**margin: margin 1 would give a half, the rule gives a quarter
        torch.testing.assert_close(state.scale, _expected_scales(state, fmax, 2, "max"), rtol=1e-6, atol=0)
    assert {c[2] for c in calls} == {FWD_MAX, BWD_MAX} and all(c[0] == c[1] and c[3] == 1 for c in calls)


def test_custom_scale_rule_of_the_wrong_shape_is_named():
    lin = _layer(session_seed())
    r = recipe.DelayedScaling(scaling_factor_compute_algo=lambda amax, scale, fp8_max, rec: amax.sum())
    with pytest.raises(ValueError, match="scaling_factor_compute_algo.*one scale per tensor"):
        _step(lin, r, 1)
