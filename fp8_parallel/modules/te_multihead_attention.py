"""TransformerEngine's `MultiheadAttention` (QKV projection, core attention, output projection) under its name
and signature, composed of this package's `Linear` / `LayerNormLinear` (FP8 GEMMs inside an enabled autocast
scope) and `DotProductAttention` (high precision, torch SDPA).

    mha = MultiheadAttention(256, 8, num_gqa_groups=2, input_layernorm=True, fuse_qkv_params=True)
    out = mha(x)   # x [s, b, 256] -> [s, b, 256]

Semantics and parameter names follow TransformerEngine 2.8 (`transformer_engine/pytorch/attention/
multi_head_attention.py`, `attention/rope.py`, `module/linear.py`):

* Self-attention projects with `layernorm_qkv` (`input_layernorm=True`) or `qkv`; cross-attention with
  `layernorm_query` / `query_layer` for the queries and `key_value` for the keys and values (from
  `encoder_output`). The output projection is `proj`.
* `fuse_qkv_params=True`: one `weight` / `bias` per projection. Its rows are grouped per key/value head
  (`qkv_weight_interleaved=True`: for each GQA group its query heads, then its key head, then its value head;
  cross-attention: each group's key head, then its value head) or concatenated (`[queries; keys; values]`).
  `fuse_qkv_params=False` (TransformerEngine's default): separate `query_weight`, `key_weight`,
  `value_weight` (and `*_bias`) parameters, concatenated in that order (the interleaving flag is then off, as
  in TransformerEngine); the FP8 cast still sees one weight (one scale), as TransformerEngine's split
  parameters do. With tensor parallelism each part is split over the ranks separately.
* `rotary_pos_emb`: TransformerEngine's convention, frequencies `[s, 1, 1, d_rot]` (or a pair for queries and
  keys), `x * cos + rotate_half(x) * sin` on the first `d_rot` channels of each head (`rotary_pos_interleaved`:
  pairs of neighbouring channels), cos and sin taken in float32 and cast to the activations' dtype.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch
import torch.distributed as dist

from ..ops import L2Normalization
from ._deferred_init import no_init, record_init, recorded_inits
from ._main_grad import weight_for_gemm
from ._te_options import check_te_options, resolve_device
from .linear import Linear
from .te_attention import DotProductAttention
from .te_layernorm_linear import LayerNormLinear
from .te_norm import LayerNorm, RMSNorm

__all__ = ["MultiheadAttention", "apply_rotary_pos_emb"]

_MHA_OPTIONS = ("fuse_wgrad_accumulation", "ub_overlap_ag", "ub_overlap_rs", "ub_overlap_rs_dgrad", "ub_bulk_dgrad",
                "ub_bulk_wgrad", "seq_length", "micro_batch_size")
QK_NORM_TYPES = (None, "L2Normalization", "RMSNorm", "LayerNorm")


def _rotate_half(x: torch.Tensor, interleaved: bool) -> torch.Tensor:
    if not interleaved:
        first, second = x.chunk(2, dim=-1)
        return torch.cat((-second, first), dim=-1)
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack((-odd, even), dim=-1).flatten(-2)


def apply_rotary_pos_emb(t: torch.Tensor, freqs: torch.Tensor, tensor_format: str = "sbhd",
                         interleaved: bool = False) -> torch.Tensor:
    """TransformerEngine's rotary position embedding on `t` (`[s, b, h, d]` for "sbhd", `[b, s, h, d]` for
    "bshd"): `freqs` is `[s2, 1, 1, d2]` (float), `s2 >= s`, `d2 <= d`; the first `d2` channels become
    `t * cos(freqs) + rotate_half(t) * sin(freqs)` (cos / sin in `freqs`' precision, then cast to `t`'s dtype),
    the rest pass through. `rotate_half` maps halves `(a, b)` to `(-b, a)` or, `interleaved`, channel pairs
    `(a, b)` to `(-b, a)`."""
    if tensor_format not in ("sbhd", "bshd"):
        raise NotImplementedError(f"apply_rotary_pos_emb: tensor_format={tensor_format!r}; only 'sbhd' and 'bshd' "
                                  f"(packed 'thd' sequences with rotary embeddings are not implemented)")
    if freqs.dim() != 4 or freqs.shape[1] != 1 or freqs.shape[2] != 1:
        raise ValueError(f"apply_rotary_pos_emb: freqs of shape {tuple(freqs.shape)}; expected [s, 1, 1, d]")
    seq = t.shape[1] if tensor_format == "bshd" else t.shape[0]
    rot = freqs.shape[-1]
    if freqs.shape[0] < seq or rot > t.shape[-1] or rot % 2:
        raise ValueError(f"apply_rotary_pos_emb: freqs {tuple(freqs.shape)} does not cover a sequence of {seq} "
                         f"and an even number of at most {t.shape[-1]} channels")
    freqs = freqs[:seq]
    if tensor_format == "bshd":
        freqs = freqs.transpose(0, 1)
    cos, sin = torch.cos(freqs).to(t.dtype), torch.sin(freqs).to(t.dtype)
    head, rest = t[..., :rot], t[..., rot:]
    return torch.cat((head * cos + _rotate_half(head, interleaved) * sin, rest), dim=-1)


class _SplitParameters:
    """Mixin for `Linear` / `LayerNormLinear`: TransformerEngine's `parameters_split`. The weight and bias the
    base class made (this rank's rows, initialized) become one parameter per part, `{part}_weight` /
    `{part}_bias`; `weight` / `bias` read as their concatenation, so the base class's forward (one FP8 cast of
    the whole weight, as TransformerEngine's) runs unchanged. Assigning a whole `weight` (or `bias`) Parameter
    after construction, as TransformerEngine's quickstart does to share a plain model's QKV projection, makes
    that Parameter the module's own and drops the parts of that kind."""

    def _split(self, parts: Dict[str, int]) -> None:
        weight, bias = self._parameters.pop("weight"), self._parameters.pop("bias")
        inits = recorded_inits(self)
        self._whole_weight_init, bias_init = inits.pop("weight"), inits.pop("bias", None)
        self._whole_bias_init = bias_init
        tp = self.tp.size if self.tp.mode == "column" else 1
        self._parts: List[str] = list(parts)
        start = 0
        for part, size in parts.items():
            local = size // tp
            w = torch.nn.Parameter(weight.detach()[start:start + local].clone())
            for attr in ("tensor_model_parallel", "partition_dim", "partition_stride"):
                if hasattr(weight, attr):
                    setattr(w, attr, getattr(weight, attr))
            self.register_parameter(f"{part}_weight", w)
            record_init(self, f"{part}_weight", no_init)  # drawn as one weight by `reset_parameters`
            if bias is not None:
                b = torch.nn.Parameter(bias.detach()[start:start + local].clone())
                for attr in ("tensor_model_parallel", "partition_dim", "partition_stride"):
                    if hasattr(bias, attr):
                        setattr(b, attr, getattr(bias, attr))
                self.register_parameter(f"{part}_bias", b)
                record_init(self, f"{part}_bias", bias_init)
            else:
                self.register_parameter(f"{part}_bias", None)
            start += local

    def reset_parameters(self, defer_init: Optional[bool] = False) -> None:
        """As the base class's, the parts' weights drawn as one weight and split, as the constructor did (the
        same values for the same seed on any device)."""
        super().reset_parameters(defer_init)
        if defer_init or "weight" in self._parameters:  # (a whole weight assigned: initialized as recorded)
            return
        parts = [self._parameters[f"{part}_weight"] for part in self._parts]
        whole = torch.empty(sum(p.shape[0] for p in parts), *parts[0].shape[1:], dtype=parts[0].dtype,
                            device=parts[0].device)
        self._whole_weight_init(whole)
        with torch.no_grad():
            for p, rows in zip(parts, whole.split([p.shape[0] for p in parts])):
                p.copy_(rows)

    def _joined(self, kind: str) -> Optional[torch.Tensor]:
        if kind in self._parameters:  # during the base class's constructor, or a whole one assigned since
            return self._parameters[kind]
        tensors = [self._parameters[f"{part}_{kind}"] for part in self._parts]
        if tensors[0] is None:
            return None
        return tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim=0)

    @property
    def weight(self) -> torch.Tensor:  # type: ignore[override]
        return self._joined("weight")

    def gemm_weight(self) -> Tuple[torch.Tensor, bool]:
        """The joined weight, each part's gradient into its own `main_grad` with `fuse_wgrad_accumulation`
        (added by the parts' views, not by the GEMM)."""
        owner = self._public_name()
        if "weight" in self._parameters:  # a whole weight assigned
            return weight_for_gemm(self._parameters["weight"], self.fuse_wgrad_accumulation, owner, "weight"), False
        parts = [weight_for_gemm(self._parameters[f"{part}_weight"], self.fuse_wgrad_accumulation, owner,
                                 f"{part}_weight") for part in self._parts]
        return (parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)), False

    @weight.setter
    def weight(self, value: Optional[torch.nn.Parameter]) -> None:
        self._assign_whole("weight", value)

    def _public_name(self) -> str:
        return next(c.__name__ for c in type(self).__mro__ if not c.__name__.startswith("_"))

    def __setattr__(self, name: str, value: Any) -> None:
        if name in ("weight", "bias") and "_parts" in self.__dict__:  # (torch's would refuse: the name exists)
            self._assign_whole(name, value)
        else:
            super().__setattr__(name, value)

    def _assign_whole(self, kind: str, value: Optional[torch.nn.Parameter]) -> None:
        """`weight` / `bias` set as one Parameter: during the base class's constructor, or replacing the parts."""
        if "_parts" not in self.__dict__:  # the base class's constructor
            self._parameters[kind] = value
            return
        if value is not None and not isinstance(value, torch.nn.Parameter):
            raise TypeError(f"cannot assign {torch.typename(value)} as parameter '{kind}' of {self._public_name()} "
                            "(torch.nn.Parameter or None expected)")
        current = self._joined(kind)
        if value is not None and current is not None and value.shape != current.shape:
            raise ValueError(f"{self._public_name()}.{kind}: assigned shape {tuple(value.shape)}, the module's "
                             f"{kind} (its {'/'.join(self._parts)} parts joined) is {tuple(current.shape)}")
        inits = recorded_inits(self)
        for part in self._parts:
            self._parameters.pop(f"{part}_{kind}", None)
            inits.pop(f"{part}_{kind}", None)
        self._parameters[kind] = value
        init = self._whole_weight_init if kind == "weight" else self._whole_bias_init
        if value is not None and init is not None:
            record_init(self, kind, init)

    @property
    def bias(self) -> Optional[torch.Tensor]:  # type: ignore[override]
        return self._joined("bias")

    @bias.setter
    def bias(self, value: Optional[torch.nn.Parameter]) -> None:  # also the base class's `bias = None`
        self._assign_whole("bias", value)


class _SplitLinear(_SplitParameters, Linear):
    def __init__(self, in_features: int, parts: Dict[str, int], **kwargs: Any):
        super().__init__(in_features, sum(parts.values()), **kwargs)
        self._split(parts)


class _SplitLayerNormLinear(_SplitParameters, LayerNormLinear):
    def __init__(self, in_features: int, parts: Dict[str, int], eps: float, **kwargs: Any):
        super().__init__(in_features, sum(parts.values()), eps, **kwargs)
        self._split(parts)


def _projection(input_layernorm: bool, in_features: int, parts: Optional[Dict[str, int]], out_features: int,
                eps: float, norm_kwargs: Dict[str, Any], kwargs: Dict[str, Any]) -> torch.nn.Module:
    """`LayerNormLinear` or `Linear`, with TransformerEngine's split parameters when `parts` is given."""
    if input_layernorm:
        if parts is not None:
            return _SplitLayerNormLinear(in_features, parts, eps, **norm_kwargs, **kwargs)
        return LayerNormLinear(in_features, out_features, eps, **norm_kwargs, **kwargs)
    if parts is not None:
        return _SplitLinear(in_features, parts, **kwargs)
    return Linear(in_features, out_features, **kwargs)


class MultiheadAttention(torch.nn.Module):
    """TransformerEngine's `MultiheadAttention`: QKV projection (optionally after a norm), rotary embedding,
    `DotProductAttention`, output projection. The projections run in FP8 inside an enabled autocast scope;
    the norm, the rotary embedding and the attention in high precision.

    Args:
        hidden_size, num_attention_heads: model width and query heads.
        kv_channels: head size; default `hidden_size // num_attention_heads`.
        attention_dropout: dropout of the attention weights (training mode only).
        layernorm_epsilon: the input norm's epsilon.
        init_method, output_layer_init_method: initialize the QKV / `proj` weights (default normal(0, 0.023)).
        layer_number: accepted (passed to the core attention).
        attn_mask_type, window_size: the default mask type and sliding window (see `DotProductAttention`);
            `forward` may override both.
        tp_group, tp_size, set_parallel_mode, sequence_parallel: tensor parallelism as in TransformerEngine:
            with `set_parallel_mode=True` the QKV projection is column-parallel (each rank holds
            `heads / tp_size` query heads and `num_gqa_groups / tp_size` key/value heads) and `proj`
            row-parallel. More than one TP rank without `set_parallel_mode` is refused (TransformerEngine fails
            on the shapes there).
        num_gqa_groups: key/value heads (grouped-query attention); default `num_attention_heads`.
        get_rng_state_tracker: attention dropout runs in its fork; also used for the weight initialization.
        params_dtype, device: parameters' dtype and device (default `torch.get_default_dtype()`; CUDA when
            available, else the CPU).
        return_bias: do not add `proj`'s bias; return it.
        return_layernorm_output: with `input_layernorm`, also return the norm's output.
        input_layernorm: normalize the input before the QKV projection (`normalization`: "LayerNorm" or
            "RMSNorm"; `zero_centered_gamma`: the gain is `1 + weight`).
        attention_type: "self" or "cross" (keys and values from `forward`'s `encoder_output`).
        fuse_qkv_params, qkv_weight_interleaved: the QKV weight's parameters and layout (module docstring).
        rotary_pos_interleaved: the rotary embedding rotates neighbouring channel pairs.
        bias: the projections learn biases (zero-initialized).
        qkv_format: "sbhd", "bshd" or "thd" (packed; with `cu_seqlens_*` in `forward`).
        name: a label for the FP8 states.
        qk_norm_type, qk_norm_eps, qk_norm_before_rope: per-head normalization of queries and keys
            ("L2Normalization", "RMSNorm", "LayerNorm"; after the rotary embedding unless `qk_norm_before_rope`),
            as TransformerEngine (the norms' parameters `q_norm.weight`, `k_norm.weight` in the default dtype).
        softmax_type: "vanilla" only (sink attention is refused by `DotProductAttention`).
        ub_*, seq_length, micro_batch_size: TransformerEngine's optimization options, accepted at their
            defaults (the JIT hints at any value); other values raise NotImplementedError.
        fuse_wgrad_accumulation: every projection weight's gradient is added into its `main_grad`, as for
            `Linear`.

    Forward: `forward(hidden_states, attention_mask=None, encoder_output=None, ...)` returns the output
    (`[s, b, hidden_size]` in the input's format), or a tuple with `proj`'s bias (`return_bias`) and the norm's
    output (`return_layernorm_output`), in that order.
    """

    def __init__(
        self,
        hidden_size: int,
        num_attention_heads: int,
        kv_channels: Optional[int] = None,
        attention_dropout: float = 0.1,
        layernorm_epsilon: float = 1e-5,
        init_method: Optional[Callable] = None,
        output_layer_init_method: Optional[Callable] = None,
        layer_number: Optional[int] = None,
        attn_mask_type: str = "causal",
        window_size: Optional[Tuple[int, int]] = None,
        tp_group: Optional[dist.ProcessGroup] = None,
        tp_size: int = 1,
        num_gqa_groups: Optional[int] = None,
        fuse_wgrad_accumulation: bool = False,
        get_rng_state_tracker: Optional[Callable] = None,
        sequence_parallel: bool = False,
        params_dtype: Optional[torch.dtype] = None,
        return_bias: bool = False,
        return_layernorm_output: bool = False,
        input_layernorm: bool = False,
        attention_type: str = "self",
        set_parallel_mode: bool = False,
        fuse_qkv_params: bool = False,
        zero_centered_gamma: bool = False,
        qkv_weight_interleaved: bool = True,
        rotary_pos_interleaved: bool = False,
        ub_overlap_ag: bool = False,
        ub_overlap_rs: bool = False,
        ub_overlap_rs_dgrad: bool = False,
        ub_bulk_dgrad: bool = False,
        ub_bulk_wgrad: bool = False,
        bias: bool = True,
        normalization: str = "LayerNorm",
        device: Optional[Union[str, torch.device]] = None,
        qkv_format: str = "sbhd",
        name: Optional[str] = None,
        qk_norm_type: Optional[str] = None,
        qk_norm_eps: float = 1e-6,
        qk_norm_before_rope: bool = False,
        seq_length: Optional[int] = None,
        micro_batch_size: Optional[int] = None,
        softmax_type: str = "vanilla",
    ) -> None:
        super().__init__()
        check_te_options("MultiheadAttention", _MHA_OPTIONS, dict(
            fuse_wgrad_accumulation=fuse_wgrad_accumulation, ub_overlap_ag=ub_overlap_ag, ub_overlap_rs=ub_overlap_rs,
            ub_overlap_rs_dgrad=ub_overlap_rs_dgrad, ub_bulk_dgrad=ub_bulk_dgrad, ub_bulk_wgrad=ub_bulk_wgrad,
            seq_length=seq_length, micro_batch_size=micro_batch_size))
        if attention_type not in ("self", "cross"):
            raise ValueError(f"MultiheadAttention(attention_type={attention_type!r}): expected 'self' or 'cross'")
        if qkv_format not in ("sbhd", "bshd", "thd"):
            raise ValueError(f"MultiheadAttention(qkv_format={qkv_format!r}): expected 'sbhd', 'bshd' or 'thd'")
        if qk_norm_type not in QK_NORM_TYPES:
            raise ValueError(f"MultiheadAttention(qk_norm_type={qk_norm_type!r}): expected one of {QK_NORM_TYPES}")
        if layer_number is not None and layer_number <= 0:
            raise ValueError(f"MultiheadAttention(layer_number={layer_number!r}): expected a positive integer")
        if tp_group is not None:
            if not isinstance(tp_group, dist.ProcessGroup):
                raise TypeError(f"MultiheadAttention(tp_group={tp_group!r}): expected a ProcessGroup or None")
            tp_size = dist.get_world_size(tp_group)
        if tp_size > 1 and not set_parallel_mode:
            raise ValueError(f"MultiheadAttention(tp_size={tp_size}, set_parallel_mode=False): the heads are split "
                             f"over tensor-parallel ranks only with set_parallel_mode=True (column-parallel QKV, "
                             f"row-parallel proj)")
        self.hidden_size, self.num_attention_heads = hidden_size, num_attention_heads
        self.num_gqa_groups = num_attention_heads if num_gqa_groups is None else num_gqa_groups
        if num_attention_heads % self.num_gqa_groups:
            raise ValueError(f"MultiheadAttention: {num_attention_heads} attention heads are not divisible by "
                             f"num_gqa_groups={self.num_gqa_groups}")
        if num_attention_heads % tp_size or self.num_gqa_groups % tp_size:
            raise ValueError(f"MultiheadAttention: {num_attention_heads} heads / {self.num_gqa_groups} GQA groups "
                             f"do not divide over tensor-parallel size {tp_size}")
        self.kv_channels = kv_channels if kv_channels else hidden_size // num_attention_heads
        self.tp_size = tp_size
        self.sequence_parallel = tp_size > 1 and bool(sequence_parallel)
        self.heads_per_partition = num_attention_heads // tp_size
        self.groups_per_partition = self.num_gqa_groups // tp_size
        self.attention_type, self.input_layernorm = attention_type, bool(input_layernorm)
        self.return_bias, self.return_layernorm_output = bool(return_bias), bool(return_layernorm_output)
        self.fuse_qkv_params = bool(fuse_qkv_params)
        self.qkv_weight_interleaved = bool(qkv_weight_interleaved) and self.fuse_qkv_params
        self.rotary_pos_interleaved, self.qk_norm_before_rope = bool(rotary_pos_interleaved), bool(qk_norm_before_rope)
        self.qkv_format, self.attn_mask_type, self.window_size = qkv_format, attn_mask_type, window_size
        self.layer_number = 1 if layer_number is None else layer_number
        self.name = name
        self.cp_size, self.cp_rank = 1, 0
        hq, hkv = self.kv_channels * num_attention_heads, self.kv_channels * self.num_gqa_groups
        self.hidden_size_q, self.hidden_size_kv = hq, hkv

        label = name or f"MultiheadAttention({hidden_size},{num_attention_heads})"
        common = dict(tp_group=tp_group, tp_size=tp_size, get_rng_state_tracker=get_rng_state_tracker,
                      sequence_parallel=sequence_parallel, params_dtype=params_dtype, device=device, bias=bias,
                      fuse_wgrad_accumulation=fuse_wgrad_accumulation)
        qkv_kwargs = dict(common, init_method=init_method, parallel_mode="column" if set_parallel_mode else None)
        norm_kwargs = dict(normalization=normalization, zero_centered_gamma=zero_centered_gamma,
                           return_layernorm_output=return_layernorm_output)
        fused = self.fuse_qkv_params
        self.q_norm, self.k_norm = self._qk_norms(qk_norm_type, qk_norm_eps, device)  # first, as in TE
        if attention_type == "self":
            parts = None if fused else {"query": hq, "key": hkv, "value": hkv}
            module = _projection(self.input_layernorm, hidden_size, parts, hq + 2 * hkv, layernorm_epsilon,
                                 norm_kwargs, dict(qkv_kwargs, name=f"{label}.qkv"))
            setattr(self, "layernorm_qkv" if self.input_layernorm else "qkv", module)
        else:
            if self.input_layernorm:
                self.layernorm_query = _projection(True, hidden_size, None if fused else {"query": hq}, hq,
                                                   layernorm_epsilon, norm_kwargs,
                                                   dict(qkv_kwargs, name=f"{label}.query"))
            else:  # TransformerEngine gives this one no split names
                self.query_layer = Linear(hidden_size, hq, **qkv_kwargs, name=f"{label}.query")
            self.key_value = _projection(False, hidden_size, None if fused else {"key": hkv, "value": hkv}, 2 * hkv,
                                         layernorm_epsilon, {}, dict(qkv_kwargs, name=f"{label}.kv"))
        self.core_attention = DotProductAttention(
            num_attention_heads, self.kv_channels, num_gqa_groups=self.num_gqa_groups,
            attention_dropout=attention_dropout, qkv_format=qkv_format, tp_size=tp_size,
            get_rng_state_tracker=get_rng_state_tracker, sequence_parallel=sequence_parallel, tp_group=tp_group,
            layer_number=self.layer_number, attention_type=attention_type, softmax_type=softmax_type)
        self.proj = Linear(hq, hidden_size, **common, init_method=output_layer_init_method, return_bias=return_bias,
                           parallel_mode="row" if set_parallel_mode else None, name=f"{label}.proj")

    def _qk_norms(self, kind: Optional[str], eps: float, device) -> Tuple[Optional[torch.nn.Module], ...]:
        if kind is None:
            return None, None
        if kind == "L2Normalization":
            norm = L2Normalization(eps)
            return norm, norm  # parameter-free: one instance, as in TransformerEngine
        cls = RMSNorm if kind == "RMSNorm" else LayerNorm
        device = resolve_device(device)
        return cls(self.kv_channels, eps=eps, device=device), cls(self.kv_channels, eps=eps, device=device)

    def set_tensor_parallel_group(self, tp_group: Optional[dist.ProcessGroup]) -> None:
        """Set the tensor-parallel group of every projection (TransformerEngine's method), for a module built
        with `tp_size` only."""
        for child in self.modules():
            if child is not self and hasattr(child, "set_tensor_parallel_group"):
                child.set_tensor_parallel_group(tp_group)
        self.core_attention.tp_group = tp_group

    def set_context_parallel_group(self, cp_group: Optional[dist.ProcessGroup], cp_global_ranks: Optional[List[int]],
                                   cp_stream: Any, cp_comm_type: str = "p2p") -> None:
        """Context parallelism of the core attention (`DotProductAttention.set_context_parallel_group` says
        what is implemented). Rotary embeddings under context parallelism are refused in `forward`."""
        self.core_attention.set_context_parallel_group(cp_group, cp_global_ranks, cp_stream, cp_comm_type)
        self.cp_size = 1 if cp_group is None else dist.get_world_size(cp_group)
        self.cp_rank = 0 if cp_group is None else dist.get_rank(cp_group)

    def _heads(self, x: torch.Tensor, heads: int) -> torch.Tensor:
        if self.qkv_format == "thd":
            return x.reshape(x.shape[0], heads, self.kv_channels)
        return x.reshape(x.shape[0], x.shape[1], heads, self.kv_channels)

    def _self_qkv(self, mixed: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        per_group = self.heads_per_partition // self.groups_per_partition
        ng, hn, lead = self.groups_per_partition, self.kv_channels, mixed.shape[:-1]
        if self.qkv_weight_interleaved:  # [..., ng, per_group + 2, hn]
            mixed = mixed.view(*lead, ng, per_group + 2, hn)
            q, k, v = mixed.split((per_group, 1, 1), dim=-2)
        else:  # [..., per_group + 2, ng, hn]
            mixed = mixed.view(*lead, per_group + 2, ng, hn)
            q, k, v = mixed.split((per_group, 1, 1), dim=-3)
        return tuple(t.reshape(*lead, -1, hn) for t in (q, k, v))

    def _cross_kv(self, mixed: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        ng, hn, lead = self.groups_per_partition, self.kv_channels, mixed.shape[:-1]
        if self.qkv_weight_interleaved:  # [..., ng, 2 * hn]
            k, v = mixed.view(*lead, ng, 2 * hn).split(hn, dim=-1)
        else:  # [..., 2 * ng, hn]
            k, v = mixed.view(*lead, 2 * ng, hn).split(ng, dim=-2)
        return k.reshape(*lead, ng, hn), v.reshape(*lead, ng, hn)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: Optional[Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]] = None,
        encoder_output: Optional[torch.Tensor] = None,
        attn_mask_type: Optional[str] = None,
        window_size: Optional[Tuple[int, int]] = None,
        is_first_microbatch: Optional[bool] = None,
        checkpoint_core_attention: bool = False,
        inference_params: Optional[Any] = None,
        rotary_pos_emb: Optional[Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]] = None,
        core_attention_bias_type: str = "no_bias",
        core_attention_bias: Optional[torch.Tensor] = None,
        alibi_slopes: Optional[torch.Tensor] = None,
        cu_seqlens_q: Optional[torch.Tensor] = None,
        cu_seqlens_kv: Optional[torch.Tensor] = None,
        cu_seqlens_q_padded: Optional[torch.Tensor] = None,
        cu_seqlens_kv_padded: Optional[torch.Tensor] = None,
        max_seqlen_q: Optional[int] = None,
        max_seqlen_kv: Optional[int] = None,
        fast_zero_fill: bool = True,
        pad_between_seqs: Optional[bool] = None,
    ) -> Union[torch.Tensor, Tuple[torch.Tensor, ...]]:
        """Projections, rotary embedding, attention, output projection (see the class docstring).

        `attention_mask`: boolean, True = masked out; for padding masks `[b, 1, 1, s]` (self-attention) or a
        pair `([b, 1, 1, sq], [b, 1, 1, skv])` (cross-attention); for "arbitrary" broadcastable to
        `[b, h, sq, skv]`. Masks, windows, `cu_seqlens_*`, `max_seqlen_*`, `checkpoint_core_attention` and the
        bias / ALiBi arguments go to `DotProductAttention` (which refuses biases and ALiBi).

        Raises:
            NotImplementedError: `inference_params` (KV cache), a rotary embedding with the "thd" format or
                under context parallelism, and what `DotProductAttention` refuses.
            ValueError: cross-attention without `encoder_output`.
        """
        if inference_params is not None:
            raise NotImplementedError("MultiheadAttention: inference_params is not supported (the KV cache for "
                                      "inference is not implemented)")
        if attn_mask_type is None:
            attn_mask_type = self.attn_mask_type
        if window_size is None:
            window_size = self.window_size
        layernorm_output = None
        if self.attention_type == "self":
            if self.input_layernorm:
                out = self.layernorm_qkv(hidden_states, is_first_microbatch=is_first_microbatch)
                mixed, layernorm_output = out if self.return_layernorm_output else (out, None)
            else:
                mixed = self.qkv(hidden_states, is_first_microbatch=is_first_microbatch)
            query, key, value = self._self_qkv(mixed)
        else:
            if encoder_output is None:
                raise ValueError("MultiheadAttention(attention_type='cross'): forward needs encoder_output")
            key, value = self._cross_kv(self.key_value(encoder_output, is_first_microbatch=is_first_microbatch))
            if self.input_layernorm:
                out = self.layernorm_query(hidden_states, is_first_microbatch=is_first_microbatch)
                query, layernorm_output = out if self.return_layernorm_output else (out, None)
            else:
                query = self.query_layer(hidden_states, is_first_microbatch=is_first_microbatch)
            query = self._heads(query, self.heads_per_partition)

        if self.q_norm is not None and self.qk_norm_before_rope:
            query, key = self.q_norm(query), self.k_norm(key)
        if rotary_pos_emb is not None:
            if self.qkv_format == "thd":
                raise NotImplementedError("MultiheadAttention: rotary_pos_emb with qkv_format='thd' is not "
                                          "implemented; use 'sbhd' or 'bshd'")
            if self.cp_size > 1:
                raise NotImplementedError("MultiheadAttention: rotary_pos_emb under context parallelism is not "
                                          "implemented")
            q_freqs, k_freqs = rotary_pos_emb if isinstance(rotary_pos_emb, tuple) else (rotary_pos_emb,) * 2
            query = apply_rotary_pos_emb(query, q_freqs, self.qkv_format, self.rotary_pos_interleaved)
            key = apply_rotary_pos_emb(key, k_freqs, self.qkv_format, self.rotary_pos_interleaved)
        if self.q_norm is not None and not self.qk_norm_before_rope:
            query, key = self.q_norm(query), self.k_norm(key)

        context = self.core_attention(
            query, key, value, attention_mask=attention_mask, qkv_format=self.qkv_format,
            cu_seqlens_q=cu_seqlens_q, cu_seqlens_kv=cu_seqlens_kv, cu_seqlens_q_padded=cu_seqlens_q_padded,
            cu_seqlens_kv_padded=cu_seqlens_kv_padded, max_seqlen_q=max_seqlen_q, max_seqlen_kv=max_seqlen_kv,
            attn_mask_type=attn_mask_type, window_size=window_size,
            checkpoint_core_attention=checkpoint_core_attention, core_attention_bias_type=core_attention_bias_type,
            core_attention_bias=core_attention_bias, alibi_slopes=alibi_slopes, fast_zero_fill=fast_zero_fill,
            pad_between_seqs=pad_between_seqs)
        out = self.proj(context, is_first_microbatch=is_first_microbatch)
        outputs = tuple(out) if self.return_bias else (out,)
        if self.input_layernorm and self.return_layernorm_output:
            outputs += (layernorm_output,)
        return outputs if len(outputs) > 1 else outputs[0]

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, num_attention_heads={self.num_attention_heads}, "
                f"num_gqa_groups={self.num_gqa_groups}, kv_channels={self.kv_channels}, "
                f"attention_type={self.attention_type}, input_layernorm={self.input_layernorm}, "
                f"fuse_qkv_params={self.fuse_qkv_params}, qkv_format={self.qkv_format}")
