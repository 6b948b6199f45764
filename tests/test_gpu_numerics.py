"""GPU checks of the numerics core: Triton vs torch quantize, FP8 GEMM vs dequantized matmul, graph capture."""
import pytest
import torch

from fp8_parallel.gemm import fp8_gemm
from fp8_parallel.quantize import quantize

pytestmark = pytest.mark.gpu
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _gen():
    return torch.Generator(device="cuda").manual_seed(int.from_bytes(__import__("os").urandom(4), "little"))


@pytest.mark.parametrize("shape", [(4096, 1024), (1000, 776), (3, 17, 48)])
@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2])
@pytest.mark.parametrize("with_t", [False, True])
def test_triton_quantize_equals_torch(shape, fp8_dtype, with_t):
    x = torch.randn(shape, device="cuda", generator=_gen(), dtype=torch.bfloat16) * 7
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
    y = fp8_gemm(a, b, out_dtype, bias=bias)
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


@pytest.mark.parametrize("shape", [(4096, 1024), (1000, 776)])
def test_transpose_only_cast_equals_cast_transpose(shape):
    from fp8_parallel.quantize import quantize_transposed

    x = torch.randn(shape, device="cuda", generator=_gen(), dtype=torch.bfloat16)
    scale = torch.full((1,), 17.0, device="cuda")
    a = quantize(x, scale, E4M3, with_transpose=True)
    b = quantize_transposed(x, scale, E4M3)
    assert torch.equal(a.transpose_2d(update_cache=False)._data.view(torch.uint8), b._data.view(torch.uint8))
    assert torch.equal(a._scale_inv, b._scale_inv)
