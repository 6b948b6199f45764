"""Spec objects for Megatron-LM's own training scripts: `pretrain_gpt.py --spec fp8_parallel.megatron_lm NAME`.

Megatron-LM resolves `--spec MODULE NAME` by importing MODULE and taking its attribute NAME as the model's
`transformer_layer_spec`, without calling it; megatron's `GPTModel` then always builds a plain
`TransformerBlock` from it. So what `--spec` names must be a ready spec object, and the one that works on
every pipeline stage has to learn its stage from the block that is being built:

* `block_spec` (dense), `block_spec_qk_norm` (with query/key norms), `moe_block_spec` (MoE, SequentialMLP
  experts), `moe_grouped_block_spec` (MoE, grouped FP8 experts): `StageBlockSpec`s. Each gives the block
  being built its own stage's number of FP8 layers (pipeline rank and virtual stage read from that block)
  and a final norm that supports `--sequence-parallel`. It also makes that block an `FP8TransformerBlock`:
  one FP8 scope per block pass (the layers' own scopes join its key, so a forward costs one amax
  all-reduce per direction and stage, not one per layer), and `--recompute-granularity full` through
  megatron's own checkpoint instead of TransformerEngine's (which megatron 0.16 picks whenever FP8 is on).
* `layer_spec`: the bare `FP8TransformerLayer` spec. Megatron pairs it with its own final norm (torch's,
  without TransformerEngine or apex), which refuses `--sequence-parallel`, and the layers keep one scope
  each; prefer `block_spec`.

`fp8_parallel.megatron.get_gpt_layer_spec` is a function: Megatron-LM rejects it ("specialize for
function."). docs/megatron-lm.md has the full command line.
"""
from __future__ import annotations

import sys
from typing import List, Optional

from megatron.core import tensor_parallel
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlock,
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.utils import get_pg_rank

from .megatron import fp8_context, get_gpt_layer_spec, recipe_from_config
from .modules.norm import Norm

__all__ = [
    "FP8TransformerBlock",
    "StageBlockSpec",
    "adopt_block",
    "block_spec",
    "block_spec_qk_norm",
    "layer_spec",
    "moe_block_spec",
    "moe_grouped_block_spec",
]

_FRAMES_SEARCHED = 8  # how far up the stack the block under construction is looked for


class FP8TransformerBlock(TransformerBlock):
    """megatron's TransformerBlock with one FP8 scope around each forward, and full activation recompute
    through megatron's own (reentrant) checkpoint.

    With `config.fp8` unset it opens no scope and follows the enclosing one, like `FP8TransformerLayer`.
    """

    def forward(self, *args, **kwargs):
        if recipe_from_config(self.config) is None:
            return super().forward(*args, **kwargs)
        with fp8_context(self.config):  # layer_no=-1: the block scope; bf16 layers still leave it themselves
            return super().forward(*args, **kwargs)

    def _checkpointed_forward(self, hidden_states, attention_mask, context, context_mask, rotary_pos_emb,
                              attention_bias, packed_seq_params, use_inner_quantization_context=False,
                              padding_mask=None):
        """`recompute_granularity="full"`: checkpoint groups of layers with `tensor_parallel.checkpoint`.

        megatron's version hands FP8 runs to TransformerEngine's checkpoint, which does not exist without
        TransformerEngine. Our FP8 layers recognise megatron's checkpoint and recompute with the scales of
        their first pass (`modules/_recompute.py`); each layer opens its own (bf16 or FP8) scope, so
        `use_inner_quantization_context` needs nothing here.
        """
        config = self.config

        def layers(start: int, end: int):
            def run(hidden, mask, ctx, ctx_mask, rope, pad_mask):
                for layer in self.layers[start:end]:
                    hidden, ctx = layer(
                        hidden_states=hidden, attention_mask=mask, context=ctx, context_mask=ctx_mask,
                        rotary_pos_emb=rope, attention_bias=attention_bias, inference_context=None,
                        packed_seq_params=packed_seq_params, padding_mask=pad_mask,
                    )
                return hidden, ctx

            return run

        def step(start: int, end: int, checkpointed: bool):
            nonlocal hidden_states, context
            args = (hidden_states, attention_mask, context, context_mask, rotary_pos_emb, padding_mask)
            if checkpointed:
                hidden_states, context = tensor_parallel.checkpoint(
                    layers(start, end), config.distribute_saved_activations, *args)
            else:
                hidden_states, context = layers(start, end)(*args)

        count, per_group = len(self.layers), config.recompute_num_layers
        if config.recompute_method == "uniform":  # every group of `per_group` layers is one checkpoint
            for start in range(0, count, per_group):
                step(start, min(start + per_group, count), checkpointed=True)
        elif config.recompute_method == "block":  # the first `per_group` layers one by one, the rest plain
            for index in range(count):
                step(index, index + 1, checkpointed=index < per_group)
        else:
            raise ValueError(f"recompute_method={config.recompute_method!r}: expected 'uniform' or 'block'")
        return hidden_states


def _block_under_construction() -> TransformerBlock:
    """The `TransformerBlock` whose `__init__` is reading a `StageBlockSpec` (found on the call stack: megatron
    passes the spec to the block but nothing that says which stage the block is)."""
    frame = sys._getframe(2)
    for _ in range(_FRAMES_SEARCHED):
        if frame is None:
            break
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, TransformerBlock):
            return candidate
        frame = frame.f_back
    raise RuntimeError(
        "StageBlockSpec.layer_specs depends on the pipeline stage and is read only while megatron's "
        "TransformerBlock builds its layers (pass the spec as GPTModel's transformer_layer_spec); to build "
        "a block elsewhere use fp8_parallel.megatron.get_gpt_block_spec(config, vp_stage=...)"
    )


def adopt_block(block: TransformerBlock) -> FP8TransformerBlock:
    """Make a plain megatron `TransformerBlock` an `FP8TransformerBlock` (same state, same parameters).

    megatron's `GPTModel` constructs `TransformerBlock` itself, whatever the spec says; switching the class of
    the block it built is how its forward gets the FP8 scope without changing megatron.

    Raises:
        TypeError: `block` is a different subclass of TransformerBlock (its behaviour would be lost).
    """
    if isinstance(block, FP8TransformerBlock):
        return block
    if type(block) is not TransformerBlock:
        raise TypeError(f"cannot run a {type(block).__name__} as an FP8TransformerBlock: only megatron's "
                        f"TransformerBlock itself (GPTModel's decoder) is adopted")
    block.__class__ = FP8TransformerBlock
    return block


def _check_expert_domain(config) -> None:
    """FP8 experts reduce amaxes over the expert amax domain, which `parallel_state.initialize` builds and
    Megatron-LM's own start-up does not; without it they fall back to the world group, which is that domain
    only without pipeline and expert parallelism."""
    import parallel_state
    from megatron.core import parallel_state as mpu

    if not (getattr(config, "num_moe_experts", None) and config.fp8) or parallel_state.is_initialized():
        return
    pp, ep = mpu.get_pipeline_model_parallel_world_size(), mpu.get_expert_model_parallel_world_size()
    if pp > 1 or ep > 1:
        raise NotImplementedError(
            f"FP8 MoE layers with pipeline_model_parallel_size={pp}, expert_model_parallel_size={ep} need the "
            f"expert amax domain of parallel_state.initialize(...), which was not called; the world group would "
            f"mix unrelated experts' amaxes (or wait on other stages)"
        )


class StageBlockSpec(TransformerBlockSubmodules):
    """A block spec for `GPTModel(transformer_layer_spec=...)` that is right on every pipeline and virtual
    pipeline stage: `layer_specs` is `layer` repeated as many times as the block being built has layers on
    its stage, and that block becomes an `FP8TransformerBlock`.

    Args:
        layer: the spec of one transformer layer (`fp8_parallel.megatron.get_gpt_layer_spec(...)`).
        final_norm: the final norm (built on the last stage only); `Norm` supports sequence parallelism.
    """

    def __init__(self, layer: ModuleSpec, final_norm: type = Norm):
        # not the dataclass __init__: `layer_specs` is computed per block
        self.layer = layer
        self.layer_norm = final_norm

    @property
    def layer_specs(self) -> List[ModuleSpec]:
        block = _block_under_construction()
        _check_expert_domain(block.config)
        adopt_block(block)
        pp_rank = get_pg_rank(getattr(block.pg_collection, "pp", None))
        return [self.layer] * get_num_layers_to_build(block.config, vp_stage=block.vp_stage, pp_rank=pp_rank)

    def __repr__(self) -> str:
        return f"StageBlockSpec(layer={self.layer.module.__name__}, final_norm={self.layer_norm.__name__})"

    def __eq__(self, other: object) -> bool:
        return self is other

    __hash__ = object.__hash__


def _layer(num_experts: Optional[int] = None, **kwargs) -> ModuleSpec:
    return get_gpt_layer_spec(num_experts=num_experts, **kwargs)


# Names for `--spec fp8_parallel.megatron_lm NAME`. The normalization (LayerNorm or RMSNorm) follows
# `--normalization`; the MoE specs need `--num-experts` (the expert count comes from the config).
layer_spec: ModuleSpec = _layer()
block_spec = StageBlockSpec(_layer())
block_spec_qk_norm = StageBlockSpec(_layer(qk_layernorm=True))
moe_block_spec = StageBlockSpec(_layer(num_experts=1))
moe_grouped_block_spec = StageBlockSpec(_layer(num_experts=1, moe_grouped_gemm=True))
