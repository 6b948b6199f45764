"""`LayerNormMLP`: norm -> fc1 -> activation -> fc2, with TransformerEngine's signature.

No megatron config needed; tensor parallelism is TransformerEngine's (`set_parallel_mode=True`: fc1
column-parallel, fc2 row-parallel). Both GEMMs run in FP8 inside an enabled autocast scope (each with its own
FP8 state); the norm and the activation run in high precision.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Dict, Optional, Tuple, Union

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from ._core import FP8State, fp8_linear
from ._deferred_init import ResetParameters, check_materialized, record_norm_inits
from ._delayed_wgrad import DelayedWgradMethods
from ._main_grad import accumulates_into_main_grad
from ._te_options import (add_bias, add_weight, check_input, check_te_options, in_autocast_dtype, resolve_device,
                          resolve_dtype, weight_initializer)
from ._tensor_parallel import TensorParallel, mark_partitioned, mark_sequence_parallel
from .norm import check_normalization, make_norm_parameters, normalize
from ._te_fp8_meta import TEFP8Meta

_LAYERNORM_MLP_OPTIONS = (
    "fuse_wgrad_accumulation", "seq_length", "micro_batch_size", "ub_overlap_ag", "ub_overlap_rs",
    "ub_overlap_rs_dgrad", "ub_bulk_dgrad", "ub_bulk_wgrad", "delay_wgrad_compute", "symmetric_ar_type",
)


def _qgelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


def _srelu(x: torch.Tensor) -> torch.Tensor:
    return F.relu(x).square()


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


# TransformerEngine's activation names: plain ones, and gated ones (fc1 produces twice the width; the first
# half goes through the activation and multiplies the second half)
_ACTIVATIONS: Dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": _gelu_tanh, "relu": F.relu, "silu": F.silu, "qgelu": _qgelu, "srelu": _srelu,
}
_GATED: Dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "geglu": _gelu_tanh, "reglu": F.relu, "swiglu": F.silu, "qgeglu": _qgelu, "sreglu": _srelu, "glu": torch.sigmoid,
}
# clamped_swiglu's parameters and TransformerEngine's defaults
_CLAMPED_SWIGLU_PARAMS = {"limit": 7.0, "alpha": 1.702, "glu_linear_offset": 1.0}
ACTIVATION_NAMES = sorted(_ACTIVATIONS) + sorted(_GATED) + ["clamped_swiglu"]


def _clamped_swiglu(h: torch.Tensor, limit: float, alpha: float, glu_linear_offset: float) -> torch.Tensor:
    """GPT-OSS's SwiGLU: the gate clamped from above at `limit` through `x * sigmoid(alpha * x)`, times the
    linear half clamped to [-limit, limit] plus `glu_linear_offset`."""
    gate, up = h.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    return gate * torch.sigmoid(alpha * gate) * (up.clamp(-limit, limit) + glu_linear_offset)


def check_activation(owner: str, activation: str, activation_params: Optional[dict]) -> Dict[str, float]:
    """Validate TransformerEngine's `activation` / `activation_params`; returns the parameters in use."""
    if activation not in ACTIVATION_NAMES:
        raise ValueError(f"{owner}(activation={activation!r}): expected one of {ACTIVATION_NAMES}")
    if activation != "clamped_swiglu":
        if activation_params:
            raise ValueError(f"{owner}(activation_params={activation_params!r}): only 'clamped_swiglu' takes "
                             f"parameters, not {activation!r}")
        return {}
    params = dict(activation_params or {})
    unknown = sorted(set(params) - set(_CLAMPED_SWIGLU_PARAMS))
    if unknown:
        raise ValueError(f"{owner}(activation_params={activation_params!r}): unknown {unknown}; clamped_swiglu "
                         f"takes {sorted(_CLAMPED_SWIGLU_PARAMS)}")
    return {**_CLAMPED_SWIGLU_PARAMS, **params}


def activate(activation: str, h: torch.Tensor, params: Optional[Dict[str, float]] = None) -> torch.Tensor:
    """Apply a TransformerEngine-named activation to fc1's output (gated ones halve the last dim)."""
    if activation == "clamped_swiglu":
        return _clamped_swiglu(h, **{**_CLAMPED_SWIGLU_PARAMS, **(params or {})})
    if activation in _GATED:
        gate, up = h.chunk(2, dim=-1)
        return _GATED[activation](gate) * up
    return _ACTIVATIONS[activation](h)


def _gated(activation: str) -> bool:
    return activation in _GATED or activation == "clamped_swiglu"


class LayerNormMLP(ResetParameters, DelayedWgradMethods, TEFP8Meta, torch.nn.Module):
    """Norm, fc1, activation, fc2: TransformerEngine's `LayerNormMLP`.

    Args:
        hidden_size: input and output size.
        ffn_hidden_size: the intermediate size (fc1 has `2 * ffn_hidden_size` outputs for gated activations),
            split over the TP ranks when `tp_size` > 1.
        eps, normalization, zero_centered_gamma, return_layernorm_output(_gathered): the norm, as in
            `LayerNormLinear`.
        sequence_parallel, tp_group, tp_size: as for `Linear`.
        set_parallel_mode: with more than one TP rank, fc1 is column-parallel and fc2 row-parallel (the
            output all-reduced, or reduce-scattered with sequence parallelism). Without it the weights are
            still split over `tp_size` but nothing is communicated (TransformerEngine's behaviour).
        bias: fc1 and fc2 learn biases (initialized to zero; fc2's is added after the TP reduction).
        activation: "gelu" (tanh approximation, as in TransformerEngine), "relu", "silu", "qgelu", "srelu",
            or gated "swiglu", "geglu", "reglu", "qgeglu", "sreglu", "glu", "clamped_swiglu".
        activation_params: clamped_swiglu's `limit` (7.0), `alpha` (1.702), `glu_linear_offset` (1.0).
        checkpoint: recompute norm, fc1 and the activation in backward instead of keeping their outputs
            (torch's non-reentrant checkpoint; the FP8 casts repeat with the first pass's scales).
        return_bias: do not add fc2's bias; return it.
        init_method, output_layer_init_method: initialize fc1's / fc2's weight shard (default normal(0, 0.023)).
        params_dtype, device, get_rng_state_tracker, name: as for `Linear`.
        **te_options: TransformerEngine's other options, as for `Linear` (`fuse_wgrad_accumulation` included).

    Parameters: `layer_norm_weight`, `layer_norm_bias` (LayerNorm only), `fc1_weight`, `fc1_bias`,
    `fc2_weight`, `fc2_bias`.

    Forward: `forward(inp, is_first_microbatch=None)` returns `out`, `(out, bias)`, `(out, ln_out)` or
    `(out, bias, ln_out)`, as TransformerEngine does.
    """

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        eps: float = 1e-5,
        *,
        sequence_parallel: bool = False,
        tp_group: Optional[dist.ProcessGroup] = None,
        tp_size: int = 1,
        set_parallel_mode: bool = False,
        bias: bool = True,
        normalization: str = "LayerNorm",
        activation: str = "gelu",
        activation_params: Optional[dict] = None,
        zero_centered_gamma: bool = False,
        return_layernorm_output: bool = False,
        return_layernorm_output_gathered: bool = False,
        return_bias: bool = False,
        checkpoint: bool = False,
        init_method: Optional[Callable[[torch.Tensor], Any]] = None,
        output_layer_init_method: Optional[Callable[[torch.Tensor], Any]] = None,
        params_dtype: Optional[torch.dtype] = None,
        device: Optional[Union[str, torch.device]] = None,
        get_rng_state_tracker: Optional[Callable[[], Any]] = None,
        name: Optional[str] = None,
        **te_options: Any,
    ):
        super().__init__()
        check_te_options("LayerNormMLP", _LAYERNORM_MLP_OPTIONS, te_options)
        check_normalization("LayerNormMLP", normalization)
        self.activation_params = check_activation("LayerNormMLP", activation, activation_params)
        for label, size in (("hidden_size", hidden_size), ("ffn_hidden_size", ffn_hidden_size)):
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ValueError(f"LayerNormMLP({label}={size!r}): expected a positive integer")
        if not eps > 0:
            raise ValueError(f"LayerNormMLP(eps={eps!r}): expected a positive number")
        # set_parallel_mode decides the communication; the split follows tp_size alone (as in TransformerEngine)
        self.tp = TensorParallel.resolve("LayerNormMLP", tp_group, tp_size, "column" if set_parallel_mode else None,
                                         sequence_parallel)
        dtype, device = resolve_dtype("LayerNormMLP", params_dtype), resolve_device(device)
        self.hidden_size, self.ffn_hidden_size = hidden_size, ffn_hidden_size
        self.eps, self.normalization, self.zero_centered_gamma = eps, normalization, zero_centered_gamma
        self.activation, self.set_parallel_mode, self.checkpoint = activation, bool(set_parallel_mode), bool(checkpoint)
        self.return_layernorm_output = return_layernorm_output
        self.return_layernorm_output_gathered = return_layernorm_output_gathered
        self.return_bias = return_bias
        self.fuse_wgrad_accumulation = bool(te_options.get("fuse_wgrad_accumulation", False))
        local_ffn = self.tp.split(ffn_hidden_size, "ffn_hidden_size")
        fc1_out = 2 * local_ffn if _gated(activation) else local_ffn
        self.layer_norm_weight, self.layer_norm_bias = make_norm_parameters(
            hidden_size, normalization, zero_centered_gamma, dtype, device
        )
        record_norm_inits(self, "layer_norm_weight", "layer_norm_bias", zero_centered_gamma)
        add_weight(self, "fc1_weight", (fc1_out, hidden_size), dtype, device,
                   weight_initializer(init_method, get_rng_state_tracker))
        add_bias(self, "fc1_bias", fc1_out, dtype, device, bias)
        add_weight(self, "fc2_weight", (hidden_size, local_ffn), dtype, device,
                   weight_initializer(output_layer_init_method, get_rng_state_tracker))
        add_bias(self, "fc2_bias", hidden_size, dtype, device, bias)
        mark_sequence_parallel([self.layer_norm_weight, self.layer_norm_bias, self.fc2_bias], self.tp.sequence_parallel)
        if self.tp.size > 1:
            for p, dim in ((self.fc1_weight, 0), (self.fc1_bias, 0), (self.fc2_weight, 1)):
                mark_partitioned(p, dim)
        self._init_delayed_wgrad(bool(te_options.get("delay_wgrad_compute", False)), ["fc1_weight", "fc2_weight"],
                                 ["fc1_bias", "fc2_bias"])
        tag = name or f"LayerNormMLP({hidden_size},{ffn_hidden_size},{activation})"
        self.fc1_fp8 = FP8State(f"{tag}.fc1", device=device)
        self.fc2_fp8 = FP8State(f"{tag}.fc2", device=device)

    def set_tensor_parallel_group(self, tp_group: Optional[dist.ProcessGroup]) -> None:
        """Set the tensor-parallel group (TransformerEngine's method), for a module built with `tp_size`."""
        self.tp.set_group(tp_group)

    def _local(self, inp: torch.Tensor, is_first_microbatch: Optional[bool], fc2_bias: Optional[torch.Tensor]):
        """This rank's part: norm, gather, fc1, activation, fc2 (before fc2's TP reduction)."""
        ln_out = normalize(inp, self.normalization, self.layer_norm_weight, self.layer_norm_bias, self.eps,
                           self.zero_centered_gamma)
        total = self.tp.column_input(ln_out)
        fuse1, fuse2 = (accumulates_into_main_grad(w, self.fuse_wgrad_accumulation, "LayerNormMLP", name)
                        for w, name in ((self.fc1_weight, "fc1_weight"), (self.fc2_weight, "fc2_weight")))
        h = fp8_linear(total, self.fc1_weight, self.fc1_bias, self.fc1_fp8, is_first_microbatch,
                       wgrad_store=self._wgrad_store("fc1_weight"), fuse_wgrad_accumulation=fuse1)
        h = activate(self.activation, h, self.activation_params)
        out = fp8_linear(h, self.fc2_weight, fc2_bias, self.fc2_fp8, is_first_microbatch,
                         wgrad_store=self._wgrad_store("fc2_weight"), fuse_wgrad_accumulation=fuse2)
        return out, ln_out, total

    def _fp8_gemm_states(self):  # `fp8_meta`: fc1 then fc2, as TE's GEMM1 / GEMM2
        return [self.fc1_fp8, self.fc2_fp8]

    def forward(
        self, inp: torch.Tensor, is_first_microbatch: Optional[bool] = None
    ) -> Union[torch.Tensor, Tuple[torch.Tensor, ...]]:
        """Norm -> fc1 -> activation -> fc2 (both GEMMs in FP8 inside an enabled autocast scope)."""
        check_materialized("LayerNormMLP", self.fc1_fp8.fwd.scale)
        check_input("LayerNormMLP", inp, self.hidden_size, "hidden_size")
        inp = in_autocast_dtype(inp)
        # fc2's bias goes into the GEMM only when no TP reduction follows it
        in_gemm = self.fc2_bias if not self.return_bias and not self.tp.active else None
        local = functools.partial(self._local, is_first_microbatch=is_first_microbatch, fc2_bias=in_gemm)
        if self.checkpoint and torch.is_grad_enabled():
            out, ln_out, total = torch_checkpoint(local, inp, use_reentrant=False)
        else:
            out, ln_out, total = local(inp)
        if self.tp.active:
            out = self.tp.row_output(out)
            if self.fc2_bias is not None and not self.return_bias:
                out = out + self.fc2_bias.to(out.dtype)
        extra = []
        if self.return_bias:
            extra.append(None if self.fc2_bias is None else self.fc2_bias.to(out.dtype))
        if self.return_layernorm_output_gathered:
            extra.append(total if self.tp.active and self.tp.sequence_parallel else ln_out)
        elif self.return_layernorm_output:
            extra.append(ln_out)
        return (out, *extra) if extra else out

    def extra_repr(self) -> str:
        tp = f", tp_size={self.tp.size}, set_parallel_mode={self.set_parallel_mode}" if self.tp.size > 1 else ""
        return (f"hidden_size={self.hidden_size}, ffn_hidden_size={self.ffn_hidden_size}, "
                f"activation={self.activation}, normalization={self.normalization}{tp}")
