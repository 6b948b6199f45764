"""TransformerEngine's `TransformerLayer` under its name and signature: `MultiheadAttention` (self, and cross for
decoders), `LayerNormMLP`, bias-dropout-add residuals, composed of this package's modules (FP8 GEMMs inside an
enabled autocast scope).

    layer = TransformerLayer(256, 1024, 8, num_gqa_groups=2, hidden_dropout=0.0, attention_dropout=0.0)
    out = layer(x)   # x [s, b, 256] -> [s, b, 256]

Structure and parameter names follow TransformerEngine 2.8 (`transformer_engine/pytorch/transformer.py`):
`self_attention` (its norm is `self_attention.layernorm_qkv`; none with `output_layernorm`), `inter_attention`
(decoders), `layernorm_mlp`, and `layernorm` (with `output_layernorm`). Hidden dropout uses torch's default
generator (as TransformerEngine's bias-dropout-add does); attention dropout the RNG tracker's fork.
"""
from __future__ import annotations

from typing import Any, Callable, List, Optional, Tuple, Union

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ._te_options import check_te_options, in_autocast_dtype
from .layernorm_mlp import LayerNormMLP
from .te_multihead_attention import MultiheadAttention
from .te_norm import LayerNorm, RMSNorm

__all__ = ["TransformerLayer"]

_LAYER_OPTIONS = ("fuse_wgrad_accumulation", "seq_length", "micro_batch_size")


class _DropPath(torch.nn.Module):
    """Stochastic depth, TransformerEngine's `DropPath`: in training, each index of the first dimension is
    zeroed with probability `drop_prob` (the rest scaled by `1 / (1 - drop_prob)`), from the default generator.
    `drop_prob=1` drops every index: the branch contributes zeros (TransformerEngine's formula divides by 0
    there and yields NaN)."""

    def __init__(self, drop_prob: float):
        super().__init__()
        self.drop_prob = drop_prob

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.drop_prob == 0.0 or not self.training:
            return x
        keep = 1 - self.drop_prob
        if keep == 0.0:
            return x * 0.0  # zeros, and zero gradients for the branch
        mask = (keep + torch.rand((x.shape[0],) + (1,) * (x.dim() - 1), dtype=x.dtype, device=x.device)).floor_()
        return x.div(keep) * mask


class TransformerLayer(torch.nn.Module):
    """TransformerEngine's `TransformerLayer`: attention block and MLP with residual connections.

    Args (TransformerEngine's; see its documentation for the full text):
        hidden_size, ffn_hidden_size, num_attention_heads, num_gqa_groups, kv_channels: sizes.
        layernorm_epsilon, normalization ("LayerNorm" / "RMSNorm"), zero_centered_gamma: the norms.
        hidden_dropout: dropout after the attention projection and after fc2 (training only; torch's default
            generator). attention_dropout: dropout of the attention weights (the RNG tracker's fork).
        init_method, output_layer_init_method: QKV and fc1 / proj and fc2 weight initialization.
        layer_number: passed to the attentions.
        self_attn_mask_type, window_size, enc_dec_attn_mask_type, enc_dec_window_size: the default masks and
            windows of the self- and the cross-attention (`forward` may override them).
        tp_group, tp_size, set_parallel_mode, sequence_parallel: tensor parallelism as in `MultiheadAttention`
            and `LayerNormMLP`.
        params_dtype, device, get_rng_state_tracker: as for the other modules.
        apply_residual_connection_post_layernorm: residuals taken from the norms' outputs.
        output_layernorm: no input norm in the self-attention; a norm (`layernorm`) after the last residual.
        parallel_attention_mlp: attention and MLP on the same input, their outputs summed into one residual
            (encoders only, without post-layernorm residuals or `output_layernorm`, as in TransformerEngine).
        layer_type: "encoder" or "decoder" (adds `inter_attention`, cross-attention over `encoder_output`).
        drop_path_rate: stochastic depth of the self-attention and MLP branches (training only); 1.0 drops both
            (their outputs are zeros).
        fuse_qkv_params, qkv_weight_interleaved, rotary_pos_interleaved, qk_norm_type, qk_norm_eps,
            qk_norm_before_rope, softmax_type: as for `MultiheadAttention`.
        bias: the linear layers learn biases. activation: as for `LayerNormMLP`.
        attn_input_format: "sbhd", "bshd" or "thd", the layout of `hidden_states`.
        ub_tp_comm_overlap (and the ub_* flags it gates): only off; seq_length, micro_batch_size: JIT hints,
            accepted. fuse_wgrad_accumulation: as for `Linear`.

    Forward: `forward(hidden_states, attention_mask=None, self_attn_mask_type=None, window_size=None,
    encoder_output=None, enc_dec_attn_mask=None, ..., rotary_pos_emb=None, ...)` returns the output, shaped
    as `hidden_states`.
    """

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        num_attention_heads: int,
        num_gqa_groups: Optional[int] = None,
        layernorm_epsilon: float = 1e-5,
        hidden_dropout: float = 0.1,
        attention_dropout: float = 0.1,
        init_method: Optional[Callable] = None,
        output_layer_init_method: Optional[Callable] = None,
        layer_number: Optional[int] = None,
        kv_channels: Optional[int] = None,
        self_attn_mask_type: str = "causal",
        window_size: Optional[Tuple[int, int]] = None,
        enc_dec_attn_mask_type: str = "no_mask",
        enc_dec_window_size: Optional[Tuple[int, int]] = None,
        tp_group: Optional[dist.ProcessGroup] = None,
        tp_size: int = 1,
        params_dtype: Optional[torch.dtype] = None,
        get_rng_state_tracker: Optional[Callable] = None,
        fuse_wgrad_accumulation: bool = False,
        seq_length: Optional[int] = None,
        micro_batch_size: Optional[int] = None,
        sequence_parallel: bool = False,
        apply_residual_connection_post_layernorm: bool = False,
        output_layernorm: bool = False,
        parallel_attention_mlp: bool = False,
        layer_type: str = "encoder",
        drop_path_rate: float = 0.0,
        set_parallel_mode: bool = False,
        fuse_qkv_params: bool = False,
        rotary_pos_interleaved: bool = False,
        zero_centered_gamma: bool = False,
        qkv_weight_interleaved: bool = True,
        ub_tp_comm_overlap: bool = False,
        ub_overlap_ag: bool = True,  # noqa: ARG002
        ub_overlap_rs: bool = True,  # noqa: ARG002
        ub_overlap_rs_dgrad: bool = False,  # noqa: ARG002
        ub_bulk_dgrad: bool = True,  # noqa: ARG002
        ub_bulk_wgrad: bool = True,  # noqa: ARG002
        bias: bool = True,
        activation: str = "gelu",
        normalization: str = "LayerNorm",
        device: Optional[Union[str, torch.device]] = None,
        attn_input_format: str = "sbhd",
        name: Optional[str] = None,
        qk_norm_type: Optional[str] = None,
        qk_norm_eps: float = 1e-6,
        qk_norm_before_rope: bool = False,
        softmax_type: str = "vanilla",
    ) -> None:
        super().__init__()
        check_te_options("TransformerLayer", _LAYER_OPTIONS, dict(
            fuse_wgrad_accumulation=fuse_wgrad_accumulation, seq_length=seq_length,
            micro_batch_size=micro_batch_size))
        if ub_tp_comm_overlap:  # the ub_* flags only act through it (TransformerEngine ANDs them with it)
            raise NotImplementedError("TransformerLayer(ub_tp_comm_overlap=True): userbuffers communication/GEMM "
                                      "overlap is not implemented. Leave ub_tp_comm_overlap=False.")
        if layer_type not in ("encoder", "decoder"):
            raise ValueError(f"TransformerLayer(layer_type={layer_type!r}): expected 'encoder' or 'decoder'")
        if parallel_attention_mlp and (layer_type != "encoder" or apply_residual_connection_post_layernorm
                                       or output_layernorm):
            raise ValueError("TransformerLayer(parallel_attention_mlp=True) needs layer_type='encoder', "
                             "apply_residual_connection_post_layernorm=False and output_layernorm=False "
                             "(as in TransformerEngine)")
        if not 0.0 <= float(hidden_dropout) < 1.0:
            raise ValueError(f"TransformerLayer(hidden_dropout={hidden_dropout!r}): expected a probability in [0, 1)")
        if not 0.0 <= float(drop_path_rate) <= 1.0:
            raise ValueError(f"TransformerLayer(drop_path_rate={drop_path_rate!r}): expected a probability in [0, 1]")
        if tp_group is not None:
            if not isinstance(tp_group, dist.ProcessGroup):
                raise TypeError(f"TransformerLayer(tp_group={tp_group!r}): expected a ProcessGroup or None")
            tp_size = dist.get_world_size(tp_group)
        self.layer_type, self.layer_number = layer_type, layer_number
        self.self_attn_mask_type, self.window_size = self_attn_mask_type, window_size
        self.enc_dec_attn_mask_type, self.enc_dec_window_size = enc_dec_attn_mask_type, enc_dec_window_size
        self.apply_residual_connection_post_layernorm = bool(apply_residual_connection_post_layernorm)
        self.output_layernorm, self.parallel_attention_mlp = bool(output_layernorm), bool(parallel_attention_mlp)
        self.hidden_dropout = float(hidden_dropout)
        self.tp_size = tp_size
        self.sequence_parallel = tp_size > 1 and bool(sequence_parallel)
        self.attn_input_format, self.name = attn_input_format, name
        self.kv_channels = kv_channels if kv_channels else hidden_size // num_attention_heads
        label = name or f"TransformerLayer({hidden_size},{ffn_hidden_size},{num_attention_heads})"

        attention_args = (hidden_size, num_attention_heads, self.kv_channels, attention_dropout, layernorm_epsilon,
                          init_method, output_layer_init_method)
        common = dict(layer_number=layer_number, tp_group=tp_group, tp_size=tp_size, num_gqa_groups=num_gqa_groups,
                      get_rng_state_tracker=get_rng_state_tracker, sequence_parallel=self.sequence_parallel,
                      params_dtype=params_dtype, return_layernorm_output=self.apply_residual_connection_post_layernorm,
                      set_parallel_mode=set_parallel_mode, fuse_qkv_params=fuse_qkv_params,
                      zero_centered_gamma=zero_centered_gamma, qkv_weight_interleaved=qkv_weight_interleaved,
                      rotary_pos_interleaved=rotary_pos_interleaved, qkv_format=attn_input_format,
                      softmax_type=softmax_type, bias=bias, normalization=normalization, device=device,
                      qk_norm_type=qk_norm_type, qk_norm_eps=qk_norm_eps, qk_norm_before_rope=qk_norm_before_rope,
                      fuse_wgrad_accumulation=fuse_wgrad_accumulation)
        self.self_attention = MultiheadAttention(
            *attention_args, **common, input_layernorm=not self.output_layernorm, attention_type="self",
            return_bias=not self.parallel_attention_mlp, name=f"{label}.self_attention")
        if layer_type == "decoder":
            self.inter_attention = MultiheadAttention(
                *attention_args, **common, attn_mask_type=enc_dec_attn_mask_type, input_layernorm=True,
                attention_type="cross", return_bias=True, name=f"{label}.inter_attention")
        self.layernorm_mlp = LayerNormMLP(
            hidden_size, ffn_hidden_size, eps=layernorm_epsilon, tp_group=tp_group, tp_size=tp_size,
            get_rng_state_tracker=get_rng_state_tracker, init_method=init_method,
            output_layer_init_method=output_layer_init_method, bias=bias,
            return_bias=not self.parallel_attention_mlp, sequence_parallel=self.sequence_parallel,
            params_dtype=params_dtype, return_layernorm_output=self.apply_residual_connection_post_layernorm,
            set_parallel_mode=set_parallel_mode, zero_centered_gamma=zero_centered_gamma, activation=activation,
            normalization=normalization, device=device, name=f"{label}.layernorm_mlp",
            fuse_wgrad_accumulation=fuse_wgrad_accumulation)
        self.drop_path = _DropPath(float(drop_path_rate)) if drop_path_rate > 0.0 else None
        if self.output_layernorm:
            norm = LayerNorm if normalization == "LayerNorm" else RMSNorm
            self.layernorm = norm(hidden_size, eps=layernorm_epsilon, sequence_parallel=self.sequence_parallel,
                                  params_dtype=params_dtype, zero_centered_gamma=zero_centered_gamma,
                                  device=self.layernorm_mlp.fc1_weight.device)

    def set_tensor_parallel_group(self, tp_group: Optional[dist.ProcessGroup]) -> None:
        """Set the tensor-parallel group of every submodule (TransformerEngine's method)."""
        for child in self.children():
            if hasattr(child, "set_tensor_parallel_group"):
                child.set_tensor_parallel_group(tp_group)

    def set_context_parallel_group(self, cp_group: Optional[dist.ProcessGroup], cp_global_ranks: Optional[List[int]],
                                   cp_stream: Any, cp_comm_type: str = "p2p") -> None:
        """Context parallelism of the attentions (see `DotProductAttention.set_context_parallel_group`)."""
        for child in self.children():
            if hasattr(child, "set_context_parallel_group"):
                child.set_context_parallel_group(cp_group, cp_global_ranks, cp_stream, cp_comm_type)

    def _bias_dropout_add(self, out: torch.Tensor, bias: Optional[torch.Tensor], residual: torch.Tensor,
                          drop_path: Optional[torch.nn.Module] = None) -> torch.Tensor:
        if bias is not None and bias.numel():
            out = out + bias
        out = F.dropout(out, p=self.hidden_dropout, training=self.training)
        if drop_path is not None:
            out = drop_path(out)
        return residual + out

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: Optional[Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]] = None,
        self_attn_mask_type: Optional[str] = None,
        window_size: Optional[Tuple[int, int]] = None,
        encoder_output: Optional[torch.Tensor] = None,
        enc_dec_attn_mask: Optional[Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]] = None,
        enc_dec_attn_mask_type: Optional[str] = None,
        enc_dec_window_size: Optional[Tuple[int, int]] = None,
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
    ) -> torch.Tensor:
        """Self-attention, cross-attention (decoders), MLP, each with bias-dropout-add into the residual (see
        the class docstring). Masks, windows, rotary embeddings and the packed-sequence arguments go to the
        attentions (the self-attention uses `cu_seqlens_q` / `max_seqlen_q` for keys too, as in
        TransformerEngine); what `MultiheadAttention` refuses raises here too."""
        if self_attn_mask_type is None:
            self_attn_mask_type = self.self_attn_mask_type
        if window_size is None:
            window_size = self.window_size
        if enc_dec_attn_mask_type is None:
            enc_dec_attn_mask_type = self.enc_dec_attn_mask_type
        if enc_dec_window_size is None:
            enc_dec_window_size = self.enc_dec_window_size
        hidden_states = in_autocast_dtype(hidden_states).contiguous()  # AMP: the layer runs in its dtype, as TE's
        shared = dict(inference_params=inference_params, is_first_microbatch=is_first_microbatch,
                      checkpoint_core_attention=checkpoint_core_attention, rotary_pos_emb=rotary_pos_emb,
                      core_attention_bias_type=core_attention_bias_type, core_attention_bias=core_attention_bias,
                      alibi_slopes=alibi_slopes, fast_zero_fill=fast_zero_fill, pad_between_seqs=pad_between_seqs)
        attn = self.self_attention(
            hidden_states, attention_mask=attention_mask, attn_mask_type=self_attn_mask_type, window_size=window_size,
            cu_seqlens_q=cu_seqlens_q, cu_seqlens_kv=cu_seqlens_q, cu_seqlens_q_padded=cu_seqlens_q_padded,
            cu_seqlens_kv_padded=cu_seqlens_q_padded, max_seqlen_q=max_seqlen_q, max_seqlen_kv=max_seqlen_q,
            **shared)
        if self.apply_residual_connection_post_layernorm and not self.output_layernorm:
            out, bias, residual = attn
            hidden_states = self._bias_dropout_add(out, bias, residual, self.drop_path)
        elif not self.parallel_attention_mlp:
            out, bias = attn
            hidden_states = self._bias_dropout_add(out, bias, hidden_states, self.drop_path)

        if self.layer_type == "decoder":
            cross = self.inter_attention(
                hidden_states, attention_mask=enc_dec_attn_mask, attn_mask_type=enc_dec_attn_mask_type,
                window_size=enc_dec_window_size, encoder_output=encoder_output, cu_seqlens_q=cu_seqlens_q,
                cu_seqlens_kv=cu_seqlens_kv, cu_seqlens_q_padded=cu_seqlens_q_padded,
                cu_seqlens_kv_padded=cu_seqlens_kv_padded, max_seqlen_q=max_seqlen_q, max_seqlen_kv=max_seqlen_kv,
                **shared)
            if self.apply_residual_connection_post_layernorm:
                out, bias, residual = cross
            else:
                (out, bias), residual = cross, hidden_states
            hidden_states = self._bias_dropout_add(out, bias, residual)

        mlp = self.layernorm_mlp(hidden_states, is_first_microbatch=is_first_microbatch)
        if self.apply_residual_connection_post_layernorm:
            out, bias, residual = mlp
            output = self._bias_dropout_add(out, bias, residual, self.drop_path)
        elif self.parallel_attention_mlp:  # both biases are inside the outputs here
            output = self._bias_dropout_add(attn, mlp, hidden_states, self.drop_path)
        else:
            out, bias = mlp
            output = self._bias_dropout_add(out, bias, hidden_states, self.drop_path)
        if self.output_layernorm:
            output = self.layernorm(output)
        return output

    def extra_repr(self) -> str:
        return (f"layer_type={self.layer_type}, output_layernorm={self.output_layernorm}, "
                f"parallel_attention_mlp={self.parallel_attention_mlp}, "
                f"post_layernorm_residual={self.apply_residual_connection_post_layernorm}")
