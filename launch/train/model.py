"""The model side of the job: megatron's TransformerConfig and GPTModel (our FP8 layer spec), wrapped in
megatron's DistributedDataParallel, with megatron's distributed optimizer and LR scheduler.

FP8 settings are kept out of `TransformerConfig`: megatron-core 0.16 refuses `fp8` together with MoE when
TransformerEngine is absent, and it routes full activation recompute through TransformerEngine whenever
`config.fp8` is set. The job therefore builds the config without FP8 and keeps megatron's FP8 fields in an
`FP8Settings` object of the same field names; the forward step opens `fp8_parallel.megatron.fp8_context`
of those settings around each micro batch, and the layers of our spec follow that scope (MoE experts in a
nested scope over the expert amax domain).
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import random
from typing import List, Optional, Tuple

import numpy as np
import torch

from megatron.core import parallel_state as mpu
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.models.gpt import GPTModel
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer.module import Float16Module
from megatron.core.transformer.transformer_config import TransformerConfig

from fp8_parallel.megatron import fuse_wgrad_accumulation, get_gpt_block_spec, recipe_from_config


@dataclasses.dataclass(frozen=True)
class FP8Settings:
    """megatron's FP8 fields of `TransformerConfig` (same names), read by `fp8_parallel.megatron`."""

    fp8: Optional[str]
    fp8_recipe: str = "delayed"
    fp8_margin: int = 0
    fp8_amax_history_len: int = 1
    fp8_amax_compute_algo: str = "max"
    first_last_layers_bf16: bool = False
    tp_only_amax_red: bool = False

    @property
    def recipe(self):
        return recipe_from_config(self)


def fp8_settings(args) -> FP8Settings:
    return FP8Settings(fp8=args.fp8, fp8_recipe=args.fp8_recipe, fp8_margin=args.fp8_margin,
                       fp8_amax_history_len=args.fp8_amax_history_len,
                       fp8_amax_compute_algo=args.fp8_amax_compute_algo)


def padded_vocab_size(vocab_size: int, tp: int, multiple: int = 64) -> int:
    """The vocabulary padded so every tensor-parallel shard of the embedding has equal, aligned rows.

    Padded to a multiple of `multiple * 8` whatever the TP size (when TP divides 8), so the embedding and output
    layer keep one shape across TP 1, 2, 4 and 8 and a checkpoint reshards between them."""
    step = math.lcm(multiple * tp, multiple * 8)
    return -(-vocab_size // step) * step


def transformer_config(args) -> TransformerConfig:
    """megatron's config from the flags (without FP8; see the module docstring)."""
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    moe = {}
    if args.num_experts is not None:
        moe = dict(num_moe_experts=args.num_experts, moe_router_topk=args.moe_router_topk,
                   moe_token_dispatcher_type="alltoall", moe_ffn_hidden_size=args.ffn_hidden_size,
                   moe_aux_loss_coeff=args.moe_aux_loss_coeff, moe_router_load_balancing_type="aux_loss",
                   moe_expert_capacity_factor=args.moe_expert_capacity_factor,
                   moe_pad_expert_input_to_capacity=args.moe_pad_expert_input_to_capacity,
                   moe_token_drop_policy=args.moe_token_drop_policy)
    recompute = {}
    if args.recompute_granularity == "full":
        recompute = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    elif args.recompute_granularity == "selective":
        recompute = dict(recompute_granularity="selective")
    vpp = args.virtual_pipeline_model_parallel_size
    return TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=vpp,
        context_parallel_size=args.context_parallel_size,
        expert_model_parallel_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=args.expert_tensor_parallel_size,
        sequence_parallel=args.sequence_parallel,
        add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.02,
        use_cpu_initialization=True, params_dtype=dtype, pipeline_dtype=dtype, bf16=args.bf16,
        overlap_p2p_comm=vpp is not None, batch_p2p_comm=vpp is None,
        # not `fp8` itself (see the module docstring); the history length sizes each FP8 module's amax
        # history at construction, so a fresh model has the state shapes of a trained one (checkpoint loads)
        fp8_amax_history_len=args.fp8_amax_history_len,
        **moe, **recompute,
    )


def reduce_experts_over_expert_dp(model: torch.nn.Module) -> int:
    """Mark every MoE expert parameter of `model` for gradient reduction over the expert data-parallel group
    (`allreduce = False`, read by megatron's DDP and optimizer when they are built); returns how many.

    megatron-core 0.16 marks expert linears so only with expert parallelism (EP > 1). With EP1 and an expert
    TP below the dense TP (the MoE default of sequence-parallel runs: TP2, expert TP1), each TP rank's copy
    of an expert sees only its own share of the tokens, yet as a "dense" parameter its gradient is reduced
    over data parallelism alone: the copies drift apart, and a checkpoint (one copy) does not resume them.
    Over expert-DP (which holds those TP ranks) the copies get the same, complete gradient.
    """
    from megatron.core.transformer.moe.moe_layer import MoELayer

    count = 0
    for module in model.modules():
        if isinstance(module, MoELayer):
            for p in module.experts.parameters():
                p.allreduce = False
                count += 1
    return count


def build_model(args, config: TransformerConfig, vocab_size: int) -> List[torch.nn.Module]:
    """This rank's model chunks (one per virtual stage): GPTModel, in Float16Module for bf16, in megatron DDP.

    Seeded from `--seed`: megatron's model-parallel RNG tracker (graph-safe states with `--cuda-graph` on GPUs),
    torch's generator, and Python's and NumPy's global ones, so every launch with the same seed builds the same
    weights and holds the same RNG states (which checkpoints save and restore).
    """
    random.seed(args.seed)
    np.random.seed(args.seed % 2**32)
    torch.manual_seed(args.seed)
    # CUDA graphs replay RNG (dropout, attention) only from graph-safe generator states
    model_parallel_cuda_manual_seed(args.seed, use_cudagraphable_rng=bool(args.cuda_graph) and torch.cuda.is_available())
    vpp = args.virtual_pipeline_model_parallel_size
    chunks = []
    for v in range(vpp or 1):
        stage = dict(vp_stage=v) if vpp else {}
        model = GPTModel(
            config=config,
            transformer_layer_spec=get_gpt_block_spec(config, num_experts=args.num_experts, vp_stage=v if vpp else None),
            vocab_size=padded_vocab_size(vocab_size, args.tensor_model_parallel_size),
            max_sequence_length=args.max_position_embeddings,
            pre_process=mpu.is_pipeline_first_stage(ignore_virtual=False, **stage),
            post_process=mpu.is_pipeline_last_stage(ignore_virtual=False, **stage),
            position_embedding_type="learned_absolute", **stage,
        )
        reduce_experts_over_expert_dp(model)
        if torch.cuda.is_available():
            model = model.cuda()
        if args.bf16:
            model = Float16Module(config, model)
        chunks.append(model)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=True,
        check_for_nan_in_grad=False, bucket_size=None,
    )
    # DDP's gradient hooks sit on each parameter's accumulator node, made here: on a side stream, so that a
    # backward captured into a CUDA graph (--cuda-graph) never has to make the default stream wait on it
    with torch.cuda.stream(torch.cuda.Stream()) if torch.cuda.is_available() else contextlib.nullcontext():
        wrapped = [DistributedDataParallel(config=config, ddp_config=ddp_config, module=chunk, disable_bucketing=i > 0)
                   for i, chunk in enumerate(chunks)]
    if not args.no_gradient_accumulation_fusion:  # our layers add their weight gradients into DDP's buffers
        for chunk in wrapped:
            fuse_wgrad_accumulation(chunk)
    return wrapped


def use_fused_torch_adam(optimizer, fused: bool = True) -> int:
    """Switch megatron's optimizer to torch's fused Adam kernels where it fell back to torch's Adam (no
    TransformerEngine or apex): one kernel per parameter group instead of foreach ones, whose temporaries
    are as large as the parameters. `fused=False` puts torch's own choice back (for CPU runs: a GPU
    checkpoint's groups carry `fused=True`). Idempotent; call it again after loading a checkpoint (its
    parameter groups carry the setting it was saved with, and its step counts may sit on the CPU, where the
    fused kernels cannot read them: they are moved to their parameter's device). Returns the number of
    groups switched."""
    switched = 0
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        torch_opt = getattr(inner, "optimizer", None)
        if not isinstance(torch_opt, (torch.optim.Adam, torch.optim.AdamW)):
            continue
        for group in torch_opt.param_groups:
            if not all(p.is_floating_point() for p in group["params"]):
                continue
            if not fused:
                group["foreach"], group["fused"] = None, None
                continue
            group["foreach"], group["fused"] = False, True
            for p in group["params"]:
                step = torch_opt.state.get(p, {}).get("step")
                if isinstance(step, torch.Tensor) and step.device != p.device:
                    torch_opt.state[p]["step"] = step.to(p.device, torch.float32)
            switched += 1
    return switched


def build_optimizer(args, model: List[torch.nn.Module]) -> Tuple[object, OptimizerParamScheduler]:
    """megatron's distributed Adam (fp32 master weights and moments, grad clipping) and its LR schedule."""
    opt_config = OptimizerConfig(
        optimizer="adam", lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay,
        bf16=args.bf16, params_dtype=torch.bfloat16 if args.bf16 else torch.float32,
        clip_grad=args.clip_grad, use_distributed_optimizer=True, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8,
    )
    # the job switches it to torch's fused Adam kernels once any checkpoint is loaded (`use_fused_torch_adam`)
    optimizer = get_megatron_optimizer(opt_config, model)
    warmup = min(args.lr_warmup_iters, max(args.train_iters - 1, 0))
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0 if warmup else args.lr, max_lr=args.lr, min_lr=args.min_lr,
        lr_warmup_steps=warmup, lr_decay_steps=args.train_iters, lr_decay_style=args.lr_decay_style,
        start_wd=args.weight_decay, end_wd=args.weight_decay, wd_incr_steps=args.train_iters,
        wd_incr_style="constant",
        # megatron's pair: on resume the checkpoint's schedule wins unless --override-opt-param-scheduler
        override_opt_param_scheduler=args.override_opt_param_scheduler,
        use_checkpoint_opt_param_scheduler=not args.override_opt_param_scheduler,
    )
    return optimizer, scheduler
