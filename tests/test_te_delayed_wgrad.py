"""TransformerEngine's `delay_wgrad_compute=True`: backward computes input (and bias) gradients only; the
weight gradients are computed when `backward_dw()` runs, bitwise those of the module without delay."""
from __future__ import annotations

import pytest
import torch

import fp8_parallel as te
from te_testing import seed_for

RECIPES = {"hp": None, "delayed": te.DelayedScaling(), "current": te.Float8CurrentScaling()}
BUILDERS = {
    "Linear": (lambda **kw: te.Linear(32, 48, **kw), ["weight"]),
    "LayerNormLinear": (lambda **kw: te.LayerNormLinear(32, 48, **kw), ["weight"]),
    "LayerNormMLP": (lambda **kw: te.LayerNormMLP(32, 64, activation="swiglu", **kw), ["fc1_weight", "fc2_weight"]),
    "GroupedLinear": (lambda **kw: te.GroupedLinear(3, 32, 48, **kw), ["weight0", "weight1", "weight2"]),
}


def _twins(kind: str, label: str):
    """A module with delayed weight gradients, its undelayed twin (same weights) and an input."""
    seed = seed_for(label)
    torch.manual_seed(seed)
    build = BUILDERS[kind][0]
    delayed = build(device="cpu", delay_wgrad_compute=True)
    plain = build(device="cpu")
    plain.load_state_dict(delayed.state_dict())
    return seed, delayed, plain, torch.randn(16, 32, generator=torch.Generator().manual_seed(seed + 1))


def _backward(module, kind, x, recipe):
    x = x.clone().requires_grad_()
    with te.autocast(enabled=recipe is not None, recipe=recipe):
        y = module(x, [9, 0, 7]) if kind == "GroupedLinear" else module(x)
    y.float().square().sum().backward()
    return x.grad


@pytest.mark.parametrize("rname", list(RECIPES))
@pytest.mark.parametrize("kind", list(BUILDERS))
def test_backward_dw_gives_the_gradients_of_the_undelayed_module(kind, rname):
    _, delayed, plain, x = _twins(kind, f"delay/{kind}/{rname}")
    weights = BUILDERS[kind][1]
    assert delayed.need_backward_dw() and not plain.need_backward_dw()
    hooks = []
    delayed.register_wgrad_accumulation_and_reduce_hooks(lambda: hooks.append(len(hooks)))
    for step in range(2):  # the second step: FP8 scales from the first
        for m in (delayed, plain):
            for p in m.parameters():
                p.grad = None
        dx_delayed, dx_plain = _backward(delayed, kind, x, RECIPES[rname]), _backward(plain, kind, x, RECIPES[rname])
        assert torch.equal(dx_delayed, dx_plain)
        params = dict(delayed.named_parameters())
        assert all(params[w].grad is None for w in weights) and hooks == list(range(step))
        delayed.backward_dw()
        assert hooks == list(range(step + 1))
        for name, p in plain.named_parameters():
            assert (p.grad is None) == (params[name].grad is None), name
            if p.grad is not None:
                assert torch.equal(params[name].grad, p.grad), (step, name)
    delayed.backward_dw()  # nothing pending: no effect
    assert hooks == [0, 1] and all(getattr(params[w], "skip_backward_post_hook", False) for w in weights)


def test_each_backward_dw_takes_the_oldest_backward_and_replaces_grad():
    """Two backward passes, then two `backward_dw()`: as TransformerEngine, the first gives the first pass's
    weight gradient, the second replaces it with the second pass's (`.grad` is assigned, not accumulated)."""
    seed = seed_for("delay/queue")
    torch.manual_seed(seed)
    lin = te.Linear(32, 48, device="cpu", delay_wgrad_compute=True)
    gen = torch.Generator().manual_seed(seed)
    xs = [torch.randn(8, 32, generator=gen) for _ in range(2)]
    for x in xs:
        lin(x).sum().backward()
    expected = [torch.ones(8, 48).t() @ x for x in xs]
    for want in expected:
        lin.backward_dw()
        torch.testing.assert_close(lin.weight.grad, want, rtol=1e-6, atol=1e-6)


def test_delayed_gradients_go_to_main_grad_with_fused_accumulation():
    seed = seed_for("delay/main_grad")
    torch.manual_seed(seed)
    mlp = te.LayerNormMLP(32, 64, device="cpu", delay_wgrad_compute=True, fuse_wgrad_accumulation=True)
    plain = te.LayerNormMLP(32, 64, device="cpu")
    plain.load_state_dict(mlp.state_dict())
    for name in ("fc1_weight", "fc2_weight"):
        getattr(mlp, name).main_grad = torch.zeros_like(getattr(mlp, name))
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(seed))
    for m in (mlp, plain):
        with te.autocast(recipe=te.DelayedScaling()):
            m(x).sum().backward()
    assert mlp.fc1_weight.main_grad.abs().sum() == 0
    mlp.backward_dw()
    for name in ("fc1_weight", "fc2_weight"):
        assert getattr(mlp, name).grad is None
        assert torch.equal(getattr(mlp, name).main_grad, getattr(plain, name).grad), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("rname", list(RECIPES))
@pytest.mark.parametrize("kind", list(BUILDERS))
def test_delayed_fused_accumulation_adds_what_the_undelayed_fused_module_adds(kind, rname, dtype):
    """With `fuse_wgrad_accumulation` both add the float32 weight gradient into a float32 `main_grad`, rounded
    once (TransformerEngine's delayed GEMM accumulates into `main_grad` as its undelayed one does): `main_grad`
    bitwise equal after each step, whatever the parameters' dtype."""
    seed = seed_for(f"delay/fused/{kind}/{rname}/{dtype}")
    torch.manual_seed(seed)
    build, weights = BUILDERS[kind]
    delayed = build(device="cpu", params_dtype=dtype, delay_wgrad_compute=True, fuse_wgrad_accumulation=True)
    plain = build(device="cpu", params_dtype=dtype, fuse_wgrad_accumulation=True)
    plain.load_state_dict(delayed.state_dict())
    gen = torch.Generator().manual_seed(seed + 1)
    for name in weights:
        start = torch.rand(getattr(delayed, name).shape, generator=gen)  # a gradient already accumulated
        getattr(delayed, name).main_grad = start.clone()
        getattr(plain, name).main_grad = start.clone()
    x = torch.randn(16, 32, generator=gen).to(dtype)
    for step in range(2):  # the second step: FP8 scales from the first
        _backward(delayed, kind, x, RECIPES[rname])
        _backward(plain, kind, x, RECIPES[rname])
        delayed.backward_dw()
        for name in weights:
            assert getattr(delayed, name).grad is None
            got, want = getattr(delayed, name).main_grad, getattr(plain, name).main_grad
            assert torch.equal(got, want), (step, name, (got - want).abs().max().item())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch sees none)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("rname", list(RECIPES))
def test_gpu_delayed_fused_accumulation_matches_the_undelayed_module(rname, dtype):
    """TE's `test_linear_accuracy_delay_wgrad_compute` with fused accumulation, on CUDA: without FP8 both add
    with the same `addmm` into `main_grad`, bitwise; in FP8 the undelayed compiled path adds in its GEMM's
    epilogue and the delayed one after the same GEMM, so they agree to float32 rounding of the sum."""
    seed = seed_for(f"delay/fused/gpu/{rname}/{dtype}")
    torch.manual_seed(seed)
    delayed = te.Linear(256, 384, params_dtype=dtype, device="cuda", delay_wgrad_compute=True,
                        fuse_wgrad_accumulation=True)
    plain = te.Linear(256, 384, params_dtype=dtype, device="cuda", fuse_wgrad_accumulation=True)
    plain.load_state_dict(delayed.state_dict())
    start = torch.rand(384, 256, device="cuda")
    delayed.weight.main_grad, plain.weight.main_grad = start.clone(), start.clone()
    x = torch.randn(128, 256, device="cuda").to(dtype)
    for step in range(2):
        _backward(delayed, "Linear", x, RECIPES[rname])
        _backward(plain, "Linear", x, RECIPES[rname])
        delayed.backward_dw()
        got, want = delayed.weight.main_grad, plain.weight.main_grad
        if rname == "hp":
            assert torch.equal(got, want), step
        else:
            torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-6)
        assert not torch.equal(got, start)


@pytest.mark.parametrize("rname", list(RECIPES))
@pytest.mark.parametrize("kind", ["Linear", "LayerNormMLP"])
def test_delayed_gradients_under_torch_autocast(kind, rname):
    """Forward inside `torch.autocast` (bf16), backward and `backward_dw()` outside it, as torch's AMP recipe
    runs them: the gradients are bitwise those of the undelayed module (a delayed high-precision weight
    gradient used to mix bf16 and float32 operands and fail)."""
    _, delayed, plain, x = _twins(kind, f"delay/autocast/{kind}/{rname}")
    grads = []
    for m in (delayed, plain):
        xi = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16), \
                te.autocast(enabled=RECIPES[rname] is not None, recipe=RECIPES[rname]):
            y = m(xi)
        y.float().square().sum().backward()
        m.backward_dw()
        grads.append([xi.grad] + [p.grad for p in m.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


@pytest.mark.parametrize("rname", ["delayed", "current"])
def test_fp8_backward_does_not_depend_on_an_enclosing_torch_autocast(rname):
    """The FP8 backward gives the same gradients whether `backward()` runs inside or outside the
    `torch.autocast` region of the forward (it used to differ by up to 3e-2 on CPU)."""
    seed = seed_for(f"delay/ambient/{rname}")
    torch.manual_seed(seed)
    base = te.Linear(32, 16, device="cpu")
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(seed + 1))
    grads = []
    for inside in (False, True):
        m = te.Linear(32, 16, device="cpu")
        m.load_state_dict(base.state_dict())
        xi = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            with te.autocast(recipe=RECIPES[rname]):
                y = m(xi)
            if inside:
                y.float().sum().backward()
        if not inside:
            y.float().sum().backward()
        grads.append([xi.grad, m.weight.grad, m.bias.grad])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_frozen_weight_is_skipped_by_backward_dw():
    """A frozen fc1 weight leaves no delayed gradient; backward_dw() computes fc2's and leaves fc1's None."""
    _, mlp, plain, x = _twins("LayerNormMLP", "delay/frozen")
    for m in (mlp, plain):
        m.fc1_weight.requires_grad_(False)
        _backward(m, "LayerNormMLP", x, None)
    mlp.backward_dw()
    assert mlp.fc1_weight.grad is None and torch.equal(mlp.fc2_weight.grad, plain.fc2_weight.grad)
