"""`Linear`: a standalone (single-rank) FP8 linear layer with TransformerEngine's `Linear` signature.

It needs no megatron config and no parallel set-up. Inside an enabled `fp8_parallel.autocast` /
`fp8_autocast` scope it runs in FP8, elsewhere in high precision. The tensor-parallel layers with megatron's
signatures and `(output, bias)` convention are `ColumnParallelLinear` / `RowParallelLinear`.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Tuple, Union

import torch

from ._core import fp8_linear
from ._te_options import (
    add_linear_parameters, check_forward_options, check_input, check_te_options, resolve_device, resolve_dtype,
)

_LINEAR_OPTIONS = (
    "sequence_parallel", "fuse_wgrad_accumulation", "tp_group", "tp_size", "parallel_mode", "parameters_split",
    "ub_overlap_ag", "ub_overlap_rs", "ub_overlap_rs_dgrad", "ub_bulk_dgrad", "ub_bulk_wgrad", "ub_name",
    "delay_wgrad_compute", "symmetric_ar_type", "save_original_input",
)


class Linear(torch.nn.Module):
    """FP8 linear layer `y = x @ weight.T + bias`, TransformerEngine's `Linear` at tensor-parallel size 1.

    Args:
        in_features, out_features: sizes.
        bias: learn an additive bias (initialized to zero).
        init_method: `init_method(weight)` initializes the weight; default normal(0, 0.023), as in
            TransformerEngine.
        params_dtype: parameter dtype; default `torch.get_default_dtype()`.
        device: parameter device; default CUDA when available, else the CPU.
        return_bias: do not add the bias; return `(output, bias)` instead (the bias in the output's dtype,
            None without a bias).
        get_rng_state_tracker, rng_tracker_name: initialize the weight inside `tracker.fork(name)`.
        name: a label for the FP8 state (debugging).
        **te_options: TransformerEngine's other `Linear` options, accepted at their defaults (tensor
            parallelism, userbuffers, ...); other values raise NotImplementedError naming what to use.

    Forward: `forward(inp, is_first_microbatch=None)` returns the output tensor (or `(output, bias)`).
    `is_first_microbatch`: True casts the weight to FP8 and caches it, False reuses the cache (gradient
    accumulation), None casts on every call.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bias: bool = True,
        init_method: Optional[Callable[[torch.Tensor], Any]] = None,
        params_dtype: Optional[torch.dtype] = None,
        device: Optional[Union[str, torch.device]] = None,
        return_bias: bool = False,
        get_rng_state_tracker: Optional[Callable[[], Any]] = None,
        rng_tracker_name: Optional[str] = None,
        name: Optional[str] = None,
        **te_options: Any,
    ):
        super().__init__()
        check_te_options("Linear", _LINEAR_OPTIONS, te_options)
        for label, size in (("in_features", in_features), ("out_features", out_features)):
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ValueError(f"Linear({label}={size!r}): expected a positive integer")
        dtype, device = resolve_dtype("Linear", params_dtype), resolve_device(device)
        self.in_features, self.out_features = in_features, out_features
        self.return_bias = return_bias
        add_linear_parameters(self, in_features, out_features, bias, dtype, device, init_method,
                              get_rng_state_tracker, name or f"Linear({in_features},{out_features})",
                              rng_tracker_name)

    def forward(
        self,
        inp: torch.Tensor,
        is_first_microbatch: Optional[bool] = None,
        fp8_output: Optional[bool] = False,
        fp8_grad: Optional[bool] = False,
    ) -> Union[torch.Tensor, Tuple[torch.Tensor, Optional[torch.Tensor]]]:
        """`inp @ weight.T (+ bias)`; `fp8_output` / `fp8_grad` (TransformerEngine's) must stay False."""
        check_forward_options("Linear", fp8_output, fp8_grad)
        check_input("Linear", inp, self.in_features)
        if self.return_bias:
            out = fp8_linear(inp, self.weight, None, self.fp8, is_first_microbatch)
            return out, None if self.bias is None else self.bias.to(out.dtype)
        return fp8_linear(inp, self.weight, self.bias, self.fp8, is_first_microbatch)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
