"""`FP8TransformerBlock`: megatron's TransformerBlock with one FP8 scope per pass and full activation recompute
without TransformerEngine; and the block specs' way of making the block megatron builds one.

megatron's `GPTModel` always constructs a plain `TransformerBlock` from the spec it is given (the spec's
`module` is not used), so the specs of `fp8_parallel.megatron` and `fp8_parallel.megatron_lm` adopt the block
while it reads their layer list: its class becomes `FP8TransformerBlock` (same state, same parameters), and
for MoE models the expert amax domain is set up from megatron's groups (see `expert_scope`).
"""
from __future__ import annotations

import sys
from typing import List, Optional

from .startup import import_megatron_core

import_megatron_core()  # megatron-core without torch's compiler (see startup.py), before its imports below
from megatron.core import tensor_parallel
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlock, TransformerBlockSubmodules

from .expert_scope import ensure_megatron_expert_domain
from .megatron_config import fp8_context, recipe_from_config
from .modules.norm import Norm

__all__ = ["FP8BlockSubmodules", "FP8TransformerBlock", "adopt_block", "block_under_construction", "prepare_block"]

_FRAMES_SEARCHED = 8  # how far up the stack the block under construction is looked for


class FP8TransformerBlock(TransformerBlock):
    """megatron's TransformerBlock with one FP8 scope around each forward, and full activation recompute
    through megatron's own (reentrant) checkpoint.

    With `config.fp8` unset it opens no scope and follows the enclosing one, like `FP8TransformerLayer`, and
    recomputes exactly as megatron's block does.
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
        if not config.fp8:
            return super()._checkpointed_forward(
                hidden_states, attention_mask, context, context_mask, rotary_pos_emb, attention_bias,
                packed_seq_params, use_inner_quantization_context, padding_mask=padding_mask)

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


def block_under_construction(required: bool = True) -> Optional[TransformerBlock]:
    """The `TransformerBlock` whose `__init__` is reading a block spec's layers, found on the call stack
    (megatron passes the spec to the block, but nothing that says which block or stage reads it).

    Raises:
        RuntimeError: none is found and `required` (with `required=False`: None).
    """
    frame = sys._getframe(2)
    for _ in range(_FRAMES_SEARCHED):
        if frame is None:
            break
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, TransformerBlock):
            return candidate
        frame = frame.f_back
    if not required:
        return None
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


def prepare_block(block: TransformerBlock) -> FP8TransformerBlock:
    """What a block spec does to the block that reads it: the expert amax domain for MoE models (collective:
    every rank builds its blocks, in the same order), then `adopt_block`."""
    if getattr(block.config, "num_moe_experts", None):
        ensure_megatron_expert_domain()
    return adopt_block(block)


class FP8BlockSubmodules(TransformerBlockSubmodules):
    """A fixed block spec (`get_gpt_block_spec`) that prepares the block reading it (`prepare_block`): the
    block megatron's `GPTModel` builds becomes an `FP8TransformerBlock`. Read outside a block's construction
    it is a plain list of layer specs.

    Args:
        layer_specs: the block's layers.
        layer_norm: the final norm.
    """

    def __init__(self, layer_specs: List[ModuleSpec], layer_norm: type = Norm):
        # not the dataclass __init__: `layer_specs` is a property that sees who reads it
        self._layer_specs = list(layer_specs)
        self.layer_norm = layer_norm

    @property
    def layer_specs(self) -> List[ModuleSpec]:
        block = block_under_construction(required=False)
        if block is not None and (type(block) is TransformerBlock or isinstance(block, FP8TransformerBlock)):
            prepare_block(block)
        return self._layer_specs

    def __repr__(self) -> str:
        return f"FP8BlockSubmodules(layers={len(self._layer_specs)}, final_norm={self.layer_norm.__name__})"

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, FP8BlockSubmodules) and self._layer_specs == other._layer_specs
                and self.layer_norm is other.layer_norm)

    __hash__ = object.__hash__
