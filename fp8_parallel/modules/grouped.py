"""Grouped FP8 expert linears and `FP8GroupedMLP`, usable as megatron's MoE `experts` submodule.

`GroupedLinear` holds one weight (and one FP8 state) per local expert and applies expert `i` to the i-th
block of rows of its input (`m_splits`, the token counts the dispatcher produced). Each expert keeps its own
amaxes and scales: experts see different tokens. As megatron's expert layers ("explicit expert
communication"), these layers communicate nothing themselves: the token dispatcher gathers and combines.
With expert-TP, fc1 is split along its output and fc2 along its input.

The amax layout of a scope depends on the model only, never on routing: every expert runs its FP8 linear
every step, also with no tokens (its input and grad_output amaxes are then 0, which leaves their histories
unrolled), so all ranks of an expert amax domain register the same slots in the same order.

The per-expert compute is `_grouped_core`'s, shared with TransformerEngine's `GroupedLinear`
(`fp8_parallel.GroupedLinear`, `te_grouped_linear.py`, which imports no megatron-core).
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch
from ..startup import import_megatron_core

import_megatron_core()  # megatron-core without torch's compiler (see startup.py), before its imports below
from megatron.core.transformer.module import MegatronModule

from ..expert_scope import experts_reduce_over_dense_dp, expert_scope
from ._core import history_len_of
from ._grouped_core import check_splits, expert_states, grouped_fp8_linear
from ._main_grad import accumulates_into_main_grad
from .parallel_linear import _first_microbatch


class GroupedLinear(torch.nn.Module):
    """`num_gemms` FP8 linears over consecutive row blocks of one input, with a megatron-style signature (a
    `TransformerConfig`, megatron's RNG and `is_first_microbatch` protocol). TransformerEngine's signature is
    `fp8_parallel.GroupedLinear`; both run the same per-expert FP8 compute.

    Args:
        num_gemms: local experts.
        input_size, output_size: full (unpartitioned) sizes of one expert's linear.
        partition: "column" (split the output over expert-TP) or "row" (split the input).
        config: megatron TransformerConfig (params dtype, fp8_wgrad, init).
        init_method: weight initialisation, drawn from megatron's expert-parallel RNG stream.
        bias: one bias per expert.

    `fuse_wgrad_accumulation` (None: `config.gradient_accumulation_fusion`): each expert's weight gradient goes
    into its `main_grad` (megatron's `gradient_accumulation_fusion`; see `ColumnParallelLinear`), set by
    `fp8_parallel.megatron.fuse_wgrad_accumulation` as for the other linears.
    """

    fuse_wgrad_accumulation: Optional[bool] = None
    fused_wgrad_name: Optional[str] = None  # "<this module's name>.weight" in its model, for errors (set by the helper)

    def __init__(self, num_gemms: int, input_size: int, output_size: int, *, partition: str, config,
                 init_method, bias: bool = False, etp_size: int = 1):
        super().__init__()
        if partition not in ("column", "row"):
            raise ValueError(f"partition={partition!r}: expected 'column' or 'row'")
        self.num_gemms = num_gemms
        self.config = config
        out_p = output_size // etp_size if partition == "column" else output_size
        in_p = input_size // etp_size if partition == "row" else input_size
        device = None if config.use_cpu_initialization or not torch.cuda.is_available() else torch.cuda.current_device()
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, get_expert_parallel_rng_tracker_name

        dense = experts_reduce_over_dense_dp(config)
        for i in range(num_gemms):
            w = torch.nn.Parameter(torch.empty(out_p, in_p, dtype=config.params_dtype, device=device))
            if config.perform_initialization:
                with get_cuda_rng_tracker().fork(get_expert_parallel_rng_tracker_name()):
                    init_method(w)
            w.allreduce = dense  # see experts_reduce_over_dense_dp
            self.register_parameter(f"weight{i}", w)
            b = torch.nn.Parameter(torch.zeros(out_p, dtype=config.params_dtype, device=device)) if bias else None
            if b is not None:
                b.allreduce = dense
            self.register_parameter(f"bias{i}", b)
        # one FP8 state per expert GEMM; tags name the local index, identical on the expert's DP replicas
        self.fp8 = expert_states(num_gemms, f"GroupedLinear[{{i}}]({input_size},{output_size})", device,
                                 history_len_of(config))
        self.is_first_microbatch: Optional[bool] = None  # megatron's schedule sets True at a step's first microbatch

    def forward(self, x: torch.Tensor, m_splits: Sequence[int], is_first_microbatch: Optional[bool] = None) -> torch.Tensor:
        """Expert `i` on rows `sum(m_splits[:i]) : sum(m_splits[:i+1])` of `x: [tokens, in]`.

        `is_first_microbatch`: weight caching, as in `fp8_linear` (True casts and caches every expert's weight,
        False reuses the casts, None casts every call); when not given, megatron's protocol as for the parallel
        linears (its schedule sets the attribute at a step's first microbatch). An expert with no rows still runs
        (see the module docstring); its output block is empty and its weight gradient zero.
        """
        first = _first_microbatch(self, is_first_microbatch)
        splits = check_splits("GroupedLinear", m_splits, self.num_gemms, x.shape[0])
        n = self.num_gemms
        weights = [getattr(self, f"weight{i}") for i in range(n)]
        return grouped_fp8_linear(x, splits, weights, [getattr(self, f"bias{i}") for i in range(n)], self.fp8, first,
                                  getattr(self.config, "fp8_wgrad", True), grouped_gemm=True,
                                  into_main_grad=self._into_main_grad(weights))

    def _into_main_grad(self, weights) -> list:
        fuse = self.fuse_wgrad_accumulation
        if fuse is None:
            fuse = bool(getattr(self.config, "gradient_accumulation_fusion", False))
        name = self.fused_wgrad_name or "weight"  # "<module>.weight": expert i's is "<module>.weight<i>"
        return [accumulates_into_main_grad(w, fuse, type(self).__name__, f"{name}{i}") for i, w in enumerate(weights)]


class FP8GroupedMLP(MegatronModule):
    """MoE experts as two `GroupedLinear`s (megatron's experts interface), inside the expert amax scope."""

    def __init__(self, num_local_experts: int, config, submodules=None, pg_collection=None):  # noqa: ARG002
        super().__init__(config=config)
        self.num_local_experts = num_local_experts
        etp = pg_collection.expt_tp.size() if pg_collection is not None else 1
        ffn = config.moe_ffn_hidden_size * (2 if config.gated_linear_unit else 1)
        self.linear_fc1 = GroupedLinear(num_local_experts, config.hidden_size, ffn, partition="column",
                                        config=config, init_method=config.init_method,
                                        bias=config.add_bias_linear, etp_size=etp)
        self.linear_fc2 = GroupedLinear(num_local_experts, config.moe_ffn_hidden_size, config.hidden_size,
                                        partition="row", config=config, init_method=config.output_layer_init_method,
                                        bias=False, etp_size=etp)
        self.activation_func = config.activation_func

    def forward(self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor,
                permuted_probs: torch.Tensor) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        splits = tokens_per_expert.tolist() if torch.is_tensor(tokens_per_expert) else list(tokens_per_expert)
        with expert_scope():
            h = self.linear_fc1(permuted_local_hidden_states, splits)
            if self.config.gated_linear_unit:
                a, b = torch.chunk(h, 2, dim=-1)
                h = self.activation_func(a) * b
            else:
                h = self.activation_func(h)
            h = (h * permuted_probs.unsqueeze(-1)).to(h.dtype)
            out = self.linear_fc2(h, splits)
        return out, None

