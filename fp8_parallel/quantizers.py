"""TransformerEngine's quantizer objects: what one operand's FP8 cast produces and where its scale comes from.

A quantizer turns a high-precision tensor into a `Float8Tensor`:
- `Float8Quantizer(scale, amax, fp8_dtype)`: delayed scaling. It casts with the given `scale` buffer and
  records `max(amax, |x|max)` into the `amax` buffer (the history and scale update happen elsewhere: the
  autocast scope, or the caller's own code).
- `Float8CurrentScalingQuantizer(fp8_dtype, device, ...)`: current scaling. Each cast takes its scale from the
  tensor's own amax (optionally all-reduced over a process group first), TransformerEngine's rule.

`rowwise_usage` makes the data (`[M, K]`, K contiguous: the fprop operand); `columnwise_usage` also fills the
persistent transpose (`[K, M]`: the dgrad/wgrad operand). The row-wise data is always made, also with
`rowwise=False` (a `Float8Tensor` always holds it); the transpose is made exactly when `columnwise_usage`.
"""
from __future__ import annotations

import abc
from typing import Any, Dict, Iterable, List, Optional, Sequence, Union

import torch
import torch.distributed as dist

from .quantize import quantize
from .recipe import fp8_max
from .scaling import current_scale_te
from .te_dtype import DType, torch_dtype
from .tensor import FP8_DTYPES, Float8Tensor, QuantizedTensor

__all__ = ["Float8CurrentScalingQuantizer", "Float8Quantizer", "QuantizedTensor", "Quantizer"]

_INF = float("inf")


def _fp8_dtype(fp8_dtype: Union[DType, torch.dtype], owner: str) -> torch.dtype:
    dtype = torch_dtype(fp8_dtype)
    if dtype not in FP8_DTYPES:
        raise ValueError(f"{owner}: fp8_dtype={fp8_dtype} is not an FP8 format (DType.kFloat8E4M3 or "
                         f"DType.kFloat8E5M2, or torch.float8_e4m3fn / torch.float8_e5m2)")
    return dtype


def _one_float32(t: Any, what: str, owner: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or t.numel() != 1 or t.dtype != torch.float32:
        got = f"shape {tuple(t.shape)}, {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{owner}: {what} must be a float32 tensor of one element, got {got}")
    return t


class _QuantizeFunction(torch.autograd.Function):
    """A cast that autograd sees through: the gradient of the FP8 result passes to the input unchanged (as
    TransformerEngine's quantize does under grad)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, quantizer: "Quantizer") -> Float8Tensor:  # noqa: ARG004
        return quantizer._cast(x, None, None)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ARG004
        if isinstance(grad, Float8Tensor):
            grad = grad.dequantize()
        return grad, None


class Quantizer(abc.ABC):
    """Builds `Float8Tensor`s from high-precision tensors (TransformerEngine's `Quantizer`).

    Attributes:
        rowwise_usage: the data `[M, K]` is needed (always made, see the module docstring).
        columnwise_usage: the transpose `[K, M]` is needed too: filled by every cast.
        internal: TransformerEngine's flag for storage-only results; here results are always `Float8Tensor`s.
    """

    def __init__(self, *, rowwise: bool = True, columnwise: bool = True) -> None:
        self.rowwise_usage = bool(rowwise)
        self.columnwise_usage = bool(columnwise)
        self.internal = False

    @property
    def fp8_dtype(self) -> torch.dtype:
        """The FP8 format as a torch dtype (`dtype` is TransformerEngine's `DType`)."""
        return self.dtype.torch_dtype

    @abc.abstractmethod
    def scale_for(self, x: torch.Tensor) -> torch.Tensor:
        """The `[1]` float32 scale that `x` is cast with."""

    def _amax_out(self) -> Optional[torch.Tensor]:
        """Where a cast records its amax (None: nowhere)."""
        return None

    def _cast(self, x: torch.Tensor, out: Optional[Float8Tensor], noop_flag: Optional[torch.Tensor]) -> Float8Tensor:
        if x.dtype in FP8_DTYPES or isinstance(x, Float8Tensor) or not x.is_floating_point():
            raise TypeError(f"{type(self).__name__}: quantizes a high-precision float tensor, got "
                            f"{type(x).__name__} of dtype {x.dtype}")
        x = x.detach()
        return quantize(x, self.scale_for(x), self.fp8_dtype, amax_out=self._amax_out(),
                        with_transpose=self.columnwise_usage and x.dim() > 0, out=out, noop_flag=noop_flag)

    def set_usage(self, *, rowwise: Optional[bool] = None, columnwise: Optional[bool] = None) -> None:
        """Which forms later casts produce (None leaves a form as it is)."""
        if rowwise is not None:
            self.rowwise_usage = bool(rowwise)
        if columnwise is not None:
            self.columnwise_usage = bool(columnwise)

    def get_usages(self) -> Dict[str, bool]:
        return {"rowwise": self.rowwise_usage, "columnwise": self.columnwise_usage}

    def quantize(self, tensor: torch.Tensor, *, out: Optional[Float8Tensor] = None,
                 dtype: Optional[torch.dtype] = None) -> Float8Tensor:  # noqa: ARG002 (TE's signature)
        """`tensor` cast to FP8 (into `out` in place when given). Under grad, autograd passes the result's
        gradient through to `tensor`."""
        if out is not None:
            return self.update_quantized(tensor, out)
        if torch.is_grad_enabled() and tensor.requires_grad:
            return _QuantizeFunction.apply(tensor, self)
        return self._cast(tensor, None, None)

    def __call__(self, tensor: torch.Tensor) -> Float8Tensor:
        return self.quantize(tensor)

    def multi_quantize(self, tensors: Sequence[torch.Tensor]) -> List[Float8Tensor]:
        return [self.quantize(t) for t in tensors]

    def update_quantized(self, src: torch.Tensor, dst: Float8Tensor, *,
                         noop_flag: Optional[torch.Tensor] = None) -> Float8Tensor:
        """Cast `src` into `dst` in place (its data, scale_inv and transpose buffers keep their addresses);
        where the device flag `noop_flag` is non-zero nothing is written.

        Raises:
            ValueError: `dst` is no Float8Tensor, or its shape or FP8 format is not `src`'s / this quantizer's.
        """
        if not isinstance(dst, Float8Tensor):
            raise ValueError(f"{type(self).__name__}.update_quantized: dst must be a Float8Tensor, got "
                             f"{type(dst).__name__}")
        if dst.device != src.device:
            src = src.to(dst.device)
        return self._cast(src.contiguous(), dst, noop_flag)

    def make_empty(self, shape: Iterable[int], *, dtype: torch.dtype = torch.float32,
                   device: Optional[Union[torch.device, str]] = None, requires_grad: bool = False,
                   pin_memory: bool = False) -> Float8Tensor:  # noqa: ARG002
        """An uninitialized Float8Tensor of `shape` standing for `dtype` (scale_inv 1), for `update_quantized`."""
        if device is None:
            device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
        device = torch.device(device)
        shape = tuple(int(s) for s in shape)
        out = Float8Tensor(torch.empty(shape, dtype=self.fp8_dtype, device=device),
                           torch.ones((), dtype=torch.float32, device=device), dtype, requires_grad=requires_grad,
                           quantizer=self)
        if self.columnwise_usage and len(shape) > 0:
            out._transpose_buffer()
        return out

    def calibrate(self, tensor: torch.Tensor) -> None:
        """Record what a cast of `tensor` would record, without casting (nothing for current scaling)."""
        del tensor

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(fp8_dtype={self.dtype}, rowwise_usage={self.rowwise_usage}, "
                f"columnwise_usage={self.columnwise_usage})")


class Float8Quantizer(Quantizer):
    """Delayed scaling: casts with `scale` and records the amax into `amax` (TransformerEngine's
    `Float8Quantizer(scale, amax, fp8_dtype, *, rowwise=True, columnwise=True)`).

    `scale` and `amax` are one-element float32 tensors, used by reference: updating `scale` in place changes
    the next cast, and each cast writes `max(amax, |x|max)` into `amax` (+inf for a tensor holding NaN).
    """

    def __init__(self, scale: torch.Tensor, amax: torch.Tensor, fp8_dtype: Union[DType, torch.dtype], *,
                 rowwise: bool = True, columnwise: bool = True) -> None:
        super().__init__(rowwise=rowwise, columnwise=columnwise)
        self.scale = _one_float32(scale, "scale", "Float8Quantizer")
        self.amax = _one_float32(amax, "amax", "Float8Quantizer")
        self.dtype = DType.from_torch(_fp8_dtype(fp8_dtype, "Float8Quantizer"))

    def scale_for(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.scale
        if scale.device != x.device:
            raise ValueError(f"Float8Quantizer: scale is on {scale.device}, the tensor on {x.device}")
        return scale.reshape(1)

    def _amax_out(self) -> torch.Tensor:
        return self.amax

    def calibrate(self, tensor: torch.Tensor) -> None:
        amax = tensor.detach().abs().amax().float() if tensor.numel() else torch.zeros((), device=tensor.device)
        self.amax.copy_(torch.nan_to_num(amax, nan=_INF).reshape(self.amax.shape))

    def copy(self) -> "Float8Quantizer":
        """A quantizer sharing this one's scale and amax buffers."""
        q = Float8Quantizer(self.scale, self.amax, self.dtype, rowwise=self.rowwise_usage,
                            columnwise=self.columnwise_usage)
        q.internal = self.internal
        return q

    def create_tensor_from_data(self, data: torch.Tensor, fake_dtype: torch.dtype = torch.float32,
                                requires_grad: bool = False, internal: bool = False) -> Float8Tensor:  # noqa: ARG002
        """A Float8Tensor of existing FP8 `data` (float8 or uint8 bytes) with scale_inv `1 / scale`."""
        if data.dtype == torch.uint8:
            data = data.view(self.fp8_dtype)
        if data.dtype != self.fp8_dtype:
            raise ValueError(f"Float8Quantizer.create_tensor_from_data: data of dtype {data.dtype}, this quantizer "
                             f"makes {self.fp8_dtype}")
        return Float8Tensor(data, self.scale.reciprocal().reshape(()), fake_dtype, requires_grad=requires_grad,
                            quantizer=self)


class Float8CurrentScalingQuantizer(Quantizer):
    """Current scaling: each cast takes its scale from the tensor's own amax (TransformerEngine's
    `Float8CurrentScalingQuantizer(fp8_dtype, device, *, rowwise=True, columnwise=True,
    with_amax_reduction=False, amax_reduction_group=None, force_pow_2_scales=False, amax_epsilon=0.0)`).

    With `with_amax_reduction` the amax is all-reduced (MAX) over `amax_reduction_group` first, so every rank
    of the group casts with one scale. `device` is accepted and unused, as in TransformerEngine.
    """

    def __init__(self, fp8_dtype: Union[DType, torch.dtype], device: Any = None, *, rowwise: bool = True,
                 columnwise: bool = True, use_existing_amax: bool = False, with_amax_reduction: bool = False,
                 amax_reduction_group: Optional[dist.ProcessGroup] = None, force_pow_2_scales: bool = False,
                 amax_epsilon: float = 0.0, scale: Optional[torch.Tensor] = None,
                 amax: Optional[torch.Tensor] = None) -> None:
        super().__init__(rowwise=rowwise, columnwise=columnwise)
        del device, use_existing_amax, scale, amax  # accepted for TransformerEngine's callers, unused there too
        self.dtype = DType.from_torch(_fp8_dtype(fp8_dtype, "Float8CurrentScalingQuantizer"))
        if not amax_epsilon >= 0.0:
            raise ValueError(f"Float8CurrentScalingQuantizer: amax_epsilon={amax_epsilon} must be >= 0")
        self.with_amax_reduction = bool(with_amax_reduction)
        self.amax_reduction_group = amax_reduction_group
        self.force_pow_2_scales = bool(force_pow_2_scales)
        self.amax_epsilon = float(amax_epsilon)

    def scale_for(self, x: torch.Tensor) -> torch.Tensor:
        amax = x.abs().amax().float() if x.numel() else torch.zeros((), dtype=torch.float32, device=x.device)
        if self.with_amax_reduction:
            amax = torch.nan_to_num(amax, nan=_INF).reshape(1).clone()
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=self.amax_reduction_group)
        value_for_inf = float(torch.finfo(x.dtype).max)
        return current_scale_te(amax, fp8_max(self.fp8_dtype), self.amax_epsilon, self.force_pow_2_scales,
                                value_for_inf).reshape(1)

    def copy(self) -> "Float8CurrentScalingQuantizer":
        q = Float8CurrentScalingQuantizer(self.dtype, rowwise=self.rowwise_usage, columnwise=self.columnwise_usage,
                                          with_amax_reduction=self.with_amax_reduction,
                                          amax_reduction_group=self.amax_reduction_group,
                                          force_pow_2_scales=self.force_pow_2_scales, amax_epsilon=self.amax_epsilon)
        q.internal = self.internal
        return q

    def __getstate__(self) -> Dict[str, Any]:
        state = dict(self.__dict__)
        state["amax_reduction_group"] = None  # a process group does not pickle
        return state
