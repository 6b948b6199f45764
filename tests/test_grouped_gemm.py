"""The experts' forward as one grouped FP8 GEMM (`modules/_grouped_core.py`) against the per-expert GEMMs.

On the GPU (torch's `_scaled_grouped_mm`, compute capability 9.0 / 10.0) the two paths must agree: the
output within the grouped GEMM's rounding (row-wise scales multiply the fp32 accumulator in another order
than the per-tensor scale: at most a few bfloat16 ulps, checked as 2e-2 relative per element and 5e-3
relative Frobenius), every gradient and the whole FP8 state bit for bit (the backward is the same per-expert
code, fed the same grad_output), and both within FP8's tolerance of a float64 reference. On CPU, where torch
has no grouped FP8 GEMM, the same comparison runs with the GEMM emulated in float32, which checks the
plumbing (casts into one buffer, scales, splits, records, backward order, amax slots). Splits have an empty
expert and sizes that are not multiples of 16. Every test prints its seed; FP8P_TEST_SEED reproduces it.
"""
from __future__ import annotations

from typing import List

import pytest
import torch

import fp8_parallel as te
from fp8_parallel import recipe
from fp8_parallel import testing
from te_testing import rel_error as _rel, seed_for as _seed

IN, OUT = 64, 48
SPLITS = [37, 0, 90, 5]  # an expert without rows; sizes not multiples of 16
RECIPES = {
    "delayed-hybrid": recipe.DelayedScaling(fp8_format=recipe.Format.HYBRID, amax_history_len=4),
    "delayed-e4m3": recipe.DelayedScaling(fp8_format=recipe.Format.E4M3, amax_history_len=4),
    "current-hybrid": recipe.Float8CurrentScaling(fp8_format=recipe.Format.HYBRID),
}
FP8_FWD_TOL, FP8_BWD_TOL = 0.08, 0.12


def _emulated_grouped_mm(calls: List[int]):
    """torch._scaled_grouped_mm in float32 (CPU tests), with its layout and scale-shape rules: 2d x 3d (groups
    of rows of `a`; `b [E, K, N]` column-major, scales `[M]` and `[E, N]`) and 2d x 2d (groups along the
    contraction dimension; `b [K, N]` column-major, scales `[E * M]` and `[E * N]`)."""

    def grouped_mm(a, b, scale_a, scale_b, offs=None, out_dtype=None, use_fast_accum=False):
        assert a.dtype == b.dtype == torch.float8_e4m3fn, "torch's grouped FP8 GEMM takes E4M3 only"
        assert a.stride(-1) == 1 and b.stride(-2) == 1, "a row-major, b column-major"
        assert a.shape[-1] % 16 == 0 and b.shape[-2] % 16 == 0 and b.shape[-1] % 16 == 0
        assert offs.dtype == torch.int32 and out_dtype == torch.bfloat16
        assert scale_a.is_contiguous() and scale_b.is_contiguous()
        calls.append(len(offs))
        ends = offs.tolist()
        if b.dim() == 3:
            assert scale_a.shape == (a.shape[0],) and scale_b.shape == (b.shape[0], b.shape[2])
            out, start = torch.empty((a.shape[0], b.shape[2]), dtype=torch.float32), 0
            for g, end in enumerate(ends):
                rows = a[start:end].float() * scale_a[start:end, None]
                out[start:end] = rows @ (b[g].float() * scale_b[g][None, :])
                start = end
            return out.to(out_dtype)
        m, n, groups = a.shape[0], b.shape[1], len(ends)
        assert scale_a.shape == (groups * m,) and scale_b.shape == (groups * n,)
        out, start = torch.empty((groups, m, n), dtype=torch.float32), 0
        for g, end in enumerate(ends):
            assert (end - start) % 16 == 0, "each group's contraction a multiple of 16"
            lhs = a[:, start:end].float() * scale_a[g * m : (g + 1) * m, None]
            out[g] = lhs @ (b[start:end].float() * scale_b[g * n : (g + 1) * n][None, :])
            start = end
        return out.to(out_dtype)

    return grouped_mm


def _module(gen: torch.Generator, device: str, params_dtype: torch.dtype = torch.bfloat16,
            **kwargs) -> te.GroupedLinear:
    lin = te.GroupedLinear(len(SPLITS), IN, OUT, bias=False, device=device, params_dtype=params_dtype, **kwargs)
    lin.use_grouped_gemm = True  # TransformerEngine's module keeps per-GEMM results unless asked
    with torch.no_grad():
        for p in lin.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * IN**-0.5)
    return lin


def _twins(seed: int, device: str):
    """Two modules with the same weights: one for the grouped path, one for the per-expert path."""
    a, b = _module(torch.Generator().manual_seed(seed), device), _module(torch.Generator().manual_seed(seed), device)
    return a, b


def _run(lin, x, dy, rname, grouped: bool, monkeypatch, is_first_microbatch=None):
    testing.set_grouped_gemm(monkeypatch, grouped)
    x = x.clone().requires_grad_()
    with te.autocast(enabled=True, recipe=RECIPES[rname]):
        y = lin(x, SPLITS, is_first_microbatch=is_first_microbatch)
    y.backward(dy)
    return y, x.grad


def _close(a: torch.Tensor, b: torch.Tensor, what: str, where: str) -> None:
    """Within the grouped GEMM's rounding of the per-expert result (see the module docstring)."""
    assert _rel(a, b) < 5e-3, f"{what} {_rel(a, b):.2e} from the per-expert path {where}"
    torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2 * b.abs().max().item(), msg=f"{what} {where}")


def _compare(rname: str, device: str, monkeypatch, calls: List[int], steps: int = 3) -> None:
    """Grouped vs per-expert path over steps. HYBRID and current scaling: one grouped GEMM per step (forward),
    gradients bit for bit. E4M3 with delayed scaling: three (forward, input and weight gradients), gradients
    within the grouped GEMM's rounding."""
    seed = _seed(f"grouped-vs-per-expert/{rname}/{device}")
    gen = torch.Generator().manual_seed(seed)
    grouped, per_expert = _twins(seed, device)
    rows = sum(SPLITS)
    grouped_backward = rname == "delayed-e4m3"
    for step in range(steps):
        where = f"step {step} (seed {seed})"
        x = (torch.randn(rows, IN, generator=gen) * 2).to(device=device, dtype=torch.bfloat16)
        dy = torch.randn(rows, OUT, generator=gen).to(device=device, dtype=torch.bfloat16)
        before = len(calls)
        first = (step == 0) if step < 2 else None  # weight caching, then a cast per call
        ya, gxa = _run(grouped, x, dy, rname, True, monkeypatch, first)
        expected = before + (3 if grouped_backward else 1)
        assert len(calls) == expected, f"{len(calls) - before} grouped GEMMs ran {where}"
        yb, gxb = _run(per_expert, x, dy, rname, False, monkeypatch, first)
        assert len(calls) == expected, f"the per-expert path ran the grouped GEMM {where}"
        assert ya.shape == yb.shape == (rows, OUT) and ya.dtype == torch.bfloat16
        _close(ya, yb, "output", where)
        same = _close if grouped_backward else lambda a, b, what, at: _equal(a, b, what, at)
        same(gxa, gxb, "input grad", where)
        for i in range(len(SPLITS)):
            wa, wb = getattr(grouped, f"weight{i}"), getattr(per_expert, f"weight{i}")
            if SPLITS[i] == 0:
                assert torch.equal(wa.grad, torch.zeros_like(wa.grad)), f"weight{i} (no rows) {where}"
                assert torch.equal(wb.grad, wa.grad), f"weight{i} (no rows) {where}"
            else:
                same(wa.grad, wb.grad, f"weight{i} grad", where)
            wa.grad = wb.grad = None
        # against float64: FP8's tolerance
        x64 = x.double().requires_grad_()
        ws = [getattr(per_expert, f"weight{i}").detach().double().requires_grad_() for i in range(len(SPLITS))]
        y64 = torch.cat([xi @ w.t() for xi, w in zip(torch.split(x64, SPLITS), ws)])
        y64.backward(dy.double())
        assert _rel(ya, y64) < FP8_FWD_TOL, f"output {_rel(ya, y64):.2e} from float64 {where}"
        assert _rel(ya, y64) > 1e-3, f"output within {_rel(ya, y64):.1e} of float64: not FP8? {where}"
        assert _rel(gxa, x64.grad) < FP8_BWD_TOL, f"input grad {_rel(gxa, x64.grad):.2e} from float64 {where}"
    for i in range(len(SPLITS)):
        sa, sb = grouped.fp8[i].state_dict(), per_expert.fp8[i].state_dict()
        for k in sb:
            assert torch.equal(sa[k], sb[k]), f"fp8[{i}].{k} differs (seed {seed})"
    if rname.startswith("delayed"):  # amaxes were recorded (the state is not trivially equal)
        assert (grouped.fp8[0].fwd.amax_history[:, 0] > 0).all() and (grouped.fp8[0].bwd.amax_history[:, 0] > 0).all()


def _equal(a: torch.Tensor, b: torch.Tensor, what: str, where: str) -> None:
    assert torch.equal(a, b), f"{what} differs from the per-expert path {where}"


@pytest.mark.parametrize("rname", sorted(RECIPES))
def test_grouped_path_matches_per_expert_path_emulated(rname, monkeypatch):
    """CPU, the grouped GEMM emulated: the plumbing around it equals the per-expert path, and the experts'
    casts in shared buffers reach the per-expert backward GEMMs 16-byte aligned (no aligning copies)."""
    calls: List[int] = []
    monkeypatch.setattr(torch, "_scaled_grouped_mm", _emulated_grouped_mm(calls), raising=False)
    testing.set_grouped_gemm(monkeypatch, fp8_device=True)
    misaligned = testing.record_operand_alignment(monkeypatch)
    direct = testing.record_direct_expert_backwards(monkeypatch)
    from fp8_parallel import gemm

    real_mm = gemm.scaled_mm

    def checked_mm(a, b, *args, **kwargs):  # every GEMM operand and scale, the direct backward's included
        for t in (a, b, kwargs.get("scale_a"), kwargs.get("scale_b")):
            misaligned.append(t.data_ptr() % 16)
        return real_mm(a, b, *args, **kwargs)

    monkeypatch.setattr(gemm, "scaled_mm", checked_mm)
    _compare(rname, "cpu", monkeypatch, calls)
    assert misaligned and not any(misaligned), "an FP8 GEMM operand or scale_inv needed an aligning copy"
    # HYBRID with delayed scaling, cached weights (steps 0 and 1) or not (step 2, the weights re-cast in
    # backward): the direct per-expert backward, which `_compare` found bit for bit equal to the per-expert path's
    assert len(direct) == (3 if rname == "delayed-hybrid" else 0), f"direct backward ran {len(direct)} times"


@pytest.mark.parametrize("rname", ["delayed-hybrid", "delayed-e4m3"])
def test_cached_expert_weights_live_in_one_stack(rname, monkeypatch):
    """With weight caching the experts' FP8 casts live in one stacked home the grouped GEMMs take without
    stacking per call; every expert's cached transpose stays current (a view sharing the stack's version
    counter would look stale), and a weight updated in place between microbatches is cast again into the
    stack with its new scale: grouped and per-expert paths agree at every call."""
    calls: List[int] = []
    monkeypatch.setattr(torch, "_scaled_grouped_mm", _emulated_grouped_mm(calls), raising=False)
    testing.set_grouped_gemm(monkeypatch, fp8_device=True)
    fp8_stacks = []
    real_stack = torch.stack
    monkeypatch.setattr(torch, "stack", lambda ts, *a, **k: fp8_stacks.append(ts[0].dtype in (
        torch.float8_e4m3fn, torch.float8_e5m2)) or real_stack(ts, *a, **k))
    seed = _seed(f"grouped-weight-stack/{rname}")
    gen = torch.Generator().manual_seed(seed)
    grouped, per_expert = _twins(seed, "cpu")
    rows = sum(SPLITS)
    for call, first in enumerate((True, False, False, False)):
        where = f"call {call} (seed {seed})"
        if call == 2:  # an optimizer-like in-place update without a new first microbatch: cast again
            with torch.no_grad():
                for lin in (grouped, per_expert):
                    lin.weight2.mul_(4.0)
        x = (torch.randn(rows, IN, generator=gen) * 2).to(torch.bfloat16)
        dy = torch.randn(rows, OUT, generator=gen).to(torch.bfloat16)
        del fp8_stacks[:]
        ya, gxa = _run(grouped, x, dy, rname, True, monkeypatch, first)
        assert not any(fp8_stacks), f"the FP8 weights were stacked per call {where}"
        stack = grouped.fp8[0].expert_stack
        assert isinstance(stack, testing.ExpertWeightStack), where
        for i, st in enumerate(grouped.fp8):
            assert st.weight_fp8 is stack.views[i], f"expert {i}'s cache is not the stack's view {where}"
            assert st.weight_fp8.has_current_transpose(), f"expert {i}'s cached transpose looks stale {where}"
        yb, gxb = _run(per_expert, x, dy, rname, False, monkeypatch, first)
        _close(ya, yb, "output", where)
        (_close if rname == "delayed-e4m3" else _equal)(gxa, gxb, "input grad", where)
        for i in range(len(SPLITS)):
            wa, wb = getattr(grouped, f"weight{i}"), getattr(per_expert, f"weight{i}")
            assert torch.equal(grouped.fp8[i].weight_fp8._scale_inv, per_expert.fp8[i].weight_fp8._scale_inv), where
            wa.grad = wb.grad = None
    # the update moved weight2's scale: its scale_inv in the stack follows (the column scales were made again)
    assert grouped.fp8[2].weight_fp8._scale_inv.item() != grouped.fp8[0].weight_fp8._scale_inv.item(), f"seed {seed}"


def test_grouped_path_is_skipped_where_it_cannot_serve(monkeypatch):
    """Biases, a float32 input, delayed weight gradients, FP8 off, checkpointed regions and a
    TransformerEngine-signature module not asking for it take the per-expert GEMMs; a no_grad call takes the
    grouped one and its output equals a grad call's."""
    calls: List[int] = []
    monkeypatch.setattr(torch, "_scaled_grouped_mm", _emulated_grouped_mm(calls), raising=False)
    testing.set_grouped_gemm(monkeypatch, fp8_device=True)
    seed = _seed("grouped-skipped")
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(SPLITS), IN, generator=gen).to(torch.bfloat16)
    delayed = RECIPES["delayed-hybrid"]

    def calls_of(lin, inp, rec=delayed, enabled=True, wrap=lambda f: f()):
        before = len(calls)
        with te.autocast(enabled=enabled, recipe=rec):
            wrap(lambda: lin(inp, SPLITS))
        return len(calls) - before

    plain = _module(gen, "cpu")
    assert calls_of(plain, x) == 1, f"seed {seed}"
    current = RECIPES["current-hybrid"]  # scales from the input: a no_grad call must repeat the grad call
    with te.autocast(enabled=True, recipe=current):
        y_grad = plain(x.clone().requires_grad_(), SPLITS)
    with torch.no_grad():
        assert calls_of(plain, x) == 1
        with te.autocast(enabled=True, recipe=current):
            y_no_grad = plain(x, SPLITS)
    assert torch.equal(y_grad, y_no_grad) and not y_no_grad.requires_grad, f"seed {seed}"
    biased = te.GroupedLinear(len(SPLITS), IN, OUT, bias=True, device="cpu", params_dtype=torch.bfloat16)
    biased.use_grouped_gemm = True
    assert calls_of(biased, x) == 0
    default = te.GroupedLinear(len(SPLITS), IN, OUT, bias=False, device="cpu", params_dtype=torch.bfloat16)
    assert calls_of(default, x) == 0, "TransformerEngine's GroupedLinear is per-GEMM (bitwise) by default"
    assert calls_of(plain, x.float()) == 0
    assert calls_of(_module(gen, "cpu", delay_wgrad_compute=True), x) == 0
    assert calls_of(plain, x, enabled=False) == 0
    xr = x.clone().requires_grad_()
    checkpointed = lambda f: torch.utils.checkpoint.checkpoint(f, use_reentrant=False)
    assert calls_of(plain, xr, wrap=checkpointed) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("rname", sorted(RECIPES))
def test_gpu_grouped_gemm_matches_per_expert_gemms(rname, monkeypatch):
    """The real grouped GEMM on the GPU against the per-expert GEMMs and float64."""
    if not testing.device_has_grouped_gemm(torch.device("cuda")):
        pytest.skip("torch._scaled_grouped_mm does not run on this GPU (needs compute capability 9.0 or 10.0)")
    calls: List[int] = []
    real = torch._scaled_grouped_mm

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "_scaled_grouped_mm", counting)
    _compare(rname, "cuda", monkeypatch, calls)


def _param_dtype_case(pdt: torch.dtype, device: str, monkeypatch) -> None:
    """float32 / float16 expert weights under bfloat16 activations: the grouped forward GEMM, then the
    per-expert backward GEMMs issued directly (E4M3's grouped backward needs bfloat16 weights), so the
    gradients equal the per-expert path's bit for bit, in the weights' dtype, close to float64."""
    for rname in ("delayed-hybrid", "delayed-e4m3"):
        seed = _seed(f"grouped-param-dtype/{pdt}/{rname}/{device}")
        gen = torch.Generator().manual_seed(seed)
        grouped = _module(torch.Generator().manual_seed(seed), device, params_dtype=pdt)
        per_expert = _module(torch.Generator().manual_seed(seed), device, params_dtype=pdt)
        rows = sum(SPLITS)
        for step, first in enumerate((True, False)):
            where = f"{pdt} {rname} step {step} (seed {seed})"
            x = (torch.randn(rows, IN, generator=gen) * 2).to(device=device, dtype=torch.bfloat16)
            dy = torch.randn(rows, OUT, generator=gen).to(device=device, dtype=torch.bfloat16)
            ya, gxa = _run(grouped, x, dy, rname, True, monkeypatch, first)
            yb, gxb = _run(per_expert, x, dy, rname, False, monkeypatch, first)
            _close(ya, yb, "output", where)
            _equal(gxa, gxb, "input grad", where)
            x64 = x.double().requires_grad_()
            ws = [getattr(per_expert, f"weight{i}").detach().double().requires_grad_() for i in range(len(SPLITS))]
            torch.cat([xi @ w.t() for xi, w in zip(torch.split(x64, SPLITS), ws)]).backward(dy.double())
            for i in range(len(SPLITS)):
                wa, wb = getattr(grouped, f"weight{i}"), getattr(per_expert, f"weight{i}")
                assert wa.grad.dtype == pdt, where
                _equal(wa.grad, wb.grad, f"weight{i} grad", where)
                if SPLITS[i]:
                    # an expert with a few rows sums few products, so its gradient keeps the elements' rounding:
                    # up to half an E5M2 step (12.5%) of the gradient plus half an E4M3 step (6.25%) of the
                    # input (seed 44449: 0.126 for the 5-row expert under HYBRID)
                    tol = FP8_BWD_TOL if SPLITS[i] >= 16 else 0.19
                    assert _rel(wa.grad, ws[i].grad) < tol, f"weight{i} grad from float64 {where}"
                wa.grad = wb.grad = None


@pytest.mark.parametrize("pdt", [torch.float32, torch.float16], ids=["float32", "float16"])
def test_grouped_path_other_param_dtypes_emulated(pdt, monkeypatch):
    """CPU, the grouped GEMM emulated: float32 and float16 expert weights (see `_param_dtype_case`)."""
    calls: List[int] = []
    monkeypatch.setattr(torch, "_scaled_grouped_mm", _emulated_grouped_mm(calls), raising=False)
    testing.set_grouped_gemm(monkeypatch, fp8_device=True)
    _param_dtype_case(pdt, "cpu", monkeypatch)
    assert len(calls) == 4, f"{len(calls)} grouped GEMMs (one forward per call)"


@pytest.mark.gpu
@pytest.mark.parametrize("pdt", [torch.float32, torch.float16], ids=["float32", "float16"])
def test_gpu_grouped_path_other_param_dtypes(pdt, monkeypatch):
    """The real grouped GEMM with float32 and float16 expert weights (see `_param_dtype_case`)."""
    if not testing.device_has_grouped_gemm(torch.device("cuda")):
        pytest.skip("torch._scaled_grouped_mm does not run on this GPU (needs compute capability 9.0 or 10.0)")
    _param_dtype_case(pdt, "cuda", monkeypatch)


@pytest.mark.gpu
@pytest.mark.parametrize("fp8_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
def test_gpu_fused_row_block_cast_equals_per_block_casts(fp8_dtype):
    """One launch for all blocks (`quantize_row_blocks` on CUDA) writes the bytes, transposes, amaxes and
    scale_invs that `quantize` per block writes, the transposes' zero padding included, in both transpose
    layouts: empty blocks, sizes not multiples of the tiles, a NaN, a non-contiguous input; bfloat16 and
    float16."""
    from fp8_parallel.quantize import SINV_STRIDE, quantize_row_blocks

    seed = _seed(f"row-block-cast/{fp8_dtype}")
    gen = torch.Generator().manual_seed(seed)
    for dtype in (torch.bfloat16, torch.float16):
        for splits, n in (([37, 0, 90, 5, 1], 48), ([0, 300], 256), ([3, 0, 0], 16), ([130, 7, 64, 64], 200)):
            rows = sum(splits)
            x = (torch.randn(rows, 2 * n, generator=gen) * 4).to(device="cuda", dtype=dtype)[:, ::2]  # strided
            if rows > 3:
                x[3, 1] = float("nan")
            scales = [torch.rand(1, generator=gen).cuda() * 4 + 0.1 for _ in splits]
            slots = [torch.rand(2, generator=gen).cuda() for _ in splits]  # a slot keeps max(old, new)
            ref_slots = [s.clone() for s in slots]
            for one_matrix in (False, True):
                for s, r in zip(slots, ref_slots):
                    r.copy_(s)
                torch.cuda.synchronize()
                junk = torch.full((1 << 22,), 0x7B, dtype=torch.uint8, device="cuda")
                del junk  # the caching allocator hands these bytes out again: padding must be written as zeros
                got = quantize_row_blocks(x, splits, scales, [s[:1] for s in slots], fp8_dtype, True, one_matrix)
                ref = quantize_row_blocks(x, splits, scales, [s[:1] for s in ref_slots], fp8_dtype, True, one_matrix,
                                          force_torch=True)
                where = f"{dtype} splits {splits} n {n} one_matrix {one_matrix} (seed {seed})"
                for name in ("data", "transposes"):
                    a, b = getattr(got, name), getattr(ref, name)
                    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), f"{name} differs, {where}"
                assert torch.equal(got.sinv[::SINV_STRIDE], ref.sinv[::SINV_STRIDE]), where
                assert torch.equal(got.row_sinv, ref.row_sinv), where
                for s, r in zip(slots, ref_slots):
                    assert torch.equal(s, r), f"amax slots differ {where}"
            if rows > 3:
                nan_block = next(e for e, end in enumerate(testing.cumulative_splits(splits)) if end > 3)
                assert slots[nan_block][0].item() == float("inf"), f"a NaN's amax is recorded as +inf {where}"


def test_e4m3_backward_is_grouped_only_when_every_weight_takes_a_gradient(monkeypatch):
    """E4M3 with delayed scaling groups the input and weight gradients (3 grouped GEMMs per step); a frozen
    expert weight sends the backward to the per-expert GEMMs (1 grouped GEMM: the forward), and the
    gradients of both runs agree within the grouped GEMM's rounding."""
    calls: List[int] = []
    monkeypatch.setattr(torch, "_scaled_grouped_mm", _emulated_grouped_mm(calls), raising=False)
    testing.set_grouped_gemm(monkeypatch, fp8_device=True)
    seed = _seed("grouped-e4m3-frozen")
    gen = torch.Generator().manual_seed(seed)
    trained, frozen = _twins(seed, "cpu")  # the same weights and fresh FP8 states: the same scales
    frozen.weight1.requires_grad_(False)
    x = (torch.randn(sum(SPLITS), IN, generator=gen) * 2).to(torch.bfloat16)
    dy = torch.randn(sum(SPLITS), OUT, generator=gen).to(torch.bfloat16)
    grads = []
    for lin, expected in ((trained, 3), (frozen, 1)):
        before = len(calls)
        _, gx = _run(lin, x, dy, "delayed-e4m3", True, monkeypatch)
        assert len(calls) - before == expected, f"{len(calls) - before} grouped GEMMs (seed {seed})"
        grads.append((gx, lin.weight0.grad, lin.weight2.grad))
    assert frozen.weight1.grad is None
    for what, a, b in zip(("input grad", "weight0 grad", "weight2 grad"), *grads):
        _close(a, b, what, f"(seed {seed})")


def test_direct_hybrid_backward_frozen_expert_and_constant_input(monkeypatch):
    """HYBRID with cached weights takes the direct per-expert backward also with a frozen expert weight (no
    gradient for it) and with an input that needs no gradient (weight gradients only); both equal the
    per-expert path bit for bit."""
    monkeypatch.setattr(torch, "_scaled_grouped_mm", _emulated_grouped_mm([]), raising=False)
    testing.set_grouped_gemm(monkeypatch, fp8_device=True)
    direct = testing.record_direct_expert_backwards(monkeypatch)
    seed = _seed("direct-hybrid-frozen")
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(sum(SPLITS), IN, generator=gen) * 2).to(torch.bfloat16)
    dy = torch.randn(sum(SPLITS), OUT, generator=gen).to(torch.bfloat16)
    for input_grad in (True, False):
        grouped, per_expert = _twins(seed, "cpu")
        results = []
        for lin, use_grouped in ((grouped, True), (per_expert, False)):
            lin.weight2.requires_grad_(False)  # an expert with rows
            testing.set_grouped_gemm(monkeypatch, use_grouped)
            xi = x.clone().requires_grad_(input_grad)
            with te.autocast(enabled=True, recipe=RECIPES["delayed-hybrid"]):
                y = lin(xi, SPLITS, is_first_microbatch=True)
            y.backward(dy)
            assert lin.weight2.grad is None
            results.append((xi.grad, *(getattr(lin, f"weight{i}").grad for i in (0, 1, 3))))
        where = f"input_grad={input_grad} (seed {seed})"
        assert (results[0][0] is None) == (not input_grad), where
        for what, a, b in zip(("input grad", "weight0 grad", "weight1 grad (no rows)", "weight3 grad"), *results):
            if a is None and b is None:
                continue
            _equal(a, b, what, where)
    assert len(direct) == 2, f"direct backward ran {len(direct)} times (seed {seed})"


def _bf16_grouped_cases(device: str, monkeypatch) -> None:
    """Without FP8 the experts run as one bfloat16 `torch._grouped_mm` per GEMM (counted), equal to the per-expert GEMMs
    within bfloat16 rounding and close to float64; the cases it cannot serve take the per-expert GEMMs."""
    grouped_calls: List[int] = []
    real = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **k: grouped_calls.append(1) or real(*a, **k))
    seed = _seed(f"bf16-grouped/{device}")
    gen = torch.Generator().manual_seed(seed)
    rows = sum(SPLITS)
    x = (torch.randn(rows, IN, generator=gen) * 2).to(device=device, dtype=torch.bfloat16)
    dy = torch.randn(rows, OUT, generator=gen).to(device=device, dtype=torch.bfloat16)
    grouped, per_expert = _twins(seed, device)
    results = []
    for lin, use_grouped in ((grouped, True), (per_expert, False)):
        testing.set_grouped_gemm(monkeypatch, use_grouped)
        before = len(grouped_calls)
        xi = x.clone().requires_grad_()
        with te.autocast(enabled=False):
            y = lin(xi, SPLITS)
        if use_grouped:  # the weights are kept for backward, not a stacked copy of them
            node = y.grad_fn
            while "GroupedBF16" not in type(node).__name__:
                node = node.next_functions[0][0]
            assert all(t.dim() < 3 for t in node.saved_tensors), f"seed {seed}"
        y.backward(dy)
        # forward, input gradient, weight gradients
        assert len(grouped_calls) - before == (3 if use_grouped else 0), f"seed {seed}"
        results.append((y, xi.grad, *(getattr(lin, f"weight{i}").grad for i in range(len(SPLITS)))))
    where = f"(seed {seed})"
    names = ["output", "input grad", *(f"weight{i} grad" for i in range(len(SPLITS)))]
    for name, a, b in zip(names, *results):
        assert a.dtype == b.dtype == torch.bfloat16 and a.shape == b.shape, f"{name} {where}"
        if b.abs().max() == 0:  # the expert without rows: a zero gradient
            assert torch.equal(a, b), f"{name} {where}"
        else:
            assert _rel(a, b) < 1e-2, f"{name} {_rel(a, b):.2e} from the per-expert GEMMs {where}"
    assert torch.equal(results[0][3], torch.zeros_like(results[0][3])), f"weight1 has no rows {where}"
    x64 = x.double().requires_grad_()
    ws = [getattr(per_expert, f"weight{i}").detach().double().requires_grad_() for i in range(len(SPLITS))]
    y64 = torch.cat([xi @ w.t() for xi, w in zip(torch.split(x64, SPLITS), ws)])
    y64.backward(dy.double())
    for name, a, b in zip(names, results[0], (y64, x64.grad, *(w.grad for w in ws))):
        if b.abs().max() > 0:
            assert _rel(a, b) < 2e-2, f"{name} {_rel(a, b):.2e} from float64 {where}"
    # where it cannot serve: FP8 on, biases, float32 input, no rows, delayed wgrad, a checkpointed region, and
    # TransformerEngine's module not asking for the grouped GEMM
    testing.set_grouped_gemm(monkeypatch, True)
    monkeypatch.setattr(torch, "_scaled_grouped_mm", _emulated_grouped_mm([]), raising=False)
    testing.set_grouped_gemm(monkeypatch, fp8_device=True)
    before = len(grouped_calls)
    with te.autocast(enabled=True, recipe=RECIPES["delayed-hybrid"]):
        grouped(x, SPLITS)
    biased = te.GroupedLinear(len(SPLITS), IN, OUT, bias=True, device=device, params_dtype=torch.bfloat16)
    biased.use_grouped_gemm = True
    biased(x, SPLITS)
    grouped(x.float(), SPLITS)
    grouped(x[:0], [0] * len(SPLITS))
    _module(gen, device, delay_wgrad_compute=True)(x, SPLITS)
    te.GroupedLinear(len(SPLITS), IN, OUT, bias=False, device=device, params_dtype=torch.bfloat16)(x, SPLITS)
    torch.utils.checkpoint.checkpoint(lambda t: grouped(t, SPLITS), x.clone().requires_grad_(), use_reentrant=False)
    assert len(grouped_calls) == before, f"{len(grouped_calls) - before} bfloat16 grouped GEMMs where none may run"


def test_bf16_grouped_gemm_without_fp8(monkeypatch):
    """CPU: torch's bfloat16 grouped GEMM (real, on CPU) serves the experts without FP8 where the device allows."""
    testing.set_grouped_gemm(monkeypatch, bf16_device=True)
    _bf16_grouped_cases("cpu", monkeypatch)


def test_bf16_grouped_gemm_stacks_the_weights_once_per_step(monkeypatch):
    """CPU, torch's real bfloat16 grouped GEMM: with megatron's `is_first_microbatch` protocol the experts'
    weights are stacked once per step (True), reused by later microbatches (False) and by backward, with results
    bit for bit those of stacking per call (None); a weight updated in place since is stacked again, never
    used stale."""
    testing.set_grouped_gemm(monkeypatch, True, bf16_device=True)
    stacks: List[int] = []
    real_stack = torch.stack
    monkeypatch.setattr(torch, "stack", lambda *a, **k: stacks.append(1) or real_stack(*a, **k))
    seed = _seed("bf16-grouped-stack-cache")
    print(f"seed {seed}")
    gen = torch.Generator().manual_seed(seed)
    cached, per_call = _twins(seed, "cpu")

    def step(lin, first, x, dy):
        xi = x.clone().requires_grad_()
        with te.autocast(enabled=False):
            y = lin(xi, SPLITS, is_first_microbatch=first)
        y.backward(dy)
        return y, xi.grad

    for microbatch, first in enumerate((True, False, False)):
        x = torch.randn(sum(SPLITS), IN, generator=gen).to(torch.bfloat16)
        dy = torch.randn(sum(SPLITS), OUT, generator=gen).to(torch.bfloat16)
        before = len(stacks)
        got = step(cached, first, x, dy)
        assert len(stacks) - before == (1 if first else 0), (microbatch, f"seed {seed}")
        before = len(stacks)
        want = step(per_call, None, x, dy)
        assert len(stacks) - before == 2, f"seed {seed}"  # forward and input gradient, per call
        for a, b in zip(got, want):
            assert torch.equal(a, b), (microbatch, f"seed {seed}")
    for i in range(len(SPLITS)):
        w_c, w_p = getattr(cached, f"weight{i}"), getattr(per_call, f"weight{i}")
        assert torch.equal(w_c.grad, w_p.grad), (i, f"seed {seed}")
    # an in-place update without a new first microbatch: stacked again, the output that of the new weights
    with torch.no_grad():
        for lin in (cached, per_call):
            lin.weight2.mul_(-0.5)
    x = torch.randn(sum(SPLITS), IN, generator=gen).to(torch.bfloat16)
    dy = torch.randn(sum(SPLITS), OUT, generator=gen).to(torch.bfloat16)
    before = len(stacks)
    got = step(cached, False, x, dy)
    assert len(stacks) - before == 1, f"a weight updated in place was not stacked again (seed {seed})"
    want = step(per_call, None, x, dy)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), f"seed {seed}"


@pytest.mark.gpu
def test_gpu_bf16_grouped_gemm_without_fp8(monkeypatch):
    """The bfloat16 grouped GEMM on the GPU against the per-expert GEMMs and float64."""
    if not testing.device_has_bf16_grouped_gemm(torch.device("cuda")):
        pytest.skip("torch._grouped_mm does not serve the experts on this GPU (needs compute capability 9.0 or 10.0)")
    _bf16_grouped_cases("cuda", monkeypatch)
