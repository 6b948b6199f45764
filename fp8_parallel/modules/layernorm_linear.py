"""`LayerNormColumnParallelLinear`: a LayerNorm or RMSNorm in front of an FP8 column-parallel linear.

Drop-in for megatron's TransformerEngine `TELayerNormColumnParallelLinear` in layer specs (QKV and fc1 with
the norm fused in front); the norm parameters are `layer_norm_weight` / `layer_norm_bias`, as there. With
sequence parallelism the norm runs on the local sequence shard before the all-gather, and its parameters
carry `sequence_parallel=True` so megatron all-reduces their gradients over TP.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .parallel_linear import ColumnParallelLinear


class LayerNormColumnParallelLinear(ColumnParallelLinear):
    """Norm (`config.normalization`: "LayerNorm" or "RMSNorm") + FP8 `ColumnParallelLinear`."""

    def __init__(self, input_size: int, output_size: int, *, config, init_method, **kwargs):
        kwargs.pop("tp_comm_buffer_name", None)
        super().__init__(input_size, output_size, config=config, init_method=init_method, **kwargs)
        self.normalization = getattr(config, "normalization", "LayerNorm")
        if self.normalization not in ("LayerNorm", "RMSNorm"):
            raise ValueError(f"normalization={self.normalization!r}: expected 'LayerNorm' or 'RMSNorm'")
        self.eps = getattr(config, "layernorm_epsilon", 1e-5)
        self.zero_centered_gamma = getattr(config, "layernorm_zero_centered_gamma", False)
        device = self.weight.device if self.weight is not None else None
        init = 0.0 if self.zero_centered_gamma else 1.0
        self.layer_norm_weight = torch.nn.Parameter(
            torch.full((input_size,), init, dtype=config.params_dtype, device=device)
        )
        self.layer_norm_bias = (
            torch.nn.Parameter(torch.zeros(input_size, dtype=config.params_dtype, device=device))
            if self.normalization == "LayerNorm" else None
        )
        for p in (self.layer_norm_weight, self.layer_norm_bias):
            if p is not None:
                p.sequence_parallel = bool(config.sequence_parallel)

    def norm(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.layer_norm_weight + 1 if self.zero_centered_gamma else self.layer_norm_weight
        if self.normalization == "RMSNorm":
            return F.rms_norm(x, (x.shape[-1],), weight.to(x.dtype), self.eps)
        return F.layer_norm(x, (x.shape[-1],), weight.to(x.dtype), self.layer_norm_bias.to(x.dtype), self.eps)

    def forward(self, input_, weight=None, runtime_gather_output=None, is_first_microbatch: Optional[bool] = None):
        return super().forward(self.norm(input_), weight, runtime_gather_output, is_first_microbatch)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        state_dict = self.state_dict(prefix="", keep_vars=True)
        return make_sharded_tensors_for_checkpoint(
            state_dict, prefix, {"weight": 0, "bias": 0}, sharded_offsets,
            tp_group=self.tp_group, dp_cp_group=metadata["dp_cp_group"],
        )
