"""The TransformerEngine-compatible surface: a TE user's script runs after changing only the import lines.

TE users write `import transformer_engine.pytorch as te` and `from transformer_engine.common import recipe`;
here `import fp8_parallel as te` and `from fp8_parallel import recipe`. Numerics are compared with a float64
reference and with the modules' own high-precision path (autocast disabled).

Tolerances (relative error in the Frobenius norm), about twice what was measured: forward 0.08 (E4M3
operands, at most 2**-4 relative rounding error each: about 4% measured for `x @ W.T`, 1% with a bias
added), backward 0.12 (the output gradient in E5M2, at most 2**-3: about 6% measured). Two FP8 GEMMs in a
row (LayerNormMLP) get twice these. The high-precision path must match the reference to float32 rounding
(1e-5).
"""
from __future__ import annotations

import dataclasses
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import fp8_parallel as te
from fp8_parallel import recipe
from launcher import child_env
from te_testing import seed_for as _seed, rel_error as _rel

REPO = Path(__file__).resolve().parent.parent
FWD_TOL, BWD_TOL, HP_TOL = 0.08, 0.12, 1e-5
RECIPES = {
    "delayed": recipe.DelayedScaling(fp8_format=recipe.Format.HYBRID, amax_history_len=16, amax_compute_algo="max"),
    "current": recipe.Float8CurrentScaling(fp8_format=recipe.Format.HYBRID),
}


# ---- import hygiene --------------------------------------------------------------------------------------


def test_import_does_not_load_megatron_and_integrations_are_attributes():
    """Run in a fresh interpreter, so other tests' imports do not hide an eager megatron import."""
    script = textwrap.dedent("""
        import sys, types
        import fp8_parallel as te
        from fp8_parallel import recipe
        assert not [m for m in sys.modules if m == "megatron" or m.startswith("megatron.")], "megatron imported"
        assert "parallel_state" not in sys.modules
        # a standalone module runs in FP8 with no megatron and no parallel set-up
        import torch
        lin = te.Linear(32, 16)
        with te.fp8_autocast(enabled=True, fp8_recipe=recipe.DelayedScaling(amax_history_len=4)):
            y = lin(torch.randn(8, 32))
        y.sum().backward()
        assert (lin.fp8.fwd.amax_history[:, 0] > 0).all() and (lin.fp8.bwd.amax_history[:, 0] > 0).all()
        assert not [m for m in sys.modules if m == "megatron" or m.startswith("megatron.")], "megatron imported"
        assert {"megatron", "pipeline", "ColumnParallelLinear"} <= set(dir(te))
        assert isinstance(te.pipeline, types.ModuleType) and callable(te.pipeline.capture_order)
        assert isinstance(te.megatron, types.ModuleType) and callable(te.megatron.get_gpt_layer_spec)
        from fp8_parallel.modules.parallel_linear import ColumnParallelLinear
        assert te.ColumnParallelLinear is ColumnParallelLinear
        try:
            te.no_such_name
        except AttributeError as e:
            assert "no_such_name" in str(e)
        else:
            raise AssertionError("no AttributeError")
        print("IMPORT-OK")
    """)
    env = child_env()
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, env=env,
                         cwd=REPO)
    assert res.returncode == 0 and "IMPORT-OK" in res.stdout, res.stdout + res.stderr


# ---- fp8_autocast ----------------------------------------------------------------------------------------


def _linear_pair(seed: int, **kwargs):
    torch.manual_seed(seed)
    a = te.Linear(48, 32, device="cpu", **kwargs)
    b = te.Linear(48, 32, device="cpu", **kwargs)
    b.load_state_dict(a.state_dict())
    return a, b


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_fp8_autocast_is_autocast_under_te_keywords(name):
    """Same recipe: `fp8_autocast(enabled=True, fp8_recipe=r)` and `autocast(recipe=r)` give bitwise the same
    outputs, gradients and FP8 state over a few steps."""
    seed = _seed(f"fp8_autocast/{name}")
    rec = RECIPES[name]
    a, b = _linear_pair(seed)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(3):
        x = torch.randn(16, 48, generator=gen) * 3
        g = torch.randn(16, 32, generator=gen)
        with te.fp8_autocast(enabled=True, fp8_recipe=rec, fp8_group=None):
            ya = a(x)
        with te.autocast(recipe=rec):
            yb = b(x)
        ya.backward(g)
        yb.backward(g)
        assert torch.equal(ya, yb)
        assert torch.equal(a.weight.grad, b.weight.grad) and torch.equal(a.bias.grad, b.bias.grad)
    for (k, va), vb in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(va, vb), k
    assert not torch.equal(ya, F.linear(x, a.weight, a.bias)), "ran in high precision"


def test_fp8_autocast_disabled_and_default_recipe():
    seed = _seed("fp8_autocast/disabled")
    torch.manual_seed(seed)
    lin = te.Linear(48, 32, device="cpu")
    x = torch.randn(16, 48) * 2
    with te.fp8_autocast(enabled=False):
        y = lin(x)
    assert torch.equal(y, F.linear(x, lin.weight, lin.bias))
    assert torch.equal(lin.fp8.fwd.amax_history, torch.zeros_like(lin.fp8.fwd.amax_history))
    ctx = te.fp8_autocast()  # TE's defaults: enabled, DelayedScaling()
    assert isinstance(ctx, te.autocast) and ctx.enabled and ctx.recipe == recipe.DelayedScaling()
    with ctx:
        lin(x)
    assert (lin.fp8.fwd.amax_history[:, 0] > 0).all()


def test_fp8_autocast_refuses_what_it_does_not_do():
    with pytest.raises(TypeError, match="first positional argument is `enabled`"):
        te.fp8_autocast(recipe.DelayedScaling())
    with pytest.raises(TypeError, match="second positional argument is `calibrating`"):
        te.fp8_autocast(True, recipe.DelayedScaling())

    class ForeignRecipe:  # e.g. transformer_engine.common.recipe.DelayedScaling
        pass

    with pytest.raises(TypeError, match="fp8_recipe=.*fp8_parallel.recipe"):
        te.fp8_autocast(enabled=True, fp8_recipe=ForeignRecipe())
    with pytest.raises(TypeError, match="fp8_group='world'"):
        te.fp8_autocast(enabled=True, fp8_group="world")
    with pytest.raises(TypeError, match="unexpected keyword argument 'recipe'"):  # TE's keywords, not ours
        te.fp8_autocast(enabled=True, calibrating=False, recipe=recipe.DelayedScaling())


# ---- recipes ---------------------------------------------------------------------------------------------


def test_recipe_module_mirrors_te_names():
    assert recipe.Float8CurrentScaling is recipe.CurrentScaling is te.Float8CurrentScaling
    assert te.recipe is recipe and te.DelayedScaling is recipe.DelayedScaling
    r = recipe.DelayedScaling(margin=1, fp8_format=recipe.Format.E4M3, amax_history_len=8, amax_compute_algo="most_recent",
                              scaling_factor_compute_algo=None, reduce_amax=False, fp8_dpa=False, fp8_mha=False)
    assert r == recipe.DelayedScaling(1, recipe.Format.E4M3, 8, "most_recent", None, False)  # TE's positional order
    assert hash(r) == hash(dataclasses.replace(r))
    r.margin = 2  # mutable, as TransformerEngine's recipes
    assert r != recipe.DelayedScaling(1, recipe.Format.E4M3, 8, "most_recent", None, False)
    c = recipe.Float8CurrentScaling(fp8_format=recipe.Format.HYBRID, use_power_2_scales=False,
                                    fp8_gemm_fprop=recipe.MMParams(use_split_accumulator=False),
                                    fp8_gemm_dgrad=recipe.MMParams(use_split_accumulator=True),
                                    fp8_gemm_wgrad=recipe.MMParams(use_split_accumulator=True))
    assert c == recipe.CurrentScaling() and not c.reduce_amax
    assert r.delayed() and not r.float8_current_scaling() and r.float8_per_tensor_scaling()
    assert c.float8_current_scaling() and not c.delayed() and not c.mxfp8() and not c.float8_block_scaling()
    assert isinstance(r, recipe.Recipe) and isinstance(c, recipe.Recipe)
    assert recipe.Format.E5M2.forward_dtype == recipe.Format.E5M2.backward_dtype == torch.float8_e5m2
    assert (recipe.Format.E5M2.forward_max, recipe.Format.HYBRID.backward_max) == (57344.0, 57344.0)
    assert (recipe.Format.E4M3.forward_max, recipe.Format.E4M3.backward_max) == (448.0, 448.0)


@pytest.mark.parametrize("make, error, match", [
    (lambda: recipe.DelayedScaling(fp8_format=recipe.Format.E5M2), ValueError, "Format.E5M2.*HYBRID"),
    (lambda: recipe.Float8CurrentScaling(fp8_format=recipe.Format.E5M2), ValueError, "Format.E5M2"),
    (lambda: recipe.DelayedScaling(fp8_format="hybrid"), ValueError, "fp8_format='hybrid'"),
    (lambda: recipe.DelayedScaling(scaling_factor_compute_algo="x"), ValueError, "scaling_factor_compute_algo='x'"),
    (lambda: recipe.DelayedScaling(fp8_dpa=True), NotImplementedError, "fp8_dpa=True"),
    (lambda: recipe.Float8CurrentScaling(fp8_mha=True), NotImplementedError, "fp8_mha=True"),
    (lambda: recipe.DelayedScaling(backward_override="bogus"), ValueError, "backward_override='bogus'"),
    (lambda: recipe.Float8CurrentScaling(use_power_2_scales=True), NotImplementedError, "use_power_2_scales"),
    (lambda: recipe.Float8CurrentScaling(fp8_gemm_fprop=recipe.MMParams(True)), NotImplementedError,
     "fp8_gemm_fprop=MMParams"),
    (lambda: recipe.DelayedScaling(amax_history_len=0), ValueError, "amax_history_len=0"),
    (lambda: recipe.DelayedScaling(margin=-1), ValueError, "margin=-1"),
    (lambda: recipe.DelayedScaling(amax_compute_algo="mean"), ValueError, "amax_compute_algo='mean'"),
    (lambda: recipe.DelayedScaling(reduce_amax="yes"), ValueError, "reduce_amax='yes'"),
    # TE's block-scaled recipes are constructed as TE does on a GPU without them, and refused where used
    (lambda: te.autocast(recipe=recipe.MXFP8BlockScaling()), NotImplementedError, "MXFP8BlockScaling.*DelayedScaling"),
    (lambda: te.fp8_autocast(fp8_recipe=recipe.Float8BlockScaling(x_block_scaling_dim=1)), NotImplementedError,
     "Float8BlockScaling.*Float8CurrentScaling"),
    (lambda: te.autocast(enabled=False, calibrating=True, recipe=recipe.NVFP4BlockScaling()), NotImplementedError,
     "NVFP4BlockScaling"),
])
def test_recipes_refuse_unsupported_values_by_name(make, error, match):
    with pytest.raises(error, match=match):
        make()


def test_te_names_not_provided_say_what_to_use():
    for name in ("TransformerLayer", "MultiheadAttention", "DotProductAttention", "GroupedLinear", "checkpoint"):
        assert callable(getattr(te, name)), name  # provided under TransformerEngine's names
    with pytest.raises(AttributeError, match="fp8_parallel has no initialize_ub .*userbuffers"):
        te.initialize_ub
    with pytest.raises(AttributeError, match="fp8_parallel has no Fp8Padding .*m_splits"):
        te.Fp8Padding
    with pytest.raises(AttributeError, match="has no attribute 'NoSuchName'"):
        te.NoSuchName


def test_is_fp8_available_reports_a_reason():
    result = te.is_fp8_available()
    ok, reason = result
    assert bool(result) is ok and te.is_fp8_available(return_reason=True) == result
    if not torch.cuda.is_available():
        assert not ok and "emulation" in reason and "8.9" in reason, reason
    else:
        major, minor = torch.cuda.get_device_capability()
        assert ok == ((major, minor) >= (8, 9)), (ok, reason)
        assert (reason == "") == ok


# ---- modules: construction -------------------------------------------------------------------------------


def test_module_defaults_follow_te():
    seed = _seed("defaults")
    torch.manual_seed(seed)
    lin = te.Linear(256, 512)
    expected_device = "cuda" if torch.cuda.is_available() else "cpu"
    assert lin.weight.device.type == expected_device and lin.weight.dtype == torch.get_default_dtype()
    assert abs(lin.weight.std().item() - 0.023) < 0.002 and abs(lin.weight.mean().item()) < 0.002
    assert torch.equal(lin.bias, torch.zeros_like(lin.bias))
    assert [n for n, _ in lin.named_parameters()] == ["weight", "bias"]
    ln = te.LayerNormLinear(64, 32, device="cpu")
    assert [n for n, _ in ln.named_parameters()] == ["layer_norm_weight", "layer_norm_bias", "weight", "bias"]
    assert torch.equal(ln.layer_norm_weight, torch.ones(64)) and torch.equal(ln.layer_norm_bias, torch.zeros(64))
    rms = te.LayerNormLinear(64, 32, normalization="RMSNorm", zero_centered_gamma=True, bias=False, device="cpu")
    assert [n for n, _ in rms.named_parameters()] == ["layer_norm_weight", "weight"]
    assert torch.equal(rms.layer_norm_weight, torch.zeros(64))
    mlp = te.LayerNormMLP(64, 96, activation="swiglu", device="cpu", params_dtype=torch.bfloat16)
    assert [(n, tuple(p.shape), p.dtype) for n, p in mlp.named_parameters()] == [
        ("layer_norm_weight", (64,), torch.bfloat16), ("layer_norm_bias", (64,), torch.bfloat16),
        ("fc1_weight", (192, 64), torch.bfloat16), ("fc1_bias", (192,), torch.bfloat16),
        ("fc2_weight", (64, 96), torch.bfloat16), ("fc2_bias", (64,), torch.bfloat16),
    ]
    assert te.LayerNormMLP(64, 96, activation="gelu", device="cpu").fc1_weight.shape == (96, 64)


def test_init_method_and_rng_tracker_are_used():
    calls = []

    def init(w):
        calls.append(tuple(w.shape))
        torch.nn.init.constant_(w, 0.5)

    class Tracker:  # megatron's / TE's RNG tracker: weights are initialized inside fork(name)
        def fork(self, name="model-parallel-rng"):
            calls.append(("fork", name))
            return torch.random.fork_rng()

    lin = te.Linear(8, 4, init_method=init, get_rng_state_tracker=Tracker, rng_tracker_name="tp", device="cpu")
    assert calls == [("fork", "tp"), (4, 8)] and torch.equal(lin.weight, torch.full((4, 8), 0.5))
    calls.clear()
    mlp = te.LayerNormMLP(8, 16, init_method=init, output_layer_init_method=lambda w: torch.nn.init.constant_(w, 2.0),
                          device="cpu")
    assert calls == [(16, 8)] and torch.equal(mlp.fc2_weight, torch.full((8, 16), 2.0))


@pytest.mark.parametrize("make, error, match", [
    (lambda: te.Linear(8, 8, ub_overlap_ag=True), NotImplementedError, "ub_overlap_ag=True"),
    (lambda: te.Linear(8, 8, symmetric_ar_type="multimem_all_reduce"), NotImplementedError, "symmetric_ar_type"),
    (lambda: te.Linear(8, 6, parallel_mode="column", tp_size=4), ValueError, "out_features=6.*size 4"),
    (lambda: te.Linear(8, 8, tp_size=0), ValueError, "tp_size=0"),
    (lambda: te.Linear(8, 8, tp_group="tp"), TypeError, "tp_group='tp'"),
    (lambda: te.Linear(8, 8, parameters_split=("q", "k")), NotImplementedError, "parameters_split"),
    (lambda: te.Linear(8, 8, parallel_mode="sequence"), ValueError, "parallel_mode='sequence'"),
    (lambda: te.Linear(8, 8, activation="gelu"), TypeError, "unexpected keyword argument 'activation'"),
    (lambda: te.Linear(8, 8, params_dtype=torch.float8_e4m3fn), ValueError, "params_dtype=torch.float8_e4m3fn"),
    (lambda: te.Linear(0, 8), ValueError, "in_features=0"),
    (lambda: te.LayerNormLinear(8, 8, normalization="BatchNorm"), ValueError, "normalization='BatchNorm'"),
    (lambda: te.LayerNormLinear(8, 8, parallel_mode="row", tp_size=2), NotImplementedError,
     "parallel_mode='row'.*column"),
    (lambda: te.LayerNormMLP(8, 8, activation="clamped_geglu"), ValueError, "activation='clamped_geglu'"),
    (lambda: te.LayerNormMLP(8, 8, activation="gelu", activation_params={"limit": 1.0}), ValueError,
     "only 'clamped_swiglu' takes"),
    (lambda: te.LayerNormMLP(8, 8, activation="clamped_swiglu", activation_params={"beta": 1.0}), ValueError,
     "unknown \\['beta'\\]"),
    (lambda: te.LayerNormMLP(8, 6, set_parallel_mode=True, tp_size=4), ValueError, "ffn_hidden_size=6"),
])
def test_modules_refuse_unsupported_options_by_name(make, error, match):
    with pytest.raises(error, match=match):
        make()


def test_options_te_ignores_at_tp1_are_accepted():
    """Options that change nothing at TP1 (TE ignores them there): the modules built with them compute what
    plain ones do, outputs and gradients bitwise, in FP8 and without."""
    seed = 2917
    print(f"seed {seed}")
    cases = [
        (lambda **kw: te.Linear(16, 24, device="cpu", **kw),
         dict(sequence_parallel=True, parallel_mode="column", tp_size=1, ub_name="qkv"), 16),
        (lambda **kw: te.LayerNormMLP(16, 32, device="cpu", **kw),
         dict(seq_length=128, micro_batch_size=2, set_parallel_mode=True), 16),
    ]
    for build, options, width in cases:
        for fp8 in (False, True):
            torch.manual_seed(seed)
            plain = build()
            torch.manual_seed(seed)
            optioned = build(**options)
            for a, b in zip(plain.parameters(), optioned.parameters()):
                assert torch.equal(a, b)
            gen = torch.Generator().manual_seed(seed + 1)
            for _ in range(2):  # the second step runs with delayed scales from the first
                x = torch.randn(6, width, generator=gen)
                got = []
                for module in (plain, optioned):
                    xi = x.clone().requires_grad_()
                    with te.fp8_autocast(enabled=fp8, fp8_recipe=RECIPES["delayed"]):
                        y = module(xi)
                    y.square().sum().backward()
                    got.append((y.detach(), xi.grad, [p.grad.clone() for p in module.parameters()]))
                    module.zero_grad()
                (y0, gx0, gp0), (y1, gx1, gp1) = got
                assert torch.equal(y0, y1) and torch.equal(gx0, gx1), (type(plain).__name__, options, fp8)
                assert all(torch.equal(a, b) for a, b in zip(gp0, gp1))


def test_forward_refuses_bad_inputs():
    lin = te.Linear(8, 4, device="cpu")
    with pytest.raises(ValueError, match=r"input of shape \(2, 6\).*in_features=8"):
        lin(torch.randn(2, 6))
    with pytest.raises(NotImplementedError, match="fp8_output=True"):
        lin(torch.randn(2, 8), fp8_output=True)
    with pytest.raises(ValueError, match=r"input of shape \(3, 5\).*hidden_size=8"):
        te.LayerNormMLP(8, 16, device="cpu")(torch.randn(3, 5))


# ---- modules: numerics -----------------------------------------------------------------------------------


def _train_steps(module, make_input, rec, steps=3, seed=0, **fwd):
    """A few FP8 steps (delayed scaling needs one to get scales from amaxes); returns the last step's input,
    output (the first element of a tuple) and upstream gradient."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    for _ in range(steps):
        module.zero_grad(set_to_none=True)
        x = make_input(gen).requires_grad_()
        with te.fp8_autocast(enabled=True, fp8_recipe=rec):
            out = module(x, **fwd)
        y = out[0] if isinstance(out, tuple) else out
        g = torch.randn(y.shape, generator=gen).to(y)
        y.backward(g)
    return x, out, g


def _reference_grads(fn, x, params, g):
    """float64 reference output and gradients of `fn(x, *params)`."""
    xd = x.detach().double().requires_grad_()
    pd = [p.detach().double().requires_grad_() for p in params]
    y = fn(xd, *pd)
    y.backward(g.double())
    return y.detach(), xd.grad, [p.grad for p in pd]


def _check_close(name, y, x, params, yr, gxr, gpr, fwd_tol=FWD_TOL, bwd_tol=BWD_TOL):
    errs = {"out": _rel(y, yr), "dx": _rel(x.grad, gxr)}
    errs.update({f"d{i}": _rel(p.grad, gp) for i, (p, gp) in enumerate(zip(params, gpr))})
    print(name, {k: round(v, 4) for k, v in errs.items()})
    assert errs["out"] < fwd_tol, errs
    assert all(v < bwd_tol for v in errs.values()), errs
    assert all(torch.isfinite(t).all() for t in [y, x.grad] + [p.grad for p in params])


def _hp_matches(module, x, fn, params):
    """The module's own high-precision path (autocast disabled) against the float64 function."""
    with te.fp8_autocast(enabled=False):
        out = module(x.detach())
    y = out[0] if isinstance(out, tuple) else out
    ref = fn(x.detach().double(), *[p.detach().double() for p in params])
    assert _rel(y, ref) < HP_TOL
    return y


@pytest.mark.parametrize("rname", sorted(RECIPES))
@pytest.mark.parametrize("shape", [(32, 64, 48), (24, 40, 36)], ids=["aligned", "unaligned"])
@pytest.mark.parametrize("return_bias", [False, True])
def test_linear_matches_reference(rname, shape, return_bias):
    n, k, m = shape
    seed = _seed(f"Linear/{rname}/{shape}/{return_bias}")
    torch.manual_seed(seed)
    lin = te.Linear(k, m, return_bias=return_bias, device="cpu")
    with torch.no_grad():
        lin.bias.normal_()
    x, out, g = _train_steps(lin, lambda gen: torch.randn(4, n // 4, k, generator=gen) * 2, RECIPES[rname], seed=seed)
    if return_bias:  # `(x @ W.T, bias)`: the caller adds the bias
        y, b = out
        assert torch.equal(b, lin.bias) and lin.bias.grad is None
        fn, params = (lambda x_, w: x_ @ w.t()), [lin.weight]
    else:
        y = out
        fn, params = (lambda x_, w, b_: x_ @ w.t() + b_), [lin.weight, lin.bias]
    assert y.shape == (4, n // 4, m)
    yr, gxr, gpr = _reference_grads(fn, x, params, g)
    _check_close(f"Linear {rname} {shape} return_bias={return_bias}", y, x, params, yr, gxr, gpr)
    hp = _hp_matches(lin, x, fn, params)
    assert not torch.equal(y.detach(), hp), "the FP8 scope ran in high precision"
    assert _rel(y.detach(), hp) < FWD_TOL


def test_linear_weight_cache_matches_uncached():
    """Microbatches of one step in one scope: `is_first_microbatch` True then False (the FP8 weight cast once
    and cached) gives bitwise what None (cast on every call) gives, since the weight and its scale are
    unchanged within the step."""
    seed = _seed("Linear/cache")
    a, b = _linear_pair(seed)
    gen = torch.Generator().manual_seed(seed)
    rec = RECIPES["delayed"]
    for step in range(2):
        xs = [torch.randn(16, 48, generator=gen) for _ in range(3)]
        with te.fp8_autocast(enabled=True, fp8_recipe=rec):
            ya = [a(x, is_first_microbatch=(mb == 0)) for mb, x in enumerate(xs)]
        with te.fp8_autocast(enabled=True, fp8_recipe=rec):
            yb = [b(x, is_first_microbatch=None) for x in xs]
        for mb, (p, q) in enumerate(zip(ya, yb)):
            assert torch.equal(p, q), (step, mb)
        assert not torch.equal(ya[0], F.linear(xs[0], a.weight, a.bias))


def _norm_fn(normalization, zero_centered, eps):
    def norm(x, w, b=None):
        gain = w + 1 if zero_centered else w
        if normalization == "RMSNorm":
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * gain
        mu = x.mean(-1, keepdim=True)
        var = (x - mu).pow(2).mean(-1, keepdim=True)
        return (x - mu) * torch.rsqrt(var + eps) * gain + b
    return norm


@pytest.mark.parametrize("rname", sorted(RECIPES))
@pytest.mark.parametrize("normalization, zero_centered", [("LayerNorm", False), ("RMSNorm", True)])
def test_layernorm_linear_matches_reference(rname, normalization, zero_centered):
    seed = _seed(f"LayerNormLinear/{rname}/{normalization}")
    torch.manual_seed(seed)
    eps = 1e-5
    mod = te.LayerNormLinear(64, 48, eps, normalization=normalization, zero_centered_gamma=zero_centered,
                             return_layernorm_output=True, device="cpu")
    with torch.no_grad():  # non-trivial norm parameters
        mod.layer_norm_weight.add_(torch.rand(64) * 0.5)
        if mod.layer_norm_bias is not None:
            mod.layer_norm_bias.normal_()
        mod.bias.normal_()
    x, (y, ln_out), g = _train_steps(mod, lambda gen: torch.randn(32, 64, generator=gen) * 3 + 1, RECIPES[rname],
                                      seed=seed)
    norm = _norm_fn(normalization, zero_centered, eps)
    if normalization == "LayerNorm":
        params = [mod.layer_norm_weight, mod.layer_norm_bias, mod.weight, mod.bias]
        fn = lambda x_, lw, lb, w, b: norm(x_, lw, lb) @ w.t() + b
    else:
        params = [mod.layer_norm_weight, mod.weight, mod.bias]
        fn = lambda x_, lw, w, b: norm(x_, lw) @ w.t() + b
    yr, gxr, gpr = _reference_grads(fn, x, params, g)
    _check_close(f"LayerNormLinear {rname} {normalization}", y, x, params, yr, gxr, gpr)
    ln_ref = norm(x.detach().double(), *[p.detach().double() for p in params[:-2]])
    assert _rel(ln_out, ln_ref) < HP_TOL
    hp = _hp_matches(mod, x, fn, params)
    assert not torch.equal(y.detach(), hp) and _rel(y.detach(), hp) < FWD_TOL


def _act_ref(activation):
    gelu = lambda t: 0.5 * t * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (t + 0.044715 * t ** 3)))
    plain = {"gelu": gelu, "relu": torch.relu, "silu": lambda t: t * torch.sigmoid(t),
             "qgelu": lambda t: t * torch.sigmoid(1.702 * t), "srelu": lambda t: torch.relu(t) ** 2}
    gated = {"swiglu": plain["silu"], "geglu": gelu, "reglu": torch.relu, "qgeglu": plain["qgelu"],
             "sreglu": plain["srelu"], "glu": torch.sigmoid}
    if activation in gated:
        return lambda h: gated[activation](h[..., : h.shape[-1] // 2]) * h[..., h.shape[-1] // 2:]
    return plain[activation]


@pytest.mark.parametrize("rname", sorted(RECIPES))
@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_layernorm_mlp_matches_reference(rname, activation):
    seed = _seed(f"LayerNormMLP/{rname}/{activation}")
    torch.manual_seed(seed)
    mod = te.LayerNormMLP(64, 96, activation=activation, device="cpu", init_method=lambda w: torch.nn.init.normal_(w, std=0.1),
                          output_layer_init_method=lambda w: torch.nn.init.normal_(w, std=0.1))
    with torch.no_grad():
        mod.fc1_bias.normal_(std=0.5)
        mod.fc2_bias.normal_()
    x, y, g = _train_steps(mod, lambda gen: torch.randn(2, 16, 64, generator=gen) * 2, RECIPES[rname], seed=seed)
    norm, act = _norm_fn("LayerNorm", False, 1e-5), _act_ref(activation)
    params = [mod.layer_norm_weight, mod.layer_norm_bias, mod.fc1_weight, mod.fc1_bias, mod.fc2_weight, mod.fc2_bias]
    fn = lambda x_, lw, lb, w1, b1, w2, b2: act(norm(x_, lw, lb) @ w1.t() + b1) @ w2.t() + b2
    yr, gxr, gpr = _reference_grads(fn, x, params, g)
    # two FP8 GEMMs in a row: fc1's error passes through fc2 (tolerances doubled)
    _check_close(f"LayerNormMLP {rname} {activation}", y, x, params, yr, gxr, gpr, 2 * FWD_TOL, 2 * BWD_TOL)
    hp = _hp_matches(mod, x, fn, params)
    assert not torch.equal(y.detach(), hp) and _rel(y.detach(), hp) < 2 * FWD_TOL
    for state in (mod.fc1_fp8, mod.fc2_fp8):  # delayed scaling records amaxes, current scaling does not
        assert bool((state.fwd.amax_history[:, 0] > 0).all()) == (rname == "delayed")


@pytest.mark.parametrize("activation", ["gelu", "relu", "silu", "qgelu", "srelu", "swiglu", "geglu", "reglu",
                                        "qgeglu", "sreglu", "glu"])
def test_layernorm_mlp_activations_in_high_precision(activation):
    seed = _seed(f"LayerNormMLP/hp/{activation}")
    torch.manual_seed(seed)
    mod = te.LayerNormMLP(16, 24, activation=activation, device="cpu")
    x = torch.randn(5, 16)
    params = [mod.layer_norm_weight, mod.layer_norm_bias, mod.fc1_weight, mod.fc1_bias, mod.fc2_weight, mod.fc2_bias]
    norm, act = _norm_fn("LayerNorm", False, 1e-5), _act_ref(activation)
    _hp_matches(mod, x, lambda x_, lw, lb, w1, b1, w2, b2: act(norm(x_, lw, lb) @ w1.t() + b1) @ w2.t() + b2, params)


def test_layernorm_mlp_return_bias_and_layernorm_output():
    seed = _seed("LayerNormMLP/returns")
    torch.manual_seed(seed)
    mod = te.LayerNormMLP(16, 32, return_bias=True, return_layernorm_output=True, device="cpu")
    with torch.no_grad():
        mod.fc2_bias.normal_()
    x = torch.randn(4, 16)
    with te.fp8_autocast(enabled=False):
        out, bias, ln_out = mod(x)
    mod.return_bias = mod.return_layernorm_output = False
    with te.fp8_autocast(enabled=False):
        full = mod(x)
    torch.testing.assert_close(out + bias, full)
    torch.testing.assert_close(ln_out, F.layer_norm(x, (16,), mod.layer_norm_weight, mod.layer_norm_bias, 1e-5))


# ---- GPU: every parameter dtype --------------------------------------------------------------------------

GPU_DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _gpu_module(kind: str, dtype: torch.dtype):
    if kind == "Linear":
        return te.Linear(256, 192, params_dtype=dtype)  # the device defaults to CUDA
    if kind == "LayerNormLinear":
        return te.LayerNormLinear(256, 192, params_dtype=dtype, normalization="RMSNorm")
    return te.LayerNormMLP(256, 384, params_dtype=dtype, activation="swiglu")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["Linear", "LayerNormLinear", "LayerNormMLP"])
@pytest.mark.parametrize("rname", sorted(RECIPES))
def test_gpu_modules_match_reference(kind, dtype, rname):
    assert te.is_fp8_available(), te.is_fp8_available().reason
    seed = _seed(f"gpu/{kind}/{dtype}/{rname}")
    torch.manual_seed(seed)
    mod = _gpu_module(kind, dtype)
    assert all(p.device.type == "cuda" and p.dtype == dtype for p in mod.parameters())
    with torch.no_grad():
        for name, p in mod.named_parameters():
            if "bias" in name:
                p.normal_()
    gen = torch.Generator(device="cuda").manual_seed(seed)
    rec = RECIPES[rname]
    for _ in range(3):
        mod.zero_grad(set_to_none=True)
        x = (torch.randn(128, 256, device="cuda", generator=gen) * 2).to(dtype).requires_grad_()
        with te.fp8_autocast(enabled=True, fp8_recipe=rec):
            y = mod(x)
        g = torch.randn(y.shape, device="cuda", generator=gen).to(dtype)
        y.backward(g)
    params = [p for _, p in mod.named_parameters()]
    if kind == "Linear":
        fn = lambda x_, w, b: x_ @ w.t() + b
    elif kind == "LayerNormLinear":
        norm = _norm_fn("RMSNorm", False, 1e-5)
        fn = lambda x_, lw, w, b: norm(x_, lw) @ w.t() + b
    else:
        norm, act = _norm_fn("LayerNorm", False, 1e-5), _act_ref("swiglu")
        fn = lambda x_, lw, lb, w1, b1, w2, b2: act(norm(x_, lw, lb) @ w1.t() + b1) @ w2.t() + b2
    yr, gxr, gpr = _reference_grads(fn, x, params, g)
    scale = 2 if kind == "LayerNormMLP" else 1
    _check_close(f"gpu {kind} {dtype} {rname}", y, x, params, yr, gxr, gpr, scale * FWD_TOL, scale * BWD_TOL)
    assert y.dtype == dtype


@pytest.mark.gpu
def test_gpu_is_fp8_available_on_hopper():
    ok, reason = te.is_fp8_available()
    if torch.cuda.get_device_capability() >= (9, 0):
        assert ok and reason == "", reason


def test_block_scaled_recipes_construct_as_in_te_and_say_what_they_are():
    """TE's fp8_primer builds `MXFP8BlockScaling(fp8_format=Format.E4M3)` before it checks availability: the
    objects exist, keep their arguments and answer TE's predicates; using one raises (above)."""
    mx = recipe.MXFP8BlockScaling(fp8_format=recipe.Format.E4M3)
    assert mx.fp8_format is recipe.Format.E4M3 and mx.mxfp8() and not mx.delayed() and not mx.float8_block_scaling()
    assert recipe.Float8BlockScaling().float8_block_scaling() and recipe.NVFP4BlockScaling().nvfp4()
    assert recipe.CustomRecipe(qfactory=None).custom()
    assert repr(mx).startswith("MXFP8BlockScaling(fp8_format="), repr(mx)
    with pytest.raises(AttributeError, match="margin"):
        mx.margin  # not given: TE's defaults are not invented here
    assert not te.is_mxfp8_available()[0]
