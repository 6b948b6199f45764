"""GPU checks of the numerics core: Triton vs torch quantize, FP8 GEMM vs dequantized matmul, graph capture."""
import pytest
import torch
from seeds import session_seed

from fp8_parallel.gemm import fp8_gemm
from fp8_parallel.quantize import quantize

pytestmark = pytest.mark.gpu
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _gen():
    return torch.Generator(device="cuda").manual_seed(session_seed())


@pytest.mark.parametrize("shape", [(4096, 1024), (1000, 776), (3, 17, 48), (64, 64), (256, 192)])
@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2])
@pytest.mark.parametrize("with_t", [False, True])
@pytest.mark.parametrize("hp_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_triton_quantize_equals_torch(shape, fp8_dtype, with_t, hp_dtype):
    # (64, 64) and (256, 192) float32: the fused transposed store wrote a quarter of the transpose wrong
    x = (torch.randn(shape, device="cuda", generator=_gen()) * 7).to(hp_dtype)
    x.view(-1)[5] = 1e6  # saturates
    scale = torch.full((1,), 31.0, device="cuda")
    slot_t, slot_r = torch.zeros(1, device="cuda"), torch.zeros(1, device="cuda")
    a = quantize(x, scale, fp8_dtype, amax_out=slot_t, with_transpose=with_t)
    b = quantize(x, scale, fp8_dtype, amax_out=slot_r, with_transpose=with_t, force_torch=True)
    assert torch.equal(a._data.view(torch.uint8), b._data.view(torch.uint8))
    assert torch.equal(slot_t, slot_r) and torch.equal(a._scale_inv, b._scale_inv)
    if with_t:
        assert a.has_current_transpose()
        assert torch.equal(a.transpose_2d(update_cache=False)._data.view(torch.uint8),
                           b.transpose_2d(update_cache=False)._data.view(torch.uint8))


def test_kernel_scale_arithmetic_is_ieee_float32():
    """The fused update's scales and the cast kernel's scale_inv equal torch's float32 division bit for bit
    (Triton's `/` is approximate: a 1-ulp scale_inv made the re-cast of an unaligned layer's weight, which takes
    the torch path, disagree with the fused cast)."""
    from fp8_parallel import triton_kernels
    from fp8_parallel.scaling import scale_from_amax

    gen = _gen()
    print(f"seed {gen.initial_seed()}")
    n, hist_len, margin = 4096, 4, 1
    amax = torch.rand(n, device="cuda", generator=gen) * torch.rand(n, device="cuda", generator=gen).mul(40).exp2()
    hist = torch.zeros(n, hist_len, device="cuda")
    scales = torch.ones(n, device="cuda")
    counts = torch.zeros(n, dtype=torch.int64, device="cuda")
    rows = torch.arange(n, device="cuda", dtype=torch.int64)
    addresses = torch.stack([hist.data_ptr() + rows * hist_len * 4, scales.data_ptr() + rows * 4,
                             counts.data_ptr() + rows * 8])
    triton_kernels.amax_update(amax, addresses, hist_len, 448.0, margin, most_recent=False)
    expected = scale_from_amax(amax, torch.ones_like(amax), 448.0, margin)
    assert torch.equal(hist[:, 0], amax) and not counts.any()
    assert torch.equal(scales, expected), (scales - expected).abs().max()
    x = torch.randn(64, 48, device="cuda", generator=gen)
    for s in scales[:200]:
        fused = quantize(x, s.reshape(1), E4M3)
        plain = quantize(x, s.reshape(1), E4M3, force_torch=True)
        assert torch.equal(fused._scale_inv, plain._scale_inv), (s.item(), fused._scale_inv.item())
        assert torch.equal(fused._data.view(torch.uint8), plain._data.view(torch.uint8))


@pytest.mark.parametrize("hp_dtype", [torch.float32, torch.bfloat16])
def test_cached_kernel_launches_respecialize(hp_dtype):
    """The direct launch of cached compiled kernels: a call whose arguments specialize differently (pointer
    alignment, a dimension of 1 or not a multiple of 16, another dtype) gets its own kernel, and every call equals
    the torch path and the JIT entry point, bitwise."""
    from fp8_parallel import triton_kernels

    gen = _gen()
    print(f"seed {gen.initial_seed()}")
    base = (torch.randn(4096 + 8, device="cuda", generator=gen) * 5).to(hp_dtype)
    cases = [base[: 64 * 64].view(64, 64), base[1 : 1 + 64 * 64].view(64, 64),  # aligned, then an offset pointer
             base[: 48].view(1, 48), base[: 17 * 48].view(17, 48), base[3 : 3 + 40 * 30].view(40, 30)]
    from fp8_parallel import native

    ext = native.module()
    for fp8_dtype in (E4M3, E5M2):
        for x in cases * 2:  # the second round takes the cached kernels
            scale = torch.full((1,), 13.0, device="cuda")
            got = []
            if ext is not None:  # the compiled extension's kernel, on the same cases
                got.append(quantize(x, scale, fp8_dtype, amax_out=torch.zeros(1, device="cuda"), with_transpose=True))
            previous = native.use(None)  # the Triton kernels
            try:
                got.append(quantize(x, scale, fp8_dtype, amax_out=torch.zeros(1, device="cuda"), with_transpose=True))
                triton_kernels.FAST_LAUNCH = False
                got.append(quantize(x, scale, fp8_dtype, amax_out=torch.zeros(1, device="cuda"), with_transpose=True))
            finally:
                triton_kernels.FAST_LAUNCH = True
                native.use(previous)
            ref = quantize(x, scale, fp8_dtype, with_transpose=True, force_torch=True)
            for q in got:
                assert torch.equal(q._data.view(torch.uint8), ref._data.view(torch.uint8)), (tuple(x.shape), fp8_dtype)
                assert torch.equal(q.transpose_2d(update_cache=False)._data.view(torch.uint8),
                                   ref.transpose_2d(update_cache=False)._data.view(torch.uint8))
    assert len(triton_kernels._QUANTIZE._compiled) >= 3


def test_triton_noop_flag_and_nan_amax():
    x = torch.randn(256, 128, device="cuda", generator=_gen())
    out = quantize(x, torch.ones(1, device="cuda"), E4M3)
    before = out._data.clone()
    slot = torch.zeros(1, device="cuda")
    quantize(x * 3, torch.ones(1, device="cuda"), E4M3, out=out, amax_out=slot, noop_flag=torch.ones(1, device="cuda"))
    assert torch.equal(out._data.view(torch.uint8), before.view(torch.uint8)) and slot.item() == 0
    x[7, 7] = float("nan")
    quantize(x, torch.ones(1, device="cuda"), E4M3, amax_out=slot)
    assert slot.item() == float("inf")


@pytest.mark.parametrize("m,k,n", [(1024, 2048, 512), (333, 4096, 1024), (64, 40, 24)])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_gemm_matches_dequantized_float32(m, k, n, out_dtype):
    g = _gen()
    a = quantize(torch.randn(m, k, device="cuda", generator=g), torch.full((1,), 64.0, device="cuda"), E4M3)
    b = quantize(torch.randn(n, k, device="cuda", generator=g), torch.full((1,), 8.0, device="cuda"), E5M2)
    bias = torch.randn(n, device="cuda", generator=g).to(out_dtype)
    y = fp8_gemm(a, b, out_dtype, bias=bias, pad=(k % 16 != 0 or n % 16 != 0))  # padding only when asked
    assert y.is_contiguous() and y.shape == (m, n)
    ref = a.dequantize(torch.float32) @ b.dequantize(torch.float32).t() + bias.float()
    rel = ((y.float() - ref).norm() / ref.norm()).item()
    print(f"fp8 gemm {m}x{k}x{n} -> {out_dtype}: relative error {rel:.2e}")
    # Hopper FP8 MMA accumulates in reduced precision between fp32 promotions: ~1e-4, not fp32 rounding
    assert rel < (1e-3 if out_dtype == torch.float32 else 4e-3), rel


def test_quantize_and_gemm_capture_in_cuda_graph():
    g = _gen()
    x = torch.randn(512, 256, device="cuda", generator=g, dtype=torch.bfloat16)
    w = quantize(torch.randn(128, 256, device="cuda", generator=g), torch.full((1,), 50.0, device="cuda"), E4M3)
    scale, slot = torch.full((1,), 40.0, device="cuda"), torch.zeros(1, device="cuda")
    out = quantize(x, scale, E4M3, with_transpose=True)
    fp8_gemm(out, w, torch.bfloat16)  # warm-up, as torch requires before a capture: cuBLAS sets up on first use
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # fails on any host synchronization
        quantize(x, scale, E4M3, amax_out=slot, with_transpose=True, out=out)
        y = fp8_gemm(out, w, torch.bfloat16)
    x.copy_(torch.randn(512, 256, device="cuda", generator=g))
    scale.fill_(20.0)  # an update between replays takes effect (fixed addresses)
    graph.replay()
    ref = quantize(x, scale, E4M3, force_torch=True)
    assert torch.equal(out._data.view(torch.uint8), ref._data.view(torch.uint8))
    torch.testing.assert_close(y.float(), fp8_gemm(ref, w, torch.bfloat16).float())
    assert slot.item() == x.float().abs().max().item()


@pytest.mark.parametrize("shape", [(4096, 1024), (1000, 776), (64, 64), (256, 192)])
@pytest.mark.parametrize("hp_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_transpose_only_cast_equals_cast_transpose(shape, hp_dtype):
    from fp8_parallel.quantize import quantize_transposed

    x = torch.randn(shape, device="cuda", generator=_gen()).to(hp_dtype)
    scale = torch.full((1,), 17.0, device="cuda")
    a = quantize(x, scale, E4M3, with_transpose=True)
    b = quantize_transposed(x, scale, E4M3)
    ref = quantize(x, scale, E4M3, with_transpose=True, force_torch=True).transpose_2d(update_cache=False)._data
    assert torch.equal(a.transpose_2d(update_cache=False)._data.view(torch.uint8), b._data.view(torch.uint8))
    assert torch.equal(b._data.view(torch.uint8), ref.view(torch.uint8))
    assert torch.equal(a._scale_inv, b._scale_inv)


def test_float32_transpose_under_noop_flag_keeps_old_bytes():
    """The 32-bit-input path (row-major cast, then a byte transpose) honours the device-side no-op flag."""
    x = torch.randn(64, 128, device="cuda", generator=_gen())
    out = quantize(x, torch.full((1,), 9.0, device="cuda"), E4M3, with_transpose=True)
    before, before_t = out._data.clone(), out.transpose_2d(update_cache=False)._data.clone()
    quantize(x * 5, torch.full((1,), 9.0, device="cuda"), E4M3, out=out, with_transpose=True,
             noop_flag=torch.ones(1, device="cuda"))
    assert torch.equal(out._data.view(torch.uint8), before.view(torch.uint8))
    assert torch.equal(out.transpose_2d(update_cache=False)._data.view(torch.uint8), before_t.view(torch.uint8))


# ---- FP8 linear, every parameter dtype, both recipes, aligned and unaligned sizes -----------------------------
def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _linear_case(pdt, recipe, m, k, n, leaf, is_first_microbatch, seed):
    import fp8_parallel as fp
    from fp8_parallel.modules import FP8State, fp8_linear

    g = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.nn.Parameter((torch.randn(n, k, device="cuda", generator=g) / k**0.5).to(pdt))
    b = torch.nn.Parameter(torch.randn(n, device="cuda", generator=g).to(pdt))
    state = FP8State("gpu-linear", device="cuda")
    for step in range(3):
        x0 = (torch.randn(m, k, device="cuda", generator=g) * 2).to(pdt)
        x = x0.clone().requires_grad_()
        xin = x if leaf else x * 1.0
        dy = torch.randn(m, n, device="cuda", generator=g).to(pdt)
        w.grad = b.grad = None
        with fp.autocast(recipe=recipe):
            y = fp8_linear(xin, w, b, state, is_first_microbatch=(step == 0) if is_first_microbatch else None)
        y.backward(dy)
        x64, w64, b64 = (t.detach().double().requires_grad_() for t in (x0, w, b))
        y64 = torch.nn.functional.linear(x64, w64, b64)
        y64.backward(dy.double())
        for name, got in (("output", y), ("input grad", x.grad), ("weight grad", w.grad), ("bias grad", b.grad)):
            assert got.dtype == pdt and got.is_contiguous(), (name, got.dtype)
            assert torch.isfinite(got).all(), f"step {step}: {name} not finite ({pdt}, {recipe})"
        # E4M3 forward (~4% per element), E5M2 gradients (~8%); 16-bit outputs round once more
        assert _rel(y.detach(), y64) < 0.08, ("output", _rel(y.detach(), y64))
        assert _rel(x.grad, x64.grad) < 0.12, ("input grad", _rel(x.grad, x64.grad))
        assert _rel(w.grad, w64.grad) < 0.12, ("weight grad", _rel(w.grad, w64.grad))
        assert _rel(b.grad, b64.grad) < 1e-2, ("bias grad", _rel(b.grad, b64.grad))


@pytest.mark.parametrize("pdt", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("recipe_name", ["delayed", "current"])
@pytest.mark.parametrize("mkn", [(64, 64, 64), (256, 128, 192), (21, 30, 50), (96, 40, 24)])
@pytest.mark.parametrize("leaf,cache", [(True, False), (False, False), (True, True)])
def test_fp8_linear_every_dtype_matches_float64(pdt, recipe_name, mkn, leaf, cache):
    """float32 parameters gave non-finite weight gradients on the GPU (NaN bytes in the E5M2 transpose)."""
    import fp8_parallel as fp

    seed = session_seed()
    print(f"seed {seed}")
    recipe = fp.DelayedScaling(amax_history_len=4) if recipe_name == "delayed" else fp.CurrentScaling()
    _linear_case(pdt, recipe, *mkn, leaf, cache, seed)


@pytest.mark.parametrize("pdt", [torch.float32, torch.float16, torch.bfloat16])
def test_grouped_experts_with_an_empty_expert(pdt):
    from megatron.core.transformer.transformer_config import TransformerConfig

    import fp8_parallel as fp
    from fp8_parallel.modules.grouped import GroupedLinear

    seed = session_seed()
    print(f"seed {seed}")
    g = torch.Generator(device="cuda").manual_seed(seed)
    cfg = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=2, perform_initialization=False,
                            params_dtype=pdt)
    lin = GroupedLinear(3, 64, 48, partition="column", config=cfg, init_method=None, bias=True).cuda()
    with torch.no_grad():
        for p in lin.parameters():
            p.copy_(torch.randn(p.shape, device="cuda", generator=g) / 8)
    splits = [17, 0, 30]
    x = torch.randn(sum(splits), 64, device="cuda", generator=g).to(pdt).requires_grad_()
    for recipe in (fp.DelayedScaling(), fp.CurrentScaling()):
        for p in lin.parameters():
            p.grad = None
        with fp.autocast(recipe=recipe):
            y = lin(x, splits)
        y.float().pow(2).sum().backward()
        assert y.shape == (47, 48) and torch.isfinite(y).all()
        assert all(torch.isfinite(p.grad).all() for p in lin.parameters())
        assert torch.equal(lin.weight1.grad, torch.zeros_like(lin.weight1.grad))
        ref = torch.cat([x[:17].double() @ lin.weight0.double().t() + lin.bias0.double(),
                         x[17:].double() @ lin.weight2.double().t() + lin.bias2.double()])
        assert _rel(y.detach(), ref) < 0.08


@pytest.mark.parametrize("how", ["assign", "to"])
def test_fused_amax_update_writes_replaced_buffers(how):
    """The fused update's address table follows buffers replaced by load_state_dict(assign=True) or `.to()`;
    the old tensors are never written again."""
    import fp8_parallel as fp
    from fp8_parallel.modules import FP8State, fp8_linear

    g = torch.Generator(device="cuda").manual_seed(5)
    w = torch.randn(64, 64, device="cuda", generator=g, requires_grad=True)
    state = FP8State("gpu-addresses", device="cuda")
    recipe = fp.DelayedScaling(amax_history_len=4)

    def step(scale):
        x = torch.randn(32, 64, device="cuda", generator=g) * scale
        with fp.autocast(recipe=recipe):
            y = fp8_linear(x, w, None, state)
        y.sum().backward()
        return x.abs().max()

    step(1.0)
    old = {k: v for k, v in state.state_dict(keep_vars=True).items()}
    old_copy = {k: v.clone() for k, v in old.items()}
    if how == "assign":
        state.load_state_dict({k: v.clone() for k, v in old.items()}, assign=True)
    else:
        state.cpu()
        state.cuda()  # moved away and back: new tensors
    assert state.fwd.amax_history.data_ptr() != old["fwd.amax_history"].data_ptr()
    amax = step(3.0)
    torch.cuda.synchronize()
    for k, v in old.items():  # the replaced tensors were not written
        assert torch.equal(v, old_copy[k]), k
    assert state.fwd.amax_history[0, 0] == amax  # the live buffers were
    torch.testing.assert_close(state.fwd.scale[0], 448.0 / state.fwd.amax_history[0].max(), rtol=1e-6, atol=0)


@pytest.fixture(scope="module")
def one_rank_model_parallel():
    """megatron's model-parallel state on one rank (TP1), for its parallel linears."""
    import parallel_state as ps

    ps.initialize()
    yield ps
    ps.destroy()


@pytest.mark.parametrize("pdt", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("recipe_name", ["delayed", "current"])
@pytest.mark.parametrize("d,f", [(64, 128), (30, 50)])
def test_parallel_linears_every_dtype_match_float64(one_rank_model_parallel, pdt, recipe_name, d, f):
    """LayerNormColumnParallelLinear -> gelu -> RowParallelLinear (TP1) against float64, every parameter dtype,
    aligned and unaligned sizes: outputs and every gradient finite and within FP8 tolerance."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    import fp8_parallel as fp

    ps = one_rank_model_parallel
    seed = session_seed()
    print(f"seed {seed}")
    g = torch.Generator(device="cuda").manual_seed(seed)
    cfg = TransformerConfig(num_layers=1, hidden_size=d, ffn_hidden_size=f, num_attention_heads=2,
                            perform_initialization=False, params_dtype=pdt,
                            use_cpu_initialization=not torch.cuda.is_available())
    fc1 = fp.LayerNormColumnParallelLinear(d, f, config=cfg, init_method=None, bias=True, gather_output=False,
                                           skip_bias_add=False)
    fc2 = fp.RowParallelLinear(f, d, config=cfg, init_method=None, bias=True, input_is_parallel=True,
                               skip_bias_add=False)
    with torch.no_grad():
        for p in (fc1.weight, fc1.bias, fc2.weight, fc2.bias):
            p.copy_(torch.randn(p.shape, device="cuda", generator=g) / p.shape[-1] ** 0.5)
        fc1.layer_norm_weight.copy_(1 + 0.1 * torch.randn(d, device="cuda", generator=g))
    recipe = fp.DelayedScaling(amax_history_len=4) if recipe_name == "delayed" else fp.CurrentScaling()
    params = [fc1.layer_norm_weight, fc1.layer_norm_bias, fc1.weight, fc1.bias, fc2.weight, fc2.bias]
    for step in range(3):
        x0 = torch.randn(7, 3, d, device="cuda", generator=g).to(pdt)
        x = x0.clone().requires_grad_()
        for p in params:
            p.grad = None
        with ps.cpu_compat(), fp.autocast(recipe=recipe):
            h, _ = fc1(x)
            y, _ = fc2(torch.nn.functional.gelu(h))
        dy = torch.randn(y.shape, device="cuda", generator=g).to(pdt)
        with ps.cpu_compat():
            y.backward(dy)
        ref = [p.detach().double().requires_grad_() for p in params]
        x64 = x0.double().requires_grad_()
        n64 = torch.nn.functional.layer_norm(x64, (d,), ref[0], ref[1], cfg.layernorm_epsilon)
        y64 = torch.nn.functional.linear(torch.nn.functional.gelu(torch.nn.functional.linear(n64, ref[2], ref[3])),
                                         ref[4], ref[5])
        y64.backward(dy.double())
        assert y.dtype == pdt and y.is_contiguous() and torch.isfinite(y).all()
        assert _rel(y.detach(), y64) < 0.1, ("output", step, _rel(y.detach(), y64))
        assert _rel(x.grad, x64.grad) < 0.25, ("input grad", step, _rel(x.grad, x64.grad))
        for i, (p, r) in enumerate(zip(params, ref)):
            assert p.grad is not None and torch.isfinite(p.grad).all(), (i, pdt, recipe_name)
            assert _rel(p.grad, r.grad) < 0.25, (i, step, _rel(p.grad, r.grad))
