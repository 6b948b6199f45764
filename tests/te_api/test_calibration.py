"""TransformerEngine's calibration: `fp8_autocast(enabled=False, calibrating=True)` computes in high precision,
records the forward amaxes and updates the delayed-scaling scales at exit (also under no_grad), so that FP8
inference afterwards casts with calibrated scales (TE's MNIST example, `--use-fp8-infer`)."""
from __future__ import annotations

import warnings

import pytest
import torch

import fp8_parallel as te
from fp8_parallel import recipe
from te_testing import rel_error, seed_for

E4M3_MAX = 448.0


def _small_inputs(seed: int):
    gen = torch.Generator().manual_seed(seed)
    # far below E4M3's normal range at scale 1 (its smallest normal is 2**-6): only calibrated scales keep them
    return [torch.randn(16, 48, generator=gen) * 1e-3 for _ in range(3)]


def _linear(seed: int) -> te.Linear:
    torch.manual_seed(seed)
    return te.Linear(48, 24, params_dtype=torch.float32, device="cpu")


def test_calibration_computes_in_high_precision_and_sets_the_scales():
    seed = seed_for("calibration-scales")
    lin = _linear(seed)
    batches = _small_inputs(seed)
    with torch.no_grad():
        for x in batches:
            with te.fp8_autocast(enabled=False, calibrating=True):
                assert te.FP8GlobalStateManager.is_fp8_calibration() and not te.FP8GlobalStateManager.is_fp8_enabled()
                y = lin(x)
            assert torch.equal(y, torch.nn.functional.linear(x, lin.weight, lin.bias)), f"seed {seed}"
    assert not te.FP8GlobalStateManager.is_fp8_calibration()
    history = lin.fp8.fwd.amax_history  # [slots, history]: column 0 the last step
    amax_x, amax_w = max(x.abs().max() for x in batches), lin.weight.abs().max()
    # delayed scaling's default: the largest amax of the history, margin 0
    torch.testing.assert_close(history[0].max(), amax_x, rtol=0, atol=0, msg=f"seed {seed}")
    torch.testing.assert_close(history[1, 0], amax_w, rtol=0, atol=0, msg=f"seed {seed}")
    torch.testing.assert_close(lin.fp8.fwd.scale[:2], torch.stack([E4M3_MAX / amax_x, E4M3_MAX / amax_w]),
                               rtol=1e-6, atol=0, msg=f"seed {seed}")


def test_fp8_inference_after_calibration_is_accurate_and_without_it_is_not():
    seed = seed_for("calibration-inference")
    calibrated, fresh = _linear(seed), _linear(seed)
    batches = _small_inputs(seed)
    with torch.no_grad():
        for x in batches:
            with te.fp8_autocast(enabled=False, calibrating=True):
                calibrated(x)
        x = batches[0]
        want = torch.nn.functional.linear(x.double(), calibrated.weight.double(), calibrated.bias.double())
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # calibrated scales: no warning about casting with scale 1
            with te.fp8_autocast(enabled=True):
                got = calibrated(x)
        with pytest.warns(UserWarning, match="initial scale 1"), te.fp8_autocast(enabled=True):
            uncalibrated = fresh(x)
    err, err_fresh = rel_error(got, want), rel_error(uncalibrated, want)
    assert err < 0.08, f"calibrated FP8 inference {err:.3f} from float64 (seed {seed})"
    assert err_fresh > 0.2, f"the inputs are meant to need calibration: {err_fresh:.3f} (seed {seed})"


def test_calibrating_in_fp8_updates_the_scales_where_inference_does_not():
    seed = seed_for("calibration-fp8")
    lin, plain = _linear(seed), _linear(seed)
    x = _small_inputs(seed)[0]
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the first FP8 call casts with scale 1, and says so)
        with te.fp8_autocast(enabled=True, calibrating=True, fp8_recipe=recipe.DelayedScaling()):
            lin(x)
        with te.fp8_autocast(enabled=True, fp8_recipe=recipe.DelayedScaling()):
            plain(x)
    torch.testing.assert_close(lin.fp8.fwd.scale[0], E4M3_MAX / x.abs().max(), rtol=1e-6, atol=0)
    assert torch.equal(plain.fp8.fwd.scale[:2], torch.ones(2)), "FP8 inference alone updates no scale"


def test_calibration_with_current_scaling_records_nothing():
    seed = seed_for("calibration-current")
    lin = _linear(seed)
    x = _small_inputs(seed)[0]
    with torch.no_grad(), te.fp8_autocast(enabled=False, calibrating=True, fp8_recipe=recipe.Float8CurrentScaling()):
        y = lin(x)
    assert torch.equal(y, torch.nn.functional.linear(x, lin.weight, lin.bias))
    assert torch.equal(lin.fp8.fwd.amax_history, torch.zeros_like(lin.fp8.fwd.amax_history))
