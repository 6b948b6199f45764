"""The compiled host path (`fp8_parallel/csrc`, `fp8_parallel.native`) against the Python path, bit for bit.

On the CPU the extension's CPU variant is built here with torch's JIT builder (about a minute), so its host code
(argument checks, the order and operands of the GEMMs, saved tensors, the leaf-input re-cast) runs in CI. On a
GPU the installed CUDA build is compared with the Python path there (Triton kernels): that checks the CUDA cast
kernels as well. Every comparison is exact: the two paths must produce the same bytes.
"""
from __future__ import annotations

import contextlib
import os
import re

import pytest
import torch

import fp8_parallel as fp
from fp8_parallel import native
from fp8_parallel.quantize import quantize
from native_build import cpu_extension
from te_testing import rel_error, seed_for


class CountingExtension:
    """The extension, counting its linear calls (so a test sees that the compiled path ran)."""

    def __init__(self, ext):
        self._ext = ext
        self.with_cuda = ext.with_cuda
        self.calls = {"linear_fwd": 0, "linear_bwd": 0, "cast_into": 0, "experts_bwd": 0}

    def __getattr__(self, name):
        fn = getattr(self._ext, name)
        if name not in self.calls:
            return fn

        def counted(*args):
            self.calls[name] += 1
            return fn(*args)

        return counted


@pytest.fixture(scope="module")
def cpu_ext():
    return cpu_extension()


@contextlib.contextmanager
def using(ext):
    previous = native.use(ext)
    try:
        yield ext
    finally:
        native.use(previous)


def _cuda_extension():
    """The installed CUDA build of the extension (skips where it is not built)."""
    ext = native.module()
    if ext is None or not ext.with_cuda:
        pytest.skip("the CUDA extension is not built (pip install --no-build-isolation -e .)")
    return ext


def _cast_cases():
    for shape in ((64, 128), (37, 50), (3, 16, 40), (130, 200)):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            for fp8 in (torch.float8_e4m3fn, torch.float8_e5m2):
                yield shape, dtype, fp8


def _check_cast(ext, device, seed):
    g = torch.Generator().manual_seed(seed)
    for shape, dtype, fp8 in _cast_cases():
        x = (torch.randn(shape, generator=g) * 40).to(dtype).to(device)
        if shape == (37, 50):
            x.view(-1)[3] = float("nan")  # NaN stays NaN, the amax +inf
        scale = (torch.rand(2, generator=g) * 4 + 0.5).to(device)
        m, n = x.numel() // shape[-1], shape[-1]
        for with_t, with_data, flag in ((False, True, None), (True, True, None), (True, False, None), (True, True, 1),
                                        (True, True, 0)):
            slot = torch.tensor([0.0, 3.5], device=device)
            ref_slot = slot.clone()
            noop = None if flag is None else torch.tensor([flag], dtype=torch.int32, device=device)
            poison = torch.full((m * n,), 0x5A, dtype=torch.uint8, device=device)
            data = poison.clone().view(fp8).view(shape) if with_data else None
            t = poison.clone().view(fp8).view(n, m) if with_t else None
            sinv = torch.full((), 7.0, device=device)
            ext.cast_into(x, scale, 1, data, t, sinv, slot, 1, noop)
            ref = fp.Float8Tensor(poison.clone().view(fp8).view(shape), torch.full((), 7.0, device=device), dtype)
            if with_t:
                ref._transpose_cache.buffer = poison.clone().view(fp8).view(n, m)
            quantize(x, scale[1:], fp8, amax_out=ref_slot[1:], with_transpose=with_t, out=ref, force_torch=True,
                     noop_flag=noop)
            case = f"{shape} {dtype} {fp8} transpose={with_t} data={with_data} noop={flag}"
            if with_data:
                assert torch.equal(data.view(torch.uint8), ref._data.view(torch.uint8)), case
            if with_t:
                assert torch.equal(t.view(torch.uint8), ref._transpose_cache.buffer.view(torch.uint8)), case
            assert torch.equal(sinv, ref._scale_inv), case
            assert torch.equal(slot, ref_slot), case
            assert slot[0].item() == 0.0, case  # the other slot untouched


def test_native_cast_matches_torch_formulas(cpu_ext):
    _check_cast(cpu_ext, "cpu", seed_for("test_native_cast_matches_torch_formulas"))


@pytest.mark.gpu
def test_native_cast_matches_torch_formulas_gpu():
    ext = _cuda_extension()
    _check_cast(ext, "cuda", seed_for("test_native_cast_matches_torch_formulas_gpu"))


def _linear_cases():
    # (params dtype, bias, input kind, frozen weight, input shape, format, weight cached)
    yield torch.float32, True, "activation", False, (32, 64), "hybrid", True
    yield torch.bfloat16, True, "leaf", False, (2, 16, 64), "hybrid", True
    yield torch.bfloat16, False, "activation", False, (48, 64), "e4m3", True
    yield torch.float16, True, "activation", False, (32, 64), "hybrid", True
    yield torch.bfloat16, True, "activation", True, (32, 64), "hybrid", True  # frozen layer
    yield torch.float32, False, "no_grad_input", False, (16, 64), "hybrid", True  # input without grad (first layer)
    yield torch.bfloat16, True, "leaf", False, (24, 64), "hybrid", True  # 24 tokens: not a multiple of 16, Python path
    # the weight cast at every call (is_first_microbatch=None, TransformerEngine's default)
    yield torch.bfloat16, True, "leaf", False, (32, 64), "hybrid", False
    yield torch.float32, False, "activation", True, (2, 16, 64), "hybrid", False  # frozen: the dgrad re-casts it
    yield torch.float16, True, "activation", False, (48, 64), "e4m3", False
    yield torch.bfloat16, True, "no_grad_input", False, (16, 64), "hybrid", False


def _run_linear(ext, device, seed, dtype, bias, kind, frozen, shape, fmt_name, cached, steps=3):
    """Three training steps of a Linear, two microbatches each (the weight cached at the first, or `cached=False`
    cast at every call); returns everything that must match."""
    torch.manual_seed(seed)
    fmt = fp.recipe.Format.HYBRID if fmt_name == "hybrid" else fp.recipe.Format.E4M3
    recipe = fp.recipe.DelayedScaling(fp8_format=fmt, amax_history_len=4)
    layer = fp.Linear(64, 48, bias=bias, params_dtype=dtype, device=device)
    if frozen:
        layer.weight.requires_grad_(False)
    trained = [p for p in layer.parameters() if p.requires_grad]
    opt = torch.optim.SGD(trained, lr=0.05) if trained else None
    g = torch.Generator().manual_seed(seed + 1)
    seen = []
    with using(ext):
        for _ in range(steps):
            for micro in range(2):
                x0 = torch.randn(shape, generator=g).to(device=device, dtype=dtype)
                if kind == "leaf":
                    x = x0.requires_grad_()
                elif kind == "activation":
                    x0.requires_grad_()
                    x = x0 * 1.5
                else:
                    x = x0
                with fp.fp8_autocast(fp8_recipe=recipe):
                    y = layer(x, is_first_microbatch=(micro == 0) if cached else None)
                w = torch.randn(y.shape, generator=g).to(device=device, dtype=y.dtype)
                (y.float() * w.float()).sum().backward()
                seen += [y.detach(), None if x0.grad is None else x0.grad.clone()]
            if opt is not None:
                opt.step()
                opt.zero_grad()
    seen += [p.detach().clone() for p in layer.parameters()]
    seen += [layer.fp8.fwd.scale, layer.fp8.fwd.amax_history, layer.fp8.bwd.scale, layer.fp8.bwd.amax_history]
    return seen


def _check_linear(ext_factory, device, seed):
    for case in _linear_cases():
        counting = CountingExtension(ext_factory())
        got = _run_linear(counting, device, seed, *case)
        want = _run_linear(None, device, seed, *case)
        tokens = case[4][0] if len(case[4]) == 2 else case[4][0] * case[4][1]
        expected_native = tokens % 16 == 0
        assert (counting.calls["linear_fwd"] > 0) == expected_native, (case, counting.calls)
        assert counting.calls["linear_bwd"] == (counting.calls["linear_fwd"]), (case, counting.calls)
        for i, (a, b) in enumerate(zip(got, want)):
            if a is None or b is None:
                assert a is None and b is None, (case, i)
                continue
            assert a.dtype == b.dtype and a.shape == b.shape, (case, i)
            assert torch.equal(a, b), (case, i, (a.double() - b.double()).abs().max().item())


def test_native_linear_matches_python_path(cpu_ext):
    _check_linear(lambda: cpu_ext, "cpu", seed_for("test_native_linear_matches_python_path"))


@pytest.mark.gpu
def test_native_linear_matches_python_path_gpu():
    ext = _cuda_extension()
    _check_linear(lambda: ext, "cuda", seed_for("test_native_linear_matches_python_path_gpu"))


def test_native_sources_build_messages_without_iostreams():
    """No message in `csrc/` goes through an ostream (c10::str, TORCH_CHECK, AT_ERROR, std::ostringstream): where
    the toolchain links a static libstdc++ without a set-up locale, the first one segfaults (messages.h). The
    tests below run the rejecting calls; this keeps new code from bringing the streams back."""
    here = os.path.dirname(native.sources()[0][0])
    banned = re.compile(r"\b(c10::str|TORCH_CHECK\w*|AT_ERROR|AT_ASSERT\w*|std::(o|i)?stringstream|std::cout|std::cerr)\b"
                        r"|<sstream>|<iostream>")
    found = []
    for name in sorted(os.listdir(here)):
        with open(os.path.join(here, name)) as source:
            for number, line in enumerate(source, 1):
                code = line.split("//")[0]
                if banned.search(code):
                    found.append(f"{name}:{number}: {line.strip()}")
    assert not found, "messages built with iostreams:\n" + "\n".join(found)
    assert any("native.cpp" in n for n in native.sources()[0]) and len(os.listdir(here)) >= 4


def test_native_cast_rejects_bad_outputs(cpu_ext):
    x = torch.randn(8, 16)
    scale = torch.ones(1)
    with pytest.raises(RuntimeError, match="transpose has sizes"):
        cpu_ext.cast_into(x, scale, 0, None, torch.empty(8, 16, dtype=torch.float8_e4m3fn), torch.empty(()), None, 0,
                          None)
    with pytest.raises(RuntimeError, match="index 3 outside a buffer of 1"):
        cpu_ext.cast_into(x, scale, 3, torch.empty(8, 16, dtype=torch.float8_e4m3fn), None, torch.empty(()), None, 0,
                          None)
    with pytest.raises(RuntimeError, match="must be FP8"):
        cpu_ext.cast_into(x, scale, 0, torch.empty(8, 16), None, torch.empty(()), None, 0, None)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens,fin,fout,bias", [(4096, 2048, 1024, True), (2048, 1024, 3072, False), (512, 4096, 512, True)])
def test_native_linear_matches_python_path_large_gpu(tokens, fin, fout, bias):
    """Shapes of a real layer (the GEMMs' algorithms differ by shape): one forward + backward, bit for bit."""
    ext = _cuda_extension()
    seed = seed_for("test_native_linear_matches_python_path_large_gpu")
    results = []
    for use in (ext, None):
        torch.manual_seed(seed)
        layer = fp.Linear(fin, fout, bias=bias, params_dtype=torch.bfloat16, device="cuda")
        x0 = torch.randn(tokens, fin, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        g = torch.randn(tokens, fout, device="cuda", dtype=torch.bfloat16)
        counting = CountingExtension(ext) if use is not None else None
        with using(counting):
            for micro in range(2):
                with fp.fp8_autocast(fp8_recipe=fp.recipe.DelayedScaling(amax_history_len=4)):
                    y = layer(x0 * 2.0, is_first_microbatch=micro == 0)
                y.backward(g)
        if counting is not None:
            assert counting.calls["linear_fwd"] == 2 and counting.calls["linear_bwd"] == 2, counting.calls
        results.append([y, x0.grad, layer.weight.grad, layer.bias.grad if bias else None, layer.fp8.bwd.amax_history])
    for i, (a, b) in enumerate(zip(*results)):
        if a is None:
            continue
        assert torch.equal(a, b), (i, (a.double() - b.double()).abs().max().item())


def _fused_run(ext, device, seed, dtype, main_dtype, cached):
    """Two steps of two microbatches of a Linear with `fuse_wgrad_accumulation`: outputs, input gradients and
    the main_grad after each step."""
    torch.manual_seed(seed)
    layer = fp.Linear(64, 48, bias=True, params_dtype=dtype, device=device, fuse_wgrad_accumulation=True)
    g = torch.Generator().manual_seed(seed + 1)
    layer.weight.main_grad = torch.randn(48, 64, generator=g).to(device, main_dtype)
    layer.weight.grad_added_to_main_grad = False
    seen = []
    counting = CountingExtension(ext) if ext is not None else None
    with using(counting):
        for _ in range(2):
            for micro in range(2):
                x = torch.randn(32, 64, generator=g).to(device, dtype).requires_grad_()
                with fp.fp8_autocast(fp8_recipe=fp.recipe.DelayedScaling(amax_history_len=4)):
                    y = layer(x * 1.5, is_first_microbatch=(micro == 0) if cached else None)
                y.backward(torch.randn(y.shape, generator=g).to(device, y.dtype))
                assert layer.weight.grad_added_to_main_grad
                seen += [y.detach(), x.grad, layer.bias.grad.clone()]
                layer.weight.grad = None
            seen.append(layer.weight.main_grad.clone())
    if counting is not None:
        assert counting.calls["linear_bwd"] == 4, counting.calls
    return seen


def test_native_fused_accumulation_matches_python_path(cpu_ext):
    """The compiled backward adding the weight gradient into `main_grad` (the CPU build: float32 product, then
    the add) against the Python path, bit for bit."""
    seed = seed_for("test_native_fused_accumulation_matches_python_path")
    for dtype, main_dtype, cached in ((torch.float32, torch.float32, True), (torch.bfloat16, torch.float32, False),
                                      (torch.bfloat16, torch.bfloat16, True)):
        got = _fused_run(cpu_ext, "cpu", seed, dtype, main_dtype, cached)
        want = _fused_run(None, "cpu", seed, dtype, main_dtype, cached)
        for i, (a, b) in enumerate(zip(got, want)):
            assert torch.equal(a, b), (dtype, main_dtype, cached, i)


@pytest.mark.gpu
def test_native_fused_accumulation_matches_python_path_gpu():
    """On a GPU the compiled wgrad GEMM adds in its epilogue: float32 rounding apart from the Python path's
    GEMM-then-add; everything else bit for bit."""
    ext = _cuda_extension()
    seed = seed_for("test_native_fused_accumulation_matches_python_path_gpu")
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for main_dtype, cached in ((torch.float32, True), (torch.float32, False), (torch.bfloat16, True)):
            got = _fused_run(ext, "cuda", seed, dtype, main_dtype, cached)
            want = _fused_run(None, "cuda", seed, dtype, main_dtype, cached)
            for i, (a, b) in enumerate(zip(got, want)):
                if i % 7 == 6:  # a main_grad (after each step)
                    tol = 1e-6 if main_dtype == torch.float32 else 8e-3
                    rel = ((a.double() - b.double()).norm() / b.double().norm()).item()
                    assert rel < tol, (dtype, main_dtype, cached, i, rel)
                else:
                    assert torch.equal(a, b), (dtype, main_dtype, cached, i)


@pytest.mark.gpu
@pytest.mark.parametrize("offset", [0, 4, 1], ids=["aligned", "16B", "4B"])
def test_native_fused_accumulation_into_a_buffer_view(offset):
    """The compiled wgrad GEMM adding into a `main_grad` that is a view inside a larger buffer (megatron's grad
    buffer) at 256-, 16- and 4-byte alignment (the last through the unfused fallback): the same result as the
    Python path (an FP8 GEMM to float32, then the add), and the buffer outside the view untouched."""
    from fp8_parallel.modules import FP8State, fp8_linear

    ext = _cuda_extension()
    seed = seed_for(f"native_fused/{offset}")
    gen = torch.Generator().manual_seed(seed)
    w0 = (torch.randn(256, 512, generator=gen) / 20).to("cuda", torch.bfloat16)
    x = torch.randn(128, 512, generator=gen).to("cuda", torch.bfloat16)
    dy = torch.randn(128, 256, generator=gen).to("cuda", torch.bfloat16)
    fill = torch.randn(offset + 256 * 512 + 64, generator=gen).to("cuda")
    got = {}
    counting = CountingExtension(ext)
    for use in (counting, None):
        previous = native.use(use)
        try:
            buf = fill.clone()
            weight = torch.nn.Parameter(w0.clone())
            weight.main_grad = buf[offset : offset + 256 * 512].view(256, 512)
            weight.grad_added_to_main_grad = False
            with fp.autocast(recipe=fp.DelayedScaling(), group=None):
                y = fp8_linear(x, weight, None, FP8State("t", device=torch.device("cuda")), fuse_wgrad_accumulation=True)
            y.backward(dy)
            got[use is not None] = buf
        finally:
            native.use(previous)
    assert counting.calls["linear_bwd"] == 1, counting.calls  # the compiled backward ran (aligned or not)
    a, b = got[True], got[False]
    assert torch.equal(a[:offset], fill[:offset]) and torch.equal(a[offset + 256 * 512 :], fill[offset + 256 * 512 :])
    # the epilogue's add may round as one fused multiply-add: float32 rounding apart
    assert rel_error(a, b) < 1e-6, rel_error(a, b)
    assert not torch.equal(a, fill)


def _experts_run(ext, device: str, seed: int, fuse: bool, frozen_input: bool, monkeypatch):
    """Two calls (cached weights, then a cast per call) of HYBRID experts on the grouped path, whose backward
    runs the direct per-expert GEMMs: outputs, input gradients and weight gradients (or, fused, the
    `main_grad`s after each call). On CPU the grouped forward GEMM is emulated."""
    from fp8_parallel.modules import _grouped_core
    from test_grouped_gemm import IN, OUT, SPLITS, _emulated_grouped_mm

    if device == "cpu":
        monkeypatch.setattr(torch, "_scaled_grouped_mm", _emulated_grouped_mm([]), raising=False)
        monkeypatch.setattr(_grouped_core, "device_has_grouped_gemm", lambda d: True)
    gen = torch.Generator().manual_seed(seed)
    lin = fp.GroupedLinear(len(SPLITS), IN, OUT, bias=False, device=device, params_dtype=torch.bfloat16,
                           fuse_wgrad_accumulation=fuse)
    lin.use_grouped_gemm = True
    weights = [getattr(lin, f"weight{i}") for i in range(len(SPLITS))]
    with torch.no_grad():
        for w in weights:
            w.copy_(torch.randn(w.shape, generator=gen) * IN**-0.5)
            if fuse:
                w.main_grad = torch.randn(w.shape, generator=gen).to(device)
                w.grad_added_to_main_grad = False
    weights[2].requires_grad_(False)  # a frozen expert with rows
    seen = []
    with using(ext):
        for first in (True, None):
            x = (torch.randn(sum(SPLITS), IN, generator=gen) * 2).to(device, torch.bfloat16)
            x.requires_grad_(not frozen_input)
            with fp.autocast(recipe=fp.DelayedScaling(amax_history_len=4)):
                y = lin(x, SPLITS, is_first_microbatch=first)
            y.backward(torch.randn(y.shape, generator=gen).to(device, torch.bfloat16))
            seen += [y.detach(), x.grad if x.grad is not None else torch.zeros(())]
            for w in weights:
                seen.append(w.main_grad.clone() if fuse and w.requires_grad else w.grad)
                w.grad = None
    return seen


def _check_experts(ext, device: str, monkeypatch):
    counting = CountingExtension(ext)
    for fuse in (False, True):
        for frozen_input in (False, True):
            seed = seed_for(f"native_experts/{device}/{fuse}/{frozen_input}")
            before = counting.calls["experts_bwd"]
            got = _experts_run(counting, device, seed, fuse, frozen_input, monkeypatch)
            assert counting.calls["experts_bwd"] - before == 2, counting.calls
            want = _experts_run(None, device, seed, fuse, frozen_input, monkeypatch)
            for i, (a, b) in enumerate(zip(got, want)):
                case = (device, fuse, frozen_input, i, seed)
                if a is None or b is None:
                    assert a is None and b is None, case  # the frozen expert's gradient
                elif fuse and device == "cuda" and i % 6 >= 2:  # a main_grad: added in the GEMM's epilogue
                    assert rel_error(a, b) < 1e-6, (case, rel_error(a, b))
                else:
                    assert torch.equal(a, b), case


def test_native_expert_backward_matches_python_path(cpu_ext, monkeypatch):
    """The compiled per-expert backward GEMMs of a grouped HYBRID call (with and without fused accumulation, a
    frozen expert, an expert without rows, an input without gradient) against the Python loop, bit for bit."""
    _check_experts(cpu_ext, "cpu", monkeypatch)


@pytest.mark.gpu
def test_native_expert_backward_matches_python_path_gpu(monkeypatch):
    """The same on the GPU (the real grouped forward GEMM); a fused add in the epilogue is float32 rounding apart."""
    from fp8_parallel.modules import _grouped_core

    ext = _cuda_extension()
    if not _grouped_core.device_has_grouped_gemm(torch.device("cuda")):
        pytest.skip("torch._scaled_grouped_mm does not run on this GPU (needs compute capability 9.0 or 10.0)")
    _check_experts(ext, "cuda", monkeypatch)


def test_native_expert_backward_rejects_bad_arguments(cpu_ext):
    fp8 = torch.float8_e5m2
    g = torch.randn(8, 16).to(fp8)
    sinv = torch.ones(8)[::4]
    w_t = [torch.randn(32, 16).to(torch.float8_e4m3fn)] * 2
    with pytest.raises(RuntimeError, match=r"2 experts, \[3\] grad_output scale_invs"):
        cpu_ext.experts_bwd(16, 32, g, torch.ones(3), [4, 4], w_t, [torch.ones(())] * 2, 0, None, None, None, [], [],
                            [], [], [])
    with pytest.raises(RuntimeError, match="splits sum to 9, the cast has 8 rows"):
        cpu_ext.experts_bwd(16, 32, g, sinv, [4, 5], w_t, [torch.ones(())] * 2, 0, None, None, None, [], [], [], [],
                            [])
    with pytest.raises(RuntimeError, match=r"weight transpose 1 has sizes \[16, 16\], expected \[32, 16\]"):
        cpu_ext.experts_bwd(16, 32, g, sinv, [4, 4], [w_t[0], torch.randn(16, 16).to(fp8)], [torch.ones(())] * 2, 0,
                            None, None, None, [], [], [], [], [])
    g_t, x_t = torch.zeros(16 * 32, dtype=fp8), torch.zeros(32 * 32, dtype=torch.float8_e4m3fn)
    with pytest.raises(RuntimeError, match=r"main_grad 0 has sizes \[16, 16\]"):
        cpu_ext.experts_bwd(16, 32, None, sinv, [4, 4], [], [], 0, g_t, x_t, sinv, [0, 16], [16, 16], [True, True],
                            [0, 0], [torch.zeros(16, 16), None])
