"""`module.fp8_meta`: TransformerEngine's keys and layout, read from the module's FP8 state."""
from __future__ import annotations

import torch

import fp8_parallel as te
from fp8_parallel import recipe
from te_testing import seed_for

RECIPE = recipe.DelayedScaling(amax_history_len=4)


def _steps(module, inputs, grads, call=lambda m, x: m(x)):
    for x, g in zip(inputs, grads):
        with te.fp8_autocast(enabled=True, fp8_recipe=RECIPE):
            y = call(module, x.clone().requires_grad_())
        y.backward(g)


def _seeded(name: str):
    """The test's seed (printed), torch's generator seeded with it, and a generator for the data."""
    seed = seed_for(name)
    print(f"seed {seed}")
    torch.manual_seed(seed)
    return seed, torch.Generator().manual_seed(seed)


def test_linear_fp8_meta_has_te_keys_and_history_layout():
    seed, gen = _seeded("fp8-meta-linear")
    lin = te.Linear(32, 16, params_dtype=torch.float32, device="cpu")
    xs = [torch.randn(8, 32, generator=gen) * (1 + i) for i in range(3)]
    gs = [torch.randn(8, 16, generator=gen) * (1 + i) for i in range(3)]
    _steps(lin, xs, gs)
    meta = lin.fp8_meta
    assert meta["recipe"] == RECIPE and meta["num_gemms"] == 1 and meta["fp8_max_fwd"] == 448.0
    assert meta["fp8_max_bwd"] == 57344.0
    fwd, bwd = meta["scaling_fwd"], meta["scaling_bwd"]
    assert fwd.scale.shape == (3,) and fwd.amax_history.shape == (4, 3) and bwd.amax_history.shape == (4, 2)
    assert torch.equal(fwd.amax_history[0], torch.zeros(3)) and torch.equal(bwd.amax_history[0], torch.zeros(2))
    w_amax = lin.weight.detach().abs().max()
    for back, step in ((1, 2), (2, 1), (3, 0)):  # the last row the latest step, as TE's history after its update
        row = fwd.amax_history[-back]
        assert torch.equal(row[0], xs[step].abs().max()) and torch.equal(row[2], torch.zeros(())), (back, row)
        assert torch.equal(bwd.amax_history[-back, 0], gs[step].abs().max()), (back, f"seed {seed}")
    assert torch.equal(fwd.amax_history[-1, 1], w_amax), f"seed {seed}"
    assert torch.equal(fwd.scale[:2], lin.fp8.fwd.scale[:2]) and fwd.scale[2] == 1
    assert torch.equal(fwd.scale_inv, fwd.scale.reciprocal()) and bwd.scale[1] == 1
    fwd.scale.fill_(7.0)  # a copy: the module's scales stay
    assert not torch.equal(lin.fp8.fwd.scale[:2], torch.full((2,), 7.0))


def test_mlp_and_grouped_fp8_meta_index_the_gemms_as_te():
    seed, gen = _seeded("fp8-meta-mlp-grouped")
    mlp = te.LayerNormMLP(32, 64, params_dtype=torch.float32, device="cpu")
    _steps(mlp, [torch.randn(8, 32, generator=gen)], [torch.randn(8, 32, generator=gen)])
    fwd, bwd = mlp.fp8_meta["scaling_fwd"], mlp.fp8_meta["scaling_bwd"]
    assert mlp.fp8_meta["num_gemms"] == 2 and fwd.scale.shape == (6,) and bwd.scale.shape == (4,)
    for gemm, state in enumerate((mlp.fc1_fp8, mlp.fc2_fp8)):  # GEMM1 = fc1: forward 0..2, backward 0..1
        assert torch.equal(fwd.scale[3 * gemm: 3 * gemm + 2], state.fwd.scale[:2]), gemm
        assert torch.equal(bwd.amax_history[-1, 2 * gemm], state.bwd.amax_history[0, 0]), gemm
    assert bwd.amax_history[-1, 0] > 0 and bwd.amax_history[-1, 2] > 0
    splits = [3, 0, 5]
    grouped = te.GroupedLinear(3, 32, 16, bias=False, params_dtype=torch.float32, device="cpu")
    _steps(grouped, [torch.randn(8, 32, generator=gen)], [torch.randn(8, 16, generator=gen)],
           call=lambda m, x: m(x, splits))
    fwd, bwd = grouped.fp8_meta["scaling_fwd"], grouped.fp8_meta["scaling_bwd"]
    assert fwd.scale.shape == (9,) and bwd.scale.shape == (6,)
    for g, state in enumerate(grouped.fp8):  # by kind: inputs 0..2, weights 3..5, outputs 6..8
        assert torch.equal(fwd.amax_history[-1, g], state.fwd.amax_history[0, 0]), g
        assert torch.equal(fwd.amax_history[-1, 3 + g], state.fwd.amax_history[1, 0]), g
        assert torch.equal(bwd.amax_history[-1, g], state.bwd.amax_history[0, 0]), g
    assert torch.equal(fwd.amax_history[-1, 6:], torch.zeros(3)) and fwd.amax_history[-1, 3:6].min() > 0
