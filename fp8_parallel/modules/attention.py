"""Core attention on torch's `scaled_dot_product_attention`, with megatron-core's `DotProductAttention`
signature, and context parallelism.

    attention = SDPADotProductAttention(config, layer_number, AttnMaskType.causal, "self")
    context = attention(query, key, value, attention_mask)   # [s, b, np, hn] x3 -> [s, b, np * hn]

* Causal self-attention runs without an S x S mask (`is_causal`), so torch can pick its flash / cuDNN /
  memory-efficient kernels. Masks and sliding windows become one boolean mask per call.
* megatron's mask convention: `attention_mask` is boolean, True = masked out, broadcastable to
  `[b, np, sq, sk]`. A given mask is always applied; causal mask types add the causal mask to it. A query row
  that every key is masked from attends to all keys uniformly (no gradient to its query), as in megatron's
  softmax, which fills masked scores with -10000 rather than -inf.
* Grouped-query attention: fewer key/value heads than query heads (`num_query_groups`).
* Attention dropout (`config.attention_dropout`, training only) runs inside megatron's model-parallel RNG
  tracker fork unless sequence parallel is on, as megatron's `DotProductAttention` does.
* Context parallel (`config.context_parallel_size > 1`): queries, keys and values hold this rank's two
  load-balanced chunks (megatron's `get_batch_on_this_cp_rank`); keys and values are all-gathered over the CP
  group (backward: one reduce-scatter) and each query chunk attends to the keys up to its own end. A mask, if
  given, is `[.., 2c, S]` (its query rows sliced like the batch, its keys the full sequence).
"""
from __future__ import annotations

import contextlib
import math
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from ..startup import import_megatron_core

import_megatron_core()  # megatron-core without torch's compiler (see startup.py), before its imports below
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.utils import is_layer_window_attention

from ._attention_masks import position_mask  # moved there (megatron-free); importable from here as before
from ._context_parallel import chunk_indices, gather_sequence

_CAUSAL = (AttnMaskType.causal, AttnMaskType.padding_causal, AttnMaskType.causal_bottom_right)
_CP_COMM_TYPES = (None, "all_gather")


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    """[s, b, n, h] -> [b, n, s, h] (a view)."""
    return x.permute(1, 2, 0, 3)


class SDPADotProductAttention(MegatronModule):
    """megatron-core's core attention (`DotProductAttention`'s constructor and forward) on torch SDPA.

    Args:
        config: megatron's `TransformerConfig` (`kv_channels`, `attention_dropout`, `window_size`,
            `context_parallel_size`, `sequence_parallel`).
        layer_number: 1-based layer number (sliding-window layer selection).
        attn_mask_type: default mask type of `forward`.
        attention_type: "self" or "cross" (kept for megatron; context parallel needs "self").
        attention_dropout: overrides `config.attention_dropout`.
        softmax_scale: scale of the scores; default `1 / sqrt(kv_channels)`. megatron's
            `apply_query_key_layer_scaling` does not change the effective scale, so it is not applied.
        cp_comm_type: None or "all_gather" (ring / all-to-all context parallel are not implemented).
        pg_collection: megatron's process groups; its `cp` group is used when present, else megatron's
            context-parallel group.

    Raises:
        NotImplementedError: a softmax type other than "vanilla", `qk_clip`, or another `cp_comm_type`.
        ValueError: a CP group whose size differs from `config.context_parallel_size`.
    """

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection=None,
    ) -> None:
        super().__init__(config=config)
        if getattr(config, "softmax_type", "vanilla") != "vanilla":
            raise NotImplementedError(f"SDPADotProductAttention: softmax_type={config.softmax_type!r}")
        if getattr(config, "qk_clip", False) or getattr(config, "log_max_attention_logit", False):
            raise NotImplementedError("SDPADotProductAttention: qk_clip / max attention logits are not tracked")
        if cp_comm_type not in _CP_COMM_TYPES:
            raise NotImplementedError(
                f"SDPADotProductAttention: cp_comm_type={cp_comm_type!r}; supported: {_CP_COMM_TYPES}")
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)
        self.dropout_p = float(config.attention_dropout if attention_dropout is None else attention_dropout)
        if not 0.0 <= self.dropout_p < 1.0:
            raise ValueError(f"SDPADotProductAttention: attention_dropout={self.dropout_p} is not in [0, 1)")
        self.window_size = (
            tuple(config.window_size)
            if is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number)
            else None
        )
        self.cp_group = self._cp_group(config, pg_collection)

    @staticmethod
    def _cp_group(config, pg_collection) -> Optional[dist.ProcessGroup]:
        cp = getattr(config, "context_parallel_size", 1)
        if cp == 1:
            return None
        group = getattr(pg_collection, "cp", None) if pg_collection is not None else None
        if group is None:
            from megatron.core import parallel_state as mpu

            group = mpu.get_context_parallel_group()
        if dist.get_world_size(group) != cp:
            raise ValueError(
                f"SDPADotProductAttention: context_parallel_size={cp} but the CP group has "
                f"{dist.get_world_size(group)} ranks")
        return group

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[torch.Tensor] = None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        """Attention of `query` `[sq, b, np, hn]` over `key` / `value` `[sk, b, ng, hn]`; returns
        `[sq, b, np * hn]`.

        Raises:
            NotImplementedError: `packed_seq_params` (THD packed sequences) or `attention_bias`.
            ValueError / TypeError: shapes that do not fit, or a mask that is not boolean.
        """
        if packed_seq_params is not None:
            raise NotImplementedError(
                "SDPADotProductAttention: packed sequences (packed_seq_params, THD) are not supported")
        if attention_bias is not None:
            raise NotImplementedError("SDPADotProductAttention: attention_bias is not supported")
        self._check(query, key, value, attention_mask)
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        causal = mask_type in _CAUSAL
        dropout_p = self.dropout_p if self.training else 0.0
        with self._rng(dropout_p):
            if self.cp_group is None:
                context = self._attend(query, key, value, key.shape[0] - query.shape[0], causal, attention_mask,
                                       dropout_p)
            else:
                context = self._attend_context_parallel(query, key, value, causal, attention_mask, dropout_p)
        return context.reshape(context.shape[0], context.shape[1], -1)

    def _rng(self, dropout_p: float):
        """megatron's model-parallel RNG fork around dropout (not with sequence parallel, as megatron does)."""
        if dropout_p == 0.0 or self.config.sequence_parallel:
            return contextlib.nullcontext()
        from megatron.core import tensor_parallel

        return tensor_parallel.get_cuda_rng_tracker().fork()

    @staticmethod
    def _check(query, key, value, mask) -> None:
        if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
            raise ValueError(
                f"SDPADotProductAttention: expected [s, b, heads, dim] tensors, got query {tuple(query.shape)}, "
                f"key {tuple(key.shape)}, value {tuple(value.shape)}")
        if key.shape[:3] != value.shape[:3] or query.shape[1] != key.shape[1] or query.shape[3] != key.shape[3]:
            raise ValueError(
                f"SDPADotProductAttention: query {tuple(query.shape)}, key {tuple(key.shape)} and value "
                f"{tuple(value.shape)} do not fit together")
        if query.shape[2] % key.shape[2]:
            raise ValueError(
                f"SDPADotProductAttention: {query.shape[2]} query heads are not a multiple of {key.shape[2]} "
                f"key/value heads")
        if mask is not None and mask.dtype != torch.bool:
            raise TypeError(f"SDPADotProductAttention: attention_mask must be boolean (True = masked), got {mask.dtype}")

    def _attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        q_start: int,
        causal: bool,
        masked: Optional[torch.Tensor],
        dropout_p: float,
    ) -> torch.Tensor:
        """SDPA of `[sq, b, np, hn]` queries at absolute positions from `q_start` over keys at 0...sk-1;
        returns `[sq, b, np, hn]`. `masked`: megatron's boolean mask (True = masked), `[.., sq, sk]`."""
        sq, sk = query.shape[0], key.shape[0]
        q, k, v = _heads_first(query), _heads_first(key), _heads_first(value)
        is_causal = causal and masked is None and self.window_size is None and q_start == 0 and sq == sk
        allowed = None
        if not is_causal:
            allowed = position_mask(q_start, sq, sk, causal, self.window_size, query.device)
            if masked is not None:
                if masked.shape[-2:] not in ((sq, sk), (1, sk)):
                    raise ValueError(
                        f"SDPADotProductAttention: attention_mask {tuple(masked.shape)} does not fit {sq} queries "
                        f"x {sk} keys")
                allowed = ~masked if allowed is None else allowed & ~masked
                # A row masked from every key: megatron's softmax gives it uniform weights with no gradient to
                # its scores. The same here: such a row attends to all keys with a zeroed query.
                attends = allowed.any(dim=-1, keepdim=True)
                allowed = allowed | ~attends
                q = q * attends.to(q.dtype)
        groups = q.shape[1] // k.shape[1]
        enable_gqa = groups > 1 and allowed is None
        if groups > 1 and allowed is not None:  # masked kernels take equal head counts: expand the groups
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=allowed, dropout_p=dropout_p, is_causal=is_causal, scale=self.softmax_scale,
            enable_gqa=enable_gqa,
        )
        return out.permute(2, 0, 1, 3)

    def _attend_context_parallel(self, query, key, value, causal, masked, dropout_p) -> torch.Tensor:
        """Both local query chunks over the gathered keys (see the module docstring)."""
        if query.shape[0] != key.shape[0] or query.shape[0] % 2:
            raise ValueError(
                f"SDPADotProductAttention: context parallel needs self-attention over two equal local chunks; "
                f"got {query.shape[0]} queries and {key.shape[0]} keys")
        cp, rank = dist.get_world_size(self.cp_group), dist.get_rank(self.cp_group)
        chunk = query.shape[0] // 2
        if key.shape == value.shape:  # one collective for both
            full = gather_sequence(torch.stack((key, value), dim=1), self.cp_group)  # [S, 2, b, ng, hn]
            full_key, full_value = full[:, 0], full[:, 1]
        else:
            full_key, full_value = gather_sequence(key, self.cp_group), gather_sequence(value, self.cp_group)
        seq = full_key.shape[0]
        if masked is not None and masked.shape[-1] != seq:
            raise ValueError(
                f"SDPADotProductAttention: with context parallel the mask's key dimension must be the full "
                f"sequence ({seq}), got mask {tuple(masked.shape)}")
        outs = []
        for half, index in enumerate(chunk_indices(cp, rank)):
            rows = slice(half * chunk, (half + 1) * chunk)
            keys = (index + 1) * chunk if causal else seq
            mask = None
            if masked is not None:
                mask = masked[..., :keys] if masked.shape[-2] == 1 else masked[..., rows, :keys]
            outs.append(self._attend(query[rows], full_key[:keys], full_value[:keys], index * chunk, causal, mask,
                                     dropout_p))
        return torch.cat(outs)
