"""megatron-core integration: FP8 recipe and contexts from `TransformerConfig`, and a GPT layer spec.

    spec = get_gpt_block_spec(config, num_experts=None)                 # or get_gpt_layer_spec(...)
    model = GPTModel(config=config, transformer_layer_spec=spec, ...)   # megatron's own GPTModel
    with fp8_context(config):                                            # one scope for the whole pass
        output = model(...)

The block megatron builds from `get_gpt_block_spec` is an `FP8TransformerBlock`: with `config.fp8` set it
opens one scope per pass (so the caller's `fp8_context` is optional) and runs `recompute_granularity="full"`
through megatron's own checkpoint. Each `FP8TransformerLayer` opens its own scope too (bf16 for the
first/last layers when `config.first_last_layers_bf16`); inside an outer scope the layer scopes share its
key, so the whole model still costs one amax collective per direction. MoE experts run in a nested scope over
the expert amax domain (the ranks that hold the same experts; built from megatron's groups when
`parallel_state.initialize` did not run).
"""
from __future__ import annotations

from typing import Optional

from .startup import import_megatron_core

import_megatron_core()  # megatron-core without torch's compiler (see startup.py), before its imports below
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import get_num_layers_to_build
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add

from .expert_scope import expert_scope, experts_reduce_over_dense_dp  # noqa: F401
from .modules import ColumnParallelLinear, LayerNormColumnParallelLinear, RowParallelLinear
from .modules.norm import Norm
from .megatron_block import FP8BlockSubmodules, FP8TransformerBlock
from .megatron_config import fp8_context, is_bf16_layer, recipe_from_config

__all__ = [
    "FP8SequentialMLP",
    "FP8TransformerBlock",
    "FP8TransformerLayer",
    "expert_scope",
    "fp8_context",
    "fuse_wgrad_accumulation",
    "get_gpt_block_spec",
    "get_gpt_layer_spec",
    "is_bf16_layer",
    "recipe_from_config",
]

class FP8TransformerLayer(TransformerLayer):
    """megatron's TransformerLayer, run inside its FP8 scope (or in high precision for bf16 layers).

    With `config.fp8` unset the layer opens no scope of its own and follows the enclosing one: megatron 0.16
    routes full activation recompute through TransformerEngine whenever `config.fp8` is set, so a model that
    recomputes without TransformerEngine keeps `config.fp8` off and runs under `fp8_parallel.autocast`."""

    def forward(self, *args, **kwargs):
        if recipe_from_config(self.config) is None:
            return super().forward(*args, **kwargs)
        with fp8_context(self.config, self.layer_number - 1):
            return super().forward(*args, **kwargs)


class FP8SequentialMLP(SequentialMLP):
    """megatron's SequentialMLP experts (our FP8 linears), inside a scope over the expert amax domain.

    Its parameters carry megatron's expert `allreduce` mark, as `FP8GroupedMLP`'s do (our linears set none):
    see `experts_reduce_over_dense_dp`."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        dense = experts_reduce_over_dense_dp(self.config)
        for p in self.parameters():
            p.allreduce = dense

    def forward(self, *args, **kwargs):
        with expert_scope():
            return super().forward(*args, **kwargs)


def _define_missing_te_general_gemm() -> None:
    """megatron-core 0.16's MoE router (`moe_utils.router_gating_linear`) calls `te_general_gemm` when the name
    is not None, and leaves it undefined when TransformerEngine is absent: every MoE forward on a GPU without
    TransformerEngine then fails with NameError. Defined as None here (what megatron means: its own torch
    GEMM); a TransformerEngine install keeps its function."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def get_gpt_layer_spec(
    num_experts: Optional[int] = None,
    moe_grouped_gemm: bool = False,
    qk_layernorm: bool = False,
    normalization: str = "LayerNorm",
    attention_backend: str = "sdpa",
) -> ModuleSpec:
    """A `TransformerLayer` spec with this package's FP8 modules (QKV and fc1 with the norm fused in front).

    Set `config.normalization` to the same value. MoE experts: `moe_grouped_gemm=True` gives
    `FP8GroupedMLP` (one grouped linear per projection), False megatron's SequentialMLP of FP8 linears.
    Core attention: `attention_backend="sdpa"` (torch SDPA, context parallel; `modules.attention`) or
    "local" (megatron's `DotProductAttention`).
    """
    if normalization not in ("LayerNorm", "RMSNorm"):
        raise ValueError(f"normalization={normalization!r}: expected 'LayerNorm' or 'RMSNorm'")
    if attention_backend not in ("sdpa", "local"):
        raise ValueError(f"attention_backend={attention_backend!r}: expected 'sdpa' or 'local'")
    from .modules.attention import SDPADotProductAttention

    attention = ModuleSpec(
        module=SelfAttention,
        params={"attn_mask_type": AttnMaskType.causal},
        submodules=SelfAttentionSubmodules(
            linear_qkv=LayerNormColumnParallelLinear,
            core_attention=SDPADotProductAttention if attention_backend == "sdpa" else DotProductAttention,
            linear_proj=RowParallelLinear,
            q_layernorm=Norm if qk_layernorm else IdentityOp,
            k_layernorm=Norm if qk_layernorm else IdentityOp,
        ),
    )
    if num_experts is None:
        mlp = ModuleSpec(module=MLP, submodules=MLPSubmodules(
            linear_fc1=LayerNormColumnParallelLinear, linear_fc2=RowParallelLinear))
        pre_mlp_norm = IdentityOp
    else:
        _define_missing_te_general_gemm()  # the router would fail on GPUs without TransformerEngine
        if moe_grouped_gemm:
            from .modules.grouped import FP8GroupedMLP

            experts = ModuleSpec(module=FP8GroupedMLP)
        else:
            experts = ModuleSpec(module=FP8SequentialMLP, submodules=MLPSubmodules(
                linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear))
        mlp = ModuleSpec(module=MoELayer, submodules=MoESubmodules(experts=experts, shared_experts=None))
        pre_mlp_norm = Norm
    return ModuleSpec(
        module=FP8TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=IdentityOp,
            self_attention=attention,
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=pre_mlp_norm,
            mlp=mlp,
            mlp_bda=get_bias_dropout_add,
        ),
    )


def get_gpt_block_spec(config, num_experts: Optional[int] = None, vp_stage: Optional[int] = None, **kwargs) -> ModuleSpec:
    """A block spec: this stage's layers from `get_gpt_layer_spec` and a final norm that supports sequence
    parallelism (megatron's torch-norm fallback refuses it without TransformerEngine or apex).

    The block built from it (by megatron's `GPTModel`, which always constructs a plain `TransformerBlock`, or
    by `build_module`) is an `FP8TransformerBlock`: one FP8 scope per pass when `config.fp8` is set, and
    `recompute_granularity="full"` with `config.fp8` through megatron's own checkpoint. For MoE models
    (`config.num_moe_experts`) building it also sets up the expert amax domain from megatron's groups when
    `parallel_state.initialize` did not run (collective: every rank builds its blocks).

    Args:
        config: megatron's TransformerConfig (layer count per stage, normalization).
        num_experts: MoE layers when given (see `get_gpt_layer_spec`).
        vp_stage: the virtual pipeline stage whose layers to build.
        **kwargs: more `get_gpt_layer_spec` options.
    """
    normalization = getattr(config, "normalization", "LayerNorm")
    layer = get_gpt_layer_spec(num_experts=num_experts, normalization=normalization, **kwargs)
    layers = [layer] * get_num_layers_to_build(config, vp_stage=vp_stage)
    return ModuleSpec(module=FP8TransformerBlock, submodules=FP8BlockSubmodules(layers, layer_norm=Norm))


def fuse_wgrad_accumulation(model, enabled: bool = True) -> int:
    """Set `fuse_wgrad_accumulation = enabled` on every linear of this package in `model`: their weight
    gradients are accumulated in float32 and added into `main_grad` in the GEMM (megatron's
    `gradient_accumulation_fusion`, which megatron's layers accept only with apex). For a model wrapped in
    megatron's DistributedDataParallel, before or after wrapping: its buffers must exist at the first training
    forward. Returns the number of layers set.

    Raises:
        RuntimeError: later, at a training forward, from a layer whose weight has no `main_grad` (naming the
        weight by its name in `model`).
    """
    count = 0
    for name, module in model.named_modules():
        if hasattr(type(module), "fuse_wgrad_accumulation") or (
                type(module).__module__.startswith("fp8_parallel.") and hasattr(module, "fuse_wgrad_accumulation")):
            module.fuse_wgrad_accumulation = enabled
            if hasattr(type(module), "fused_wgrad_name"):
                module.fused_wgrad_name = f"{name}.weight" if name else "weight"
            count += 1
    return count
