"""Fused weight-gradient accumulation of the experts' linears (megatron's `gradient_accumulation_fusion`,
TransformerEngine's `fuse_wgrad_accumulation`) on every path a grouped call takes: the direct per-expert
backward GEMMs (HYBRID), the grouped weight-gradient GEMM (E4M3), the per-expert `linear_backward` (current
scaling) and the bfloat16 grouped GEMM without FP8.

References, over two microbatches with weight caching then one without:
- the per-expert path with fusion (itself checked against its unfused twin in `test_fused_wgrad.py`): bit for
  bit where both accumulate the same float32 products (HYBRID, current scaling; on the GPU the compiled path
  adds in the GEMM's epilogue: float32 rounding apart), within the grouped GEMM's rounding elsewhere;
- the same grouped path without fusion, its bfloat16 gradients added into float32 as megatron's DDP hook
  adds them: bit for bit where the grouped GEMM's gradient is what is added (E4M3, bfloat16), within
  bfloat16 rounding of the gradient where fusion skips that rounding.
An expert without rows leaves its `main_grad` untouched. On CPU the FP8 grouped GEMM is emulated (see
`test_grouped_gemm.py`); torch's bfloat16 grouped GEMM is real. Every test prints its seed.
"""
from __future__ import annotations

from typing import Dict, List

import pytest
import torch

import fp8_parallel as te
from fp8_parallel import testing
from te_testing import rel_error as _rel, seed_for as _seed
from test_grouped_gemm import IN, OUT, RECIPES, SPLITS, _emulated_grouped_mm

PATHS = ["delayed-hybrid", "delayed-e4m3", "current-hybrid", "bf16"]
# grouped GEMMs per step of each path: the FP8 forward; E4M3 also both backward GEMMs; bf16 all three
GROUPED_PER_STEP = {"delayed-hybrid": 1, "delayed-e4m3": 3, "current-hybrid": 1, "bf16": 3}
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _counting_grouped_gemms(path: str, device: str, monkeypatch) -> List[int]:
    """Route the grouped calls (emulated FP8 grouped GEMM on CPU) and count the grouped GEMMs."""
    calls: List[int] = []
    if path == "bf16":
        real = torch._grouped_mm
        monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **k: calls.append(1) or real(*a, **k))
        if device == "cpu":
            testing.set_grouped_gemm(monkeypatch, bf16_device=True)
    elif device == "cpu":
        monkeypatch.setattr(torch, "_scaled_grouped_mm", _emulated_grouped_mm(calls), raising=False)
        testing.set_grouped_gemm(monkeypatch, fp8_device=True)
    else:
        real = torch._scaled_grouped_mm
        monkeypatch.setattr(torch, "_scaled_grouped_mm", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def _skip_without_grouped_gemm(device: str) -> None:
    if device == "cuda" and not testing.device_has_grouped_gemm(torch.device("cuda")):
        pytest.skip("torch's grouped GEMMs do not serve the experts on this GPU (compute capability 9.0 / 10.0)")


def _experts(seed: int, device: str, fuse: bool, starts: List[torch.Tensor]) -> te.GroupedLinear:
    gen = torch.Generator().manual_seed(seed)
    lin = te.GroupedLinear(len(SPLITS), IN, OUT, bias=False, device=device, params_dtype=torch.bfloat16,
                           fuse_wgrad_accumulation=fuse)
    lin.use_grouped_gemm = True
    with torch.no_grad():
        for i in range(len(SPLITS)):
            w = getattr(lin, f"weight{i}")
            w.copy_(torch.randn(w.shape, generator=gen) * IN**-0.5)
            w.main_grad = starts[i].clone()  # megatron's DDP buffer, not zero: the add must keep what is there
            w.grad_added_to_main_grad = False
    return lin


def _steps(lin, path: str, batches, grouped: bool, fuse: bool, monkeypatch) -> Dict[str, List[torch.Tensor]]:
    """Three calls (cached weights for two microbatches, then a cast per call); after each the `main_grad`s as
    megatron's DDP hook leaves them (unfused: the gradient added into float32), outputs and input gradients."""
    testing.set_grouped_gemm(monkeypatch, grouped)
    seen: Dict[str, List[torch.Tensor]] = {"y": [], "dx": [], "main_grad": []}
    for step, (x, dy) in enumerate(batches):
        xi = x.clone().requires_grad_()
        first = (step == 0) if step < 2 else None
        with te.autocast(enabled=path != "bf16", recipe=RECIPES.get(path)):
            y = lin(xi, SPLITS, is_first_microbatch=first)
        y.backward(dy)
        for i in range(len(SPLITS)):
            w = getattr(lin, f"weight{i}")
            assert w.grad is not None and w.grad.shape == w.shape, f"weight{i} step {step}"
            assert w.grad_added_to_main_grad is fuse, f"weight{i} step {step}: protocol flag"
            if not fuse:  # the hook's add
                assert w.grad.dtype == torch.bfloat16
                w.main_grad.add_(w.grad)
            w.grad, w.grad_added_to_main_grad = None, False
        seen["y"].append(y.detach())
        seen["dx"].append(xi.grad)
        seen["main_grad"].append(torch.stack([getattr(lin, f"weight{i}").main_grad.clone() for i in range(len(SPLITS))]))
    return seen


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("device", DEVICES)
def test_grouped_fused_accumulation_matches_references(path, device, monkeypatch):
    _skip_without_grouped_gemm(device)
    seed = _seed(f"grouped-fused-wgrad/{path}/{device}")
    gen = torch.Generator().manual_seed(seed)
    rows = sum(SPLITS)
    batches = [((torch.randn(rows, IN, generator=gen) * 2).to(device, torch.bfloat16),
                torch.randn(rows, OUT, generator=gen).to(device, torch.bfloat16)) for _ in range(3)]
    starts = [torch.randn(OUT, IN, generator=gen).to(device) for _ in SPLITS]
    calls = _counting_grouped_gemms(path, device, monkeypatch)
    direct = testing.record_direct_expert_backwards(monkeypatch)
    fused = _steps(_experts(seed, device, True, starts), path, batches, True, True, monkeypatch)
    assert len(calls) == 3 * GROUPED_PER_STEP[path], f"{len(calls)} grouped GEMMs: not the grouped path (seed {seed})"
    assert len(direct) == (3 if path == "delayed-hybrid" else 0), f"direct backward ran {len(direct)} times"
    unfused = _steps(_experts(seed, device, False, starts), path, batches, True, False, monkeypatch)
    per_expert = _steps(_experts(seed, device, True, starts), path, batches, False, True, monkeypatch)
    same_products = path in ("delayed-hybrid", "current-hybrid")  # fusion and the per-expert path: float32 products
    for step in range(3):
        where = f"{path} {device} step {step} (seed {seed})"
        assert torch.equal(fused["y"][step], unfused["y"][step]), f"output {where}"
        assert torch.equal(fused["dx"][step], unfused["dx"][step]), f"input grad {where}"
        got, plain, ref = fused["main_grad"][step], unfused["main_grad"][step], per_expert["main_grad"][step]
        start = torch.stack(starts)
        assert torch.equal(got[1], start[1]), f"the expert without rows changed its main_grad {where}"
        delta, plain_delta, ref_delta = got - start, plain - start, ref - start
        if same_products:
            if device == "cpu":
                assert torch.equal(got, ref), f"main_grad differs from the per-expert path's {where}"
            else:  # the compiled path adds in the GEMM's epilogue
                assert _rel(delta, ref_delta) < 1e-6, f"main_grad {_rel(delta, ref_delta):.2e} {where}"
            # the unfused gradients were rounded to bfloat16 before the add
            assert 0 < _rel(delta, plain_delta) < 1e-2, f"main_grad {_rel(delta, plain_delta):.2e} from unfused {where}"
        else:
            assert torch.equal(got, plain), f"main_grad differs from the unfused grouped path's {where}"
            assert _rel(delta, ref_delta) < 1e-2, f"main_grad {_rel(delta, ref_delta):.2e} from the per-expert {where}"
        assert delta[0].abs().max() > 0 and delta[3].abs().max() > 0, f"nothing was accumulated {where}"


@pytest.mark.parametrize("device", DEVICES)
def test_grouped_fused_accumulation_frozen_expert_and_missing_buffer(device, monkeypatch):
    """A frozen expert takes no gradient and needs no `main_grad`; a trainable one without it is refused,
    naming the weight; the grouped path serves the others (HYBRID, direct backward)."""
    _skip_without_grouped_gemm(device)
    seed = _seed(f"grouped-fused-frozen/{device}")
    gen = torch.Generator().manual_seed(seed)
    starts = [torch.randn(OUT, IN, generator=gen).to(device) for _ in SPLITS]
    x = (torch.randn(sum(SPLITS), IN, generator=gen) * 2).to(device, torch.bfloat16)
    calls = _counting_grouped_gemms("delayed-hybrid", device, monkeypatch)
    lin = _experts(seed, device, True, starts)
    lin.weight2.requires_grad_(False)
    del lin.weight2.main_grad
    with te.autocast(recipe=RECIPES["delayed-hybrid"]):
        y = lin(x, SPLITS, is_first_microbatch=True)
    y.float().pow(2).sum().backward()
    assert len(calls) == 1, f"seed {seed}"
    assert lin.weight2.grad is None and not hasattr(lin.weight2, "main_grad")
    assert not torch.equal(lin.weight0.main_grad, starts[0]) and lin.weight0.grad_added_to_main_grad
    del lin.weight3.main_grad
    with pytest.raises(RuntimeError, match=r"GroupedLinear\(fuse_wgrad_accumulation=True\): parameter 'weight3'"):
        with te.autocast(recipe=RECIPES["delayed-hybrid"]):
            lin(x.clone().requires_grad_(), SPLITS)


def test_megatron_expert_linear_follows_the_fusion_helper(monkeypatch):
    """megatron's expert linear takes fusion from `config.gradient_accumulation_fusion` or the helper
    `fp8_parallel.megatron.fuse_wgrad_accumulation` (as the dense linears), and its errors name the expert's
    weight by its name in the model; the fused gradients equal those added by hand (per-expert path, CPU)."""
    from megatron.core.transformer.transformer_config import TransformerConfig
    from fp8_parallel.megatron import fuse_wgrad_accumulation
    from fp8_parallel.modules.grouped import GroupedLinear

    seed = _seed("megatron-expert-fusion")
    gen = torch.Generator().manual_seed(seed)
    cfg = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=2, use_cpu_initialization=True,
                            perform_initialization=False)
    models = []
    for _ in range(2):
        lin = GroupedLinear(3, 32, 16, partition="column", config=cfg, init_method=None)
        models.append(torch.nn.ModuleDict({"fc1": lin}))
    with torch.no_grad():
        for p, q in zip(models[0].parameters(), models[1].parameters()):
            p.copy_(torch.randn(p.shape, generator=gen))
            q.copy_(p)
    assert fuse_wgrad_accumulation(models[0]) == 1 and models[0]["fc1"].fuse_wgrad_accumulation is True
    x = torch.randn(20, 32, generator=gen)
    splits = [7, 0, 13]
    starts = [torch.randn(16, 32, generator=gen) for _ in splits]
    for model, fuse in zip(models, (True, False)):
        for i in range(3):
            w = getattr(model["fc1"], f"weight{i}")
            w.main_grad, w.grad_added_to_main_grad = starts[i].clone(), False
        with te.autocast(recipe=te.DelayedScaling()):
            model["fc1"](x, splits).sum().backward()
        for i in range(3):
            w = getattr(model["fc1"], f"weight{i}")
            assert w.grad_added_to_main_grad is fuse
            if not fuse:
                w.main_grad.add_(w.grad.float())
    for i in range(3):
        a, b = models[0]["fc1"], models[1]["fc1"]
        ga, gb = getattr(a, f"weight{i}").main_grad, getattr(b, f"weight{i}").main_grad
        assert torch.equal(ga, gb), f"weight{i} (seed {seed})"  # float32 weights: the same float32 gradient
    assert torch.equal(models[0]["fc1"].weight1.main_grad, starts[1])  # no rows: untouched
    # megatron's config field turns it on without the helper
    cfg_fused = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=2, use_cpu_initialization=True,
                                  perform_initialization=False)
    cfg_fused.gradient_accumulation_fusion = True
    lin = GroupedLinear(2, 32, 16, partition="row", config=cfg_fused, init_method=None)
    with pytest.raises(RuntimeError, match=r"parameter 'weight0' needs a `main_grad`"):
        lin(torch.randn(4, 32, generator=gen), [2, 2])
    del models[0]["fc1"].weight2.main_grad
    with pytest.raises(RuntimeError, match=r"parameter 'fc1.weight2' needs a `main_grad`"):
        with te.autocast(recipe=te.DelayedScaling()):
            models[0]["fc1"](x, splits)
