"""FP8 GEMM on `torch._scaled_mm` (a float32 matmul on the CPU), with the GPU's layout rules enforced on every
device.

Convention ("TN", as the FP8 tensor cores want it): `fp8_gemm(a, b)` computes `a @ b.T` for `a: [M, K]` and
`b: [N, K]`, both row-major with K contiguous. A linear layer's three GEMMs then read:

    fprop  y  = x  @ W.T   -> fp8_gemm(x, W)
    dgrad  dx = dy @ W     -> fp8_gemm(dy, W.transpose_2d())
    wgrad  dW = dy.T @ x   -> fp8_gemm(dy.transpose_2d(), x.transpose_2d())

cuBLAS refuses FP8 GEMMs whose K or N is not a multiple of 16 and E5M2 x E5M2; the CPU kernel checks
neither, so this wrapper does, on every device.

Alignment. An unaligned K or N is refused (`FP8GemmShapeError` naming the sizes) unless the caller asks for
padding with `pad=True`: then both operands are zero-padded to multiples of 16 (exact: padding adds zero
terms to every dot product, and zero columns that are dropped). An operand stored by `zero_padded` (the FP8
weight of a layer with unaligned features and its transpose, padded once when cast) is used in place; any
other operand is copied into a padded buffer for this call. Whatever the path, the result is an ordinary
contiguous tensor of shape `[M, N]`, never a view into a padded buffer (a strided view is silently dropped by
communication that works on `.contiguous()` copies, as megatron's tensor-parallel all-reduce does). An empty
M or K gives a zero-filled result without a GEMM.
"""
from __future__ import annotations

from typing import Optional

import torch

from .tensor import Float8Tensor

ALIGN = 16
SINV_STRIDE = 4  # float32 elements between two blocks' scale_inv in a block-scaled buffer (16 bytes apart)
_PADDED = "_fp8_padded_storage"  # attribute of a `zero_padded` view: its whole zero-padded buffer


class FP8GemmShapeError(ValueError):
    """An FP8 GEMM the GPU would refuse (layout, alignment or dtype)."""


def _check(a: Float8Tensor, b: Float8Tensor) -> None:
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, Float8Tensor):
            raise TypeError(f"fp8_gemm: {name} must be a Float8Tensor, got {type(t).__name__}")
        if t._data.dim() != 2:
            raise FP8GemmShapeError(f"fp8_gemm: {name} must be 2-D, got shape {tuple(t._data.shape)}")
        if t._data.stride(1) != 1:
            raise FP8GemmShapeError(
                f"fp8_gemm: {name} must be row-major with K contiguous, got strides {t._data.stride()}"
            )
    if a._data.shape[1] != b._data.shape[1]:
        raise FP8GemmShapeError(f"fp8_gemm: K mismatch, a is {tuple(a._data.shape)}, b is {tuple(b._data.shape)}")
    if a._data.dtype == torch.float8_e5m2 and b._data.dtype == torch.float8_e5m2:
        raise FP8GemmShapeError("fp8_gemm: E5M2 x E5M2 is not supported by the FP8 tensor cores")


def _pad_cols(data: torch.Tensor, cols: int) -> torch.Tensor:
    if data.shape[1] == cols:
        return data
    out = torch.zeros((data.shape[0], cols), dtype=torch.uint8, device=data.device)
    out[:, : data.shape[1]] = data.view(torch.uint8)
    return out.view(data.dtype)


def _pad_rows(data: torch.Tensor, rows: int) -> torch.Tensor:
    if data.shape[0] == rows:
        return data
    out = torch.zeros((rows, data.shape[1]), dtype=torch.uint8, device=data.device)
    out[: data.shape[0]] = data.view(torch.uint8)
    return out.view(data.dtype)


def _round_up(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def zero_padded(rows: int, cols: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An empty `[rows, cols]` tensor stored at the top left of a zeroed buffer whose sizes are rounded up to
    multiples of 16 (`ALIGN`). `fp8_gemm(..., pad=True)` multiplies such an operand through its whole buffer
    without copying it: write the values into the returned view only, so the padding stays zero."""
    base = torch.zeros((_round_up(rows), _round_up(cols)), dtype=torch.uint8, device=device).view(dtype)
    view = base[:rows, :cols]
    setattr(view, _PADDED, base)  # on this view object only: a slice of it is a new object, without it
    return view


def _padded(data: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """`data` zero-padded to `[rows, cols]`: the buffer it is stored in when it is a `zero_padded` view of that
    size, else a padded copy."""
    if data.shape == (rows, cols):
        return data
    base = getattr(data, _PADDED, None)
    if base is not None and base.shape == (rows, cols) and base.dtype == data.dtype:
        return base
    return _pad_rows(_pad_cols(data, cols), rows)


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """`t`, or a copy of it when its storage does not start at a 16-byte boundary: cuBLAS's FP8 GEMM refuses
    such operand and scale pointers (CUBLAS_STATUS_NOT_SUPPORTED on H200 for a scale_inv 12 bytes into its
    buffer). Views into shared buffers (one buffer for several experts' casts) can start anywhere."""
    return t if t.data_ptr() % 16 == 0 else t.clone(memory_format=torch.contiguous_format)


def _scale_operand(scale_inv: torch.Tensor) -> torch.Tensor:
    """A scale_inv as `_scaled_mm`'s per-tensor scale: a 16-byte aligned float32 scalar (no copy, and no view
    made, for the usual 0-d float32 one: each torch call is host time on every GEMM)."""
    if scale_inv.dim() != 0:
        scale_inv = scale_inv.reshape(())
    if scale_inv.dtype != torch.float32:
        scale_inv = scale_inv.float()
    return _aligned(scale_inv)


def scaled_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    out_dtype: torch.dtype,
    bias: Optional[torch.Tensor] = None,
    use_fast_accum: bool = False,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """`torch._scaled_mm` with per-tensor scales: `a @ b * scale_a * scale_b (+ bias)` for FP8 `a` `[M, K]`
    (row-major) and `b` `[K, N]` (column-major), float32 accumulation, result in `out_dtype` (into `out` when
    given). Every FP8 GEMM of the package goes through here.

    On the CPU it is a float32 matmul of the operands upcast (exactly) and one scaling: the same sums as
    torch's CPU FP8 kernel up to their order, which is a reference loop (seconds for one 512^3 GEMM, where a
    float32 matmul takes milliseconds). The compiled host path computes the CPU case with the same operations,
    so both paths stay bitwise equal. Elsewhere it is `torch._scaled_mm`."""
    if not a.is_cpu:  # (one attribute read: this is on every GEMM's host path)
        if out is None:
            return torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, bias=bias, out_dtype=out_dtype,
                                    use_fast_accum=use_fast_accum)
        return torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, bias=bias, out_dtype=out_dtype,
                                use_fast_accum=use_fast_accum, out=out)
    result = torch.mm(a.float(), b.float()) * (scale_a * scale_b)
    if bias is not None:
        result = result + bias.to(out_dtype).float()
    result = result.to(out_dtype)
    return result if out is None else out.copy_(result)


def fp8_gemm(
    a: Float8Tensor,
    b: Float8Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
    bias: Optional[torch.Tensor] = None,
    use_fast_accum: bool = False,
    pad: bool = False,
) -> torch.Tensor:
    """`a @ b.T` in FP8 with float32 accumulation (or fast accumulation), result in `out_dtype`.

    Args:
        a: `[M, K]` Float8Tensor, K contiguous.
        b: `[N, K]` Float8Tensor, K contiguous.
        out_dtype: result dtype (bfloat16, float16 or float32).
        bias: optional `[N]` bias added to the result (in `out_dtype`).
        use_fast_accum: Hopper fast accumulation (fine for the forward GEMM; keep False for gradients).
        pad: zero-pad an unaligned K or N to a multiple of 16 (exact); False (default) refuses it.

    Returns:
        A contiguous `[M, N]` tensor of `out_dtype`.

    Raises:
        FP8GemmShapeError: a layout, alignment or dtype pair the GPU refuses.
    """
    _check(a, b)
    m, k, n = a._data.shape[0], a._data.shape[1], b._data.shape[0]
    if bias is not None and bias.shape != (n,):
        raise FP8GemmShapeError(f"fp8_gemm: bias must have shape ({n},), got {tuple(bias.shape)}")
    if m == 0 or k == 0:  # nothing to multiply (an expert without tokens): no GEMM is launched
        out = torch.zeros((m, n), dtype=out_dtype, device=a._data.device)
        return out + bias.to(out_dtype) if bias is not None and m else out
    a_data, b_data = a._data, b._data
    if k % ALIGN or n % ALIGN:
        if not pad:
            raise FP8GemmShapeError(
                f"fp8_gemm: K={k} and N={n} must be multiples of {ALIGN} (a {tuple(a._data.shape)}, "
                f"b {tuple(b._data.shape)}); pass pad=True for exact zero padding"
            )
        kp, np_ = _round_up(k), _round_up(n)
        a_data, b_data = _padded(a_data, m, kp), _padded(b_data, np_, kp)
    result_dtype = out_dtype
    bias_arg = None
    if bias is not None:
        if out_dtype != torch.bfloat16 or b_data.shape[0] != n:
            result_dtype = torch.float32  # add the bias after the GEMM (fused only for a bfloat16 result)
        else:
            bias_arg = bias.to(out_dtype)
    out = scaled_mm(  # (looked up here at each call: tests wrap it through fp8_parallel.testing)
        _aligned(a_data),
        _aligned(b_data).t(),  # [K, N] column-major view: what cuBLAS wants for the second operand
        scale_a=_scale_operand(a._scale_inv),
        scale_b=_scale_operand(b._scale_inv),
        bias=bias_arg,
        out_dtype=result_dtype,
        use_fast_accum=use_fast_accum,
    )
    if out.shape[1] != n:
        out = out[:, :n]
    if bias is not None and bias_arg is None:
        out = out + bias.float()
    out = out.to(out_dtype) if out.dtype != out_dtype else out
    return out if out.is_contiguous() else out.contiguous()  # a padded result's column slice is copied out
