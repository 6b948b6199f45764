"""A recipe's `backward_override` (TransformerEngine's): the forward GEMM in FP8, the backward GEMMs in high
precision, from the forward's input and weight ("high_precision") or from their FP8 casts dequantized
("dequantized"); the gradient itself is never cast."""
from __future__ import annotations

import pytest
import torch

import fp8_parallel as te
from fp8_parallel import recipe
from te_testing import rel_error, seed_for

RECIPES = {
    "delayed": lambda override: recipe.DelayedScaling(backward_override=override),
    "current": lambda override: recipe.Float8CurrentScaling(backward_override=override),
}


def _pair(seed: int, dtype: torch.dtype, bias: bool = True):
    mods = []
    for _ in range(2):
        torch.manual_seed(seed)
        mods.append(te.Linear(40, 24, bias=bias, params_dtype=dtype, device="cpu"))
    return mods


def _step(module, x, g, rcp):
    xi = x.clone().requires_grad_()
    with te.fp8_autocast(enabled=True, fp8_recipe=rcp):
        y = module(xi)
    y.backward(g)
    return y, xi.grad


@pytest.mark.parametrize("rname", list(RECIPES))
@pytest.mark.parametrize("override", ["high_precision", "dequantized"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backward_override_matches_high_precision_gemms(rname, override, dtype):
    seed = seed_for(f"backward-override/{rname}/{override}/{dtype}")
    gen = torch.Generator().manual_seed(seed)
    overridden, plain = _pair(seed, dtype)
    for step in range(2):  # the second step casts with delayed scales from the first
        x = torch.randn(3, 6, 40, generator=gen).to(dtype)
        g = torch.randn(3, 6, 24, generator=gen).to(dtype)
        w = overridden.weight.detach().clone()
        scale_before = overridden.fp8.fwd.scale[:2].clone()  # what a delayed-scaling forward casts with
        for p in overridden.parameters():
            p.grad = None
        y, gx = _step(overridden, x, g, RECIPES[rname](override))
        y_plain, _ = _step(plain, x, g, RECIPES[rname](None))
        where = f"step {step}, seed {seed}"
        assert torch.equal(y, y_plain), f"the forward is the FP8 forward ({where})"
        if override == "high_precision":
            x_used, w_used = x.double(), w.double()
        else:  # the forward's casts, dequantized: the scales the forward used
            if rname == "delayed":
                sx, sw = scale_before[0], scale_before[1]
            else:  # current scaling: each cast's scale from its own amax
                sx, sw = 448.0 / x.abs().max().float(), 448.0 / w.abs().max().float()
            x_used = ((x.float() * sx).to(torch.float8_e4m3fn).float() / sx).to(dtype).double()
            w_used = ((w.float() * sw).to(torch.float8_e4m3fn).float() / sw).to(dtype).double()
        g2 = g.double().reshape(-1, 24)
        want_gx = (g2 @ w_used).reshape(x.shape)
        want_gw = g2.t() @ x_used.reshape(-1, 40)
        tol = 1e-6 if dtype == torch.float32 else 1e-2
        assert rel_error(gx, want_gx) < tol, (override, rel_error(gx, want_gx), where)
        assert rel_error(overridden.weight.grad, want_gw) < tol, (override, rel_error(overridden.weight.grad, want_gw), where)
        assert torch.allclose(overridden.bias.grad.double(), g2.sum(0), rtol=tol, atol=tol)
    assert torch.equal(overridden.fp8.bwd.amax_history, torch.zeros_like(overridden.fp8.bwd.amax_history)), \
        "no gradient is cast: no backward amax"
    assert plain.fp8.bwd.amax_history.abs().sum() > 0 or rname == "current"


def test_backward_override_dequantized_differs_from_high_precision():
    """The two overrides are told apart: with inputs the FP8 cast rounds visibly, their gradients differ."""
    seed = seed_for("backward-override-differ")
    gen = torch.Generator().manual_seed(seed)
    a, b = _pair(seed, torch.float32)
    x, g = torch.randn(16, 40, generator=gen) * 3, torch.randn(16, 24, generator=gen)
    _step(a, x, g, recipe.Float8CurrentScaling(backward_override="high_precision"))
    _step(b, x, g, recipe.Float8CurrentScaling(backward_override="dequantized"))
    assert not torch.equal(a.weight.grad, b.weight.grad), f"seed {seed}"
    assert rel_error(a.weight.grad, b.weight.grad) < 0.1, f"seed {seed}"


def test_backward_override_value_is_checked():
    with pytest.raises(ValueError, match="backward_override='fp32'"):
        recipe.DelayedScaling(backward_override="fp32")
