"""`GroupedLinear`: TransformerEngine's grouped linear (one FP8 linear per expert over consecutive row blocks
of one input), under its name and signature.

It needs no megatron config and imports no megatron-core. The per-expert compute is the one megatron's expert
layers use (`_grouped_core`): one FP8 state per GEMM, every expert run on every call (also without rows), so
the amax layout never depends on routing. The expert linear with a megatron-style signature is
`fp8_parallel.modules.grouped.GroupedLinear`.
"""
from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from ._grouped_core import check_splits, expert_states, grouped_fp8_linear
from ._deferred_init import ResetParameters, check_materialized
from ._delayed_wgrad import DelayedWgradMethods
from ._main_grad import accumulates_into_main_grad
from ._te_options import (add_bias, add_weight, check_input, check_te_options, in_autocast_dtype, resolve_device,
                          resolve_dtype, weight_initializer)
from ._tensor_parallel import TensorParallel, mark_partitioned
from ._te_fp8_meta import TEFP8Meta

# TransformerEngine's GroupedLinear options handled by `check_te_options` (accepted at their defaults, or
# at any value where they change no result)
_GROUPED_OPTIONS = ("fuse_wgrad_accumulation", "ub_overlap_rs", "ub_overlap_ag", "ub_name", "delay_wgrad_compute",
                    "save_original_input")
# TransformerEngine 2.14+ options of GroupedLinear only (experimental there)
_SINGLE_PARAMETER_OPTIONS = ("single_grouped_weight", "single_grouped_bias")


class GroupedLinear(ResetParameters, DelayedWgradMethods, TEFP8Meta, torch.nn.Module):
    """`num_gemms` FP8 linears over consecutive row blocks of one input: rows `sum(m_splits[:i]) :
    sum(m_splits[:i+1])` of the input go through `y_i = x_i @ weight{i}.T + bias{i}`. TransformerEngine's
    `GroupedLinear`, as MoE layers use it for their experts.

    Args:
        num_gemms: the number of GEMMs (local experts).
        in_features, out_features: full (unsplit) sizes of each GEMM.
        sequence_parallel, tp_group, tp_size, parallel_mode: as in TransformerEngine, they only shape the
            parameters: "column" splits `out_features`, "row" `in_features` over the tensor-parallel ranks,
            and the module communicates nothing (the MoE token dispatcher does). `bias=True` with more than one
            tensor-parallel rank is refused (ValueError), as in TransformerEngine.
        bias: one learnable bias per GEMM (initialized to zero).
        init_method: `init_method(weight{i})` initializes each weight; default normal(0, 0.023), as in
            TransformerEngine.
        get_rng_state_tracker, rng_tracker_name: initialize the weights inside `tracker.fork(name)`.
        params_dtype: parameter dtype; default `torch.get_default_dtype()`.
        device: parameter device; default CUDA when available, else the CPU.
        return_bias: do not add the biases; return `(output, [bias0, ...])` instead (each bias in the output's
            dtype; None entries without biases).
        name: a label for the FP8 states (debugging).
        **te_options: TransformerEngine's other `GroupedLinear` options. `ub_name` and `save_original_input`
            are accepted at any value (no effect on a result); `fuse_wgrad_accumulation=True` adds each weight's
            gradient into its `main_grad` (as TransformerEngine); `delay_wgrad_compute=True` leaves the
            weight gradients to `backward_dw()` (as `Linear`); `ub_overlap_rs`, `ub_overlap_ag`,
            `single_grouped_weight`, `single_grouped_bias` only at their defaults (False): other values raise
            NotImplementedError naming the option.

    Parameters: `weight0 .. weight{num_gemms-1}` (`[out_features, in_features]`, this rank's shard, carrying
    megatron's `tensor_model_parallel` / `partition_dim` when split) and `bias0 ..` (None without biases), in
    TransformerEngine's order and under its names; the FP8 states are `fp8[i]` (state dict `fp8.<i>.*`).
    `in_features` / `out_features` hold this rank's sizes, as in TransformerEngine.

    Forward: `forward(inp, m_splits, is_first_microbatch=None)` (see `forward`).

    `use_grouped_gemm` (attribute, default False): run the GEMMs as one grouped FP8 GEMM where torch offers one,
    and without FP8 as one bfloat16 grouped GEMM (`modules/_grouped_core.py`). Off by default because TransformerEngine's contract is that a GroupedLinear
    equals one `Linear` per GEMM bit for bit (its own tests assert it), and the grouped GEMM rounds
    differently; megatron's expert layer (`FP8GroupedMLP`) uses it.
    """

    use_grouped_gemm: bool = False

    def __init__(
        self,
        num_gemms: int,
        in_features: int,
        out_features: int,
        *,
        sequence_parallel: bool = False,
        tp_group: Optional[dist.ProcessGroup] = None,
        tp_size: int = 1,
        get_rng_state_tracker: Optional[Callable[[], Any]] = None,
        rng_tracker_name: Optional[str] = None,
        init_method: Optional[Callable[[torch.Tensor], Any]] = None,
        bias: bool = True,
        return_bias: bool = False,
        params_dtype: Optional[torch.dtype] = None,
        parallel_mode: Optional[str] = None,
        device: Optional[Union[str, torch.device]] = None,
        name: Optional[str] = None,
        **te_options: Any,
    ):
        super().__init__()
        for option in _SINGLE_PARAMETER_OPTIONS:
            if te_options.pop(option, False):
                raise NotImplementedError(
                    f"GroupedLinear({option}=True): parameters are one per GEMM (weight0.., bias0..); a single "
                    f"grouped parameter is not implemented. Leave {option}=False.")
        check_te_options("GroupedLinear", _GROUPED_OPTIONS, te_options)
        self.fuse_wgrad_accumulation = bool(te_options.get("fuse_wgrad_accumulation", False))
        delay_wgrad_compute = bool(te_options.get("delay_wgrad_compute", False))
        for label, size in (("num_gemms", num_gemms), ("in_features", in_features), ("out_features", out_features)):
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ValueError(f"GroupedLinear({label}={size!r}): expected a positive integer")
        self.tp = TensorParallel.resolve("GroupedLinear", tp_group, tp_size, parallel_mode, sequence_parallel)
        if self.tp.size > 1 and bias:
            raise ValueError(f"GroupedLinear(bias=True) with tensor-parallel size {self.tp.size}: not supported, as "
                             "in TransformerEngine (the module does no tensor-parallel communication, so a bias "
                             "cannot be added after it); use bias=False")
        dtype, device = resolve_dtype("GroupedLinear", params_dtype), resolve_device(device)
        self.num_gemms = num_gemms
        self.in_features = self.tp.split(in_features, "in_features") if parallel_mode == "row" else in_features
        self.out_features = self.tp.split(out_features, "out_features") if parallel_mode == "column" else out_features
        self.use_bias, self.return_bias = bool(bias), return_bias
        init = weight_initializer(init_method, get_rng_state_tracker, rng_tracker_name)
        for i in range(num_gemms):  # TransformerEngine's order: weight0, bias0, weight1, ...
            w = add_weight(self, f"weight{i}", (self.out_features, self.in_features), dtype, device, init)
            if self.tp.size > 1 and parallel_mode is not None:
                mark_partitioned(w, 1 if parallel_mode == "row" else 0)
            add_bias(self, f"bias{i}", self.out_features, dtype, device, bias)
        self._init_delayed_wgrad(delay_wgrad_compute, [f"weight{i}" for i in range(num_gemms)],
                                 [f"bias{i}" for i in range(num_gemms)])
        tag = (name or f"GroupedLinear({in_features},{out_features})").replace("{", "{{").replace("}", "}}")
        self.fp8 = expert_states(num_gemms, tag + "[{i}]", device)

    def set_tensor_parallel_group(self, tp_group: Optional[dist.ProcessGroup]) -> None:
        """Set the tensor-parallel group (TransformerEngine's method), for a module built with `tp_size`. Only
        recorded: the module communicates nothing."""
        self.tp.set_group(tp_group)

    def _weights(self) -> List[torch.Tensor]:
        return [getattr(self, f"weight{i}") for i in range(self.num_gemms)]

    def _biases(self) -> List[Optional[torch.Tensor]]:
        return [getattr(self, f"bias{i}") for i in range(self.num_gemms)]

    _fp8_meta_by_kind = True  # `fp8_meta`: every GEMM's input, then every weight, ... as in TE

    def _fp8_gemm_states(self):
        return list(self.fp8)

    def forward(
        self,
        inp: torch.Tensor,
        m_splits: Union[Sequence[int], torch.Tensor],
        is_first_microbatch: Optional[bool] = None,
        out: Optional[torch.Tensor] = None,
        dgrad_out: Optional[torch.Tensor] = None,
    ) -> Union[torch.Tensor, Tuple[torch.Tensor, List[Optional[torch.Tensor]]]]:
        """GEMM `i` on the i-th block of `m_splits[i]` rows of `inp` (`[..., in_features]`, its leading
        dimensions flattened into rows, as in TransformerEngine); the output has `inp`'s leading dimensions.

        Args:
            m_splits: rows per GEMM (a list of ints or a 1-D tensor), non-negative, summing to the rows. A GEMM
                with no rows still runs (its output block is empty, its gradients zero), so the amax layout
                does not depend on the split.
            is_first_microbatch: True casts every weight to FP8 and caches the casts, False reuses them
                (gradient accumulation), None casts on every call.
            out, dgrad_out: TransformerEngine's preallocated output buffers: only None.

        Returns:
            the output, or `(output, [bias0, ...])` with `return_bias`.

        Raises:
            ValueError: `m_splits` of the wrong length, negative, or not summing to the rows (naming both);
                an input whose last dimension is not `in_features`.
            NotImplementedError: `out` / `dgrad_out` given.
        """
        for label, buffer in (("out", out), ("dgrad_out", dgrad_out)):
            if buffer is not None:
                raise NotImplementedError(f"GroupedLinear.forward({label}=...): preallocated buffers are not "
                                          f"implemented; leave {label}=None (the result is a new tensor)")
        check_materialized("GroupedLinear", self.fp8[0].fwd.scale)
        check_input("GroupedLinear", inp, self.in_features,
                    "in_features/tp_size" if self.tp.mode == "row" and self.tp.size > 1 else "in_features")
        inp = in_autocast_dtype(inp)
        x = inp.reshape(-1, inp.shape[-1])
        rows = "" if inp.dim() == 2 else f" (the input of shape {tuple(inp.shape)} flattened to [-1, {inp.shape[-1]}])"
        splits = check_splits("GroupedLinear", m_splits, self.num_gemms, x.shape[0], rows)
        biases = [None] * self.num_gemms if self.return_bias else self._biases()
        weights = self._weights()
        into = [accumulates_into_main_grad(w, self.fuse_wgrad_accumulation, "GroupedLinear", f"weight{i}")
                for i, w in enumerate(weights)]
        stores = [self._wgrad_store(f"weight{i}") for i in range(self.num_gemms)]
        y = grouped_fp8_linear(x, splits, weights, biases, self.fp8, is_first_microbatch, wgrad_stores=stores,
                               grouped_gemm=self.use_grouped_gemm, into_main_grad=into)
        y = y.reshape(*inp.shape[:-1], y.shape[-1])
        if self.return_bias:
            return y, [None if b is None else b.to(y.dtype) for b in self._biases()]
        return y

    def extra_repr(self) -> str:
        tp = f", parallel_mode={self.tp.mode}, tp_size={self.tp.size}" if self.tp.mode else ""
        return (f"num_gemms={self.num_gemms}, in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.use_bias}{tp}")
