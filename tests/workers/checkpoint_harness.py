"""A tiny training run on megatron-core's own stack (GPTModel with the FP8 spec, megatron DDP, the
distributed optimizer, OptimizerParamScheduler, megatron's schedule), for checkpoint tests.

`Run(opts)` builds everything for the current parallel layout; `run.train(until, ...)` trains with
deterministic per-iteration data, and `run.snapshot()` returns every parameter, optimizer and FP8 state
tensor of this rank, for bitwise comparison.
"""
from __future__ import annotations

import dataclasses
import random
from typing import Dict, List, Optional

import numpy as np
import torch
import torch.distributed as dist

import parallel_state as ps

VOCAB = 64


@dataclasses.dataclass(frozen=True)
class Opts:
    """One run's settings (layout, model, FP8)."""

    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: Optional[int] = None
    layers: int = 2
    hidden: int = 32
    heads: int = 4
    seq: int = 32
    mbs: int = 2
    gbs: int = 4
    experts: Optional[int] = None
    fp8: Optional[str] = "hybrid"
    local_spec: bool = False
    seed: int = 1234
    dropout: float = 0.1
    lr: float = 1e-2
    train_iters: int = 10
    megatron_expert_marking: bool = False  # experts marked as megatron does (EP1: dense, one optimizer)

    def run_args(self) -> dict:
        d = dataclasses.asdict(self)
        return {
            "tensor_model_parallel_size": d["tp"], "pipeline_model_parallel_size": d["pp"],
            "expert_model_parallel_size": d["ep"], "expert_tensor_parallel_size": d["etp"], "num_layers": d["layers"], "hidden_size": d["hidden"],
            "num_attention_heads": d["heads"], "seq_length": d["seq"], "num_experts": d["experts"],
            "fp8_format": d["fp8"], "micro_batch_size": d["mbs"], "global_batch_size": d["gbs"],
            "vocab_size": VOCAB, "seed": d["seed"], "lr": d["lr"], "train_iters": d["train_iters"],
        }


def _batch(seed: int, index: int, mbs: int, seq: int) -> torch.Tensor:
    """Global sample `index`'s micro batch of tokens (a learnable pattern plus noise), independent of layout."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + index)
    start = torch.randint(0, VOCAB, (mbs, 1), generator=g)
    step = torch.randint(1, 4, (mbs, 1), generator=g)
    return (start + step * torch.arange(seq + 1)) % VOCAB


class Run:
    """Model chunks, optimizer and scheduler of one tiny GPT run in the current layout."""

    def __init__(self, opts: Opts):
        from megatron.core import parallel_state as mpu
        from megatron.core.distributed import (DistributedDataParallel, DistributedDataParallelConfig,
                                               finalize_model_grads)
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
        from megatron.core.transformer.transformer_config import TransformerConfig
        from megatron.core.transformer.moe.moe_layer import MoELayer

        from fp8_parallel.megatron import get_gpt_block_spec
        from launch.train.model import reduce_experts_over_expert_dp

        self.opts = opts
        moe = dict(
            num_moe_experts=opts.experts, moe_router_topk=2, moe_token_dispatcher_type="alltoall",
            moe_ffn_hidden_size=2 * opts.hidden, moe_aux_loss_coeff=0.0,
        ) if opts.experts else {}
        config = TransformerConfig(
            num_layers=opts.layers, hidden_size=opts.hidden, num_attention_heads=opts.heads,
            use_cpu_initialization=True, tensor_model_parallel_size=opts.tp,
            pipeline_model_parallel_size=opts.pp, expert_model_parallel_size=opts.ep,
            expert_tensor_parallel_size=opts.etp,
            pipeline_dtype=torch.float32, hidden_dropout=opts.dropout, attention_dropout=opts.dropout,
            add_bias_linear=not opts.experts, bf16=False, sequence_parallel=bool(opts.experts) and opts.tp > 1,
            **moe,
        )
        if opts.fp8:
            config.fp8 = opts.fp8  # set after construction: megatron 0.16 refuses fp8 + MoE without TE
            config.fp8_recipe = "delayed"
            config.fp8_amax_history_len = 4
        self.config = config
        random.seed(opts.seed)
        np.random.seed(opts.seed)
        torch.manual_seed(opts.seed)
        with ps.cpu_compat():
            model_parallel_cuda_manual_seed(opts.seed)
            if opts.local_spec:
                spec = get_gpt_layer_local_spec(num_experts=opts.experts)
            else:
                spec = get_gpt_block_spec(config, num_experts=opts.experts)
            model = GPTModel(
                config=config, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=opts.seq,
                pre_process=mpu.is_pipeline_first_stage(), post_process=mpu.is_pipeline_last_stage(),
            )
            if opts.experts and opts.megatron_expert_marking:
                # megatron's own rule (EP1: dense), also where our experts' rule differs (EP1, expert TP < TP)
                for module in model.modules():
                    if isinstance(module, MoELayer):
                        for p in module.experts.parameters():
                            p.allreduce = opts.ep == 1
            elif opts.experts:
                reduce_experts_over_expert_dp(model)  # as the job does (EP1 with expert TP < TP)
            ddp_config = DistributedDataParallelConfig(
                grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=True,
            )
            self.model = [DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)]
            # megatron's schedule calls this after the last backward: DP / expert-DP gradient reduction, the
            # tied embedding's gradient across stages, and the TP sum of sequence-parallel replicated
            # parameters (norms, router). Without it the replicas of one parameter drift apart.
            config.finalize_model_grads_func = finalize_model_grads
            opt_config = OptimizerConfig(
                optimizer="adam", lr=opts.lr, min_lr=opts.lr / 10, weight_decay=0.01, clip_grad=1.0,
                use_distributed_optimizer=True, bf16=False,
            )
            self.optimizer = get_megatron_optimizer(opt_config, self.model)
            self.scheduler = OptimizerParamScheduler(
                self.optimizer, init_lr=0.0, max_lr=opts.lr, min_lr=opts.lr / 10, lr_warmup_steps=opts.gbs,
                lr_decay_steps=opts.train_iters * opts.gbs, lr_decay_style="cosine", start_wd=0.01, end_wd=0.01,
                wd_incr_steps=opts.train_iters * opts.gbs, wd_incr_style="constant",  # steps count samples
            )

    def train(self, start: int, until: int) -> List[float]:
        """Iterations `start+1 .. until`; returns the mean loss of each (on the last stage, [] elsewhere)."""
        from megatron.core import parallel_state as mpu
        from megatron.core.pipeline_parallel import get_forward_backward_func

        o = self.opts
        dp, dp_rank = mpu.get_data_parallel_world_size(), mpu.get_data_parallel_rank()
        n_micro = o.gbs // (o.mbs * dp)
        losses = []
        for it in range(start, until):
            micro = [_batch(o.seed, (it * dp + dp_rank) * n_micro + m, o.mbs, o.seq) for m in range(n_micro)]

            def forward_step(data_iterator, model):
                tokens = next(data_iterator)
                inputs, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
                pos = torch.arange(o.seq).expand(o.mbs, o.seq)
                out = model(inputs, pos, None, labels=labels)

                def loss_func(output):
                    loss = output.float().mean()
                    return loss, {"loss": loss.detach().clone()}

                return out, loss_func

            with ps.cpu_compat():
                for chunk in self.model:
                    chunk.zero_grad_buffer()
                self.optimizer.zero_grad()
                out = get_forward_backward_func()(
                    forward_step_func=forward_step, data_iterator=iter(micro), model=self.model,
                    num_microbatches=n_micro, seq_length=o.seq, micro_batch_size=o.mbs,
                )
                ok, grad_norm, _ = self.optimizer.step()
                assert ok, f"iteration {it + 1}: optimizer step skipped"
                self.scheduler.step(increment=o.gbs)
            if mpu.is_pipeline_last_stage():
                loss = torch.stack([d["loss"] for d in out]).mean()
                dist.all_reduce(loss, group=mpu.get_data_parallel_group())
                losses.append((loss / dp).item())
        return losses

    def snapshot(self) -> Dict[str, torch.Tensor]:
        """Every parameter and buffer (FP8 state included) and the optimizer's state tensors of this rank."""
        out = {}
        for i, chunk in enumerate(self.model):
            for k, v in chunk.state_dict().items():
                if isinstance(v, torch.Tensor):
                    out[f"model{i}.{k}"] = v.detach().clone()
        for i, opt in enumerate(getattr(self.optimizer, "chained_optimizers", [self.optimizer])):
            for gi, group in enumerate(opt.optimizer.param_groups):
                for pi, p in enumerate(group["params"]):
                    out[f"opt{i}.g{gi}.p{pi}.master"] = p.detach().clone()
                    for name, t in opt.optimizer.state.get(p, {}).items():
                        if isinstance(t, torch.Tensor):
                            out[f"opt{i}.g{gi}.p{pi}.{name}"] = t.detach().clone()
        return out
