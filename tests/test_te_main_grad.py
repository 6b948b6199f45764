"""TransformerEngine's `fuse_wgrad_accumulation=True`: weight gradients are added into `param.main_grad` (as
megatron's DistributedDataParallel expects) instead of `.grad`, in every TE-style module that has weights."""
from __future__ import annotations

import pytest
import torch

import fp8_parallel as te
from te_testing import seed_for

RECIPES = {"hp": None, "delayed": te.DelayedScaling(), "current": te.Float8CurrentScaling()}
BUILDERS = {
    "Linear": lambda **kw: te.Linear(32, 48, **kw),
    "LayerNormLinear": lambda **kw: te.LayerNormLinear(32, 48, **kw),
    "LayerNormMLP": lambda **kw: te.LayerNormMLP(32, 64, activation="swiglu", **kw),
    "GroupedLinear": lambda **kw: te.GroupedLinear(3, 32, 48, **kw),
    "MultiheadAttention": lambda **kw: te.MultiheadAttention(32, 4, attention_dropout=0.0, fuse_qkv_params=False,
                                                             input_layernorm=True, **kw),
    "TransformerLayer": lambda **kw: te.TransformerLayer(32, 64, 4, hidden_dropout=0.0, attention_dropout=0.0, **kw),
}


def _gemm_weights(module: torch.nn.Module):
    """The parameters TE routes through fused accumulation: the linear layers' weights (not the norms')."""
    linear_types = (te.Linear, te.LayerNormLinear, te.LayerNormMLP, te.GroupedLinear)
    names = []
    for prefix, sub in module.named_modules():
        if isinstance(sub, linear_types):
            for name, _ in sub.named_parameters(recurse=False):
                if "weight" in name and not name.startswith("layer_norm"):
                    names.append(f"{prefix}.{name}" if prefix else name)
    return names


def _run(module: torch.nn.Module, kind: str, x: torch.Tensor, recipe) -> None:
    with te.autocast(enabled=recipe is not None, recipe=recipe):
        y = module(x.reshape(-1, 32), [7, 0, 9]) if kind == "GroupedLinear" else module(x)
    (y[0] if isinstance(y, tuple) else y).float().square().sum().backward()


@pytest.mark.parametrize("rname", list(RECIPES))
@pytest.mark.parametrize("kind", list(BUILDERS))
def test_weight_gradients_accumulate_into_main_grad(kind, rname):
    """Two backward passes: each fused weight's main_grad is its starting value plus both gradients of the same
    module without fusion, `.grad` stays None; every other parameter's `.grad` is unchanged."""
    seed = seed_for(f"main_grad/{kind}/{rname}")
    torch.manual_seed(seed)
    fused = BUILDERS[kind](device="cpu", fuse_wgrad_accumulation=True)
    plain = BUILDERS[kind](device="cpu")
    plain.load_state_dict(fused.state_dict())
    names = _gemm_weights(fused)
    params = dict(fused.named_parameters())
    assert names and all(n in params for n in names), names
    start = {}
    for n in names:
        params[n].main_grad = torch.randn(params[n].shape, dtype=torch.float32)
        start[n] = params[n].main_grad.clone()
    gen = torch.Generator().manual_seed(seed + 1)
    xs = [torch.randn(8, 2, 32, generator=gen) for _ in range(2)]
    for module in (fused, plain):
        for x in xs:
            _run(module, kind, x, RECIPES[rname])
    for n, p in plain.named_parameters():
        q = params[n]
        if n in names:
            assert q.grad is None, n
            torch.testing.assert_close(q.main_grad, start[n] + p.grad, rtol=1e-5, atol=1e-6, msg=n)
            assert torch.equal(q.main_grad, start[n]) == (not p.grad.any()), n  # an expert without tokens: 0
        elif p.grad is not None:
            assert torch.equal(q.grad, p.grad), n


def test_megatron_protocol_flag_and_zero_out_wgrad():
    """With megatron's `grad_added_to_main_grad` attribute the flag is set and autograd gets a buffer in place
    of the gradient (zeros when the parameter has `zero_out_wgrad`), as TransformerEngine does."""
    seed = seed_for("main_grad/protocol")
    torch.manual_seed(seed)
    lin = te.Linear(32, 48, device="cpu", fuse_wgrad_accumulation=True)
    lin.weight.main_grad = torch.zeros(48, 32)
    lin.weight.grad_added_to_main_grad = False
    lin.weight.zero_out_wgrad = True
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(seed))
    lin(x).sum().backward()
    assert lin.weight.grad_added_to_main_grad is True
    assert torch.equal(lin.weight.grad, torch.zeros_like(lin.weight))
    assert lin.weight.main_grad.abs().sum() > 0 and lin.bias.grad is not None


def test_missing_main_grad_names_the_parameter():
    lin = te.LayerNormMLP(32, 64, device="cpu", fuse_wgrad_accumulation=True)
    x = torch.randn(4, 32)
    with pytest.raises(RuntimeError, match="LayerNormMLP.*'fc1_weight'.*main_grad"):
        lin(x)
    with torch.no_grad():  # no gradient to compute: no main_grad needed
        lin(x)
    lin.fc1_weight.main_grad = lin.fc2_weight.main_grad = torch.zeros(3)
    with pytest.raises(RuntimeError, match=r"shape \(3,\)"):
        lin(x)


def test_bfloat16_weights_accumulate_in_float32():
    seed = seed_for("main_grad/bf16")
    torch.manual_seed(seed)
    lin = te.Linear(32, 48, device="cpu", params_dtype=torch.bfloat16, fuse_wgrad_accumulation=True)
    lin.weight.main_grad = torch.zeros(48, 32, dtype=torch.float32)
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(seed)).bfloat16()
    for _ in range(3):
        with te.autocast(recipe=te.DelayedScaling()):
            lin(x).float().sum().backward()
    assert lin.weight.main_grad.dtype == torch.float32 and lin.weight.grad is None
    reference = 3 * (torch.ones(8, 48, dtype=torch.float64).t() @ x.double())
    rel = ((lin.weight.main_grad.double() - reference).norm() / reference.norm()).item()
    assert rel < 0.1, rel
