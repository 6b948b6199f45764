"""The FP8 weight cache is never used stale: a weight updated in place after its cast (an optimizer step, or a
`no_grad` edit, without a new first microbatch) is cast again by the next call that would reuse the cache.

Each test trains a module one step with `is_first_microbatch=True` (the weights cached), updates its weights
in place under `no_grad`, then calls it with `is_first_microbatch=False`: the result must equal, bitwise, that
of a fresh module loaded from the updated state dict (same weights and FP8 scales, nothing cached), and be
within FP8 tolerance of a float64 reference of the updated weights (a stale cast computes with the old ones).
"""
from __future__ import annotations

import pytest
import torch

import fp8_parallel as fp
from fp8_parallel.modules import GroupedLinear, LayerNormLinear, LayerNormMLP, Linear

RECIPE = fp.DelayedScaling(amax_history_len=4)
SEED = 4242
SPLITS = [5, 0, 11, 16]  # an expert without tokens among them


def _weights(module: torch.nn.Module):
    return [p for name, p in module.named_parameters() if "weight" in name and p.dim() == 2]


def _call(module, x, first, splits=None):
    args = (x, splits) if splits is not None else (x,)
    with fp.autocast(recipe=RECIPE):
        return module(*args, is_first_microbatch=first)


def _cached(module):
    states = [m for m in module.modules() if isinstance(m, fp.modules.FP8State)]
    return [s for s in states if s.weight_fp8 is not None]


def _check(build, width, grad, reference=None, splits=None):
    print(f"seed {SEED}")
    torch.manual_seed(SEED)
    module = build()
    gen = torch.Generator().manual_seed(SEED + 1)
    rows = sum(splits) if splits is not None else 24
    x0 = torch.randn(rows, width, generator=gen)
    _call(module, x0.clone().requires_grad_(), True, splits).square().sum().backward()  # cache + delayed scales
    assert _cached(module), "the first microbatch cached no FP8 weight"
    with torch.no_grad():
        for w in _weights(module):
            w.mul_(-0.5)  # in place: same storage, a new version; the amax stays within the scale's range
    fresh = build()
    fresh.load_state_dict(module.state_dict())
    assert not [s for s in _cached(fresh)], "a fresh module has no cached weight"
    x = torch.randn(rows, width, generator=gen)
    outs, grads = [], []
    for m in (module, fresh):
        xi = x.clone().requires_grad_(grad)
        if grad:
            y = _call(m, xi, False, splits)
            y.square().sum().backward()
            grads.append(xi.grad)
        else:
            with torch.no_grad():
                y = _call(m, xi, False, splits)
        outs.append(y.detach())
    assert torch.equal(outs[0], outs[1]), "the call after an in-place update used the stale FP8 weight"
    if grad:
        assert torch.equal(grads[0], grads[1]), "the backward after an in-place update used the stale FP8 weight"
    if reference is not None:
        ref = reference(module, x.double())
        rel = ((outs[0].double() - ref).norm() / ref.norm()).item()
        assert rel < 0.1, f"relative error {rel:.3f} against the updated weights' float64 result"


def _linear_ref(m, x):
    return x @ m.weight.detach().double().t() + m.bias.detach().double()


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_linear_recasts_a_weight_updated_in_place(grad):
    _check(lambda: Linear(32, 48, device="cpu"), 32, grad, _linear_ref)


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_layernorm_linear_recasts_a_weight_updated_in_place(grad):
    def ref(m, x):
        ln = torch.nn.functional.layer_norm(x, (32,), m.layer_norm_weight.detach().double(),
                                            m.layer_norm_bias.detach().double(), m.eps)
        return _linear_ref(m, ln)

    _check(lambda: LayerNormLinear(32, 48, device="cpu"), 32, grad, ref)


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_layernorm_mlp_recasts_both_weights_updated_in_place(grad):
    def ref(m, x):
        ln = torch.nn.functional.layer_norm(x, (32,), m.layer_norm_weight.detach().double(),
                                            m.layer_norm_bias.detach().double(), m.eps)
        h = torch.nn.functional.gelu(ln @ m.fc1_weight.detach().double().t() + m.fc1_bias.detach().double(),
                                     approximate="tanh")
        return h @ m.fc2_weight.detach().double().t() + m.fc2_bias.detach().double()

    _check(lambda: LayerNormMLP(32, 64, device="cpu"), 32, grad, ref)


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_grouped_linear_recasts_expert_weights_updated_in_place(grad):
    def ref(m, x):
        blocks = x.split(SPLITS)
        return torch.cat([b @ getattr(m, f"weight{i}").detach().double().t() + getattr(m, f"bias{i}").detach().double()
                          for i, b in enumerate(blocks)])

    _check(lambda: GroupedLinear(len(SPLITS), 32, 48, device="cpu"), 32, grad, ref, splits=SPLITS)
