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
  For MoE models it also builds the expert amax domain from megatron's groups (Megatron-LM's start-up builds
  megatron's groups only), so expert amaxes are reduced over the ranks that hold the same experts.
* `layer_spec`: the bare `FP8TransformerLayer` spec. Megatron pairs it with its own final norm (torch's,
  without TransformerEngine or apex), which refuses `--sequence-parallel`, and the layers keep one scope
  each; prefer `block_spec`.

`fp8_parallel.megatron.get_gpt_layer_spec` is a function: Megatron-LM rejects it ("specialize for
function."). docs/megatron-lm.md has the full command line.
"""
from __future__ import annotations

from typing import List, Optional

from .startup import import_megatron_core

import_megatron_core()  # megatron-core without torch's compiler (see startup.py), before its imports below
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.utils import get_pg_rank

from .megatron import get_gpt_layer_spec
from .megatron_block import FP8TransformerBlock, adopt_block, block_under_construction, prepare_block
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
        block = block_under_construction()
        prepare_block(block)
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
