"""Fused weight-gradient accumulation (`fp8_linear(..., fuse_wgrad_accumulation=True)`, megatron's
`gradient_accumulation_fusion`, TransformerEngine's `fuse_wgrad_accumulation`): the weight gradient is
accumulated in float32 and added into `weight.main_grad`, with megatron's protocol flag and placeholder.

The reference is the same call without fusion, whose gradient is rounded to the parameter's dtype before it
would be added: with float32 parameters the two agree to float32 rounding; with bf16 / fp16 parameters the
fused result is the more exact one, checked against a float64 sum of the unrounded gradients.
"""
from __future__ import annotations

import pytest
import torch

import fp8_parallel as fp
from fp8_parallel.modules import FP8State, fp8_linear
from fp8_parallel.testing import add_weight_gradient
from te_testing import rel_error, seed_for

RECIPES = {"hp": None, "delayed": fp.DelayedScaling(amax_history_len=4), "current": fp.Float8CurrentScaling()}
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _steps(weight, state, recipe, batches, fuse: bool, cached: bool):
    """Two microbatches per batch through `fp8_linear`; returns outputs, input gradients and, per call, the
    weight gradient autograd got (float32), or what was added into main_grad."""
    outs, wgrads = [], []
    for i, (x, dy) in enumerate(batches):
        x0 = x.clone().requires_grad_()
        xr = x0 * 1.5 if i % 2 else x0  # an activation (its FP8 transpose kept) and a leaf (re-cast in backward)
        before = weight.main_grad.clone() if fuse else None
        with fp.autocast(enabled=recipe is not None, recipe=recipe or fp.DelayedScaling(), group=None):
            y = fp8_linear(xr, weight, None, state, is_first_microbatch=(i % 2 == 0) if cached else None,
                           fuse_wgrad_accumulation=fuse)
        y.backward(dy)
        outs += [y.detach(), x0.grad]
        if fuse:
            assert weight.grad_added_to_main_grad, "the protocol flag is set"
            wgrads.append((weight.main_grad - before).float())
            weight.grad = None  # megatron's DDP hook: the placeholder is dropped
        else:
            wgrads.append(weight.grad.float())
            weight.grad = None
    return outs, wgrads


@pytest.mark.parametrize("rname", list(RECIPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("main_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cached", [False, True], ids=["uncached", "cached"])
@pytest.mark.parametrize("device", DEVICES)
def test_fused_accumulation_adds_the_weight_gradient(rname, dtype, main_dtype, cached, device):
    seed = seed_for(f"fused_wgrad/{rname}/{dtype}/{main_dtype}/{cached}/{device}")
    if device == "cpu" and dtype == torch.float16:
        pytest.skip("float16 GEMMs on the CPU are not what this checks")
    gen = torch.Generator().manual_seed(seed)
    recipe = RECIPES[rname]
    w0 = torch.randn(48, 64, generator=gen) / 8
    batches = [((torch.randn(32, 64, generator=gen) * 2).to(device, dtype), torch.randn(32, 48, generator=gen).to(device, dtype))
               for _ in range(4)]
    start = torch.randn(48, 64, generator=gen).to(device, main_dtype)
    results = {}
    for fuse in (True, False):
        weight = torch.nn.Parameter(w0.to(device, dtype))
        weight.main_grad = start.clone()
        weight.grad_added_to_main_grad = False
        state = FP8State("t", device=torch.device(device))
        results[fuse] = _steps(weight, state, recipe, batches, fuse, cached), weight
    (outs_f, wg_f), wf = results[True]
    (outs_u, wg_u), _ = results[False]
    for a, b in zip(outs_f, outs_u):  # fusion changes nothing but where the weight gradient goes
        assert torch.equal(a, b)
    for i, (a, b) in enumerate(zip(wg_f, wg_u)):
        # unfused: rounded to the parameter's dtype; fused: float32 (rounded once into main_grad's dtype)
        tol = {torch.float32: 2e-6, torch.bfloat16: 8e-3, torch.float16: 1e-3}[dtype]
        if main_dtype == torch.bfloat16:
            tol = max(tol, 1e-2)  # the difference of two bf16 main_grad states
        assert rel_error(a, b) < tol, (i, rel_error(a, b))
    total = start.double() + sum(b.double() for b in wg_u)
    tol = {torch.float32: 1e-6, torch.bfloat16: 8e-3, torch.float16: 1e-3}[dtype]
    if main_dtype == torch.bfloat16:
        tol = 1e-2
    assert wf.main_grad.dtype == main_dtype
    assert rel_error(wf.main_grad, total) < tol, rel_error(wf.main_grad, total)


@pytest.mark.parametrize("device", DEVICES)
def test_fused_accumulation_protocol_and_errors(device):
    """Without megatron's attribute autograd gets no gradient (`.grad` stays None, as TransformerEngine); with
    it, the flag and a placeholder of the weight's shape; `zero_out_wgrad` gives zeros. A missing or misshapen
    `main_grad` is an error naming the parameter's shape, from the modules' check."""
    from fp8_parallel.testing import accumulates_into_main_grad

    seed = seed_for(f"fused_wgrad/protocol/{device}")
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(16, 32, generator=gen).to(device)
    for attr, zero in ((False, False), (True, False), (True, True)):
        weight = torch.nn.Parameter((torch.randn(48, 32, generator=gen) / 6).to(device))
        weight.main_grad = torch.zeros(48, 32, device=device)
        if attr:
            weight.grad_added_to_main_grad = False
        if zero:
            weight.zero_out_wgrad = True
        with fp.autocast(recipe=fp.DelayedScaling(), group=None):
            y = fp8_linear(x, weight, None, FP8State("t", device=torch.device(device)), fuse_wgrad_accumulation=True)
        y.sum().backward()
        assert weight.main_grad.abs().sum() > 0
        if not attr:
            assert weight.grad is None
        else:
            assert weight.grad_added_to_main_grad and weight.grad.shape == weight.shape
            if zero:
                assert not weight.grad.any()
    weight = torch.nn.Parameter(torch.randn(48, 32, device=device))
    with pytest.raises(RuntimeError, match=r"needs a `main_grad` tensor of its shape \(48, 32\).*found none"):
        accumulates_into_main_grad(weight, True, "ColumnParallelLinear", "weight")
    weight.main_grad = torch.zeros(32, 48, device=device)
    with pytest.raises(RuntimeError, match=r"found shape \(32, 48\)"):
        accumulates_into_main_grad(weight, True, "ColumnParallelLinear", "weight")
    with torch.no_grad():
        assert not accumulates_into_main_grad(weight, True, "ColumnParallelLinear", "weight")  # nothing to add


@pytest.mark.gpu
@pytest.mark.parametrize("in_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("main_dtype", [torch.float32, torch.bfloat16])
def test_add_weight_gradient_on_cuda_matches_float64(in_dtype, main_dtype):
    """The high-precision path's one-GEMM accumulation (cuBLAS adding into the buffer) against float64."""
    seed = seed_for(f"add_weight_gradient/{in_dtype}/{main_dtype}")
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(300, 96, generator=gen).to("cuda", in_dtype)
    x = torch.randn(300, 80, generator=gen).to("cuda", in_dtype)
    start = torch.randn(96, 80, generator=gen).to("cuda", main_dtype)
    acc = start.clone()
    add_weight_gradient(acc, g, x)
    want = start.double() + g.double().t() @ x.double()
    tol = 1e-5 if main_dtype == torch.float32 else 8e-3
    if in_dtype == torch.float32 and main_dtype == torch.float32:
        tol = 1e-4  # TF32 may be on for float32 GEMMs
    assert acc.dtype == main_dtype and rel_error(acc, want) < tol, rel_error(acc, want)


def test_high_precision_fused_linear_adds_into_the_owners_main_grad():
    """FP8 off, a weight that stands for a parameter (an FP8 parameter's dequantized value): the gradient goes
    into the parameter's `main_grad` and its flag; autograd gets a placeholder shaped as the stand-in."""
    from fp8_parallel.testing import linear_into_main_grad

    seed = seed_for("fused_wgrad/owner")
    gen = torch.Generator().manual_seed(seed)
    owner = torch.nn.Parameter(torch.randn(48, 32, generator=gen))
    owner.main_grad = torch.randn(48, 32, generator=gen)
    owner.grad_added_to_main_grad = False
    start = owner.main_grad.clone()
    source = torch.randn(48, 32, generator=gen).to(torch.bfloat16).requires_grad_()
    x = torch.randn(16, 32, generator=gen).to(torch.bfloat16).requires_grad_()
    y = linear_into_main_grad(x, source * 1.0, None, owner=owner)
    g = torch.randn(y.shape, generator=gen).to(y.dtype)
    y.backward(g)
    want = start.double() + g.double().t() @ x.detach().double()
    assert rel_error(owner.main_grad, want) < 1e-6 and owner.grad_added_to_main_grad
    assert owner.grad is None and source.grad.shape == source.shape and source.grad.dtype == torch.bfloat16
    torch.testing.assert_close(x.grad.float(), (g.float() @ source.detach().float()), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("shape", [(30, 25), (64, 48)], ids=["unaligned", "aligned"])
@pytest.mark.parametrize("recompute", [None, True, False], ids=["plain", "reentrant", "non-reentrant"])
@pytest.mark.parametrize("rname", list(RECIPES))
@pytest.mark.parametrize("device", DEVICES)
def test_fused_accumulation_with_recompute_and_unaligned_features(shape, recompute, rname, device):
    """A TE-style `Linear` with `fuse_wgrad_accumulation` under activation checkpointing (reentrant or not) and
    with features that are not multiples of 16: main_grad equals the unfused twin's `.grad` (float32
    parameters: float32 rounding apart), and is added once (a recompute adds nothing of its own)."""
    from torch.utils.checkpoint import checkpoint

    seed = seed_for(f"fused_wgrad/recompute/{shape}/{recompute}/{rname}/{device}")
    torch.manual_seed(seed)
    fin, fout = shape
    fused = fp.Linear(fin, fout, device=device, fuse_wgrad_accumulation=True)
    plain = fp.Linear(fin, fout, device=device)
    plain.load_state_dict(fused.state_dict())
    fused.weight.main_grad = torch.zeros(fout, fin, device=device)
    fused.weight.grad_added_to_main_grad = False
    gen = torch.Generator().manual_seed(seed + 1)
    recipe = RECIPES[rname]
    for _ in range(2):
        x = (torch.randn(21, fin, generator=gen) * 2).to(device)
        for module in (fused, plain):
            xr = x.clone().requires_grad_()
            with fp.autocast(enabled=recipe is not None, recipe=recipe or fp.DelayedScaling(), group=None):
                y = module(xr) if recompute is None else checkpoint(module, xr, use_reentrant=recompute)
            y.float().square().sum().backward()
        fused.weight.grad = None
    assert rel_error(fused.weight.main_grad, plain.weight.grad) < 1e-5, rel_error(fused.weight.main_grad, plain.weight.grad)
    assert torch.equal(fused.bias.grad, plain.bias.grad)
