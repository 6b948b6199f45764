"""`LayerNormLinear`: a norm followed by an FP8 linear, with TransformerEngine's signature.

No megatron config needed; tensor parallelism is TransformerEngine's column mode (`parallel_mode="column"`,
`tp_group`, `sequence_parallel`). The norm runs in high precision; the linear runs in FP8 inside an enabled
autocast scope. The tensor-parallel form with megatron's signature is `LayerNormColumnParallelLinear`.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Tuple, Union

import torch
import torch.distributed as dist

from ._core import fp8_linear
from ._deferred_init import ResetParameters, check_materialized, record_norm_inits
from ._delayed_wgrad import DelayedWgradMethods
from ._main_grad import accumulates_into_main_grad
from ._te_options import (
    add_linear_parameters, check_forward_options, check_input, check_te_options, in_autocast_dtype, resolve_device,
    resolve_dtype,
)
from ._tensor_parallel import TensorParallel, mark_partitioned, mark_sequence_parallel
from .norm import check_normalization, make_norm_parameters, normalize
from ._te_fp8_meta import TEFP8Meta

_LAYERNORM_LINEAR_OPTIONS = (
    "fuse_wgrad_accumulation", "parameters_split", "ub_overlap_ag", "ub_overlap_rs", "ub_overlap_rs_dgrad",
    "ub_bulk_wgrad", "ub_bulk_dgrad", "ub_name", "delay_wgrad_compute", "symmetric_ar_type",
)


class LayerNormLinear(ResetParameters, DelayedWgradMethods, TEFP8Meta, torch.nn.Module):
    """`normalization(x) @ weight.T + bias`, TransformerEngine's `LayerNormLinear`.

    Args:
        in_features, out_features: full (unsplit) sizes.
        eps: the norm's epsilon.
        sequence_parallel, tp_group, tp_size: as for `Linear`.
        parallel_mode: None or "column" (output features split over TP; with sequence parallelism the norm
            runs on this rank's shard and its output is all-gathered). "row" is refused, as in
            TransformerEngine.
        bias: learn an additive bias for the linear (initialized to zero).
        normalization: "LayerNorm" (gain and bias) or "RMSNorm" (gain only).
        zero_centered_gamma: the norm's gain is `1 + layer_norm_weight`, with the weight starting at 0.
        return_layernorm_output: also return the norm's output (this rank's shard under sequence parallelism).
        return_layernorm_output_gathered: also return the norm's output, all-gathered under sequence
            parallelism.
        return_bias: do not add the linear's bias; return it.
        init_method, params_dtype, device, get_rng_state_tracker, name: as for `Linear`.
        **te_options: TransformerEngine's other options, as for `Linear` (`fuse_wgrad_accumulation` included).

    Parameters: `layer_norm_weight`, `layer_norm_bias` (LayerNorm only; both carry `sequence_parallel`),
    `weight`, `bias`.

    Forward: `forward(inp, is_first_microbatch=None)` returns `out`, `(out, bias)`, `(out, ln_out)` or
    `(out, bias, ln_out)`, as TransformerEngine does.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        eps: float = 1e-5,
        *,
        sequence_parallel: bool = False,
        tp_group: Optional[dist.ProcessGroup] = None,
        tp_size: int = 1,
        parallel_mode: Optional[str] = None,
        bias: bool = True,
        normalization: str = "LayerNorm",
        zero_centered_gamma: bool = False,
        return_layernorm_output: bool = False,
        return_layernorm_output_gathered: bool = False,
        return_bias: bool = False,
        init_method: Optional[Callable[[torch.Tensor], Any]] = None,
        params_dtype: Optional[torch.dtype] = None,
        device: Optional[Union[str, torch.device]] = None,
        get_rng_state_tracker: Optional[Callable[[], Any]] = None,
        name: Optional[str] = None,
        **te_options: Any,
    ):
        super().__init__()
        check_te_options("LayerNormLinear", _LAYERNORM_LINEAR_OPTIONS, te_options)
        check_normalization("LayerNormLinear", normalization)
        if parallel_mode == "row":
            raise NotImplementedError("LayerNormLinear(parallel_mode='row'): a norm needs the whole feature "
                                      "dimension (TransformerEngine refuses it too); use parallel_mode='column', "
                                      "or a norm followed by Linear(parallel_mode='row')")
        for label, size in (("in_features", in_features), ("out_features", out_features)):
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ValueError(f"LayerNormLinear({label}={size!r}): expected a positive integer")
        if not eps > 0:
            raise ValueError(f"LayerNormLinear(eps={eps!r}): expected a positive number")
        self.tp = TensorParallel.resolve("LayerNormLinear", tp_group, tp_size, parallel_mode, sequence_parallel,
                                         modes=(None, "column"))
        dtype, device = resolve_dtype("LayerNormLinear", params_dtype), resolve_device(device)
        self.in_features, self.out_features = in_features, out_features
        self.eps, self.normalization, self.zero_centered_gamma = eps, normalization, zero_centered_gamma
        self.return_layernorm_output = return_layernorm_output
        self.return_layernorm_output_gathered = return_layernorm_output_gathered
        self.return_bias = return_bias
        self.fuse_wgrad_accumulation = bool(te_options.get("fuse_wgrad_accumulation", False))
        self.layer_norm_weight, self.layer_norm_bias = make_norm_parameters(
            in_features, normalization, zero_centered_gamma, dtype, device
        )
        record_norm_inits(self, "layer_norm_weight", "layer_norm_bias", zero_centered_gamma)
        mark_sequence_parallel([self.layer_norm_weight, self.layer_norm_bias], self.tp.sequence_parallel)
        local_out = self.tp.split(out_features, "out_features") if parallel_mode == "column" else out_features
        add_linear_parameters(self, in_features, local_out, bias, dtype, device, init_method,
                              get_rng_state_tracker, name or f"LayerNormLinear({in_features},{out_features})")
        self._init_delayed_wgrad(bool(te_options.get("delay_wgrad_compute", False)), ["weight"], ["bias"])
        if self.tp.size > 1 and parallel_mode == "column":
            mark_partitioned(self.weight, 0)
            mark_partitioned(self.bias, 0)

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
    ) -> Union[torch.Tensor, Tuple[torch.Tensor, ...]]:
        """Norm, then the FP8 linear; `fp8_output` / `fp8_grad` (TransformerEngine's) must stay False."""
        check_forward_options("LayerNormLinear", fp8_output, fp8_grad)
        check_materialized("LayerNormLinear", self.fp8.fwd.scale)
        check_input("LayerNormLinear", inp, self.in_features)
        inp = in_autocast_dtype(inp)
        ln_out = normalize(inp, self.normalization, self.layer_norm_weight, self.layer_norm_bias, self.eps,
                           self.zero_centered_gamma)
        total = self.tp.column_input(ln_out)
        weight, fuse = self.gemm_weight()
        out = fp8_linear(total, weight, None if self.return_bias else self.bias, self.fp8, is_first_microbatch,
                         wgrad_store=self._wgrad_store("weight"), fuse_wgrad_accumulation=fuse)
        extra = []
        if self.return_bias:
            extra.append(None if self.bias is None else self.bias.to(out.dtype))
        if self.return_layernorm_output_gathered:
            extra.append(total if self.tp.active and self.tp.sequence_parallel else ln_out)
        elif self.return_layernorm_output:
            extra.append(ln_out)
        return (out, *extra) if extra else out

    def extra_repr(self) -> str:
        tp = f", parallel_mode={self.tp.mode}, tp_size={self.tp.size}" if self.tp.mode else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"normalization={self.normalization}{tp}")
