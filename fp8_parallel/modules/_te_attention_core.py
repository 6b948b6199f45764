"""The computation behind the TransformerEngine-signature `DotProductAttention` (`te_attention.py`):
TransformerEngine's mask-type and window rules, the full boolean mask of a call, torch SDPA over it, and the
three layouts (padded "sbhd" / "bshd" with context parallel, packed "thd"). Pure torch: no megatron-core."""
from __future__ import annotations

import warnings
from typing import Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ._attention_masks import position_mask, shifted_window_mask
from ._context_parallel import chunk_indices, gather_sequence

MASK_TYPES = ("no_mask", "padding", "causal", "padding_causal", "causal_bottom_right",
              "padding_causal_bottom_right", "arbitrary")
QKV_FORMATS = ("sbhd", "bshd", "thd")
CP_COMM_TYPES = ("p2p", "all_gather")  # both run as an all-gather of keys and values here
UNBOUNDED = (-1, -1)


def canonical_mask_type(mask_type: str) -> str:
    """TransformerEngine's spelling rules: "padding,causal", "causal,padding" and "causal_padding" are
    "padding_causal"."""
    name = mask_type.replace(",", "_")
    name = "padding_causal" if name == "causal_padding" else name
    if name not in MASK_TYPES:
        raise ValueError(f"DotProductAttention: attn_mask_type={mask_type!r}; expected one of {MASK_TYPES}")
    return name


def checked_window(mask_type: str, window: Optional[Tuple[int, int]]) -> Tuple[int, int]:
    """The sliding window a mask type runs with, by TransformerEngine's rules: causal types take `(-1, 0)` or
    `(>= 0, 0)`, the others `(-1, -1)` or `(>= 0, >= 0)`; None is "no window". A near miss is corrected with a
    warning (a causal type with a right bound: the bound becomes 0; `(-1, 0)` on a non-causal type: no
    window), anything else raises ValueError."""
    causal = "causal" in mask_type
    if window is None:
        return (-1, 0) if causal else UNBOUNDED
    window = (int(window[0]), int(window[1]))
    if causal:
        if window == (-1, 0) or (window[0] >= 0 and window[1] == 0):
            return window
        if window == UNBOUNDED or window[0] >= 0:
            warnings.warn(f"DotProductAttention: window_size should be (-1, 0) or (>=0, 0) for "
                          f"attn_mask_type={mask_type}; using ({window[0]}, 0)", stacklevel=3)
            return window[0], 0
    else:
        if window == UNBOUNDED or (window[0] >= 0 and window[1] >= 0):
            return window
        if window == (-1, 0):
            warnings.warn(f"DotProductAttention: window_size should be (-1, -1) or (>=0, >=0) for "
                          f"attn_mask_type={mask_type}; using (-1, -1) (causality comes from the mask type)", stacklevel=3)
            return UNBOUNDED
    raise ValueError(f"DotProductAttention: window_size={window} is invalid for attn_mask_type={mask_type}")


class MaskInputs:
    """Mask tensors of one call (True = masked): per-batch padding of queries `[b, sq]` and keys `[b, sk]`,
    and an "arbitrary" mask broadcastable to `[b, h, sq, sk]`."""

    def __init__(self) -> None:
        self.q_pad: Optional[torch.Tensor] = None
        self.kv_pad: Optional[torch.Tensor] = None
        self.arbitrary: Optional[torch.Tensor] = None


def padding_mask(mask: torch.Tensor, batch: int, seq: int, what: str) -> torch.Tensor:
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        raise TypeError(f"DotProductAttention: the {what} padding mask must be a boolean tensor (True = padded)")
    if tuple(mask.shape) != (batch, 1, 1, seq):
        raise ValueError(f"DotProductAttention: the {what} padding mask is {tuple(mask.shape)}; expected "
                         f"[b, 1, 1, s] = [{batch}, 1, 1, {seq}]")
    return mask.reshape(batch, seq)


def lengths_of(cu_seqlens: torch.Tensor, batch: int, what: str) -> torch.Tensor:
    if cu_seqlens.dim() != 1 or cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype == torch.bool:
        raise TypeError(f"DotProductAttention: {what} must be a 1-D integer tensor [batch + 1]")
    if batch >= 0 and cu_seqlens.numel() != batch + 1:
        raise ValueError(f"DotProductAttention: {what} has {cu_seqlens.numel()} entries for batch size {batch} "
                         f"(expected batch + 1)")
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    if (lengths < 0).any():
        raise ValueError(f"DotProductAttention: {what} is not non-decreasing")
    return lengths


def pad_from_lengths(lengths: torch.Tensor, seq: int, what: str) -> torch.Tensor:
    """`[b, seq]`, True past each sequence's length (sequences padded at the end)."""
    if lengths.numel() and int(lengths.max()) > seq:
        raise ValueError(f"DotProductAttention: a {what} sequence of {int(lengths.max())} tokens exceeds the "
                         f"padded length {seq}")
    return torch.arange(seq, device=lengths.device).unsqueeze(0) >= lengths.unsqueeze(1)


class Spec:
    """How one call attends: mask type, checked window, diagonal alignment, softmax scale, dropout."""

    def __init__(self, mask_type: str, window: Tuple[int, int], bottom_right: bool, scale: float,
                 dropout_p: float) -> None:
        self.mask_type, self.window, self.bottom_right = mask_type, window, bottom_right
        self.scale, self.dropout_p = scale, dropout_p


def allowed_keys(spec: Spec, sq: int, sk: int, masks: MaskInputs, device: torch.device) -> Optional[torch.Tensor]:
    """Which keys each query attends to (True = attend), broadcastable to `[b, h, sq, sk]`, or None for all.

    TransformerEngine's full mask: the padding masks of queries and keys, the arbitrary mask, and the window
    (causal types: right bound 0) around diagonal offset 0 (top left), `sk - sq` (bottom right) or, for
    padding types aligned bottom right, each sequence's actual `len_kv - len_q`."""
    mask_type = spec.mask_type
    left, right = spec.window
    if "causal" in mask_type:
        right = 0
    allowed = None
    if left >= 0 or right >= 0:
        if "padding" in mask_type and spec.bottom_right:
            lengths_q = (~masks.q_pad).sum(-1)
            lengths_kv = (~masks.kv_pad).sum(-1)
            allowed = shifted_window_mask(lengths_kv - lengths_q, sq, sk, (left, right))
        else:
            offset = sk - sq if spec.bottom_right else 0
            allowed = position_mask(offset, sq, sk, False, (left, right), device)
    if masks.q_pad is not None:
        keep = ~masks.q_pad.unsqueeze(1).unsqueeze(-1) & ~masks.kv_pad.unsqueeze(1).unsqueeze(2)  # [b, 1, sq, sk]
        allowed = keep if allowed is None else allowed & keep
    if masks.arbitrary is not None:
        allowed = ~masks.arbitrary if allowed is None else allowed & ~masks.arbitrary
    return allowed


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: Optional[torch.Tensor], is_causal: bool,
          spec: Spec) -> torch.Tensor:
    """SDPA over `[b, h, sq, d]` queries and `[b, g, sk, d]` keys / values; a query with no allowed key
    outputs zeros (and passes no gradient)."""
    attends = None
    if allowed is not None:
        attends = allowed.any(dim=-1, keepdim=True)
        allowed = allowed | ~attends  # such a row attends everywhere, then is zeroed: no NaN, no gradient
    groups = q.shape[1] // k.shape[1]
    enable_gqa = groups > 1 and allowed is None
    if groups > 1 and allowed is not None:  # masked kernels take equal head counts: expand the groups
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, dropout_p=spec.dropout_p, is_causal=is_causal,
                                         scale=spec.scale, enable_gqa=enable_gqa)
    if attends is not None:
        out = out * attends.to(out.dtype)
    return out


def attend_all(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: Spec, masks: MaskInputs) -> torch.Tensor:
    """`[b, h, sq, d]` attention with the call's full mask; plain causal runs as SDPA's `is_causal`."""
    sq, sk = q.shape[2], k.shape[2]
    plain_causal = spec.window[0] < 0 and (
        spec.mask_type == "causal" or (spec.mask_type == "causal_bottom_right" and sq == sk))  # SDPA's is top-left
    if plain_causal:
        return sdpa(q, k, v, None, True, spec)
    return sdpa(q, k, v, allowed_keys(spec, sq, sk, masks, q.device), False, spec)


class PaddedAttention:
    """One "sbhd" / "bshd" call (a callable of query, key and value, so that it can be checkpointed)."""

    def __init__(self, spec: Spec, fmt: str, masks: MaskInputs, cp_group: Optional[dist.ProcessGroup],
                 attention_type: str) -> None:
        self.spec, self.fmt, self.masks, self.cp_group, self.attention_type = spec, fmt, masks, cp_group, attention_type

    def __call__(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        order = (1, 2, 0, 3) if self.fmt == "sbhd" else (0, 2, 1, 3)  # -> [b, h, s, d]
        q, k, v = (t.permute(*order) for t in (query, key, value))
        out = attend_all(q, k, v, self.spec, self.masks) if self.cp_group is None else self._context_parallel(q, k, v)
        out = out.permute(2, 0, 1, 3) if self.fmt == "sbhd" else out.transpose(1, 2)  # [s, b, h, d] / [b, s, h, d]
        return out.reshape(*out.shape[:2], -1)

    def _context_parallel(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """This rank's two query chunks over all ranks' keys and values (gathered over the CP group)."""
        spec = self.spec
        causal = spec.mask_type in ("causal", "causal_bottom_right")
        if (spec.mask_type not in ("no_mask", "causal", "causal_bottom_right") or self.attention_type != "self"
                or spec.window[0] >= 0 or (spec.window[1] >= 0 and not causal)):
            raise NotImplementedError(
                f"DotProductAttention: context parallel (cp_group) supports self-attention with 'no_mask' or "
                f"'causal' masks and no sliding window; got attn_mask_type={spec.mask_type!r}, "
                f"window_size={spec.window}, attention_type={self.attention_type!r}")
        if q.shape[2] != k.shape[2] or q.shape[2] % 2:
            raise ValueError(f"DotProductAttention: context parallel needs two equal local chunks of queries and "
                             f"keys; got {q.shape[2]} queries and {k.shape[2]} keys")
        cp, rank = dist.get_world_size(self.cp_group), dist.get_rank(self.cp_group)
        chunk = q.shape[2] // 2
        # [b, g, s, d] -> [s, b, g, d] for the sequence gather (dim 0), back after
        if k.shape == v.shape:  # one collective for both
            full = gather_sequence(torch.stack((k, v)).permute(3, 0, 1, 2, 4), self.cp_group)  # [S, 2, b, g, d]
            full_k, full_v = full[:, 0].permute(1, 2, 0, 3), full[:, 1].permute(1, 2, 0, 3)
        else:
            full_k, full_v = (gather_sequence(t.permute(2, 0, 1, 3), self.cp_group).permute(1, 2, 0, 3)
                              for t in (k, v))
        outs = []
        for half, index in enumerate(chunk_indices(cp, rank)):
            rows = q[:, :, half * chunk:(half + 1) * chunk]
            if causal:  # the chunk's queries sit at index * chunk ...; later keys are masked anyway: not used
                keys = (index + 1) * chunk
                allowed = position_mask(index * chunk, chunk, keys, True, None, q.device)
                outs.append(sdpa(rows, full_k[:, :, :keys], full_v[:, :, :keys], allowed, False, spec))
            else:
                outs.append(sdpa(rows, full_k, full_v, None, False, spec))
        return torch.cat(outs, dim=2)


class PackedAttention:
    """One "thd" call: the packed sequences are laid out padded (`[b, s, h, d]`, a differentiable index copy),
    attended with padding masks from their lengths, and packed back; tokens outside every sequence (padding
    between sequences, `cu_seqlens_*_padded`) output zeros."""

    def __init__(self, spec: Spec, cu_q: torch.Tensor, cu_kv: torch.Tensor, cu_q_padded: Optional[torch.Tensor],
                 cu_kv_padded: Optional[torch.Tensor], max_q: Optional[int], max_kv: Optional[int]) -> None:
        self.spec = spec
        self.q_layout = PackedLayout(cu_q, cu_q_padded, max_q, "cu_seqlens_q")
        self.kv_layout = PackedLayout(cu_kv, cu_kv_padded, max_kv, "cu_seqlens_kv")
        if self.q_layout.batch != self.kv_layout.batch:
            raise ValueError("DotProductAttention: cu_seqlens_q and cu_seqlens_kv differ in batch size")

    def __call__(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        q = self.q_layout.unpack(query).transpose(1, 2)  # [b, h, sq, d]
        k, v = (self.kv_layout.unpack(t).transpose(1, 2) for t in (key, value))
        masks = MaskInputs()
        masks.q_pad, masks.kv_pad = self.q_layout.padding(), self.kv_layout.padding()
        out = attend_all(q, k, v, self.spec, masks).transpose(1, 2)  # [b, sq, h, d]
        return self.q_layout.pack(out.reshape(*out.shape[:2], -1), query.shape[0])


class PackedLayout:
    """Where each packed sequence's tokens are: sequence `n` has `cu[n + 1] - cu[n]` tokens from offset
    `cu_padded[n]` (default `cu[n]`); in the padded layout it fills rows `n * s ...` of `[b * s, ...]`."""

    def __init__(self, cu: torch.Tensor, cu_padded: Optional[torch.Tensor], max_len: Optional[int], what: str):
        lengths = lengths_of(cu, -1, what)
        self.batch = lengths.numel()
        starts = (cu if cu_padded is None else cu_padded)[:-1].long()
        if cu_padded is not None and cu_padded.shape != cu.shape:
            raise ValueError(f"DotProductAttention: {what}_padded {tuple(cu_padded.shape)} differs from {what} "
                             f"{tuple(cu.shape)}")
        longest = int(lengths.max()) if self.batch else 0
        self.seq = longest if max_len is None else int(max_len)
        if self.seq < longest:
            raise ValueError(f"DotProductAttention: max_seqlen {self.seq} is shorter than a sequence of "
                             f"{longest} tokens ({what})")
        self.lengths = lengths
        lens, offs = lengths.tolist(), starts.tolist()
        device = cu.device
        self.tokens = torch.cat([torch.arange(o, o + n, device=device) for o, n in zip(offs, lens)] or
                                [torch.zeros(0, dtype=torch.long, device=device)])
        self.rows = torch.cat([torch.arange(n, device=device) + i * self.seq for i, n in enumerate(lens)] or
                              [torch.zeros(0, dtype=torch.long, device=device)])

    def unpack(self, packed: torch.Tensor) -> torch.Tensor:
        """`[t, h, d]` -> `[b, s, h, d]` (zeros past each sequence's end)."""
        if self.tokens.numel() and int(self.tokens.max()) >= packed.shape[0]:
            raise ValueError(f"DotProductAttention: the sequence offsets reach past the {packed.shape[0]} packed "
                             f"tokens")
        rows = packed.new_zeros(self.batch * self.seq, *packed.shape[1:])
        rows = rows.index_copy(0, self.rows.to(packed.device), packed.index_select(0, self.tokens.to(packed.device)))
        return rows.view(self.batch, self.seq, *packed.shape[1:])

    def pack(self, padded: torch.Tensor, tokens: int) -> torch.Tensor:
        """`[b, s, f]` -> `[tokens, f]` (zeros for tokens outside every sequence)."""
        flat = padded.reshape(self.batch * self.seq, -1)
        out = flat.new_zeros(tokens, flat.shape[-1])
        return out.index_copy(0, self.tokens.to(flat.device), flat.index_select(0, self.rows.to(flat.device)))

    def padding(self) -> torch.Tensor:
        return pad_from_lengths(self.lengths, self.seq, "packed")
