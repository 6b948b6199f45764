"""TransformerEngine's `cpp_extensions.general_gemm`: one GEMM in TE's layout names, on `gemm.fp8_gemm`.

TransformerEngine names its operands in cuBLAS's column-major terms. In row-major terms, with `A` and `B` the
first two arguments:

    "TN"  out = B @ A.T      fprop: general_gemm(weight [N, K], x [M, K])         -> [M, N]
    "NN"  out = B @ A        dgrad: general_gemm(weight [N, K], dy [M, N])        -> [M, K]
    "NT"  out = B.T @ A      wgrad: general_gemm(x [M, K], dy [M, N])             -> [N, K]

Both operands are Float8Tensors (an FP8 GEMM: the transposes it needs come from their persistent transpose
buffers) or both high-precision tensors (a float32-accumulated matmul). Leading dimensions of `B` ("TN",
"NN") are kept in the result.
"""
from __future__ import annotations

from typing import Any, Optional, Tuple

import torch

from .gemm import fp8_gemm
from .tensor import Float8Tensor

__all__ = ["general_gemm"]

_LAYOUTS = ("TN", "NN", "NT")


def general_gemm(A: torch.Tensor, B: torch.Tensor, *args: Any, **kwargs: Any
                 ) -> Tuple[torch.Tensor, Optional[torch.Tensor], None, None]:
    """`general_gemm(A, B, out_dtype=None, quantization_params=None, gelu=False, gelu_in=None, alpha=1.0,
    beta=None, accumulate=False, layout="TN", out=None, bias=None, use_split_accumulator=False, grad=False,
    ...)`, as TransformerEngine's: returns `(out, bias_grad, gelu_input, extra_output)`.

    A workspace tensor given third (TransformerEngine before 2.6: `general_gemm(A, B, workspace, ...)`) or as
    `workspace=` is accepted and unused.
    - `bias` without `grad`: added to the result. With `grad=True`: `bias_grad` is `B` summed over its rows
      (the bias gradient of a wgrad GEMM), and nothing is added.
    - `accumulate=True`: `out = alpha * result + beta * out` (`beta` default 1); otherwise the result (times
      `alpha`) is written into `out` when given.
    - `quantization_params`: a quantizer that casts the result (an FP8 output).
    - `use_split_accumulator=False` (the default) is the tensor cores' fast accumulation.

    Raises:
        ValueError: an unknown layout, one FP8 and one high-precision operand, inconsistent shapes,
            `accumulate` without `out`.
        NotImplementedError: `gelu`, and userbuffers overlap (`ub`, `ub_type`, `extra_output`, `bulk_overlap`).
    """
    if args and isinstance(args[0], torch.Tensor) and args[0].dtype == torch.uint8:
        args = args[1:]  # the workspace of TransformerEngine before 2.6
    kwargs.pop("workspace", None)
    return _general_gemm(A, B, *args, **kwargs)


def _general_gemm(A: torch.Tensor, B: torch.Tensor, out_dtype: Optional[torch.dtype] = None,
                  quantization_params: Any = None, gelu: bool = False, gelu_in: Optional[torch.Tensor] = None,
                  alpha: float = 1.0, beta: Optional[float] = None, accumulate: bool = False, layout: str = "TN",
                  out: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None,
                  use_split_accumulator: bool = False, grad: bool = False, ub: Any = None, ub_type: Any = None,
                  extra_output: Optional[torch.Tensor] = None, bulk_overlap: bool = False):
    if layout not in _LAYOUTS:
        raise ValueError(f"general_gemm: layout={layout!r}; TransformerEngine's layouts are {_LAYOUTS}")
    if gelu or gelu_in is not None:
        raise NotImplementedError("general_gemm: the fused GELU epilogue (gelu=True, gelu_in) is not provided")
    if ub is not None or ub_type is not None or extra_output is not None or bulk_overlap:
        raise NotImplementedError("general_gemm: userbuffers communication overlap is not provided")
    if accumulate and out is None:
        raise ValueError("general_gemm: accumulate=True adds into out, which was not given")
    fp8 = isinstance(A, Float8Tensor), isinstance(B, Float8Tensor)
    if fp8[0] != fp8[1]:
        raise ValueError(f"general_gemm: A is {_kind(A)} and B is {_kind(B)}: give two Float8Tensors (an FP8 GEMM) "
                         f"or two high-precision tensors")
    if out_dtype is None:
        out_dtype = out.dtype if out is not None and not isinstance(out, Float8Tensor) else A.dtype
    result = _product(A, B, layout, out_dtype if not accumulate else torch.float32, not use_split_accumulator,
                      fp8[0], bias if not grad else None)
    bias_grad = None
    if grad and bias is not None:
        rows = B.dequantize() if fp8[1] else B
        bias_grad = rows.reshape(-1, rows.shape[-1]).float().sum(0).to(bias.dtype)
    if alpha != 1.0:
        result = result * alpha
    if accumulate:
        result = result.float() + (1.0 if beta is None else beta) * out.float()
    result = result.to(out_dtype)
    if quantization_params is not None:
        target = out if isinstance(out, Float8Tensor) else None
        return quantization_params.quantize(result, out=target), bias_grad, None, None
    if out is not None:
        out.copy_(result.reshape(out.shape))
        return out, bias_grad, None, None
    return result, bias_grad, None, None


def _kind(t: torch.Tensor) -> str:
    return "a Float8Tensor" if isinstance(t, Float8Tensor) else f"a {t.dtype} tensor"


def _product(A: torch.Tensor, B: torch.Tensor, layout: str, out_dtype: torch.dtype, fast_accum: bool, fp8: bool,
             bias: Optional[torch.Tensor]) -> torch.Tensor:
    """The layout's product (see the module docstring), `bias` added, in `out_dtype`."""
    lead = B.shape[:-1]
    b2 = B.reshape(-1, B.shape[-1]) if B.dim() != 2 else B
    a2 = A.reshape(-1, A.shape[-1]) if A.dim() != 2 else A
    contracted = {"TN": (a2.shape[1], b2.shape[1]), "NN": (a2.shape[0], b2.shape[1]), "NT": (a2.shape[0], b2.shape[0])}
    left, right = contracted[layout]
    if left != right:
        raise ValueError(f"general_gemm: layout {layout} contracts A {tuple(A.shape)} with B {tuple(B.shape)}: "
                         f"{left} != {right}")
    if fp8:
        first, second = {"TN": (b2, a2), "NN": (b2, a2.transpose_2d()),
                         "NT": (b2.transpose_2d(), a2.transpose_2d())}[layout]
        result = fp8_gemm(first, second, out_dtype=out_dtype, bias=bias, use_fast_accum=fast_accum, pad=True)
    else:
        left_m, right_m = {"TN": (b2, a2.t()), "NN": (b2, a2), "NT": (b2.t(), a2)}[layout]
        result = left_m.float() @ right_m.float()
        if bias is not None:
            result = result + bias.float()
        result = result.to(out_dtype)
    if layout != "NT" and len(lead) != 1:
        result = result.reshape(*lead, result.shape[-1])
    return result
