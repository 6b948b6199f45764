"""GPU half of the differential suite (run by benchmarks/run_gpu.sh): `fp8_parallel.Linear` on CUDA against
float64 and its own high-precision path, for every parameter dtype (float32 / float16 / bfloat16) x delayed and
current scaling x sizes aligned and unaligned for the FP8 GEMM (torch._scaled_mm needs multiples of 16) x call
patterns; the Triton cast kernels run on this path. Tolerances: tests/workers/differential_common.py.
"""
from __future__ import annotations

import pytest
import torch

from differential_common import HP_TOL, assert_within, fails_within, weight_scale_inv_off
from test_differential import RECIPES, _linear, _make_input, _reference, _seed, _step

pytestmark = pytest.mark.gpu

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# in, out, tokens: aligned for scaled_mm; unaligned everywhere; a float32 shape that once gave NaN weight grads
SIZES = {"aligned": (256, 128, 192), "unaligned": (30, 50, 21), "odd_tokens": (64, 64, 64), "mixed": (48, 80, 37)}
VARIANTS = ["plain", "frozen", "no_grad_inside", "checkpoint_reentrant", "checkpoint_nonreentrant", "twice",
            "noncontiguous", "transposed", "batched_3d"]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("size", list(SIZES))
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("recipe_name", list(RECIPES))
def test_cuda_linear_matches_float64_and_its_high_precision_path(recipe_name, dtype, size, variant):
    seed = _seed()
    gen = torch.Generator().manual_seed(seed)
    k, n, tokens = SIZES[size]
    pdtype, recipe = DTYPES[dtype], RECIPES[recipe_name]()
    lin = _linear(k, n, pdtype, gen, device="cuda")
    if variant == "frozen":
        lin.weight.requires_grad_(False)
    for step in range(3):
        x = _make_input(gen, tokens, k, variant, pdtype, device="cuda")
        x2 = _make_input(gen, tokens, k, "plain", pdtype, device="cuda") if variant == "twice" else None
        dy = torch.randn(x.shape[:-1] + (n,), generator=gen).cuda()
        probe = x.detach() * 0.5 if variant == "no_grad_inside" else None
        ref = _reference(x, lin.weight, lin.bias, dy, x2)
        if variant == "frozen":
            del ref["weight grad"]
        got = _step(lin, x, dy, recipe, variant, x2=x2, probe=probe)
        assert got["output"].is_contiguous()
        errs = assert_within(got, ref, f"cuda {recipe_name} {dtype} {size} {variant} step {step} (seed {seed})")
        assert errs["output"] > 3e-3, f"no FP8 rounding in the output ({errs}): the FP8 path did not run"
        xh = x.detach().clone().requires_grad_()
        x2h = x2.detach().clone().requires_grad_() if x2 is not None else None
        hp = _step(lin, xh, dy, recipe, "twice" if x2 is not None else "plain", enabled=False, x2=x2h)
        # (float32 matmuls may use TF32 on the device: allow its 10-bit mantissa)
        tol = 2e-3 if pdtype == torch.float32 else HP_TOL[pdtype]
        assert_within(hp, ref, f"cuda high-precision path {dtype} step {step}", tol, tol)
        if recipe_name == "delayed":
            assert (lin.fp8.fwd.amax_history[:, 0] > 0).all() and (lin.fp8.bwd.amax_history[:, 0] > 0).all()
            assert torch.isfinite(lin.fp8.fwd.scale).all() and torch.isfinite(lin.fp8.bwd.scale).all()


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_cuda_negative_control_fails_the_same_comparison(dtype):
    seed = _seed()
    gen = torch.Generator().manual_seed(seed)
    k, n, tokens = SIZES["aligned"]
    lin = _linear(k, n, DTYPES[dtype], gen, device="cuda")
    recipe = RECIPES["delayed"]()
    for _ in range(2):
        x = _make_input(gen, tokens, k, "plain", DTYPES[dtype], device="cuda")
        dy = torch.randn(tokens, n, generator=gen).cuda()
        ref = _reference(x, lin.weight, lin.bias, dy)
        assert not fails_within(_step(lin, x, dy, recipe, "plain"), ref)
        with weight_scale_inv_off(1.125):
            bad = _step(lin, x.detach().clone().requires_grad_(), dy, recipe, "plain")
        assert fails_within(bad, ref), "a weight scale_inv off by one E4M3 step passed the comparison"
