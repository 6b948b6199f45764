"""Differential suite: FP8 modules against a float64 reference (within FP8 tolerance, see
workers/differential_common.py) and against their own high-precision path (scope disabled).

Single process: `fp8_parallel.Linear` over recipes x sizes x parameter dtypes x call patterns (frozen weight,
no_grad calls between and inside training calls, torch checkpoint reentrant / non-reentrant, a module called
twice in one scope, non-contiguous and transposed inputs, graphed). Multi-rank (gloo, torchrun): tensor
parallel linears, LayerNormColumnParallelLinear, grouped experts, a megatron TransformerBlock of our spec
(workers/differential_checks.py). Negative controls apply deliberate bugs and require the same comparison
to fail.
"""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import fp8_parallel as fp
from differential_common import HP_TOL, assert_within, errors, fails_within, weight_scale_inv_off
from launcher import launch
from seeds import session_seed

HEAVY = pytest.mark.xdist_group("heavy")  # 4+ torchrun ranks: one at a time (--dist loadgroup)

RECIPES = {"delayed": lambda: fp.DelayedScaling(amax_history_len=4), "current": lambda: fp.CurrentScaling()}
SIZES = {"aligned": (64, 128, 32), "unaligned": (30, 50, 21)}  # in, out, tokens
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
VARIANTS = ["plain", "frozen", "no_grad_between", "no_grad_inside", "checkpoint_reentrant",
            "checkpoint_nonreentrant", "twice", "noncontiguous", "transposed", "batched_3d", "graphed"]
STEPS = 3


def _seed() -> int:
    seed = session_seed()
    print(f"seed {seed} (FP8P_TEST_SEED={seed} reproduces)")
    return seed


def _make_input(gen, tokens: int, k: int, variant: str, dtype: torch.dtype, device: str = "cpu") -> torch.Tensor:
    """A fresh random input with the variant's layout (values ~N(0, 2^2)), drawn on the CPU from `gen`."""
    if variant == "noncontiguous":
        x = (torch.randn(tokens, 2 * k, generator=gen) * 2).to(dtype)[:, ::2]
        assert not x.is_contiguous()
    elif variant == "transposed":
        x = (torch.randn(k, tokens, generator=gen) * 2).to(dtype).t()
        assert not x.is_contiguous()
    elif variant == "batched_3d":
        x = (torch.randn(3, tokens, k, generator=gen) * 2).to(dtype).transpose(0, 1)  # [s, b, h], strided
    else:
        x = (torch.randn(tokens, k, generator=gen) * 2).to(dtype)
    if device != "cpu":  # the same layout on the device
        x = torch.empty_strided(x.shape, x.stride(), dtype=dtype, device=device).copy_(x)
    return x.requires_grad_()


def _linear(k: int, n: int, dtype: torch.dtype, gen, device: str = "cpu") -> fp.Linear:
    lin = fp.Linear(k, n, params_dtype=dtype, device=device)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=gen) / k**0.5)
        lin.bias.copy_(torch.randn(n, generator=gen))
    return lin


def _reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, dy: torch.Tensor, twice_x=None):
    """float64 forward and backward of `x @ w.T + b` (and `+ x2 @ w.T + b` for a module called twice)."""
    x64 = x.detach().double().requires_grad_()
    w64, b64 = w.detach().double().requires_grad_(), b.detach().double().requires_grad_()
    y = F.linear(x64, w64, b64)
    x2 = None
    if twice_x is not None:
        x2 = twice_x.detach().double().requires_grad_()
        y = y + F.linear(x2, w64, b64)
    y.backward(dy.to(x64))
    out = {"output": y, "input grad": x64.grad, "weight grad": w64.grad, "bias grad": b64.grad}
    if x2 is not None:
        out["input2 grad"] = x2.grad
    return out


def _step(lin, x, dy, recipe, variant: str, enabled: bool = True, x2=None, probe=None):
    """One training step of `lin` on `x` in the variant's call pattern; returns output and gradients."""
    for p in lin.parameters():
        p.grad = None
    with fp.autocast(enabled=enabled, recipe=recipe):
        if variant == "checkpoint_reentrant":
            y = checkpoint(lin, x, use_reentrant=True)
        elif variant == "checkpoint_nonreentrant":
            y = checkpoint(lin, x, use_reentrant=False)
        elif variant == "twice":
            y = lin(x) + lin(x2)
        else:
            y = lin(x)
        if variant == "no_grad_inside":
            with torch.no_grad():  # a logging probe inside the training scope (smaller values: same amaxes)
                lin(probe)
    y.backward(dy.to(device=y.device, dtype=y.dtype))
    got = {"output": y.detach(), "input grad": x.grad, "bias grad": lin.bias.grad}
    if lin.weight.requires_grad:
        got["weight grad"] = lin.weight.grad
    if x2 is not None:
        got["input2 grad"] = x2.grad
    return got


# every recipe x size x dtype plainly; every call pattern at float32 (unaligned) and a few at bfloat16 (aligned)
CASES = (
    [(r, size, dt, "plain") for r in RECIPES for size in SIZES for dt in DTYPES]
    + [(r, "unaligned", "float32", v) for r in RECIPES for v in VARIANTS if v != "plain"]
    + [(r, "aligned", "bfloat16", v) for r in RECIPES
       for v in ("frozen", "no_grad_inside", "checkpoint_nonreentrant", "transposed")]
)


@pytest.mark.parametrize("recipe_name,size,dtype,variant", CASES)
def test_linear_matches_float64_and_its_high_precision_path(recipe_name, size, dtype, variant):
    seed = _seed()
    gen = torch.Generator().manual_seed(seed)
    k, n, tokens = SIZES[size]
    pdtype = DTYPES[dtype]
    recipe = RECIPES[recipe_name]()
    lin = _linear(k, n, pdtype, gen)
    twin = _linear(k, n, pdtype, torch.Generator().manual_seed(0))  # the same module without the variant
    twin.load_state_dict(lin.state_dict())
    if variant == "frozen":
        lin.weight.requires_grad_(False)
    module = lin
    if variant == "graphed":
        sample = (torch.randn(tokens, k, dtype=pdtype, requires_grad=True),)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # on CPU the callable runs eagerly, with one warning
            module = fp.make_graphed_callables(lin, sample, fp8_enabled=True, fp8_recipe=recipe)
        twin.load_state_dict(lin.state_dict())  # warm-up updated the FP8 state: start the twin from it
    for step in range(STEPS):
        x = _make_input(gen, tokens, k, variant, pdtype)
        x2 = _make_input(gen, tokens, k, "plain", pdtype) if variant == "twice" else None
        dy = torch.randn(x.shape[:-1] + (n,), generator=gen)
        probe = (x.detach() * 0.5) if variant == "no_grad_inside" else None
        ref = _reference(x, lin.weight, lin.bias, dy, x2)
        if "weight grad" in ref and variant == "frozen":
            del ref["weight grad"]
        got = _step(module, x, dy, recipe, variant, x2=x2, probe=probe)
        assert got["output"].is_contiguous(), "the FP8 linear returned a strided output"
        errs = assert_within(got, ref, f"{recipe_name} {size} {dtype} {variant} step {step} (seed {seed})")
        assert errs["output"] > 3e-3, f"no FP8 rounding in the output ({errs}): the FP8 path did not run"
        # the module's own high-precision path (scope disabled) is the float64 result in the parameter dtype
        xh = x.detach().clone().requires_grad_()
        x2h = x2.detach().clone().requires_grad_() if x2 is not None else None
        hp = _step(lin, xh, dy, recipe, "twice" if x2 is not None else "plain", enabled=False, x2=x2h)
        hp_errs = assert_within(hp, ref, f"high-precision path {dtype} step {step}", HP_TOL[pdtype], HP_TOL[pdtype])
        print(f"step {step}: fp8 {errs}  hp {hp_errs}")
        # FP8 state: forward amaxes of this step are the inputs' and the weight's; backward history updated
        if recipe_name == "delayed":
            fwd, bwd = lin.fp8.fwd.amax_history[:, 0], lin.fp8.bwd.amax_history[:, 0]
            xs = [x] + ([x2] if x2 is not None else [])
            assert fwd[0].item() == max(t.detach().abs().max().float().item() for t in xs), (step, fwd)
            assert fwd[1].item() == lin.weight.detach().abs().max().float().item(), (step, fwd)
            assert bwd[0].item() == dy.to(got["output"].dtype).abs().max().float().item(), (step, bwd)
            assert (lin.fp8.bwd.amax_history[:, 0] > 0).all(), f"step {step}: backward history not updated"
        # the twin (plain calls, no variant) sees the same steps: variants must not change the results
        if variant in ("no_grad_between", "no_grad_inside", "checkpoint_reentrant", "checkpoint_nonreentrant"):
            xt = x.detach().clone().requires_grad_()
            plain = _step(twin, xt, dy, recipe, "plain")
            for key, t in plain.items():
                assert torch.equal(got[key], t), f"{variant} step {step}: {key} differs from the plain module"
            for a, b in zip(lin.fp8.state_dict().values(), twin.fp8.state_dict().values()):
                assert torch.equal(a, b), f"{variant} step {step}: FP8 state differs from the plain module"
        if variant == "no_grad_between":  # an inference call in its own scope between training steps
            with torch.no_grad(), fp.autocast(recipe=recipe):
                lin(_make_input(gen, tokens, k, "plain", pdtype) * 10)


@pytest.mark.parametrize("recipe_name", list(RECIPES))
def test_negative_controls_fail_the_same_comparison(recipe_name):
    """Deliberate bugs (a weight scale_inv off by one E4M3 step, or by 2x) fail the comparison used above;
    without them the same data passes."""
    seed = _seed()
    gen = torch.Generator().manual_seed(seed)
    k, n, tokens = SIZES["unaligned"]
    recipe = RECIPES[recipe_name]()
    lin = _linear(k, n, torch.float32, gen)
    for step in range(2):
        # inputs bounded at 3 sigma: under delayed scaling a step whose amax far exceeds the history saturates
        # (seed 3061070732: amax 10.4 after 6.2, output error 8.6% without any bug), which this test is not about
        x = _make_input(gen, tokens, k, "plain", torch.float32).detach().clamp(-6.0, 6.0).requires_grad_()
        dy = torch.randn(tokens, n, generator=gen)
        ref = _reference(x, lin.weight, lin.bias, dy)
        good = _step(lin, x, dy, recipe, "plain")
        assert not fails_within(good, ref), errors(good, ref)
        for factor in (1.125, 2.0):
            with weight_scale_inv_off(factor):
                xb = x.detach().clone().requires_grad_()
                bad = _step(lin, xb, dy, recipe, "plain")
            assert fails_within(bad, ref), f"scale_inv x{factor} passed the comparison: {errors(bad, ref)}"


def test_loaded_state_records_the_recipe_it_runs_with():
    """A state dict loaded into a module that already ran (here: its own state from before its first step)
    must not leave a stale `recipe` record: the next step records the recipe again. (Found by the block
    checkpoint differential check: the FP8 state after a reload differed from the plain run's.)"""
    seed = _seed()
    gen = torch.Generator().manual_seed(seed)
    lin = _linear(30, 50, torch.float32, gen)
    fresh = {k: v.clone() for k, v in lin.state_dict().items()}
    recipe = fp.DelayedScaling(amax_history_len=4)
    x, dy = _make_input(gen, 21, 30, "plain", torch.float32), torch.randn(21, 50, generator=gen)
    _step(lin, x, dy, recipe, "plain")
    recorded = lin.fp8.recipe.clone()
    assert recorded.any()
    lin.load_state_dict(fresh)
    _step(lin, x.detach().clone().requires_grad_(), dy, recipe, "plain")
    assert torch.equal(lin.fp8.recipe, recorded), (lin.fp8.recipe, recorded)


# ---- multi-rank (gloo) -------------------------------------------------------------------------------------

LAYER_CHECKS = ["grouped_empty_experts_delayed", "grouped_empty_experts_current",
                "block_fp8_vs_high_precision", "block_recompute_full", "block_recompute_selective",
                "block_torch_checkpoint", "block_frozen_and_no_grad"]


@HEAVY
def test_tensor_parallel_linears_tp1_tp2_tp4():
    from differential_checks import tp_check_names

    launch("differential_checks.py", 4, ["tp"], timeout=900, expect_checks=tp_check_names())


def test_grouped_experts_and_transformer_block():
    """The run's seed (`--seed N` or FP8P_TEST_SEED=N reproduces one). Seeds 2233635159 and 708325428 once failed the
    grouped delayed check: an expert's tokens grew 3 -> 13 between steps and its grad_output amax with them
    (1.8x the history's), which saturated under margin 0; the check's recipe now has margin 2."""
    launch("differential_checks.py", 2, ["layer"], timeout=900, expect_checks=LAYER_CHECKS)
