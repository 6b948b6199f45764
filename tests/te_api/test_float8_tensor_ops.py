"""torch ops on a `Float8Tensor` as on TransformerEngine's: ops other than views, copies and casts run on the
dequantized values in the tensor's high-precision dtype and return plain tensors; in-place ops re-quantize with
the tensor's scale; `x.data = t` takes another Float8Tensor's data and scale, or quantizes a high-precision
tensor in place. References: the same op on `dequantize()` (bit for bit), and float64 for the re-quantized
values (within one FP8 step)."""
from __future__ import annotations

import pytest
import torch

from fp8_parallel.quantize import quantize
from fp8_parallel.tensor import Float8Tensor
from seeds import session_seed

OPS = {
    "neg": lambda t, u: -t, "abs": lambda t, u: torch.abs(t), "sin": lambda t, u: torch.sin(t),
    "exp": lambda t, u: t.exp(), "add": lambda t, u: t + u, "sub_scalar": lambda t, u: t - 0.5,
    "mul": lambda t, u: t * u, "div": lambda t, u: t / 3.0, "eq": lambda t, u: t == u, "lt": lambda t, u: t < u,
    "matmul": lambda t, u: t @ u.t(), "sum": lambda t, u: t.sum(dim=0), "max": lambda t, u: t.max(),
    "where": lambda t, u: torch.where(t > 0, t, u), "cat": lambda t, u: torch.cat([t, u]),
}


def _pair(dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(12, 20, generator=gen).to(dtype)
    b = torch.randn(12, 20, generator=gen).to(dtype)
    qa = quantize(a, torch.tensor([100.0]), torch.float8_e4m3fn)
    qb = quantize(b, torch.tensor([60.0]), torch.float8_e5m2)
    return qa, qb


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("op", sorted(OPS))
def test_ops_run_on_dequantized_values(op, dtype):
    seed = session_seed()
    print("seed", seed)
    qa, qb = _pair(dtype, seed)
    assert qa.dtype == dtype
    got = OPS[op](qa, qb)
    want = OPS[op](qa.dequantize(), qb.dequantize())
    assert type(got) is torch.Tensor and got.dtype == want.dtype
    assert torch.equal(got, want), op


@pytest.mark.parametrize("op", ["add_", "mul_", "copy_", "zero_"])
def test_inplace_ops_requantize_with_the_tensors_scale(op):
    seed = session_seed()
    print("seed", seed)
    qa, qb = _pair(torch.float32, seed)
    before = qa.dequantize().double()
    sinv, ptr = qa._scale_inv.clone(), qa._data.data_ptr()
    want = {"add_": before + 0.25, "mul_": before * 1.5, "copy_": qb.dequantize().double(),
            "zero_": torch.zeros_like(before)}[op]
    {"add_": lambda: qa.add_(0.25), "mul_": lambda: qa.mul_(1.5), "copy_": lambda: qa.copy_(qb),
     "zero_": lambda: qa.zero_()}[op]()
    assert isinstance(qa, Float8Tensor) and qa._data.data_ptr() == ptr
    if op != "copy_":  # copy_ from a Float8Tensor of another format re-quantizes; of the same, takes its scale
        assert torch.equal(qa._scale_inv, sinv)
    step = 2.0 ** -3 * want.abs().clamp(min=2.0 ** -6) + float(sinv) * 2.0 ** -9  # E4M3: 3 mantissa bits
    assert ((qa.dequantize().double() - want).abs() <= step).all(), op


def test_data_assignment_from_a_float8_tensor_takes_its_data_and_scale():
    seed = session_seed()
    print("seed", seed)
    qa, qb = _pair(torch.bfloat16, seed)
    t = qa.transpose_2d()  # fills the transpose buffer of the old data
    assert torch.equal(t.dequantize(), qa.dequantize().t())
    small = quantize(torch.randn(4, 8, generator=torch.Generator().manual_seed(seed)), torch.tensor([7.0]),
                     torch.float8_e5m2)
    for src in (qb, small):  # same shape, then another shape and dtype
        qa.data = src
        assert isinstance(qa, Float8Tensor) and qa.shape == src.shape and qa.dtype == src.dtype
        assert qa._data is src._data and torch.equal(qa.dequantize(), src.dequantize())
        assert torch.equal(qa.transpose_2d().dequantize(), src.dequantize().t())  # never the old transpose


def test_data_assignment_from_a_high_precision_tensor_quantizes_in_place():
    seed = session_seed()
    print("seed", seed)
    qa, _ = _pair(torch.float32, seed)
    qa.transpose_2d()
    new = torch.randn(12, 20, generator=torch.Generator().manual_seed(seed + 1))
    ptr = qa._data.data_ptr()
    qa.data = new
    assert qa._data.data_ptr() == ptr and torch.equal(qa.dequantize(), quantize(new, torch.tensor([100.0]),
                                                                               torch.float8_e4m3fn).dequantize())
    assert torch.equal(qa.transpose_2d().dequantize(), qa.dequantize().t())
    with pytest.raises(ValueError, match=r"shape \(3, 3\)"):
        qa.data = torch.zeros(3, 3)
    assert isinstance(qa.data, Float8Tensor) and qa.data._data is qa._data


def test_te_constructor_keywords_and_dtype_names():
    import fp8_parallel as te

    seed = session_seed()
    print("seed", seed)
    x = torch.randn(6, 16, generator=torch.Generator().manual_seed(seed))
    q = quantize(x, torch.tensor([50.0]), torch.float8_e4m3fn)
    data_t = q._data.t().contiguous()
    t = te.Float8Tensor(shape=q.shape, dtype=torch.float32, data=q._data, fp8_scale_inv=q._scale_inv,
                        fp8_dtype=te.DType.kFloat8E4M3, requires_grad=False, data_transpose=data_t, quantizer=None)
    assert torch.equal(t.dequantize(), q.dequantize()) and t.dtype == torch.float32
    assert t._fp8_dtype is te.DType.kFloat8E4M3 and t.transpose_2d()._data is data_t  # the given transpose serves
    assert te.DType.kBFloat16.torch_dtype is torch.bfloat16 and te.DType.from_torch(torch.float8_e5m2) is te.DType.kFloat8E5M2
    with pytest.raises(TypeError, match="fp8_dtype=DType.kFloat8E5M2 but data is torch.float8_e4m3fn"):
        te.Float8Tensor(data=q._data, fp8_scale_inv=q._scale_inv, fp8_dtype=te.DType.kFloat8E5M2)
    with pytest.raises(ValueError, match=r"shape=\(4, 4\)"):
        te.Float8Tensor(shape=(4, 4), data=q._data, fp8_scale_inv=q._scale_inv, fp8_dtype=te.DType.kFloat8E4M3)
    with pytest.raises(ValueError, match="data_transpose of shape"):
        te.Float8Tensor(data=q._data, fp8_scale_inv=q._scale_inv, fp8_dtype=te.DType.kFloat8E4M3, data_transpose=q._data)
