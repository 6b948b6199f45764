"""TransformerEngine's `DType` (`transformer_engine_torch.DType`, re-exported as `te.DType`): the element types
its kernels and quantized tensors name, each mapped to the torch dtype it stands for."""
from __future__ import annotations

import enum
from typing import Union

import torch

__all__ = ["DType", "torch_dtype"]


class DType(enum.Enum):
    """TransformerEngine's element types under their names; `.torch_dtype` is the torch dtype."""

    kByte = "uint8"
    kInt32 = "int32"
    kInt64 = "int64"
    kFloat32 = "float32"
    kFloat16 = "float16"
    kBFloat16 = "bfloat16"
    kFloat8E4M3 = "float8_e4m3fn"
    kFloat8E5M2 = "float8_e5m2"

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.value)

    @classmethod
    def from_torch(cls, dtype: torch.dtype) -> "DType":
        """The `DType` of a torch dtype.

        Raises:
            ValueError: a dtype TransformerEngine has no name for (naming it).
        """
        for member in cls:
            if member.torch_dtype == dtype:
                return member
        raise ValueError(f"{dtype} has no TransformerEngine DType")


def torch_dtype(dtype: Union[DType, torch.dtype]) -> torch.dtype:
    """A torch dtype given as itself or as a TransformerEngine `DType`."""
    return dtype.torch_dtype if isinstance(dtype, DType) else dtype
