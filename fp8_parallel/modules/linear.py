"""`Linear`: an FP8 linear layer with TransformerEngine's `Linear` signature, tensor parallelism included.

It needs no megatron config and no parallel set-up beyond a process group for tensor parallelism. Inside an
enabled `fp8_parallel.autocast` / `fp8_autocast` scope it runs in FP8, elsewhere in high precision. The
tensor-parallel layers with megatron's signatures and `(output, bias)` convention are `ColumnParallelLinear` /
`RowParallelLinear`.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Tuple, Union

import torch
import torch.distributed as dist

from ._core import fp8_linear
from ._deferred_init import ResetParameters, check_materialized
from ._delayed_wgrad import DelayedWgradMethods
from ._main_grad import accumulates_into_main_grad
from ._te_options import (
    add_linear_parameters, check_forward_options, check_input, check_te_options, in_autocast_dtype, resolve_device,
    resolve_dtype,
)
from ._tensor_parallel import TensorParallel, mark_partitioned, mark_sequence_parallel
from ._te_fp8_meta import TEFP8Meta

_LINEAR_OPTIONS = (
    "fuse_wgrad_accumulation", "parameters_split", "ub_overlap_ag", "ub_overlap_rs", "ub_overlap_rs_dgrad",
    "ub_bulk_dgrad", "ub_bulk_wgrad", "ub_name", "delay_wgrad_compute", "symmetric_ar_type", "save_original_input",
)


class Linear(ResetParameters, DelayedWgradMethods, TEFP8Meta, torch.nn.Module):
    """FP8 linear layer `y = x @ weight.T + bias`, TransformerEngine's `Linear`.

    Args:
        in_features, out_features: full (unsplit) sizes.
        sequence_parallel: with `parallel_mode` and more than one TP rank: the input ("column") / output
            ("row") is sharded along its first dimension over the TP ranks.
        tp_group, tp_size: the tensor-parallel group (or only its size, the group given later with
            `set_tensor_parallel_group`).
        parallel_mode: None (no split), "column" (output features split over TP; the input all-gathered with
            sequence parallelism, else replicated) or "row" (input features split; partial outputs
            all-reduced, or reduce-scattered with sequence parallelism; the bias added after).
        bias: learn an additive bias (initialized to zero).
        init_method: `init_method(weight)` initializes this rank's weight shard; default normal(0, 0.023), as
            in TransformerEngine.
        params_dtype: parameter dtype; default `torch.get_default_dtype()`.
        device: parameter device; default CUDA when available, else the CPU.
        return_bias: do not add the bias; return `(output, bias)` instead (the bias in the output's dtype,
            None without a bias).
        get_rng_state_tracker, rng_tracker_name: initialize the weight inside `tracker.fork(name)`.
        name: a label for the FP8 state (debugging).
        **te_options: TransformerEngine's other `Linear` options. `fuse_wgrad_accumulation=True`: the weight
            gradient is added into `weight.main_grad` (which must exist, e.g. from megatron's DDP); `.grad`
            stays None, or (the parameter having `grad_added_to_main_grad`, megatron's protocol) the flag is
            set and autograd gets an unused, uninitialized buffer, as in TransformerEngine. `delay_wgrad_compute=True`:
            backward computes the input gradient only and `backward_dw()` the weight gradient later (it
            replaces `.grad`, as in TransformerEngine). The others (userbuffers, ...)
            are accepted at their defaults; other values raise NotImplementedError naming what to use.

    Parameters carry megatron's tensor-parallel attributes (`tensor_model_parallel`, `partition_dim`) when
    split, and a row-parallel bias carries `sequence_parallel` (its gradient is partial per rank then).

    Forward: `forward(inp, is_first_microbatch=None)` returns the output tensor (or `(output, bias)`).
    `is_first_microbatch`: True casts the weight to FP8 and caches it, False reuses the cache (gradient
    accumulation), None casts on every call.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        sequence_parallel: bool = False,
        tp_group: Optional[dist.ProcessGroup] = None,
        tp_size: int = 1,
        parallel_mode: Optional[str] = None,
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
        self.tp = TensorParallel.resolve("Linear", tp_group, tp_size, parallel_mode, sequence_parallel)
        dtype, device = resolve_dtype("Linear", params_dtype), resolve_device(device)
        self.in_features, self.out_features = in_features, out_features
        local_in = self.tp.split(in_features, "in_features") if parallel_mode == "row" else in_features
        local_out = self.tp.split(out_features, "out_features") if parallel_mode == "column" else out_features
        self.return_bias = return_bias
        self.fuse_wgrad_accumulation = bool(te_options.get("fuse_wgrad_accumulation", False))
        add_linear_parameters(self, local_in, local_out, bias, dtype, device, init_method,
                              get_rng_state_tracker, name or f"Linear({in_features},{out_features})",
                              rng_tracker_name)
        self._init_delayed_wgrad(bool(te_options.get("delay_wgrad_compute", False)), ["weight"], ["bias"])
        if self.tp.size > 1 and parallel_mode is not None:
            mark_partitioned(self.weight, 1 if parallel_mode == "row" else 0)
            if parallel_mode == "column":
                mark_partitioned(self.bias, 0)
            else:
                mark_sequence_parallel([self.bias], self.tp.sequence_parallel)

    def gemm_weight(self) -> Tuple[torch.Tensor, bool]:
        """The weight as the GEMM uses it, and whether its gradient goes into `weight.main_grad` there
        (`fuse_wgrad_accumulation`)."""
        fuse = accumulates_into_main_grad(self.weight, self.fuse_wgrad_accumulation, type(self).__name__, "weight")
        return self.weight, fuse

    def set_tensor_parallel_group(self, tp_group: Optional[dist.ProcessGroup]) -> None:
        """Set the tensor-parallel group (TransformerEngine's method), for a module built with `tp_size`."""
        self.tp.set_group(tp_group)

    def forward(
        self,
        inp: torch.Tensor,
        is_first_microbatch: Optional[bool] = None,
        fp8_output: Optional[bool] = False,
        fp8_grad: Optional[bool] = False,
    ) -> Union[torch.Tensor, Tuple[torch.Tensor, Optional[torch.Tensor]]]:
        """`inp @ weight.T (+ bias)` with the tensor-parallel communication of `parallel_mode`;
        `fp8_output` / `fp8_grad` (TransformerEngine's) must stay False."""
        check_forward_options("Linear", fp8_output, fp8_grad)
        row = self.tp.mode == "row"
        check_materialized("Linear", self.fp8.fwd.scale)
        check_input("Linear", inp, self.weight.shape[1], "in_features/tp_size" if row else "in_features")
        inp = in_autocast_dtype(inp)
        bias = self.bias if not self.return_bias and not row else None
        if self.tp.mode == "column":
            inp = self.tp.column_input(inp)
        weight, fuse = self.gemm_weight()
        out = fp8_linear(inp, weight, bias, self.fp8, is_first_microbatch,
                         wgrad_store=self._wgrad_store("weight"), fuse_wgrad_accumulation=fuse)
        if row:
            out = self.tp.row_output(out)
            if self.bias is not None and not self.return_bias:
                out = out + self.bias.to(out.dtype)
        if self.return_bias:
            return out, None if self.bias is None else self.bias.to(out.dtype)
        return out

    def extra_repr(self) -> str:
        tp = f", parallel_mode={self.tp.mode}, tp_size={self.tp.size}" if self.tp.mode else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}{tp}")
