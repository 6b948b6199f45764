"""A tiny multi-chunk model driven by megatron's real pipeline schedules, and its single-process reference."""
from __future__ import annotations

from functools import partial
from typing import List, Optional, Sequence, Tuple

import torch
from megatron.core.enums import ModelType
from megatron.core.transformer.transformer_config import TransformerConfig

HIDDEN = 8
SEQ = 4
MICRO_BATCH = 2


def make_config(pp: int, vpp: Optional[int], tp: int = 1) -> TransformerConfig:
    return TransformerConfig(
        num_layers=pp * (vpp or 1),
        hidden_size=HIDDEN,
        num_attention_heads=2 * tp,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        pipeline_dtype=torch.float32,
        params_dtype=torch.float32,
        # As megatron-LM does for interleaving: unbatched p2p. With pp=2 both neighbours are the same rank, and
        # batched isend/irecv would match an activation with a gradient (same peer, same shape).
        overlap_p2p_comm=vpp is not None,
        batch_p2p_comm=vpp is None,
    )


class ToyChunk(torch.nn.Module):
    """One pipeline chunk: linear + tanh. Like megatron's models, only the first chunk (`pre_process`) reads
    the batch; every other chunk reads the activation the schedule handed to `set_input_tensor`."""

    def __init__(self, config: TransformerConfig, seed: int, chunk_index: int) -> None:
        super().__init__()
        self.config = config
        self.model_type = ModelType.encoder_or_decoder
        gen = torch.Generator().manual_seed(seed * 1000 + chunk_index)
        self.weight = torch.nn.Parameter(torch.randn(HIDDEN, HIDDEN, generator=gen) / HIDDEN**0.5)
        self.bias = torch.nn.Parameter(torch.randn(HIDDEN, generator=gen) * 0.1)
        self.input_tensor: Optional[torch.Tensor] = None
        self.pre_process = chunk_index == 0

    def set_input_tensor(self, tensors) -> None:
        self.input_tensor = tensors[0] if isinstance(tensors, (list, tuple)) else tensors

    def forward(self, x: Optional[torch.Tensor]) -> torch.Tensor:
        inp = x if self.pre_process else self.input_tensor
        return torch.tanh(inp @ self.weight.t() + self.bias)


def make_batches(seed: int, n: int) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(SEQ, MICRO_BATCH, HIDDEN, generator=gen), torch.randn(SEQ, MICRO_BATCH, HIDDEN, generator=gen))
        for _ in range(n)
    ]


def _loss(target: torch.Tensor, output: torch.Tensor):
    loss = ((output - target) ** 2).mean()
    return loss, {"loss": loss.detach().clone()}


def forward_step(data_iterator, model):
    x, target = next(data_iterator)
    return model(x), partial(_loss, target)


def reference_grads(
    config: TransformerConfig,
    seed: int,
    batches: Sequence[Tuple[torch.Tensor, torch.Tensor]],
    n_chunks: int,
    device: torch.device = torch.device("cpu"),
) -> Tuple[List[List[torch.Tensor]], List[float]]:
    """Single-process run over all chunks in order; returns per-chunk grads and per-microbatch losses."""
    chunks = [ToyChunk(config, seed, i).to(device) for i in range(n_chunks)]
    losses = []
    for x, target in batches:
        h = x
        for c in chunks:
            c.set_input_tensor(h)
            h = c(x)
        loss = _loss(target, h)[0] / len(batches)
        loss.backward()
        losses.append(loss.item() * len(batches))
    return [[p.grad.clone() for p in c.parameters()] for c in chunks], losses
