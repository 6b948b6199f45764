"""TransformerEngine's core attention module, `DotProductAttention`, on torch's `scaled_dot_product_attention`.

    attention = DotProductAttention(16, 64, num_gqa_groups=4, attn_mask_type="causal")
    out = attention(q, k, v)   # q [s, b, 16, 64], k / v [s, b, 4, 64] -> [s, b, 16 * 64]

High precision, in the inputs' dtype (TransformerEngine's default: FP8 attention needs `fp8_dpa=True`, which
our recipes refuse). Imports no megatron-core. TransformerEngine's conventions, as its
`attention/dot_product_attention` sources define them:

* Formats: "sbhd" -> output `[s, b, h * d]`, "bshd" -> `[b, s, h * d]`, "thd" (packed sequences, with
  `cu_seqlens_q` / `cu_seqlens_kv`, optionally `cu_seqlens_*_padded`) -> `[t, h * d]`.
* Masks are boolean, True = masked out. "padding" types take `attention_mask` `[b, 1, 1, s]` (self-attention)
  or a pair `([b, 1, 1, sq], [b, 1, 1, skv])`, or `cu_seqlens_q` / `cu_seqlens_kv` (sequences padded at the
  end); "arbitrary" takes a mask broadcastable to `[b, h, sq, skv]`. Other types use no mask tensor
  (TransformerEngine documents the argument as unused for them). "causal" aligns the diagonal to the top left
  corner, "*_bottom_right" to the bottom right one (of each sequence's actual lengths for padding types).
* `window_size = (left, right)`: query `i` attends keys `i + off - left ... i + off + right` (`-1`:
  unbounded), `off` 0 (top-left) or `skv - sq` (bottom-right: `bottom_right_diagonal`, by default True except
  for "causal" / "padding_causal").
* A query that may attend to no key (a padded query, a window or bottom-right causal mask leaving it none)
  outputs zeros and passes no gradient, as padded queries do in TransformerEngine's unfused backend (it zeroes
  their attention weights); for such rows of other masks its backends differ (the unfused one spreads the row
  uniformly over all keys), so one rule is kept here.
"""
from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, List, Optional, Tuple, Union

import torch
import torch.distributed as dist

from ..te_checkpoint import checkpoint, resolve_rng_tracker
from ..tensor import Float8Tensor
from ._te_attention_core import (CP_COMM_TYPES, QKV_FORMATS, MaskInputs, PackedAttention, PaddedAttention, Spec,
                                 canonical_mask_type, checked_window, lengths_of, pad_from_lengths, padding_mask)

__all__ = ["DotProductAttention"]


def _refuse(name: str, value: Any, default: Any, why: str) -> None:
    if value is not default and value != default:
        raise NotImplementedError(f"DotProductAttention: {name}={value!r} is not supported ({why})")


def _group_size(group: Optional[dist.ProcessGroup]) -> int:
    return 1 if group is None else dist.get_world_size(group)


class DotProductAttention(torch.nn.Module):
    """TransformerEngine's `DotProductAttention`: softmax(scale * Q K^T + mask) V over per-head query, key and
    value tensors, on torch's `scaled_dot_product_attention`. It has no parameters.

    Args:
        num_attention_heads: query heads of the whole layer (each rank holds `num_attention_heads / tp_size`).
        kv_channels: head size of keys and values, or `(key head size, value head size)`.
        num_gqa_groups: key/value heads of the whole layer (grouped-query attention); default
            `num_attention_heads`.
        attention_dropout: dropout probability of the attention weights, in training mode only; inside
            `get_rng_state_tracker().fork()` when a tracker is given and `sequence_parallel` is False.
        qkv_format: "sbhd", "bshd" or "thd" (see the module docstring); `forward` may override it.
        attn_mask_type: "no_mask", "padding", "causal", "padding_causal" (also "padding,causal",
            "causal,padding"), "causal_bottom_right", "padding_causal_bottom_right" or "arbitrary";
            `forward` may override it.
        window_size: sliding window `(left, right)`, see the module docstring; `forward` may override it.
        bottom_right_diagonal: align the window's diagonal to the bottom right (True) or top left (False)
            corner; None: bottom right except for "causal" / "padding_causal". Causal mask types fix it.
        sequence_parallel: True runs dropout outside the tracker's fork (as TransformerEngine does).
        tp_size, tp_group: tensor parallelism divides the heads: `tp_group`'s size, else `tp_size`.
        get_rng_state_tracker: a callable returning an RNG states tracker (or the tracker itself).
        layer_number, name, cp_global_ranks, cp_stream: accepted; no effect on results.
        attention_type: "self" or "cross".
        cp_group, cp_comm_type: context parallelism (see `set_context_parallel_group`).
        softmax_scale: default `1 / sqrt(key head size)`.
        softmax_type: "vanilla" only (sink attention is not implemented).
        return_max_logit: False only.

    Raises:
        NotImplementedError: an option this module does not implement (named in the message).
        ValueError: heads that do not divide by the GQA groups or the TP size, an unknown mask type or
            format, an invalid window, dropout outside [0, 1).
    """

    def __init__(
        self,
        num_attention_heads: int,
        kv_channels: Union[int, Tuple[int, int]],
        num_gqa_groups: Optional[int] = None,
        attention_dropout: float = 0.0,
        qkv_format: str = "sbhd",
        attn_mask_type: str = "causal",
        window_size: Optional[Tuple[int, int]] = None,
        bottom_right_diagonal: Optional[bool] = None,
        sequence_parallel: bool = False,
        tp_size: int = 1,
        get_rng_state_tracker: Optional[Callable] = None,
        tp_group: Optional[dist.ProcessGroup] = None,
        layer_number: Optional[int] = None,
        attention_type: str = "self",
        cp_group: Optional[Union[dist.ProcessGroup, List[dist.ProcessGroup]]] = None,
        cp_global_ranks: Optional[List[int]] = None,
        cp_stream: Optional[Any] = None,
        cp_comm_type: str = "p2p",
        softmax_scale: Optional[float] = None,
        softmax_type: str = "vanilla",
        return_max_logit: Optional[bool] = False,
        name: Optional[str] = None,
    ) -> None:
        super().__init__()
        _refuse("softmax_type", softmax_type, "vanilla", "sink attention ('off-by-one', 'learnable') is not "
                "implemented")
        _refuse("return_max_logit", bool(return_max_logit), False, "the maximum attention logit is not tracked")
        if qkv_format not in QKV_FORMATS:
            raise ValueError(f"DotProductAttention: qkv_format={qkv_format!r}; expected one of {QKV_FORMATS}")
        if attention_type not in ("self", "cross"):
            raise ValueError(f"DotProductAttention: attention_type={attention_type!r}; expected 'self' or 'cross'")
        if not 0.0 <= float(attention_dropout) < 1.0:
            raise ValueError(f"DotProductAttention: attention_dropout={attention_dropout} is not in [0, 1)")
        self.qkv_format = qkv_format
        self.attn_mask_type = canonical_mask_type(attn_mask_type)
        checked_window(self.attn_mask_type, window_size)  # refuse a bad window now; kept as given
        self.window_size = None if window_size is None else tuple(window_size)
        self.bottom_right_diagonal = bottom_right_diagonal
        self.tp_group = tp_group
        self.tp_size = _group_size(tp_group) if tp_group is not None else int(tp_size)
        self.num_attention_heads = num_attention_heads
        self.num_gqa_groups = num_attention_heads if num_gqa_groups is None else num_gqa_groups
        if num_attention_heads % self.num_gqa_groups:
            raise ValueError(f"DotProductAttention: {num_attention_heads} attention heads are not divisible by "
                             f"{self.num_gqa_groups} GQA groups")
        if num_attention_heads % self.tp_size or self.num_gqa_groups % self.tp_size:
            raise ValueError(f"DotProductAttention: {num_attention_heads} heads / {self.num_gqa_groups} GQA "
                             f"groups do not divide over tensor-parallel size {self.tp_size}")
        self.num_heads_per_partition = num_attention_heads // self.tp_size
        self.num_gqa_groups_per_partition = self.num_gqa_groups // self.tp_size
        self.head_dim_k, self.head_dim_v = (
            (kv_channels, kv_channels) if isinstance(kv_channels, int) else (int(kv_channels[0]), int(kv_channels[1])))
        self.softmax_scale = (
            float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(self.head_dim_k))
        self.attention_dropout = float(attention_dropout)
        self.sequence_parallel = bool(sequence_parallel)
        self.get_rng_state_tracker = get_rng_state_tracker
        self.layer_number = 1 if layer_number is None else layer_number
        self.attention_type = attention_type
        self.name = name
        self.cp_group: Optional[dist.ProcessGroup] = None
        self.set_context_parallel_group(cp_group, cp_global_ranks, cp_stream, cp_comm_type)

    def set_context_parallel_group(
        self,
        cp_group: Optional[Union[dist.ProcessGroup, List[dist.ProcessGroup]]],
        cp_global_ranks: Optional[List[int]],
        cp_stream: Optional[Any],
        cp_comm_type: str = "p2p",
    ) -> None:
        """Context parallelism, as TransformerEngine sets it: each rank holds chunks `r` and `2 * cp - 1 - r` of
        `2 * cp` equal sequence chunks (TransformerEngine's and megatron's load-balanced layout); keys and
        values are all-gathered over `cp_group` (backward: one reduce-scatter) for "p2p" and "all_gather"
        alike (results are the same; TransformerEngine's ring exchange overlaps the communication, this one
        does not). Implemented for self-attention with "no_mask" or "causal" masks, no sliding window, and
        the "sbhd" / "bshd" formats; other combinations raise in `forward`.

        Raises:
            NotImplementedError: `cp_comm_type` "a2a" or "a2a+p2p", or a list of groups.
        """
        if isinstance(cp_group, (list, tuple)):
            raise NotImplementedError("DotProductAttention: cp_group as a list of groups (cp_comm_type "
                                      "'a2a+p2p') is not supported")
        if cp_group is not None and cp_comm_type not in CP_COMM_TYPES:
            raise NotImplementedError(f"DotProductAttention: cp_comm_type={cp_comm_type!r} is not supported; "
                                      f"context parallel runs as an all-gather of keys and values "
                                      f"({CP_COMM_TYPES})")
        self.cp_group = cp_group
        self.cp_global_ranks = cp_global_ranks
        self.cp_stream = cp_stream
        self.cp_comm_type = cp_comm_type

    def forward(  # noqa: C901
        self,
        query_layer: torch.Tensor,
        key_layer: torch.Tensor,
        value_layer: torch.Tensor,
        attention_mask: Optional[Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]] = None,
        qkv_format: Optional[str] = None,
        cu_seqlens_q: Optional[torch.Tensor] = None,
        cu_seqlens_kv: Optional[torch.Tensor] = None,
        cu_seqlens_q_padded: Optional[torch.Tensor] = None,
        cu_seqlens_kv_padded: Optional[torch.Tensor] = None,
        max_seqlen_q: Optional[int] = None,
        max_seqlen_kv: Optional[int] = None,
        attn_mask_type: Optional[str] = None,
        window_size: Optional[Tuple[int, int]] = None,
        bottom_right_diagonal: Optional[bool] = None,
        checkpoint_core_attention: bool = False,
        core_attention_bias_type: str = "no_bias",
        core_attention_bias: Optional[torch.Tensor] = None,
        alibi_slopes: Optional[torch.Tensor] = None,
        fast_zero_fill: bool = True,
        inference_params: Optional[Any] = None,
        pad_between_seqs: Optional[bool] = None,
        fp8_output: Optional[bool] = False,
        num_splits: Optional[int] = 1,
        score_mod: Optional[Callable] = None,
        score_mod_bprop: Optional[Callable] = None,
        score_mod_tensors: Optional[dict] = None,
        score_mod_bprop_tensors: Optional[dict] = None,
    ) -> torch.Tensor:
        """Attention of `query_layer` over `key_layer` / `value_layer`, in `qkv_format` (see the module
        docstring for layouts and masks).

        `checkpoint_core_attention=True` recomputes the attention in backward (`fp8_parallel.checkpoint`,
        reentrant, with the RNG tracker). `fast_zero_fill` and `num_splits` (kernel hints) and
        `pad_between_seqs` (inferred from `cu_seqlens_*_padded`) have no effect on results.

        Raises:
            NotImplementedError: `core_attention_bias_type` other than "no_bias" (or a `core_attention_bias`),
                `alibi_slopes`, `inference_params` (KV cache), `fp8_output=True`, `score_mod*`, FP8 inputs,
                context parallel beyond what `set_context_parallel_group` describes.
            ValueError / TypeError: shapes, masks or sequence lengths that do not fit.
        """
        _refuse("core_attention_bias_type", core_attention_bias_type, "no_bias", "attention biases and ALiBi "
                "are not implemented")
        flex = "cuDNN's flex-attention callbacks are not available"
        for arg, value, why in (("core_attention_bias", core_attention_bias, "attention biases are not implemented"),
                                ("alibi_slopes", alibi_slopes, "ALiBi is not implemented"),
                                ("inference_params", inference_params, "the KV cache is not implemented"),
                                ("score_mod", score_mod, flex), ("score_mod_bprop", score_mod_bprop, flex),
                                ("score_mod_tensors", score_mod_tensors, flex),
                                ("score_mod_bprop_tensors", score_mod_bprop_tensors, flex)):
            if value is not None:
                raise NotImplementedError(f"DotProductAttention: {arg} is not supported ({why})")
        _refuse("fp8_output", bool(fp8_output), False, "attention runs in high precision; the output is in the "
                "inputs' dtype")
        del fast_zero_fill, num_splits, pad_between_seqs  # kernel hints / inferred: no effect on results
        if any(isinstance(t, Float8Tensor) for t in (query_layer, key_layer, value_layer)):
            raise NotImplementedError("DotProductAttention: FP8 query/key/value tensors are not supported "
                                      "(attention runs in high precision)")

        fmt = self.qkv_format if qkv_format is None else qkv_format
        if fmt not in QKV_FORMATS:
            raise ValueError(f"DotProductAttention: qkv_format={fmt!r}; expected one of {QKV_FORMATS}")
        mask_type = self.attn_mask_type if attn_mask_type is None else canonical_mask_type(attn_mask_type)
        window = checked_window(mask_type, self.window_size if window_size is None else window_size)
        if bottom_right_diagonal is None:
            bottom_right_diagonal = self.bottom_right_diagonal
        if mask_type in ("causal", "padding_causal"):
            bottom_right_diagonal = False
        elif bottom_right_diagonal is None or "bottom_right" in mask_type:
            bottom_right_diagonal = True
        self._check_shapes(query_layer, key_layer, value_layer, fmt)

        spec = Spec(mask_type, window, bool(bottom_right_diagonal), self.softmax_scale,
                     self.attention_dropout if self.training else 0.0)
        if fmt == "thd":
            if attention_mask is not None:
                raise ValueError("DotProductAttention: qkv_format='thd' takes cu_seqlens_q / cu_seqlens_kv, "
                                 "not attention_mask")
            if "padding" not in mask_type:
                raise ValueError(f"DotProductAttention: qkv_format='thd' needs a padding mask type "
                                 f"('padding', 'padding_causal', 'padding_causal_bottom_right'), got {mask_type!r}")
            if self._cp_size() > 1:
                raise NotImplementedError("DotProductAttention: context parallel (cp_group) with qkv_format='thd' "
                                          "is not supported")
            if cu_seqlens_q is None or cu_seqlens_kv is None:
                raise ValueError("DotProductAttention: qkv_format='thd' needs cu_seqlens_q and cu_seqlens_kv")
            run = PackedAttention(spec, cu_seqlens_q, cu_seqlens_kv, cu_seqlens_q_padded, cu_seqlens_kv_padded,
                                   max_seqlen_q, max_seqlen_kv)
        else:
            if cu_seqlens_q_padded is not None or cu_seqlens_kv_padded is not None:
                raise ValueError("DotProductAttention: cu_seqlens_q_padded / cu_seqlens_kv_padded are for "
                                 "qkv_format='thd'")
            seq_dim = 0 if fmt == "sbhd" else 1
            for arg, value, t in (("max_seqlen_q", max_seqlen_q, query_layer),
                                  ("max_seqlen_kv", max_seqlen_kv, key_layer)):
                if value is not None and value != t.shape[seq_dim]:
                    raise ValueError(f"DotProductAttention: {arg}={value} differs from the sequence length "
                                     f"{t.shape[seq_dim]} of the {fmt} tensors")
            run = PaddedAttention(spec, fmt, self._masks(mask_type, attention_mask, cu_seqlens_q, cu_seqlens_kv,
                                                          query_layer, key_layer, fmt),
                                   self.cp_group if self._cp_size() > 1 else None, self.attention_type)
        def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
            with self._dropout_rng(spec.dropout_p):  # inside: a recompute forks the tracker as well
                return run(query, key, value)

        if checkpoint_core_attention and torch.is_grad_enabled():
            return checkpoint(attend, query_layer, key_layer, value_layer, use_reentrant=True,
                              get_rng_state_tracker=self._fork_tracker(spec.dropout_p))
        return attend(query_layer, key_layer, value_layer)

    # ---- checks and inputs ------------------------------------------------------------------------------

    def _cp_size(self) -> int:
        return _group_size(self.cp_group)

    def _check_shapes(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fmt: str) -> None:
        dims = 3 if fmt == "thd" else 4
        if q.dim() != dims or k.dim() != dims or v.dim() != dims:
            raise ValueError(f"DotProductAttention: qkv_format={fmt!r} takes {dims}-D tensors, got query "
                             f"{tuple(q.shape)}, key {tuple(k.shape)}, value {tuple(v.shape)}")
        if not q.dtype == k.dtype == v.dtype:
            raise TypeError(f"DotProductAttention: query, key and value must share a dtype, got {q.dtype}, "
                            f"{k.dtype}, {v.dtype}")
        if k.shape[:-1] != v.shape[:-1]:
            raise ValueError(f"DotProductAttention: key {tuple(k.shape)} and value {tuple(v.shape)} differ in "
                             f"batch, sequence or heads")
        if fmt != "thd":
            batch_dim = 1 if fmt == "sbhd" else 0
            if q.shape[batch_dim] != k.shape[batch_dim]:
                raise ValueError(f"DotProductAttention: query {tuple(q.shape)} and key {tuple(k.shape)} differ "
                                 f"in batch size ({fmt})")
        if q.shape[-1] != self.head_dim_k or k.shape[-1] != self.head_dim_k or v.shape[-1] != self.head_dim_v:
            raise ValueError(f"DotProductAttention: head sizes query {q.shape[-1]}, key {k.shape[-1]}, value "
                             f"{v.shape[-1]}; kv_channels expects {self.head_dim_k} for query and key, "
                             f"{self.head_dim_v} for value")
        if q.shape[-2] != self.num_heads_per_partition or k.shape[-2] != self.num_gqa_groups_per_partition:
            raise ValueError(f"DotProductAttention: {q.shape[-2]} query and {k.shape[-2]} key/value heads; "
                             f"expected {self.num_heads_per_partition} and {self.num_gqa_groups_per_partition} "
                             f"({self.num_attention_heads} heads, {self.num_gqa_groups} GQA groups over "
                             f"tensor-parallel size {self.tp_size})")

    def _masks(self, mask_type: str, attention_mask, cu_seqlens_q, cu_seqlens_kv, q: torch.Tensor,
               k: torch.Tensor, fmt: str) -> "MaskInputs":
        """The padding masks and the arbitrary mask of an "sbhd" / "bshd" call (True = masked)."""
        seq_dim, batch = (0, q.shape[1]) if fmt == "sbhd" else (1, q.shape[0])
        sq, sk = q.shape[seq_dim], k.shape[seq_dim]
        inputs = MaskInputs()
        if "padding" in mask_type:
            if attention_mask is not None:
                if isinstance(attention_mask, (tuple, list)):
                    if len(attention_mask) != 2:
                        raise ValueError("DotProductAttention: a padding attention_mask pair is (query mask, "
                                         "key/value mask)")
                    q_mask, kv_mask = attention_mask
                elif sq == sk:
                    q_mask = kv_mask = attention_mask
                else:
                    raise ValueError(f"DotProductAttention: {sq} queries and {sk} keys need a pair of padding "
                                     f"masks ([b, 1, 1, sq], [b, 1, 1, skv])")
                inputs.q_pad = padding_mask(q_mask, batch, sq, "query")
                inputs.kv_pad = padding_mask(kv_mask, batch, sk, "key/value")
            elif cu_seqlens_q is not None and cu_seqlens_kv is not None:
                inputs.q_pad = pad_from_lengths(lengths_of(cu_seqlens_q, batch, "cu_seqlens_q"), sq, "query")
                inputs.kv_pad = pad_from_lengths(lengths_of(cu_seqlens_kv, batch, "cu_seqlens_kv"), sk, "key/value")
            else:
                raise ValueError(f"DotProductAttention: attn_mask_type={mask_type!r} needs attention_mask or "
                                 f"cu_seqlens_q and cu_seqlens_kv")
        elif mask_type == "arbitrary":
            if attention_mask is None or isinstance(attention_mask, (tuple, list)):
                raise ValueError("DotProductAttention: attn_mask_type='arbitrary' needs one attention_mask tensor "
                                 "broadcastable to [b, h, sq, skv]")
            if attention_mask.dtype != torch.bool:
                raise TypeError(f"DotProductAttention: attention_mask must be boolean (True = masked out), got "
                                f"{attention_mask.dtype}")
            full = (batch, self.num_heads_per_partition, sq, sk)
            try:
                fits = torch.broadcast_shapes(attention_mask.shape, full) == full
            except RuntimeError:
                fits = False
            if not fits:
                raise ValueError(f"DotProductAttention: attention_mask {tuple(attention_mask.shape)} is not "
                                 f"broadcastable to [b, h, sq, skv] = {list(full)}")
            inputs.arbitrary = attention_mask
        # other mask types use no mask tensor (TransformerEngine documents attention_mask as unused there)
        return inputs

    # ---- dropout RNG ------------------------------------------------------------------------------------

    def _fork_tracker(self, dropout_p: float) -> Any:
        """The tracker whose fork dropout runs in, or None (no dropout, no tracker, or sequence parallel)."""
        if dropout_p == 0.0 or self.sequence_parallel or self.get_rng_state_tracker is None:
            return None
        return resolve_rng_tracker(self.get_rng_state_tracker)

    def _dropout_rng(self, dropout_p: float):
        tracker = self._fork_tracker(dropout_p)
        return tracker.fork() if tracker is not None else contextlib.nullcontext()
