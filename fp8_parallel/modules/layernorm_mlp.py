"""`LayerNormMLP`: norm -> fc1 -> activation -> fc2, standalone, with TransformerEngine's signature.

Single-rank, like `Linear`. Both GEMMs run in FP8 inside an enabled autocast scope (each with its own FP8
state); the norm and the activation run in high precision.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Tuple, Union

import torch
import torch.nn.functional as F

from ._core import FP8State, fp8_linear
from ._te_options import check_input, check_te_options, init_weight, resolve_device, resolve_dtype
from .norm import check_normalization, make_norm_parameters, normalize

_LAYERNORM_MLP_OPTIONS = (
    "sequence_parallel", "tp_group", "tp_size", "activation_params", "fuse_wgrad_accumulation",
    "return_layernorm_output_gathered", "seq_length", "micro_batch_size", "set_parallel_mode", "ub_overlap_ag",
    "ub_overlap_rs", "ub_overlap_rs_dgrad", "ub_bulk_dgrad", "ub_bulk_wgrad", "delay_wgrad_compute",
    "symmetric_ar_type", "checkpoint",
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


def activate(activation: str, h: torch.Tensor) -> torch.Tensor:
    """Apply a TransformerEngine-named activation to fc1's output (gated ones halve the last dim)."""
    if activation in _GATED:
        gate, up = h.chunk(2, dim=-1)
        return _GATED[activation](gate) * up
    return _ACTIVATIONS[activation](h)


class LayerNormMLP(torch.nn.Module):
    """Norm, fc1, activation, fc2: TransformerEngine's `LayerNormMLP` at tensor-parallel size 1.

    Args:
        hidden_size: input and output size.
        ffn_hidden_size: the intermediate size (fc1 has `2 * ffn_hidden_size` outputs for gated activations).
        eps, normalization, zero_centered_gamma, return_layernorm_output: the norm, as in `LayerNormLinear`.
        bias: fc1 and fc2 learn biases (initialized to zero).
        activation: "gelu" (tanh approximation, as in TransformerEngine), "relu", "silu", "qgelu", "srelu",
            or gated "swiglu", "geglu", "reglu", "qgeglu", "sreglu", "glu".
        return_bias: do not add fc2's bias; return it.
        init_method, output_layer_init_method: initialize fc1's / fc2's weight (default normal(0, 0.023)).
        params_dtype, device, get_rng_state_tracker, name: as for `Linear`.
        **te_options: TransformerEngine's other options, accepted at their defaults (see `Linear`).

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
        bias: bool = True,
        normalization: str = "LayerNorm",
        activation: str = "gelu",
        zero_centered_gamma: bool = False,
        return_layernorm_output: bool = False,
        return_bias: bool = False,
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
        if activation not in _ACTIVATIONS and activation not in _GATED:
            raise ValueError(
                f"LayerNormMLP(activation={activation!r}): expected one of {sorted(_ACTIVATIONS) + sorted(_GATED)}"
            )
        for label, size in (("hidden_size", hidden_size), ("ffn_hidden_size", ffn_hidden_size)):
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ValueError(f"LayerNormMLP({label}={size!r}): expected a positive integer")
        if not eps > 0:
            raise ValueError(f"LayerNormMLP(eps={eps!r}): expected a positive number")
        dtype, device = resolve_dtype("LayerNormMLP", params_dtype), resolve_device(device)
        self.hidden_size, self.ffn_hidden_size = hidden_size, ffn_hidden_size
        self.eps, self.normalization, self.zero_centered_gamma = eps, normalization, zero_centered_gamma
        self.activation = activation
        self.return_layernorm_output, self.return_bias = return_layernorm_output, return_bias
        fc1_out = 2 * ffn_hidden_size if activation in _GATED else ffn_hidden_size
        self.layer_norm_weight, self.layer_norm_bias = make_norm_parameters(
            hidden_size, normalization, zero_centered_gamma, dtype, device
        )
        self.fc1_weight = torch.nn.Parameter(torch.empty(fc1_out, hidden_size, dtype=dtype, device=device))
        init_weight(self.fc1_weight, init_method, get_rng_state_tracker)
        self.fc1_bias = torch.nn.Parameter(torch.zeros(fc1_out, dtype=dtype, device=device)) if bias else None
        self.fc2_weight = torch.nn.Parameter(torch.empty(hidden_size, ffn_hidden_size, dtype=dtype, device=device))
        init_weight(self.fc2_weight, output_layer_init_method, get_rng_state_tracker)
        self.fc2_bias = torch.nn.Parameter(torch.zeros(hidden_size, dtype=dtype, device=device)) if bias else None
        tag = name or f"LayerNormMLP({hidden_size},{ffn_hidden_size},{activation})"
        self.fc1_fp8 = FP8State(f"{tag}.fc1", device=device)
        self.fc2_fp8 = FP8State(f"{tag}.fc2", device=device)

    def forward(
        self, inp: torch.Tensor, is_first_microbatch: Optional[bool] = None
    ) -> Union[torch.Tensor, Tuple[torch.Tensor, ...]]:
        """Norm -> fc1 -> activation -> fc2 (both GEMMs in FP8 inside an enabled autocast scope)."""
        check_input("LayerNormMLP", inp, self.hidden_size, "hidden_size")
        ln_out = normalize(inp, self.normalization, self.layer_norm_weight, self.layer_norm_bias, self.eps,
                           self.zero_centered_gamma)
        h = fp8_linear(ln_out, self.fc1_weight, self.fc1_bias, self.fc1_fp8, is_first_microbatch)
        h = activate(self.activation, h)
        out = fp8_linear(h, self.fc2_weight, None if self.return_bias else self.fc2_bias, self.fc2_fp8,
                         is_first_microbatch)
        extra = []
        if self.return_bias:
            extra.append(None if self.fc2_bias is None else self.fc2_bias.to(out.dtype))
        if self.return_layernorm_output:
            extra.append(ln_out)
        return (out, *extra) if extra else out

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, ffn_hidden_size={self.ffn_hidden_size}, "
                f"activation={self.activation}, normalization={self.normalization}")
