"""TransformerEngine 2.x's names, used the way a TransformerEngine script or test uses them (CPU).

`te.autocast(enabled, calibrating, recipe, amax_reduction_group)`, the recipes' fields and defaults
(`DelayedScaling`, `Float8CurrentScaling`, `Format` values, `MMParams`, `QParams`), the availability checks,
`quantized_model_init` / `fp8_model_init`, `get_default_recipe`, `LayerNorm` / `RMSNorm`, `LayerNormMLP`'s
`clamped_swiglu` / `activation_params` / `checkpoint`, options that change no result, tensor parallelism
(multi-rank: workers/te_tp_checks.py) and `make_graphed_callables`' 2.x argument names. Numerics are compared
with float64 references; tolerances as in tests/test_te_compat.py (FP8: forward 0.08, backward 0.12 relative
Frobenius error, doubled for two FP8 GEMMs in a row; high precision 1e-5).
"""
from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch
import torch.nn.functional as F

import fp8_parallel as te
from fp8_parallel import recipe
from launcher import launch
from te_testing import seed_for as _seed, rel_error as _rel

FWD_TOL, BWD_TOL, HP_TOL = 0.08, 0.12, 1e-5
DELAYED = recipe.DelayedScaling(amax_history_len=8, amax_compute_algo="max")


# ---- autocast ----------------------------------------------------------------------------------------------


def _pair(seed: int):
    torch.manual_seed(seed)
    a = te.Linear(48, 32, device="cpu")
    b = te.Linear(48, 32, device="cpu")
    b.load_state_dict(a.state_dict())
    return a, b


@pytest.mark.parametrize("call", ["keywords", "positional"])
def test_autocast_takes_te2_arguments(call):
    """`te.autocast(enabled=True, calibrating=False, recipe=r, amax_reduction_group=None)` (and TE's positional
    order) runs exactly what the older `fp8_autocast(enabled, calibrating, fp8_recipe, fp8_group)` runs."""
    seed = _seed(f"autocast/{call}")
    a, b = _pair(seed)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(3):
        x, g = torch.randn(16, 48, generator=gen) * 3, torch.randn(16, 32, generator=gen)
        ctx = (te.autocast(enabled=True, calibrating=False, recipe=DELAYED, amax_reduction_group=None)
               if call == "keywords" else te.autocast(True, False, DELAYED, None))
        assert ctx.enabled and ctx.recipe == DELAYED and ctx.amax_reduction_group is None
        with ctx:
            ya = a(x)
        with te.fp8_autocast(enabled=True, calibrating=False, fp8_recipe=DELAYED, fp8_group=None):
            yb = b(x)
        ya.backward(g)
        yb.backward(g)
        assert torch.equal(ya, yb) and torch.equal(a.weight.grad, b.weight.grad)
    assert not torch.equal(ya, F.linear(x, a.weight, a.bias)), "ran in high precision"
    for (k, va), vb in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(va, vb), k


def test_autocast_refuses_what_it_does_not_do():
    with pytest.raises(TypeError, match=r"autocast\(calibrating=DelayedScaling.*recipe=\.\.\."):
        te.autocast(True, DELAYED)  # the second positional argument is `calibrating`, as in TE 2.x
    with pytest.raises(TypeError, match="autocast\\(amax_reduction_group='tp'\\)"):
        te.autocast(amax_reduction_group="tp")
    with pytest.raises(TypeError, match="autocast\\(recipe='delayed'\\)"):
        te.autocast(recipe="delayed")
    with pytest.raises(TypeError, match="unexpected keyword argument '_graph'"):
        te.autocast(_graph=True)
    assert te.autocast().recipe == te.get_default_recipe() == recipe.DelayedScaling()


# ---- recipes -----------------------------------------------------------------------------------------------


def test_recipe_fields_and_defaults_are_te_2x():
    """Field names, their order (positional construction) and defaults of TransformerEngine 2.x."""
    delayed = [(f.name, f.default) for f in dataclasses.fields(recipe.DelayedScaling)]
    assert delayed == [("margin", 0), ("fp8_format", recipe.Format.HYBRID), ("amax_history_len", 1024),
                       ("amax_compute_algo", "max"), ("scaling_factor_compute_algo", None), ("reduce_amax", True),
                       ("fp8_dpa", False), ("fp8_mha", False), ("backward_override", None)]
    current = [(f.name, f.default) for f in dataclasses.fields(recipe.Float8CurrentScaling)]
    assert current[:8] == [("use_power_2_scales", False), ("fp8_format", recipe.Format.HYBRID),
                           ("fp8_gemm_fprop", recipe.MMParams(False)), ("fp8_gemm_dgrad", recipe.MMParams(True)),
                           ("fp8_gemm_wgrad", recipe.MMParams(True)), ("fp8_dpa", False), ("fp8_mha", False),
                           ("backward_override", None)]
    assert recipe.Float8CurrentScaling(False, recipe.Format.E4M3).fp8_format is recipe.Format.E4M3
    c = recipe.Float8CurrentScaling()
    assert c.fp8_quant_fwd_inp == c.fp8_quant_fwd_weight == c.fp8_quant_bwd_grad == recipe.QParams()
    assert [(f.name, f.default) for f in dataclasses.fields(recipe.QParams)] == [
        ("power_2_scale", False), ("amax_epsilon", 0.0), ("random_hadamard_transform", False),
        ("stochastic_rounding", False), ("fp4_2d_quantization", False)]
    assert recipe.MMParams().use_split_accumulator is True


def test_format_values_carry_te_maxima():
    F_ = recipe.Format
    assert [(f.name, f.value.max_fwd, f.value.max_bwd) for f in F_] == [
        ("E2M1", 6.0, 6.0), ("E4M3", 448.0, 448.0), ("E5M2", 57344.0, 57344.0), ("HYBRID", 448.0, 57344.0)]
    for f in (F_.E4M3, F_.E5M2, F_.HYBRID):  # the maxima are those of the dtypes the casts use
        dtypes = (torch.finfo(f.forward_dtype).max, torch.finfo(f.backward_dtype).max)
        assert (f.value.max_fwd, f.value.max_bwd) == dtypes
    with pytest.raises(ValueError, match="E2M1 is FP4"):
        recipe.DelayedScaling(fp8_format=F_.E2M1)
    with pytest.raises(ValueError, match="E2M1 is FP4"):
        F_.E2M1.forward_dtype


def test_recipes_are_mutable_dataclasses_as_in_te():
    r = recipe.DelayedScaling()
    r.amax_history_len = 16
    assert r.amax_history_len == 16 and r == recipe.DelayedScaling(amax_history_len=16)
    c = recipe.Float8CurrentScaling()
    c.fp8_format = recipe.Format.E4M3
    assert c.fp8_format is recipe.Format.E4M3
    assert dataclasses.replace(r, margin=1).margin == 1 and r.margin == 0


# ---- availability, model init --------------------------------------------------------------------------------


@pytest.mark.parametrize("name, what", [("is_mxfp8_available", "MXFP8"),
                                        ("is_fp8_block_scaling_available", "block scaling"),
                                        ("is_nvfp4_available", "NVFP4")])
def test_other_format_checks_say_not_available(name, what):
    check = getattr(te, name)
    for result in (check(), check(return_reason=True), check(return_reason=False)):
        ok, reason = result
        assert not ok and not result and what in reason and "not implemented" in reason, reason


def test_is_bf16_available():
    ok, reason = te.is_bf16_available(return_reason=True)
    if not torch.cuda.is_available():
        assert ok and reason == ""
    else:
        assert ok == (torch.cuda.get_device_capability()[0] >= 8) and (reason == "") == ok


@pytest.mark.parametrize("name", ["quantized_model_init", "fp8_model_init"])
def test_model_init_disabled_is_a_noop_and_enabled_says_what_to_use(name):
    seed = _seed(name)
    init = getattr(te, name)
    torch.manual_seed(seed)
    with init(enabled=False, recipe=DELAYED):
        inside = te.Linear(32, 16, device="cpu", params_dtype=torch.bfloat16)
    torch.manual_seed(seed)
    outside = te.Linear(32, 16, device="cpu", params_dtype=torch.bfloat16)
    assert inside.weight.dtype == torch.bfloat16 and torch.equal(inside.weight, outside.weight)
    with pytest.raises(NotImplementedError, match=rf"{name}\(enabled=True\).*is_first_microbatch"):
        with init():
            te.Linear(32, 16, device="cpu")


# ---- LayerNorm / RMSNorm -------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("zero_centered", [False, True])
def test_norms_match_float64(kind, zero_centered):
    seed = _seed(f"{kind}/{zero_centered}")
    torch.manual_seed(seed)
    norm = getattr(te, kind)(64, eps=1e-6, zero_centered_gamma=zero_centered, sequence_parallel=True, device="cpu")
    names = ["weight", "bias"] if kind == "LayerNorm" else ["weight"]
    assert [n for n, _ in norm.named_parameters()] == names
    assert all(p.sequence_parallel for p in norm.parameters())
    assert torch.equal(norm.weight, torch.full((64,), 0.0 if zero_centered else 1.0))
    with torch.no_grad():
        for p in norm.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    x = (torch.randn(4, 8, 64) * 3 + 1).requires_grad_()
    y = norm(x)
    g = torch.randn_like(y)
    y.backward(g)
    xd = x.detach().double().requires_grad_()
    pd = [p.detach().double().requires_grad_() for p in norm.parameters()]
    gain = pd[0] + 1 if zero_centered else pd[0]
    if kind == "LayerNorm":
        mu = xd.mean(-1, keepdim=True)
        ref = (xd - mu) * torch.rsqrt((xd - mu).pow(2).mean(-1, keepdim=True) + 1e-6) * gain + pd[1]
    else:
        ref = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6) * gain
    ref.backward(g.double())
    assert _rel(y, ref) < HP_TOL and _rel(x.grad, xd.grad) < HP_TOL
    assert all(_rel(p.grad, q.grad) < HP_TOL for p, q in zip(norm.parameters(), pd))


@pytest.mark.parametrize("kind", ["LayerNorm", "RMSNorm"])
def test_norms_bitwise_equal_for_a_transposed_input(kind):
    # TransformerEngine's test_numerics.py::test_noncontiguous: a transposed (non-contiguous) input gives the
    # same output and gradients as its contiguous copy, bit for bit (torch's rms_norm backward reduces the
    # weight gradient in another order for a non-contiguous input: 4e-6 apart)
    seed = _seed(f"{kind}/noncontiguous")
    torch.manual_seed(seed)
    norm_t = getattr(te, kind)(128, device="cpu")
    norm_c = getattr(te, kind)(128, device="cpu")
    with torch.no_grad():
        for p, q in zip(norm_t.parameters(), norm_c.parameters()):
            p.add_(torch.randn_like(p) * 0.3)
            q.copy_(p)
    a = torch.randn(128, 256).T.requires_grad_()
    b = a.detach().contiguous().requires_grad_()
    assert not a.is_contiguous()
    ya, yb = norm_t(a), norm_c(b)
    g = torch.randn_like(yb)
    ya.backward(g)
    yb.backward(g)
    assert torch.equal(ya, yb) and torch.equal(a.grad, b.grad)
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(norm_t.parameters(), norm_c.parameters()))


@pytest.mark.parametrize("kind", ["LayerNorm", "RMSNorm"])
def test_norms_under_torch_autocast_output_the_autocast_dtype(kind):
    # TransformerEngine's test_sanity.py::test_sanity_normalization_amp: inside torch.autocast the norm
    # outputs the autocast dtype (as our Linear / LayerNormLinear / LayerNormMLP do), the float32 input and
    # parameters get float32 gradients; the output is the norm of the input cast to that dtype
    seed = _seed(f"{kind}/torch.autocast")
    torch.manual_seed(seed)
    norm = getattr(te, kind)(64, device="cpu")
    x = torch.randn(5, 3, 64, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = norm(x)
        y.float().sum().backward()
    assert y.dtype == torch.bfloat16 and x.grad.dtype == torch.float32
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in norm.parameters())
    ref = norm(x.detach().to(torch.bfloat16))  # outside autocast: in the input's dtype
    assert torch.equal(y, ref)


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("kind", ["Linear", "LayerNormLinear", "LayerNormMLP", "GroupedLinear"])
def test_linear_modules_under_torch_autocast_compute_and_output_the_autocast_dtype(kind, fp8):
    # TransformerEngine's activation dtype: inside torch.autocast a module's input is cast to the autocast
    # dtype, with or without FP8 (FP8 on, the output used to stay float32); float32 parameters get float32
    # gradients; the result is the module's own on the input cast to that dtype, within FP8's tolerance of
    # a float64 reference when FP8 is on
    seed = _seed(f"{kind}/torch.autocast/fp8={fp8}")
    torch.manual_seed(seed)
    module = {"Linear": lambda: te.Linear(64, 48, device="cpu"),
              "LayerNormLinear": lambda: te.LayerNormLinear(64, 48, device="cpu"),
              "LayerNormMLP": lambda: te.LayerNormMLP(64, 96, device="cpu"),
              "GroupedLinear": lambda: te.GroupedLinear(2, 64, 48, device="cpu")}[kind]()
    call = (lambda t: module(t, [8, 12])) if kind == "GroupedLinear" else module
    x = torch.randn(20, 64, requires_grad=True)
    fp8_scope = (lambda: te.fp8_autocast(fp8_recipe=recipe.Float8CurrentScaling())) if fp8 else contextlib.nullcontext
    with torch.autocast("cpu", dtype=torch.bfloat16), fp8_scope():
        y = call(x)
    y.float().sum().backward()
    assert y.dtype == torch.bfloat16 and x.grad.dtype == torch.float32
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in module.parameters())
    with fp8_scope():
        same = call(x.detach().to(torch.bfloat16))  # outside torch.autocast, on the bf16 input
    assert same.dtype == torch.bfloat16
    assert _rel(y.detach(), same.detach()) < 0.05, _rel(y.detach(), same.detach())


@pytest.mark.parametrize("kind", ["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_norms_low_precision_within_one_rounding_of_float64(kind, dtype):
    # TransformerEngine's test_numerics.py::test_layernorm_accuracy / test_rmsnorm_accuracy in bfloat16: the
    # gain's gradient, a sum over all tokens, was reduced in bfloat16 by torch's CPU kernel (1.5 % off);
    # computed in float32 and rounded once, every output and gradient is within the dtype's rounding
    seed = _seed(f"{kind}/{dtype}")
    torch.manual_seed(seed)
    norm = getattr(te, kind)(128, params_dtype=dtype, device="cpu")
    with torch.no_grad():
        for p in norm.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    x = (torch.randn(64, 2, 128) * 2 + 0.5).to(dtype).requires_grad_()
    y = norm(x)
    g = torch.randn_like(y)
    y.backward(g)
    xd = x.detach().double().requires_grad_()
    pd = [p.detach().double().requires_grad_() for p in norm.parameters()]
    if kind == "LayerNorm":
        ref = F.layer_norm(xd, (128,), pd[0], pd[1], 1e-5)
    else:
        ref = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5) * pd[0]
    ref.backward(g.double())
    eps = torch.finfo(dtype).eps
    for got, want in [(y, ref), (x.grad, xd.grad)] + [(p.grad, q.grad) for p, q in zip(norm.parameters(), pd)]:
        assert got.dtype == dtype
        assert (got.double() - want).abs().max() <= eps * want.abs().max() + 1e-6, (kind, dtype)


@pytest.mark.parametrize("module", ["LayerNormLinear", "LayerNormMLP"])
@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_norm_gradients_low_precision_near_float64(module, normalization, dtype):
    # TransformerEngine's test_numerics.py::test_layernorm_linear_accuracy in bfloat16: the norm inside
    # LayerNormLinear / LayerNormMLP ran torch's CPU kernel in bfloat16, which reduced the bias gradient (a sum
    # over all tokens) in bfloat16: 7 % off. Computed in float32 and rounded once, the norm's gradients are
    # within a few roundings of float64 (the linear's bfloat16 dgrad feeds them)
    seed = _seed(f"{module}/{normalization}/{dtype}")
    print("seed", seed)
    torch.manual_seed(seed)
    h = 128
    if module == "LayerNormLinear":
        m = te.LayerNormLinear(h, 4 * h, normalization=normalization, params_dtype=dtype, bias=False, device="cpu")
    else:
        m = te.LayerNormMLP(h, 4 * h, normalization=normalization, params_dtype=dtype, bias=False, device="cpu")
    with torch.no_grad():
        m.layer_norm_weight.add_(torch.randn_like(m.layer_norm_weight) * 0.3)
        if m.layer_norm_bias is not None:
            m.layer_norm_bias.add_(torch.randn_like(m.layer_norm_bias) * 0.3)
    x = torch.randn(128, 2, h).to(dtype).requires_grad_()
    y = m(x)
    g = torch.ones_like(y) + 0.1 * torch.randn_like(y)  # as TE's loss = out.sum(): the sums all grow one way
    y.backward(g)
    norm_params = [p for p in (m.layer_norm_weight, m.layer_norm_bias) if p is not None]
    got = [p.grad for p in norm_params]
    # float64 reference: the norm in float64, the rest of the module on float64 copies of its weights
    xd = x.detach().double().requires_grad_()
    pd = [p.detach().double().requires_grad_() for p in norm_params]
    if normalization == "LayerNorm":
        ln = F.layer_norm(xd, (h,), pd[0], pd[1], 1e-5)
    else:
        ln = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5) * pd[0]
    if module == "LayerNormLinear":
        ref = ln @ m.weight.detach().double().t()
    else:
        ref = F.gelu(ln @ m.fc1_weight.detach().double().t(), approximate="tanh") @ m.fc2_weight.detach().double().t()
    ref.backward(g.double())
    eps = torch.finfo(dtype).eps
    for p, q, name in zip(got, pd, ["weight", "bias"]):
        assert p.dtype == dtype
        err = (p.double() - q.grad).abs().max().item()
        assert err <= 4 * eps * q.grad.abs().max().item(), (module, normalization, dtype, name, err, seed)


def test_norm_arguments_as_te_takes_them():
    ln = te.LayerNorm((4, 8), device="cpu", dtype=torch.bfloat16)  # trailing dims, like torch.nn.LayerNorm
    x = torch.randn(3, 4, 8, dtype=torch.bfloat16)
    torch.testing.assert_close(ln(x), F.layer_norm(x, (4, 8), eps=1e-5))
    assert te.RMSNorm(hidden_size=16, params_dtype=torch.float16, device="cpu").weight.dtype == torch.float16
    assert not hasattr(te.LayerNorm(8, device="cpu").weight, "sequence_parallel")  # set only when given
    te.LayerNorm(8, device="cpu", sm_margin={"forward": 8, "backward": 8})  # scheduling hint: accepted
    with pytest.raises(ValueError, match="normalized_shape or hidden_size, not both"):
        te.LayerNorm(8, hidden_size=8)
    with pytest.raises(ValueError, match="dtype or params_dtype, not both"):
        te.RMSNorm(8, params_dtype=torch.float32, dtype=torch.float32)
    with pytest.raises(ValueError, match="normalized_shape=0"):
        te.LayerNorm(0)


# ---- LayerNormMLP's newer options ------------------------------------------------------------------------------


def _clamped_swiglu_ref(h, limit, alpha, offset):
    gate, up = h[..., : h.shape[-1] // 2], h[..., h.shape[-1] // 2:]
    gate = torch.minimum(gate, torch.tensor(limit, dtype=h.dtype))
    up = torch.clamp(up, -limit, limit)
    return gate * torch.sigmoid(alpha * gate) * (up + offset)


@pytest.mark.parametrize("params", [None, {"limit": 1.5, "alpha": 1.0, "glu_linear_offset": 0.5}])
def test_clamped_swiglu_matches_float64(params):
    """GPT-OSS's clamped SwiGLU: TransformerEngine's defaults (limit 7, alpha 1.702, offset 1) or given ones;
    inputs large enough that both clamps act. The high-precision path (forward and every gradient) against
    float64 to 1e-5. The FP8 path: output and fc2's weight gradient within FP8 tolerance. Gradients through
    the clamps are not compared in FP8: a clamp's derivative is a step, and FP8's rounding of fc1's output
    moves values across it (measured 0.15-0.35 relative error against float64 for those gradients); the
    backward formula itself is the one the high-precision check covers."""
    seed = _seed(f"clamped_swiglu/{params}")
    torch.manual_seed(seed)
    mod = te.LayerNormMLP(32, 48, activation="clamped_swiglu", activation_params=params, device="cpu",
                          init_method=lambda w: torch.nn.init.normal_(w, std=1.0))
    assert mod.fc1_weight.shape == (96, 32)
    p = {"limit": 7.0, "alpha": 1.702, "glu_linear_offset": 1.0, **(params or {})}
    ps = [mod.layer_norm_weight, mod.layer_norm_bias, mod.fc1_weight, mod.fc1_bias, mod.fc2_weight, mod.fc2_bias]

    def fn(x_, lw, lb, w1, b1, w2, b2):
        mu = x_.mean(-1, keepdim=True)
        n = (x_ - mu) * torch.rsqrt((x_ - mu).pow(2).mean(-1, keepdim=True) + 1e-5) * lw + lb
        return _clamped_swiglu_ref(n @ w1.t() + b1, p["limit"], p["alpha"], p["glu_linear_offset"]) @ w2.t() + b2

    def reference(x, g):
        xd = x.detach().double().requires_grad_()
        pd = [q.detach().double().requires_grad_() for q in ps]
        yd = fn(xd, *pd)
        yd.backward(g.double())
        return yd, xd.grad, [q.grad for q in pd]

    def errors(y, x, yd, gxd, gpd):
        return {"out": _rel(y, yd), "dx": _rel(x.grad, gxd),
                **{f"d{i}": _rel(q.grad, r) for i, (q, r) in enumerate(zip(ps, gpd))}}

    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(24, 32, generator=gen).requires_grad_()
    g = torch.randn(24, 32, generator=gen)
    with te.autocast(enabled=False):
        y = mod(x)
    y.backward(g)
    hp = errors(y, x, *reference(x, g))
    assert all(v < HP_TOL for v in hp.values()), hp
    h = F.layer_norm(x.detach(), (32,), ps[0].detach(), ps[1].detach(), 1e-5) @ ps[2].detach().t() + ps[3].detach()
    gate, up = h.chunk(2, dim=-1)
    assert (gate > p["limit"]).any() and (up.abs() > p["limit"]).any(), "the clamps did not act"
    for _ in range(3):  # FP8 steps (delayed scaling takes its scales from the previous step)
        mod.zero_grad(set_to_none=True)
        x = torch.randn(24, 32, generator=gen).requires_grad_()
        with te.autocast(recipe=DELAYED):
            y = mod(x)
        g = torch.randn(y.shape, generator=gen)
        y.backward(g)
    fp8 = errors(y, x, *reference(x, g))
    print({"hp": hp, "fp8": fp8})
    assert fp8["out"] < 2 * FWD_TOL and fp8["d4"] < 2 * BWD_TOL, fp8
    assert all(torch.isfinite(q.grad).all() for q in ps) and torch.isfinite(x.grad).all()


@pytest.mark.parametrize("rname", ["delayed", "current"])
def test_layernorm_mlp_checkpoint_equals_no_checkpoint(rname):
    """`checkpoint=True` recomputes norm, fc1 and the activation in backward: outputs, all gradients, the
    returned norm output and the FP8 state are bitwise those of `checkpoint=False`, over a few steps (the
    recompute casts with the first pass's scales, weight cache included)."""
    seed = _seed(f"LayerNormMLP/checkpoint/{rname}")
    rec = DELAYED if rname == "delayed" else recipe.Float8CurrentScaling()
    torch.manual_seed(seed)
    plain = te.LayerNormMLP(32, 64, activation="swiglu", return_layernorm_output=True, device="cpu")
    ckpt = te.LayerNormMLP(32, 64, activation="swiglu", return_layernorm_output=True, checkpoint=True, device="cpu")
    ckpt.load_state_dict(plain.state_dict())
    gen = torch.Generator().manual_seed(seed)
    recomputed = []
    orig = ckpt._local
    ckpt._local = lambda *a, **k: (recomputed.append(1), orig(*a, **k))[1]
    for step in range(3):
        x = torch.randn(2, 12, 32, generator=gen)
        g = torch.randn(2, 12, 32, generator=gen)
        outs = []
        for mod in (plain, ckpt):
            xi = x.clone().requires_grad_()
            with te.autocast(recipe=rec):
                y, ln_out = mod(xi, is_first_microbatch=(step == 0) or None)
            (y * g).sum().backward()
            outs.append((y.detach(), ln_out.detach(), xi.grad, [p.grad.clone() for p in mod.parameters()]))
        (ya, la, dxa, ga), (yb, lb, dxb, gb) = outs
        assert torch.equal(ya, yb) and torch.equal(la, lb) and torch.equal(dxa, dxb)
        assert all(torch.equal(p, q) for p, q in zip(ga, gb)), step
        plain.zero_grad(set_to_none=True)
        ckpt.zero_grad(set_to_none=True)
    assert len(recomputed) == 6, recomputed  # forward and recompute, each step
    for (k, va), vb in zip(plain.state_dict().items(), ckpt.state_dict().values()):
        assert torch.equal(va, vb), k


def test_options_without_effect_on_results_are_accepted():
    """`save_original_input=True` (what backward keeps, not what it computes) and the gathered norm output at
    TP1 (it is the norm output): results bitwise those of the defaults."""
    seed = _seed("no-effect options")
    torch.manual_seed(seed)
    a = te.Linear(32, 16, device="cpu")
    b = te.Linear(32, 16, device="cpu", save_original_input=True)
    b.load_state_dict(a.state_dict())
    x = torch.randn(8, 32)
    for mod in (a, b):
        xi = x.clone().requires_grad_()
        with te.autocast(recipe=DELAYED):
            mod(xi * 2).sum().backward()
    assert torch.equal(a.weight.grad, b.weight.grad)
    ln = te.LayerNormLinear(32, 16, return_layernorm_output_gathered=True, device="cpu")
    with te.autocast(enabled=False):
        out, ln_out = ln(x)
    torch.testing.assert_close(ln_out, F.layer_norm(x, (32,), ln.layer_norm_weight, ln.layer_norm_bias, 1e-5))


def test_tp_size_without_group_asks_for_it():
    lin = te.Linear(32, 16, parallel_mode="column", tp_size=2, device="cpu")
    assert lin.weight.shape == (8, 32) and lin.weight.tensor_model_parallel and lin.weight.partition_dim == 0
    with pytest.raises(RuntimeError, match="tp_size=2 and no tp_group.*set_tensor_parallel_group"):
        lin(torch.randn(4, 32))
    with pytest.raises(ValueError, match="the group has 1 ranks.*size 2"):
        lin.set_tensor_parallel_group(None)
    # parallel_mode None: TransformerEngine splits nothing and communicates nothing
    plain = te.Linear(32, 16, tp_size=2, device="cpu")
    assert plain.weight.shape == (16, 32)
    plain(torch.randn(4, 32))


def test_tensor_parallel_modules_tp2():
    """Column / row Linear, column LayerNormLinear, LayerNormMLP(set_parallel_mode) at TP2, with and without
    sequence parallelism, tp_group given or set later, delayed and current scaling: against float64 and the
    TP1 module; `autocast(amax_reduction_group=...)` and `Float8CurrentScalingQuantizer(with_amax_reduction=True)`
    reduce over exactly that group (2 gloo ranks)."""
    launch("te_tp_checks.py", 2, timeout=600,
           expect_checks=["tp_parameter_attributes", "autocast_amax_reduction_group",
                          "current_scaling_quantizer_amax_reduction", "calibration_reduces_amaxes_over_the_group",
                          "distributed_gather_along_first_dim", "modules_tp2"])


# ---- make_graphed_callables: 2.x names -------------------------------------------------------------------------


def test_graphed_callables_take_te2_names():
    """`enabled`, `recipe`, `amax_reduction_group`, `cache_quantized_params`, the warm-up hooks and
    `clone_param_grads_on_return` work (CPU: the callables run eagerly, same results as the plain module);
    an argument under both of its names, `calibrating=True` and `capture_time_hooks` are refused."""
    seed = _seed("graphs/te2")
    torch.manual_seed(seed)
    plain = torch.nn.Sequential(te.Linear(32, 32, device="cpu"), torch.nn.GELU(), te.Linear(32, 32, device="cpu"))
    graphed = torch.nn.Sequential(te.Linear(32, 32, device="cpu"), torch.nn.GELU(), te.Linear(32, 32, device="cpu"))
    graphed.load_state_dict(plain.state_dict())
    sample = (torch.randn(8, 32, requires_grad=True),)
    with pytest.raises(ValueError, match="give enabled or its older name fp8_enabled"):
        te.make_graphed_callables(graphed, sample, enabled=True, fp8_enabled=True)
    with pytest.raises(NotImplementedError, match="fp8_calibrating=True"):
        te.make_graphed_callables(graphed, sample, enabled=True, calibrating=True)
    with pytest.raises(NotImplementedError, match="capture_time_hooks"):
        te.make_graphed_callables(graphed, sample, capture_time_hooks=[{"forward_hooks": {}}])
    calls = []
    no_cuda = pytest.warns(UserWarning, match="CUDA is not available")
    with no_cuda if not torch.cuda.is_available() else contextlib.nullcontext():
        te.make_graphed_callables(graphed, sample, num_warmup_iters=2, enabled=True, recipe=DELAYED,
                                  amax_reduction_group=None, cache_quantized_params=False,
                                  clone_param_grads_on_return=False, pre_warmup_hook=lambda: calls.append("pre"),
                                  post_warmup_hook=lambda: calls.append("post"))
    assert calls == ["pre", "post"]
    gen = torch.Generator().manual_seed(seed)
    for _ in range(2):
        x = torch.randn(8, 32, generator=gen)
        results = []
        for mod in (plain, graphed):
            xi = x.clone().requires_grad_()
            with te.autocast(recipe=DELAYED):
                y = mod(xi)
            y.sum().backward()
            results.append((y.detach(), xi.grad, mod[0].weight.grad.clone()))
            mod.zero_grad(set_to_none=True)
        assert all(torch.equal(p, q) for p, q in zip(*results))
    assert not torch.equal(results[0][0], plain[2](F.gelu(plain[0](x))))  # FP8 ran (not the HP path)

