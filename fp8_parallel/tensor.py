"""Float8Tensor: FP8 data, the `scale_inv` it was quantized with, and a persistent, never-stale transpose.

Hopper FP8 GEMMs take both operands K-major, so the weight (for dgrad) and the input and grad_output
(for wgrad) are needed transposed too. The transpose lives in a buffer that is allocated once and refilled
in place, so a captured CUDA graph keeps reading the same address.

Staleness: in eager mode a cached transpose is never returned stale. The cache records which version of the
FP8 data it was filled from: a write counter bumped by every write that goes through this class (`copy_`,
in-place arithmetic such as an optimizer step on an FP8 parameter, `quantize_`), together with the data's
own autograd version counter, which catches direct writes to `_data` made outside of it. (Writes made
inside `__torch_dispatch__` do not move autograd version counters, hence the explicit counter.) Any change
makes the next `transpose_2d()` refill the buffer. Inside CUDA graphs host counters do not move on replay, so graphed code
uses the explicit mode (`update_cache=True` with a device-side `noop_flag`).
"""
from __future__ import annotations

from typing import Any, Optional, Union

import torch
from torch.utils._pytree import tree_map

from .recipe import fp8_max
from .te_dtype import DType, torch_dtype

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
aten = torch.ops.aten


def cast_to_fp8(x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """`x * scale`, saturated to the format's range, cast to `fp8_dtype` (NaN stays NaN)."""
    limit = fp8_max(fp8_dtype)
    return (x.float() * scale.float()).clamp(-limit, limit).to(fp8_dtype)


class _TransposeCache:
    """The persistent transpose buffer of one FP8 storage, shared by its aliases (detach, Parameter)."""

    __slots__ = ("buffer", "version", "writes")

    def __init__(self) -> None:
        self.buffer: Optional[torch.Tensor] = None
        self.version: Optional[tuple] = None  # data version the buffer was filled at; None: never filled
        self.writes = 0  # writes to the data made through Float8Tensor


def _as_2d(data: torch.Tensor) -> torch.Tensor:
    return data.reshape(-1, data.shape[-1]) if data.dim() != 2 else data


def _fill_transpose(dst: torch.Tensor, data: torch.Tensor, noop_flag: Optional[torch.Tensor]) -> None:
    src = _as_2d(data).t()
    if noop_flag is None:
        dst.copy_(src)
        return
    # device-side skip, no host sync: keep the old bytes where the flag is set
    dst_u8, src_u8 = dst.view(torch.uint8), src.contiguous().view(torch.uint8)
    dst_u8.copy_(torch.where(noop_flag.reshape(()).bool(), dst_u8, src_u8))


class QuantizedTensor(torch.Tensor):
    """The base of this package's quantized tensors (TransformerEngine's `QuantizedTensor`): `Float8Tensor`."""


class Float8Tensor(QuantizedTensor):
    """An FP8 tensor that stands for a high-precision tensor of dtype `dtype`.

    `Float8Tensor(data, scale_inv, dtype)`, or with TransformerEngine's keywords: `Float8Tensor(shape=...,
    dtype=..., data=..., fp8_scale_inv=..., fp8_dtype=DType.kFloat8E4M3, requires_grad=..., data_transpose=...,
    quantizer=...)` (`fake_dtype` for `dtype`; `shape` and `fp8_dtype` must match `data`; a given
    `data_transpose` becomes the transpose buffer, taken as current).

    Attributes:
        _data: the FP8 payload (float8_e4m3fn or float8_e5m2), same shape as the tensor.
        _scale_inv: float32 scalar tensor; `dequantize() == _data * _scale_inv`. Kept from quantization time.
    """

    _data: torch.Tensor
    _scale_inv: torch.Tensor
    _transpose_cache: _TransposeCache

    @staticmethod
    def __new__(
        cls,
        data: torch.Tensor,
        scale_inv: Optional[torch.Tensor] = None,
        dtype: Optional[torch.dtype] = None,
        transpose_cache: Optional[_TransposeCache] = None,
        requires_grad: bool = False,
        *,
        fp8_scale_inv: Optional[torch.Tensor] = None,
        fp8_dtype: Union[DType, torch.dtype, None] = None,
        shape: Optional[Any] = None,
        fake_dtype: Optional[torch.dtype] = None,
        data_transpose: Optional[torch.Tensor] = None,
        quantizer: Any = None,
    ):
        if fp8_scale_inv is not None:
            if scale_inv is not None:
                raise TypeError("Float8Tensor: give scale_inv or fp8_scale_inv, not both")
            scale_inv = fp8_scale_inv
        if scale_inv is None:
            raise TypeError("Float8Tensor: scale_inv (TransformerEngine's fp8_scale_inv) is required")
        dtype = dtype if dtype is not None else (fake_dtype if fake_dtype is not None else torch.bfloat16)
        if fp8_dtype is not None and torch_dtype(fp8_dtype) != data.dtype:
            raise TypeError(f"Float8Tensor: fp8_dtype={fp8_dtype} but data is {data.dtype}")
        if shape is not None and tuple(shape) != tuple(data.shape):
            raise ValueError(f"Float8Tensor: shape={tuple(shape)} but data has shape {tuple(data.shape)}")
        if data.dtype not in FP8_DTYPES:
            raise TypeError(f"Float8Tensor data must be float8_e4m3fn or float8_e5m2, got {data.dtype}")
        if dtype in FP8_DTYPES or not dtype.is_floating_point:
            raise TypeError(f"Float8Tensor must stand for a high-precision float dtype, got {dtype}")
        self = torch.Tensor._make_wrapper_subclass(
            cls, data.shape, strides=data.stride(), dtype=dtype, device=data.device, requires_grad=requires_grad
        )
        self._data = data
        self._scale_inv = scale_inv
        self._transpose_cache = transpose_cache if transpose_cache is not None else _TransposeCache()
        self._quantizer = quantizer
        if data_transpose is not None:
            if tuple(data_transpose.shape) != self._transpose_shape() or data_transpose.dtype != data.dtype:
                raise ValueError(f"Float8Tensor: data_transpose of shape {tuple(data_transpose.shape)} and dtype "
                                 f"{data_transpose.dtype}; expected {self._transpose_shape()} and {data.dtype}")
            self._transpose_cache.buffer = data_transpose
            self._transpose_cache.version = self._data_version()
        return self

    @property
    def _fp8_dtype(self) -> DType:
        """The FP8 format as TransformerEngine's `DType` (its tensors' attribute)."""
        return DType.from_torch(self._data.dtype)

    # ---- plain API -------------------------------------------------------------------------------------
    @property
    def fp8_dtype(self) -> torch.dtype:
        return self._data.dtype

    def dequantize(self, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """The high-precision tensor this stands for, as `dtype` (default: `self.dtype`)."""
        return (self._data.float() * self._scale_inv).to(dtype or self.dtype)

    def transpose_2d(
        self,
        cache: bool = True,
        update_cache: Union[bool, str] = "auto",
        noop_flag: Optional[torch.Tensor] = None,
    ) -> "Float8Tensor":
        """The `[K, M]` transpose of the data viewed as `[M, K]` (K = last dim), as a Float8Tensor.

        Args:
            cache: use the persistent buffer (allocated once, refilled in place). False returns a fresh copy.
            update_cache: "auto" (default) refills exactly when the data changed since the last fill;
                True refills now; False returns the buffer as it is (the caller vouches it is current).
            noop_flag: with `update_cache=True`, a device tensor; where it is non-zero the refill is skipped
                on the device (for CUDA graphs, where host-side checks do not run on replay).
        """
        if not cache:
            return Float8Tensor(_as_2d(self._data).t().contiguous(), self._scale_inv, self.dtype)
        if update_cache not in (True, False, "auto"):
            raise ValueError(f"update_cache={update_cache!r} must be True, False or 'auto'")
        tc = self._transpose_cache
        if update_cache is False and (tc.buffer is None or tc.buffer.shape != self._transpose_shape()):
            raise RuntimeError("transpose_2d(update_cache=False): the transpose cache was never filled")
        self._transpose_buffer()
        if update_cache is True or (update_cache == "auto" and tc.version != self._data_version()):
            _fill_transpose(tc.buffer, self._data, noop_flag)
            tc.version = self._data_version()
        return Float8Tensor(tc.buffer, self._scale_inv, self.dtype)

    def _transpose_shape(self) -> tuple:
        rows = self._data.numel() // self._data.shape[-1] if self._data.dim() else 1
        return (self._data.shape[-1], rows)

    def _transpose_buffer(self) -> torch.Tensor:
        """The persistent transpose buffer, allocated on first need (or when the shape changed)."""
        tc = self._transpose_cache
        shape = self._transpose_shape()
        if tc.buffer is None or tc.buffer.shape != shape:
            tc.buffer = torch.empty(shape, dtype=self._data.dtype, device=self._data.device)
            tc.version = None
        return tc.buffer

    def has_current_transpose(self) -> bool:
        """Whether the cached transpose matches the data as it is now (eager bookkeeping)."""
        tc = self._transpose_cache
        return tc.buffer is not None and tc.version == self._data_version()

    def _data_version(self) -> tuple:
        data = self._data
        # inference tensors keep no version counter: only writes through this class are seen there
        return (self._transpose_cache.writes, -1 if data.is_inference() else data._version)

    def _write_data(self, fp8: torch.Tensor) -> None:
        """The one way this class writes its data in place; marks the cached transpose stale."""
        self._data.copy_(fp8)
        self._transpose_cache.writes += 1

    @property
    def data(self) -> "Float8Tensor":
        """This tensor without autograd history (the same FP8 storage, scale and transpose buffer)."""
        return self.detach()

    @data.setter
    def data(self, value: torch.Tensor) -> None:
        """`x.data = t`, as TransformerEngine's Float8Tensor: a Float8Tensor `t` lends its FP8 data and scale
        (shape, device and dtype follow it; the transpose buffer starts empty); a high-precision `t` of this
        shape and device is quantized into this tensor's data in place with its current scale."""
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"Float8Tensor.data = {type(value).__name__}: expected a tensor")
        if not isinstance(value, Float8Tensor):
            if value.shape != self.shape or value.device != self.device:
                raise ValueError(f"Float8Tensor.data = a tensor of shape {tuple(value.shape)} on {value.device}: "
                                 f"a high-precision tensor is quantized in place, so it must have this tensor's "
                                 f"shape {tuple(self.shape)} and device {self.device}")
            self.quantize_(value)
            return
        if (value.shape, value.stride(), value.dtype, value.device) != (self.shape, self.stride(), self.dtype, self.device):
            shell = torch.Tensor._make_wrapper_subclass(type(self), value.shape, strides=value.stride(),
                                                        dtype=value.dtype, device=value.device)
            torch.Tensor.data.__set__(self, shell)
        self._data, self._scale_inv = value._data, value._scale_inv
        self._transpose_cache = _TransposeCache()

    def quantize_(self, x: torch.Tensor, scale: Optional[torch.Tensor] = None, *,
                  noop_flag: Optional[torch.Tensor] = None) -> "Float8Tensor":
        """Quantize `x` into this tensor in place (same addresses), as TransformerEngine's `quantize_`: with the
        tensor's quantizer when it has one (its scale rule, amax record and usages) and no `scale` is given,
        else with `scale` (default `1 / scale_inv`). Where the device flag `noop_flag` is non-zero nothing is
        written."""
        if scale is None and self._quantizer is not None:
            return self._quantizer.update_quantized(x, self, noop_flag=noop_flag)
        if scale is None:
            scale = self._scale_inv.reciprocal()
        if noop_flag is not None:  # decided on the device: the old bytes and scale kept where the flag is set
            keep = noop_flag.reshape(()).bool()
            new = cast_to_fp8(x.detach().reshape(self.shape), scale, self._data.dtype)
            self._write_data(torch.where(keep, self._data.view(torch.uint8), new.view(torch.uint8)).view(new.dtype))
            new_sinv = scale.float().reciprocal().reshape(self._scale_inv.shape)
            self._scale_inv.copy_(torch.where(keep, self._scale_inv, new_sinv))
            return self
        self._write_data(cast_to_fp8(x, scale, self._data.dtype))
        self._scale_inv.copy_(scale.reciprocal().reshape(self._scale_inv.shape))
        return self

    def update_usage(self, rowwise_usage: Optional[bool] = None, columnwise_usage: Optional[bool] = None) -> None:
        """TransformerEngine's usage switch: `columnwise_usage=True` makes the transpose current now, False
        frees its buffer. The row-wise data is always kept (`rowwise_usage=False` frees nothing)."""
        del rowwise_usage
        if columnwise_usage is True:
            self.transpose_2d()
        elif columnwise_usage is False:
            self._transpose_cache.buffer = None
            self._transpose_cache.version = None

    def get_usages(self) -> dict:
        """`{"rowwise": True, "columnwise": whether a current transpose is held}`."""
        return {"rowwise": True, "columnwise": self.has_current_transpose()}

    def __repr__(self) -> str:  # no dispatch: printing must not need any op support
        return (
            f"Float8Tensor(shape={tuple(self.shape)}, fp8_dtype={self._data.dtype}, dtype={self.dtype}, "
            f"scale_inv={self._scale_inv.detach().cpu().tolist()}, device={self.device})"
        )

    def __reduce_ex__(self, protocol: Any):
        return _rebuild_float8_tensor, (self._data, self._scale_inv, self.dtype)

    # ---- tensor-subclass protocol ------------------------------------------------------------------------
    def __tensor_flatten__(self):
        return ["_data", "_scale_inv"], {"dtype": self.dtype}

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return Float8Tensor(inner["_data"], inner["_scale_inv"], meta["dtype"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        handler = _HANDLERS.get(func)
        if handler is not None:
            return handler(func, args, kwargs)
        if _is_inplace(func) and args and isinstance(args[0], Float8Tensor):
            return _inplace_via_high_precision(func, args, kwargs)
        # any other op (arithmetic, comparisons, unary math, a matmul, the `*_like` factories) runs on the
        # dequantized values in the tensor's high-precision dtype and returns a plain tensor, as
        # TransformerEngine's quantized tensors do; fp8_parallel.gemm is the FP8 GEMM
        return func(*tree_map(_dequantize_if_fp8, args), **tree_map(_dequantize_if_fp8, kwargs))


def _rebuild_float8_tensor(data: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype) -> Float8Tensor:
    return Float8Tensor(data, scale_inv, dtype)


def _dequantize_if_fp8(t: Any) -> Any:
    return t.dequantize() if isinstance(t, Float8Tensor) else t


def _is_inplace(func) -> bool:
    schema = func._schema
    return bool(schema.arguments) and schema.arguments[0].alias_info is not None and schema.arguments[0].alias_info.is_write


def _inplace_via_high_precision(func, args, kwargs):
    """In-place ops on FP8 data (optimizer steps): dequantize, apply, re-quantize with the same scale."""
    target: Float8Tensor = args[0]
    hp = target.dequantize(torch.float32)
    func(hp, *tree_map(_dequantize_if_fp8, args[1:]), **tree_map(_dequantize_if_fp8, kwargs))
    target._write_data(cast_to_fp8(hp, target._scale_inv.reciprocal(), target._data.dtype))
    return target


def _detach(func, args, kwargs):  # noqa: ARG001
    t: Float8Tensor = args[0]
    # the same inner data object (it never requires grad), so both aliases share one version counter
    return Float8Tensor(t._data, t._scale_inv, t.dtype, transpose_cache=t._transpose_cache)


def _alias(func, args, kwargs):
    """View-like ops: apply to the data; the result keeps the scale (and its own transpose cache)."""
    t: Float8Tensor = args[0]
    return Float8Tensor(func(t._data, *args[1:], **kwargs), t._scale_inv, t.dtype)


def _clone(func, args, kwargs):
    t: Float8Tensor = args[0]
    return Float8Tensor(func(t._data, *args[1:], **kwargs), t._scale_inv.clone(), t.dtype)


def _to_copy(func, args, kwargs):
    t: Float8Tensor = args[0]
    kwargs = dict(kwargs)
    dtype = kwargs.pop("dtype", None)
    device = kwargs.get("device", t.device)
    if dtype is not None and dtype != t.dtype:
        return func(t.dequantize(dtype), dtype=dtype, **kwargs)
    data = func(t._data, **kwargs)
    return Float8Tensor(data, t._scale_inv.to(device), t.dtype)


def _copy_(func, args, kwargs):  # noqa: ARG001
    dst, src = args[0], args[1]
    if isinstance(dst, Float8Tensor):
        if isinstance(src, Float8Tensor) and src._data.dtype == dst._data.dtype:
            dst._write_data(src._data)
            dst._scale_inv.copy_(src._scale_inv)
        else:
            dst.quantize_(_dequantize_if_fp8(src), dst._scale_inv.reciprocal())
        return dst
    return dst.copy_(src.dequantize())


_HANDLERS = {
    aten.detach.default: _detach,
    aten.view.default: _alias,
    aten._unsafe_view.default: _alias,
    aten.alias.default: _alias,
    aten.slice.Tensor: _alias,
    aten.select.int: _alias,
    aten.split.Tensor: lambda f, a, k: [Float8Tensor(d, a[0]._scale_inv, a[0].dtype) for d in f(a[0]._data, *a[1:], **k)],
    aten.clone.default: _clone,
    aten._to_copy.default: _to_copy,
    aten.copy_.default: _copy_,
    aten.is_same_size.default: lambda f, a, k: a[0].shape == a[1].shape,  # noqa: ARG005
}
