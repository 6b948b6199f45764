"""Shared pieces of the differential suite: error measure, FP8 tolerances, and deliberate bugs for negative controls.

Tolerances, from FP8's precision (norm-wise relative error ||got - ref|| / ||ref||):

* E4M3 has 3 mantissa bits: round-to-nearest moves a value by at most 2**-4 of its binade and, for values
  spread over a binade, by about 2.4% RMS (2.65% measured on Gaussian data). A forward GEMM quantizes two
  operands: ~3.4-3.75% RMS on the output.
* E5M2 (gradients, HYBRID format) has 2 mantissa bits: about 4.8% RMS per cast (5.3% on Gaussian data).
  dgrad = E5M2 x E4M3 and wgrad = E5M2 x E4M3: ~5.5-5.9% RMS.
* The reduction size K does not change these values: for random-signed operands both the rounding errors and
  the products add up in quadrature over K. K and the number of outputs set how much the measured error
  spreads around them (measured worst of 3000 single linears, 20 outputs per token: one-GEMM gradients 0.14
  at 1 token, 0.099 at 2, 0.090 at 4, 0.075 at 13: the bound below holds from 2 tokens per GEMM on).
* So: outputs < 0.08, gradients of one GEMM < 0.12 (about twice the expected noise, so a normal run does not
  flake). Gradients that pass a second E5M2 cast (fc1's in an MLP: grad_output of fc2, then of fc1, through
  gelu') compound: sqrt(2 x 5.3^2 + 2 x 2.7^2) = 8.4%, plus gelu' taken at the FP8 forward's pre-activation,
  which its FP8 error moves where gelu' changes fastest (|h| < 2): about 9% measured with weights of std
  1/sqrt(fan_in) (up to 0.15; 12% and up to 0.25 with std 1, whose pre-activations are ~10x larger): < 0.25.
* These hold without saturation: delayed scaling on fresh random data per step uses margin 2 here (see
  RECIPES in differential_checks.py), else a step whose amax outgrows the history's clips its largest values.
* A transformer block against its own high-precision path (residual-dominated output, per-weight gradients
  measured <= 0.11): < 0.15 / 0.20.

These bounds are tight enough to catch the bugs of the class: a scale_inv off by one E4M3 step (12.5%), a
scale off by 2x (100%), a dropped tensor-parallel sum (>= 50%) all fail them; the negative controls in the
suite apply such bugs on purpose and require the same comparison to fail.
"""
from __future__ import annotations

import contextlib
from typing import Dict, Iterator, Mapping

import torch

OUT_TOL = 0.08
GRAD_TOL = 0.12
LAYER_OUT_TOL = 0.15
LAYER_GRAD_TOL = 0.20
CHAIN_GRAD_TOL = 0.25
# the high-precision path (scope disabled) against float64: the parameter dtype's own rounding
HP_TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 3e-3}


def rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    """Norm-wise relative error in float64 (NaN/inf in `got` give inf)."""
    got, ref = got.detach().double(), ref.detach().double()
    if not torch.isfinite(got).all():
        return float("inf")
    return ((got - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def errors(got: Mapping[str, torch.Tensor], ref: Mapping[str, torch.Tensor]) -> Dict[str, float]:
    """Relative error of every entry of `got` against `ref` (same keys)."""
    missing = set(got) ^ set(ref)
    assert not missing, f"compared different tensors: {sorted(missing)}"
    return {k: rel(got[k], ref[k]) for k in got}


def assert_within(got: Mapping[str, torch.Tensor], ref: Mapping[str, torch.Tensor], what: str,
                  out_tol: float = OUT_TOL, grad_tol: float = GRAD_TOL) -> Dict[str, float]:
    """Every entry within its tolerance ("output*" keys: `out_tol`, others `grad_tol`); the message lists all."""
    errs = errors(got, ref)
    bad = {k: e for k, e in errs.items() if e >= (out_tol if k.startswith("output") else grad_tol)}
    assert not bad, f"{what}: off the reference {bad} (all: {errs}; tolerances out {out_tol}, grad {grad_tol})"
    return errs


def fails_within(got, ref, out_tol: float = OUT_TOL, grad_tol: float = GRAD_TOL) -> bool:
    """True when `assert_within` would fail (for negative controls)."""
    try:
        assert_within(got, ref, "negative control", out_tol, grad_tol)
    except AssertionError:
        return True
    return False


@contextlib.contextmanager
def weight_scale_inv_off(factor: float) -> Iterator[None]:
    """A deliberate bug: every FP8 weight cast carries `scale_inv * factor` (its dequantized value is off by
    `factor`), as a scale bookkeeping error would. The bug is planted in the Python path's cast, so the compiled
    host path (`fp8_parallel.native`, which casts in C++) is off meanwhile."""
    from fp8_parallel import native
    from fp8_parallel.testing import casts_wrapped

    previous = native.use(None)

    def buggy(cast, x, recipe, scale, slot, fp8_dtype, out=None, with_transpose=False, noop_flag=None):
        q = cast(x, recipe, scale, slot, fp8_dtype, out, with_transpose, noop_flag)
        if with_transpose or (isinstance(x, torch.nn.Parameter)):
            q._scale_inv = q._scale_inv * factor
        return q

    try:
        with casts_wrapped(buggy):
            yield
    finally:
        native.use(previous)
