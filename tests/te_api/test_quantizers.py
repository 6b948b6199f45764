"""TransformerEngine's quantizer objects and `general_gemm`, as TE documents them: `Float8Quantizer` (delayed:
casts with its scale buffer, records the amax), `Float8CurrentScalingQuantizer` (TE's scale rule, epsilon,
power-of-2 scales, the float32 overflow value), `quantize` / `update_quantized` / `make_empty` / `noop_flag` /
usages / `calibrate`, gradients through a cast, and the three GEMM layouts. References: float64 arithmetic on
the same inputs (casts within half an FP8 step; GEMMs to float32 rounding of the dequantized operands)."""
from __future__ import annotations

import pytest
import torch

import fp8_parallel as te
from fp8_parallel import DType
from fp8_parallel.cpp_extensions import general_gemm
from fp8_parallel.scaling import current_scale_te
from seeds import session_seed

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
MANTISSA = {torch.float8_e4m3fn: 3, torch.float8_e5m2: 2}


def _gen(salt: int = 0) -> torch.Generator:
    seed = session_seed() + salt
    print("seed", seed)
    return torch.Generator().manual_seed(seed)


def _assert_cast_close(q: te.Float8Tensor, x: torch.Tensor, scale: float) -> None:
    """Each element within half an FP8 step of `x * scale` (float64), saturated to the format's range."""
    fp8 = q._data.dtype
    fmax = te.fp8_max(fp8)
    want = (x.double() * scale).clamp(-fmax, fmax)
    got = q._data.double()
    tiny = torch.finfo(fp8).smallest_normal
    step = torch.maximum(want.abs(), torch.full_like(want, tiny)) * 2.0 ** -MANTISSA[fp8]
    assert bool(((got - want).abs() <= step / 2 + 1e-12).all()), float((got - want).abs().max())


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("dtype", DTYPES)
def test_float8_quantizer_casts_with_its_scale_and_records_the_amax(dtype, fp8):
    gen = _gen()
    x = (torch.randn(37, 53, generator=gen) * 3).to(dtype)
    scale = torch.tensor([float(torch.rand((), generator=gen)) * 20 + 1])
    amax = torch.tensor([0.25])
    q = te.Float8Quantizer(scale, amax, DType.from_torch(fp8))
    assert q.dtype == DType.from_torch(fp8) and q.get_usages() == {"rowwise": True, "columnwise": True}
    out = q(x)
    assert isinstance(out, te.QuantizedTensor) and isinstance(out, te.Float8Tensor) and out.dtype == dtype
    _assert_cast_close(out, x, float(scale))
    assert torch.equal(out._scale_inv.reshape(1), scale.reciprocal())
    assert float(amax) == max(0.25, float(x.float().abs().max()))  # max(previous, this cast's amax)
    assert out.has_current_transpose() and torch.equal(out.transpose_2d(update_cache=False)._data.float(),
                                                       out._data.float().t())
    scale.mul_(0.5)  # used by reference: the next cast takes the new value
    _assert_cast_close(q(x), x, float(scale))


def test_usages_decide_the_transpose():
    gen = _gen(1)
    x = torch.randn(24, 40, generator=gen)
    q = te.Float8Quantizer(torch.tensor([8.0]), torch.zeros(1), torch.float8_e4m3fn, columnwise=False)
    out = q(x)
    assert not out.has_current_transpose() and out.get_usages() == {"rowwise": True, "columnwise": False}
    out.update_usage(columnwise_usage=True)
    assert out.has_current_transpose() and torch.equal(out.transpose_2d(update_cache=False)._data.float(),
                                                       out._data.float().t())
    out.update_usage(columnwise_usage=False)
    assert not out.has_current_transpose()
    q.set_usage(columnwise=True)
    assert q(x).has_current_transpose()


@pytest.mark.parametrize("dtype", DTYPES)
def test_current_scaling_quantizer_scales_from_the_tensor(dtype):
    gen = _gen(2)
    x = (torch.randn(33, 65, generator=gen) * 7).to(dtype)
    q = te.Float8CurrentScalingQuantizer(DType.kFloat8E4M3, torch.device("cpu"))
    out = q(x)
    amax = x.double().abs().max()
    want_scale = torch.tensor(448.0 / float(amax), dtype=torch.float64).float()  # float64 quotient, rounded
    assert torch.equal(out._scale_inv.reshape(()), want_scale.reciprocal())
    _assert_cast_close(out, x, float(want_scale))
    assert float(out.dequantize().float().abs().max()) == pytest.approx(float(amax), rel=2 ** -4)


def test_current_scale_rule_edges():
    """TE's rule: epsilon floors the amax; a zero or non-finite amax gives 1; an overflowing quotient the
    input type's largest value; power-of-2 scales round down."""
    amax = torch.tensor([0.0, float("nan"), float("inf"), 1e-44, 3.0, 1e-30])
    got = current_scale_te(amax, 448.0, 0.0, False, 3.4e38)
    assert got[:3].tolist() == [1.0, 1.0, 1.0]
    assert float(got[3]) == pytest.approx(3.4e38, rel=1e-6)
    assert float(got[4]) == torch.tensor(448.0 / 3.0).item()
    eps = current_scale_te(torch.tensor([0.0, 1e-9]), 448.0, 1e-6, False, 3.4e38)
    assert torch.equal(eps, torch.full((2,), 448.0) / 1e-6)
    pow2 = current_scale_te(torch.tensor([3.0, 0.01, 448.0]), 448.0, 0.0, True, 3.4e38)
    for p, a in zip(pow2.tolist(), [3.0, 0.01, 448.0]):
        assert p == 2.0 ** int(torch.floor(torch.log2(torch.tensor(448.0 / a)))), (p, a)
    zeros = te.Float8CurrentScalingQuantizer(torch.float8_e5m2)(torch.zeros(16, 16))
    assert float(zeros._scale_inv) == 1.0 and not zeros._data.float().any()


def test_fp16_input_overflow_takes_fp16_max():
    x = torch.full((16, 16), 1e-44)  # float32 subnormal: 448 / amax overflows float32
    q = te.Float8CurrentScalingQuantizer(torch.float8_e4m3fn)
    assert float(q.scale_for(x)) == pytest.approx(torch.finfo(torch.float32).max, rel=1e-6)
    assert float(q.scale_for(torch.full((16, 16), 1e-7, dtype=torch.float16))) == pytest.approx(448 / 1.1920929e-07,
                                                                                                 rel=1e-3)


def test_update_quantized_writes_in_place_and_honours_noop_flag():
    gen = _gen(3)
    x, y = torch.randn(32, 48, generator=gen), torch.randn(32, 48, generator=gen)
    q = te.Float8Quantizer(torch.tensor([16.0]), torch.zeros(1), torch.float8_e4m3fn)
    dst = q.make_empty((32, 48), dtype=torch.bfloat16, device="cpu")
    assert dst.shape == (32, 48) and dst.dtype == torch.bfloat16 and dst._data.dtype == torch.float8_e4m3fn
    ptrs = (dst._data.data_ptr(), dst._scale_inv.data_ptr())
    q.update_quantized(x, dst)
    assert (dst._data.data_ptr(), dst._scale_inv.data_ptr()) == ptrs
    _assert_cast_close(dst, x, 16.0)
    before = dst._data.clone()
    q.update_quantized(y, dst, noop_flag=torch.ones(1))
    assert torch.equal(dst._data.view(torch.uint8), before.view(torch.uint8))
    dst.quantize_(y, noop_flag=torch.zeros(1))  # its quantizer: the same rule
    _assert_cast_close(dst, y, 16.0)
    assert dst.has_current_transpose()
    with pytest.raises(ValueError, match="dst must be a Float8Tensor"):
        q.update_quantized(x, torch.empty(32, 48))


def test_calibrate_records_without_casting():
    gen = _gen(4)
    x = torch.randn(20, 20, generator=gen)
    amax = torch.tensor([100.0])
    te.Float8Quantizer(torch.ones(1), amax, torch.float8_e4m3fn).calibrate(x)
    assert float(amax) == float(x.abs().max())


def test_gradient_passes_through_a_cast():
    gen = _gen(5)
    x = torch.randn(16, 32, generator=gen, requires_grad=True)
    w = torch.randn(16, 32, generator=gen)
    qx = te.Float8CurrentScalingQuantizer(torch.float8_e4m3fn)(x)
    assert qx.requires_grad
    (qx * w).sum().backward()
    assert torch.equal(x.grad, w)
    with torch.no_grad():
        assert not te.Float8CurrentScalingQuantizer(torch.float8_e4m3fn)(x).requires_grad


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="scale must be a float32 tensor of one element, got shape \\(2,\\)"):
        te.Float8Quantizer(torch.ones(2), torch.zeros(1), torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="fp8_dtype=torch.bfloat16 is not an FP8 format"):
        te.Float8CurrentScalingQuantizer(torch.bfloat16)
    with pytest.raises(ValueError, match="amax_epsilon=-1.0"):
        te.Float8CurrentScalingQuantizer(torch.float8_e4m3fn, amax_epsilon=-1.0)
    with pytest.raises(TypeError, match="quantizes a high-precision float tensor"):
        te.Float8CurrentScalingQuantizer(torch.float8_e4m3fn)(torch.ones(4, 4, dtype=torch.int32))


def _operands(gen: torch.Generator, m: int, k: int, n: int, dtype: torch.dtype):
    x, w, dy = (torch.randn(*s, generator=gen).to(dtype) for s in ((m, k), (n, k), (m, n)))
    fwd = te.Float8CurrentScalingQuantizer(torch.float8_e4m3fn)
    bwd = te.Float8CurrentScalingQuantizer(torch.float8_e5m2)
    return x, w, dy, fwd(x), fwd(w), bwd(dy)


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    err = float((got.double() - want).abs().max() / want.abs().max())
    assert err <= tol, err


@pytest.mark.parametrize("dtype", DTYPES)
def test_general_gemm_layouts_match_float64(dtype):
    """fprop "TN", dgrad "NN", wgrad "NT" on FP8 operands (unaligned sizes: padded inside) against the float64
    product of the dequantized operands; the same layouts on high-precision operands."""
    gen = _gen(6)
    m, k, n = 40, 56, 24
    x, w, dy, qx, qw, qdy = _operands(gen, m, k, n, dtype)
    dx_, dw_, ddy = (t.dequantize(torch.float64) for t in (qx, qw, qdy))
    y, bias_grad, gelu_in, extra = general_gemm(qw, qx, out_dtype=dtype, layout="TN")
    assert y.shape == (m, n) and y.dtype == dtype and bias_grad is None and gelu_in is None and extra is None
    _close(y, dx_ @ dw_.t(), dtype)
    dx, *_ = general_gemm(qw, qdy, out_dtype=dtype, layout="NN", use_split_accumulator=True)
    _close(dx, ddy @ dw_, dtype)
    dw, *_ = general_gemm(qx, qdy, out_dtype=torch.float32, layout="NT", use_split_accumulator=True)
    assert dw.shape == (n, k)
    _close(dw, ddy.t() @ dx_, torch.float32)
    hp, *_ = general_gemm(w, x, layout="TN")
    assert hp.dtype == dtype
    _close(hp, x.double() @ w.double().t(), dtype)
    _close(general_gemm(x, dy, layout="NT")[0], dy.double().t() @ x.double(), dtype)


def test_general_gemm_bias_accumulate_output_quantizer_and_workspace():
    gen = _gen(7)
    m, k, n = 32, 48, 16
    x, w, dy, qx, qw, qdy = _operands(gen, m, k, n, torch.float32)
    bias = torch.randn(n, generator=gen)
    ref = qx.dequantize(torch.float64) @ qw.dequantize(torch.float64).t()
    workspace = torch.empty(1024, dtype=torch.uint8)
    y, *_ = general_gemm(qw, qx, workspace, torch.float32, bias=bias)  # TE < 2.6 calls pass a workspace
    _close(y, ref + bias.double(), torch.float32)
    _, bias_grad, _, _ = general_gemm(qx, qdy, out_dtype=torch.float32, layout="NT", bias=bias, grad=True)
    assert torch.allclose(bias_grad.double(), qdy.dequantize().double().sum(0), rtol=1e-6, atol=1e-6)
    acc = torch.randn(m, n, generator=gen)
    start = acc.clone()
    out, *_ = general_gemm(qw, qx, out=acc, accumulate=True, alpha=0.5, beta=2.0)
    assert out is acc
    _close(acc, 0.5 * ref + 2.0 * start.double(), torch.float32)
    q_out = te.Float8Quantizer(torch.tensor([4.0]), torch.zeros(1), torch.float8_e4m3fn)
    fp8_y, *_ = general_gemm(qw, qx, out_dtype=torch.bfloat16, quantization_params=q_out)
    assert isinstance(fp8_y, te.Float8Tensor) and fp8_y._data.dtype == torch.float8_e4m3fn
    assert float(q_out.amax) == pytest.approx(float(ref.abs().max()), rel=1e-2)
    x3 = x.reshape(4, 8, k)
    y3, *_ = general_gemm(w, x3)
    assert y3.shape == (4, 8, n)


def test_general_gemm_refuses_what_it_cannot_do():
    qx = te.Float8CurrentScalingQuantizer(torch.float8_e4m3fn)(torch.randn(16, 16))
    with pytest.raises(ValueError, match="layout='TT'"):
        general_gemm(qx, qx, layout="TT")
    with pytest.raises(ValueError, match="A is a Float8Tensor and B is a torch.float32 tensor"):
        general_gemm(qx, torch.randn(16, 16))
    with pytest.raises(NotImplementedError, match="GELU"):
        general_gemm(qx, qx, gelu=True)
    with pytest.raises(ValueError, match="accumulate=True"):
        general_gemm(qx, qx, accumulate=True)
    with pytest.raises(ValueError, match="contracts A \\(16, 16\\) with B \\(16, 8\\)"):
        general_gemm(torch.randn(16, 16), torch.randn(16, 8))


def test_quantize_in_place_without_quantizer_honours_noop_flag():
    gen = _gen(8)
    x, y = torch.randn(16, 32, generator=gen), torch.randn(16, 32, generator=gen)
    from fp8_parallel.quantize import quantize

    t = quantize(x, torch.tensor([32.0]), torch.float8_e4m3fn)
    before, sinv = t._data.clone(), t._scale_inv.clone()
    t.quantize_(y, torch.tensor([8.0]), noop_flag=torch.ones(1))
    assert torch.equal(t._data.view(torch.uint8), before.view(torch.uint8)) and torch.equal(t._scale_inv, sinv)
    t.quantize_(y, torch.tensor([8.0]), noop_flag=torch.zeros(1))
    _assert_cast_close(t, y, 8.0)
    assert float(t._scale_inv) == 0.125


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_quantizers_on_cuda(dtype):
    """Both quantizers on CUDA tensors (the fused cast kernels), every dtype: the same bytes, scale_inv and amax
    as on the CPU, and the transpose filled."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    gen = _gen(9)
    x = (torch.randn(48, 80, generator=gen) * 5).to(dtype)
    scale = torch.tensor([12.0])
    for make in (lambda dev: te.Float8Quantizer(scale.to(dev), torch.zeros(1, device=dev), torch.float8_e4m3fn),
                 lambda dev: te.Float8CurrentScalingQuantizer(torch.float8_e5m2, dev)):
        cpu_q, gpu_q = make("cpu"), make("cuda")
        want, got = cpu_q(x), gpu_q(x.cuda())
        assert got.is_cuda and got.has_current_transpose()
        assert torch.equal(got._data.cpu().view(torch.uint8), want._data.view(torch.uint8))
        assert torch.equal(got._scale_inv.cpu(), want._scale_inv)
        assert torch.equal(got.transpose_2d(update_cache=False)._data.cpu().view(torch.uint8),
                           want._data.t().contiguous().view(torch.uint8))
        if isinstance(cpu_q, te.Float8Quantizer):
            assert torch.equal(gpu_q.amax.cpu(), cpu_q.amax)
