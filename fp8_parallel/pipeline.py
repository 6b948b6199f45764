"""The order in which megatron's pipeline schedules run forward and backward passes of a rank's chunks.

`capture_order` lists, for one pipeline rank, `+c` for the forward of model chunk c (1-indexed) on its next
microbatch and `-c` for the backward of chunk c, in the order megatron-core's 1F1B (vpp=None) and
interleaved 1F1B schedules execute them. Graphed callables are captured in exactly this order
(`graph_megatron_layers` does it for the transformer layers of a rank's megatron model chunks).

Interleaved schedule, as megatron-core runs it: microbatches are taken in groups of
`microbatch_group_size_per_vp_stage` (default: the pipeline size; the last group takes the remainder); for
each group every chunk runs its forwards in chunk order. Backwards follow the same table with the chunks
reversed. A rank runs `(pp - rank - 1) * 2 + (vpp - 1) * group` warm-up forwards (all of them if there are
not more), then alternates one forward and one backward, then drains the remaining backwards.
"""
from __future__ import annotations

from typing import Callable, List, Optional

import torch


def capture_order(
    num_microbatches: int,
    pp_size: int,
    pp_rank: int,
    vpp_size: Optional[int] = None,
    microbatch_group_size_per_vp_stage: Optional[int] = None,
) -> List[int]:
    """The forward/backward order of this rank's chunks for one training step (see the module docstring).

    Raises:
        ValueError: sizes that describe no pipeline rank (megatron's own schedule validates microbatch
            counts and group sizes when it runs).
    """
    if pp_size < 1 or not 0 <= pp_rank < pp_size or num_microbatches < 1:
        raise ValueError(f"capture_order: pp_size={pp_size}, pp_rank={pp_rank}, num_microbatches={num_microbatches}")
    chunks = vpp_size or 1
    if chunks == 1:
        warmup = min(pp_size - pp_rank - 1, num_microbatches)
        forward_chunks = [0] * num_microbatches
    else:
        group = microbatch_group_size_per_vp_stage or pp_size
        forward_chunks = []
        for start in range(0, num_microbatches, group):
            end = num_microbatches if start + group >= num_microbatches else start + group
            forward_chunks += [chunk for chunk in range(chunks) for _ in range(start, end)]
        warmup = min((pp_size - pp_rank - 1) * 2 + (chunks - 1) * group, len(forward_chunks))
    forwards = [c + 1 for c in forward_chunks]
    backwards = [-(chunks - c) for c in forward_chunks]  # backward runs the chunks in reverse
    order = forwards[:warmup]
    for i in range(warmup, len(forwards)):
        order += [forwards[i], backwards[i - warmup]]
    order += backwards[len(backwards) - warmup :] if warmup else []
    return order


# -- graphed transformer layers driven by megatron's schedule ------------------------------------------------

def _unwrap(chunk):
    """The GPT model inside megatron's wrappers (DDP, Float16Module)."""
    model = chunk
    while not hasattr(model, "decoder") and hasattr(model, "module"):
        model = model.module
    if not hasattr(model, "decoder"):
        raise TypeError(f"graph_megatron_layers: {type(chunk).__name__} holds no megatron model with a `decoder`")
    return model


def layer_sample_kwargs(config, seq_length: int, micro_batch_size: int, device: torch.device) -> dict:
    """Sample keyword arguments of one megatron `TransformerLayer` call: `hidden_states` of this rank's shape
    `[seq / CP (/ TP with sequence parallel), micro batch, hidden]` in `config.params_dtype`."""
    from megatron.core import parallel_state as mpu

    seq = seq_length // mpu.get_context_parallel_world_size()
    if getattr(config, "sequence_parallel", False):
        seq //= mpu.get_tensor_model_parallel_world_size()
    hidden = torch.randn(seq, micro_batch_size, config.hidden_size, dtype=config.params_dtype, device=device)
    return {"hidden_states": hidden.requires_grad_()}


def rotary_sample_kwargs(chunk, seq_length: int) -> dict:
    """`rotary_pos_emb` of a megatron GPTModel with rotary position embeddings, as its forward passes it to every
    layer (the frequencies of `seq_length` positions, this rank's part under context parallelism); {} for
    other position embeddings."""
    gpt = _unwrap(chunk)
    if getattr(gpt, "position_embedding_type", None) != "rope" or getattr(gpt, "rotary_pos_emb", None) is None:
        return {}
    return {"rotary_pos_emb": gpt.rotary_pos_emb(seq_length)}


class GraphedPipeline:
    """The graphed transformer layers of a rank's model chunks, and the forward-step adapter.

    `forward_step(func)` wraps megatron's forward step: each call for chunk c points chunk c's graphed
    layers at the chunk's next microbatch (so its forward replays that microbatch's graphs; autograd replays
    the matching backward graphs when the schedule runs the backward), then calls `func` unchanged.

    Attributes:
        graphed: per chunk, its layers' `GraphedCallable`s (replay and eager counts, `reset`).
    """

    def __init__(self, chunks: list, layers: List[list], num_microbatches: int, graphed: List[list]):
        self.chunks = chunks
        self.layers = layers
        self.graphed = graphed
        self.num_microbatches = num_microbatches
        self._next = [0] * len(chunks)

    def _chunk_index(self, model) -> int:
        for i, chunk in enumerate(self.chunks):
            if model is chunk:
                return i
        raise ValueError("GraphedPipeline.forward_step: called with a model chunk that was not graphed")

    def forward_step(self, forward_step_func: Callable) -> Callable:
        def graphed_forward_step(data_iterator, model):
            c = self._chunk_index(model)
            mb = self._next[c]
            for call in self.graphed[c]:
                call.next_microbatch = mb
            self._next[c] = (mb + 1) % self.num_microbatches
            return forward_step_func(data_iterator, model)

        return graphed_forward_step

    def rewind(self) -> None:
        """Start every chunk at microbatch 0 (e.g. after an interrupted step)."""
        self._next = [0] * len(self.chunks)

    def reset(self) -> None:
        """Release every layer's graphs (the layers run eagerly afterwards), as `GraphedCallable.reset`.

        Call it (after `torch.cuda.synchronize()`) before `torch.distributed.destroy_process_group()`: graphs
        holding tensor-parallel NCCL collectives keep the process group's teardown waiting forever."""
        for calls in self.graphed:
            for call in calls:
                call.reset()


def graph_megatron_layers(
    model,
    config,
    *,
    num_microbatches: int,
    seq_length: int,
    micro_batch_size: int,
    fp8_recipe=None,
    fp8_weight_caching: bool = False,
    num_warmup_iters: int = 3,
    extra_sample_kwargs: Optional[dict] = None,
    pool=None,
    accumulate_into_main_grad: bool = True,
) -> GraphedPipeline:
    """Graph the transformer layers of this rank's model chunks for megatron's pipeline schedule.

    One forward and one backward graph per (chunk, microbatch, layer), captured in the order megatron's
    schedule runs them on this rank (`capture_order`). Sample arguments come from `config`
    (`layer_sample_kwargs`), the model's `rotary_pos_emb` when it uses rotary embeddings
    (`rotary_sample_kwargs`), plus `extra_sample_kwargs` (e.g. an `attention_mask` tensor, when the forward
    step passes one). `fp8_recipe`: the recipe of the FP8 scope the forward step opens around the model
    (None: the layers are captured outside FP8; layers that open their own scope are recorded either way).
    Use the returned object's `forward_step(func)` as megatron's `forward_step_func`.

    Under megatron's DistributedDataParallel the backward graphs add the layers' gradients into `main_grad`
    (`accumulate_into_main_grad`, see `make_graphed_callables`). Static buffers are shared between
    microbatches that are never in flight together and parameter gradients are returned uncopied
    (`_reuse_graph_input_output_buffers=True`, `clone_param_grads_on_return=False`): megatron's schedule
    consumes each output and gradient before a later replay writes its buffer; code of your own that keeps
    a layer's output or a parameter gradient hook's tensor across microbatches must copy it.

    Layers with dropout fork megatron's RNG tracker; capturing them needs its graph-safe states
    (`model_parallel_cuda_manual_seed(seed, use_cudagraphable_rng=True)`), which every graph registers.

    Raises:
        ValueError: chunks with different layer counts, or full activation recompute (not capturable).
        RuntimeError: layers that fork a tracker without graph-safe states (before any capture).
    """
    from megatron.core import parallel_state as mpu

    from .graphs import make_graphed_callables

    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    if getattr(config, "recompute_granularity", None) == "full":
        raise ValueError("graph_megatron_layers: config.recompute_granularity='full' cannot be captured")
    layers = [list(_unwrap(c).decoder.layers) for c in chunks]
    if len({len(ls) for ls in layers}) != 1 or not layers[0]:
        raise ValueError(f"graph_megatron_layers: layers per chunk {[len(ls) for ls in layers]}; expected an "
                         f"equal, non-zero count")
    vpp = len(chunks) if len(chunks) > 1 else None
    order = capture_order(num_microbatches, mpu.get_pipeline_model_parallel_world_size(),
                          mpu.get_pipeline_model_parallel_rank(), vpp,
                          getattr(config, "microbatch_group_size_per_vp_stage", None))
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    flat = [layer for ls in layers for layer in ls]
    rotary = rotary_sample_kwargs(chunks[0], seq_length)
    samples = [{**layer_sample_kwargs(config, seq_length, micro_batch_size, device), **rotary,
                **(extra_sample_kwargs or {})} for _ in range(len(flat) * num_microbatches)]
    make_graphed_callables(
        flat, [()] * len(samples), sample_kwargs=samples, num_warmup_iters=num_warmup_iters,
        fp8_enabled=fp8_recipe is not None, fp8_recipe=fp8_recipe, fp8_weight_caching=fp8_weight_caching,
        order=order, pool=pool, accumulate_into_main_grad=accumulate_into_main_grad,
        # megatron's schedule consumes each output (sent on, or the loss) and each gradient (added into .grad
        # or main_grad) before the buffers holding it are written again
        _reuse_graph_input_output_buffers=True, clone_param_grads_on_return=False,
    )
    return GraphedPipeline(chunks, layers, num_microbatches, [[layer.forward for layer in ls] for ls in layers])
