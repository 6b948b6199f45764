"""Tensor-parallel FP8 linears: megatron-core's Column/RowParallelLinear with FP8 GEMMs.

They subclass megatron's layers, so constructor signatures, parameters (with their tensor-parallel
attributes), `(output, bias)` returns, `sharded_state_dict` and the tensor/sequence-parallel communication
are megatron's own; only the local GEMMs change. Communication goes through megatron's autograd-aware
mappings (plain TP all-reduces the input gradient (column) or the output (row, in megatron's forward)). A
column-parallel layer can instead gather its sequence-parallel input as FP8 bytes (`fp8_input_gather`); its
gradient is then reduce-scattered in high precision, as megatron does.

Alignment: the FP8 GEMMs need the per-rank feature sizes (`input_size`, `output_size` after the split) to be
multiples of 16. A layer whose sizes are not is still exact: its GEMMs zero-pad (see `features_unaligned` in
`_core`), and every tensor it returns is an ordinary contiguous tensor, so megatron's tensor-parallel
communication sums it. Sizes that are multiples of 16 pay no padding.
"""
from __future__ import annotations

from typing import Optional

from ..startup import import_megatron_core

import_megatron_core()  # megatron-core without torch's compiler (see startup.py), before its imports below
from megatron.core import tensor_parallel as mtp
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
)

from ._core import FP8State, fp8_linear, history_len_of
from ._main_grad import accumulates_into_main_grad


def _first_microbatch(module, explicit: Optional[bool]) -> Optional[bool]:
    """Weight caching: an explicit argument wins; otherwise megatron's protocol, in which its schedule sets
    `is_first_microbatch = True` on every module at a step's first microbatch (as for TransformerEngine
    layers), unless `config.disable_parameter_transpose_cache`. Until something sets it the attribute is None:
    no caching. The cache is never used stale (see `cast_weight`)."""
    if explicit is not None:
        return explicit
    first = module.is_first_microbatch
    if first is None or getattr(module.config, "disable_parameter_transpose_cache", False):
        return None
    module.is_first_microbatch = False
    return first


def _wgrad_in_fp8(config) -> bool:
    return getattr(config, "fp8_wgrad", True)


class _FusedWgradAccumulation:
    """`fuse_wgrad_accumulation`: the weight gradient is accumulated in float32 and added into the weight's
    `main_grad` in the GEMM (megatron's `gradient_accumulation_fusion`, here without apex; under megatron's
    DistributedDataParallel its hook then adds nothing). None (the default) follows
    `config.gradient_accumulation_fusion`, which megatron accepts only with apex (its constructors, which ours
    inherit, and GPTModel's output layer refuse it otherwise); without apex set the attribute, e.g. with
    `fp8_parallel.megatron.fuse_wgrad_accumulation`. Only the layer's own weight takes part (not one passed
    to `forward`)."""

    fuse_wgrad_accumulation: Optional[bool] = None
    fused_wgrad_name: Optional[str] = None  # the weight's full name in its model, for errors (set by the helper)

    def _into_main_grad(self, weight) -> bool:
        fuse = self.fuse_wgrad_accumulation
        if fuse is None:
            fuse = bool(getattr(self, "gradient_accumulation_fusion", False))
        return accumulates_into_main_grad(weight, fuse and weight is self.weight, type(self).__name__,
                                          self.fused_wgrad_name or "weight")


class ColumnParallelLinear(_FusedWgradAccumulation, mtp.ColumnParallelLinear):
    """megatron-core `ColumnParallelLinear` computing its GEMMs in FP8 inside an FP8 autocast scope.

    `fp8_input_gather = True` (off by default): with sequence parallelism and delayed scaling, cast the input
    shard to FP8 before the all-gather, so FP8 bytes travel (half of bf16's), when the scope's amax domain
    covers TP. It pays only where the link is slow: on two NVLink-connected H200s the extra transpose pass
    after the gather cost more than the halved traffic saved (docs/benchmarks.md).

    `fuse_wgrad_accumulation` (None: `config.gradient_accumulation_fusion`): the weight gradient goes into
    `weight.main_grad` in the GEMM, as megatron's `gradient_accumulation_fusion` does with apex.
    """

    fp8_input_gather: bool = False

    def __init__(self, input_size: int, output_size: int, *, config, init_method, **kwargs):
        super().__init__(input_size, output_size, config=config, init_method=init_method, **kwargs)
        device = None if self.weight is None else self.weight.device
        self.fp8 = FP8State(f"ColumnParallelLinear({input_size},{output_size})", device=device,
                            history_len=history_len_of(config))
        self.is_first_microbatch: Optional[bool] = None  # megatron's schedule sets True at a step's first microbatch
        self._first: Optional[bool] = None

    def forward(self, input_, weight=None, runtime_gather_output=None, is_first_microbatch: Optional[bool] = None):
        self._first = _first_microbatch(self, is_first_microbatch)
        return super().forward(input_, weight=weight, runtime_gather_output=runtime_gather_output)

    def _forward_impl(self, input, weight, bias, allreduce_dgrad, sequence_parallel, tp_group, **_):
        fuse = self._into_main_grad(weight)
        if sequence_parallel:
            if self.fp8_input_gather:  # FP8 bytes where the scales allow it, else megatron's bf16 gather
                return fp8_linear(input, weight, bias, self.fp8, self._first, _wgrad_in_fp8(self.config),
                                  sp_group=tp_group, hp_gather=lambda t: gather_from_sequence_parallel_region(
                                      t, tensor_parallel_output_grad=True, group=tp_group),
                                  fuse_wgrad_accumulation=fuse)
            input = gather_from_sequence_parallel_region(input, tensor_parallel_output_grad=True, group=tp_group)
        elif allreduce_dgrad:
            input = copy_to_tensor_model_parallel_region(input, group=tp_group)
        return fp8_linear(input, weight, bias, self.fp8, self._first, _wgrad_in_fp8(self.config),
                          fuse_wgrad_accumulation=fuse)


class RowParallelLinear(_FusedWgradAccumulation, mtp.RowParallelLinear):
    """megatron-core `RowParallelLinear` computing its GEMMs in FP8 inside an FP8 autocast scope
    (`fuse_wgrad_accumulation`: as for `ColumnParallelLinear`)."""

    def __init__(self, input_size: int, output_size: int, *, config, init_method, **kwargs):
        super().__init__(input_size, output_size, config=config, init_method=init_method, **kwargs)
        self.fp8 = FP8State(f"RowParallelLinear({input_size},{output_size})", device=self.weight.device,
                            history_len=history_len_of(config))
        self.is_first_microbatch: Optional[bool] = None  # megatron's schedule sets True at a step's first microbatch
        self._first: Optional[bool] = None

    def forward(self, input_, is_first_microbatch: Optional[bool] = None):
        self._first = _first_microbatch(self, is_first_microbatch)
        return super().forward(input_)

    def _forward_impl(self, input, weight, bias, **_):
        return fp8_linear(input, weight, bias, self.fp8, self._first, _wgrad_in_fp8(self.config),
                          fuse_wgrad_accumulation=self._into_main_grad(weight))
