"""The amax collectives a training step really issues equal the cost model's count (docs/scale.md).

Usage (under torchrun, 4 ranks): amax_count_checks.py   -> DP4 dense domain; EP2, expert-DP2 expert domain
Counts every all-reduce the amax engine issues (through its `dist` module) during one optimizer step of
megatron's GPTModel built with our spec, after a first step (layout checks of a new layout are excluded),
and compares the count and the sizes with `benchmarks/amax_cost_model.py`.
"""
from __future__ import annotations

import sys
import types
from pathlib import Path

import torch
import torch.distributed as dist

import parallel_state as ps
from rank_checks import run_checks, test_seed, exit_now

ps.initialize(tp=1, pp=1, ep=2)

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import amax_cost_model as cost  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: E402
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

import fp8_parallel.amax_table as amax_table  # noqa: E402
from fp8_parallel.megatron import fp8_context, get_gpt_block_spec  # noqa: E402

VOCAB, SEQ, MBS, N_MICRO, LAYERS, EXPERTS = 64, 16, 2, 3, 2, 4


class _CountingDist(types.ModuleType):
    """torch.distributed as the amax engine sees it, recording the size of every all-reduce."""

    def __init__(self) -> None:
        super().__init__("counting_dist")
        self.sizes: list = []

    def __getattr__(self, name):
        return getattr(dist, name)

    def all_reduce(self, tensor, *args, **kwargs):
        self.sizes.append(tensor.numel())
        return dist.all_reduce(tensor, *args, **kwargs)


def _step_sizes(moe: bool) -> list:
    extra = dict(num_moe_experts=EXPERTS, moe_router_topk=2, moe_token_dispatcher_type="alltoall",
                 moe_ffn_hidden_size=32, add_bias_linear=False, moe_aux_loss_coeff=0.0) if moe else {}
    config = TransformerConfig(
        num_layers=LAYERS, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
        expert_model_parallel_size=2 if moe else 1, pipeline_dtype=torch.float32,
        fp8_recipe="delayed", fp8_amax_history_len=4, fp8_amax_compute_algo="max", **extra,
    )
    config.fp8 = "hybrid"  # megatron 0.16 refuses fp8 + MoE in __post_init__ without TransformerEngine
    counter = _CountingDist()
    with ps.cpu_compat():
        model_parallel_cuda_manual_seed(test_seed() % 1000)
        model = GPTModel(config=config, transformer_layer_spec=get_gpt_block_spec(config, num_experts=EXPERTS if moe else None),
                         vocab_size=VOCAB, max_sequence_length=SEQ)
        gen = torch.Generator().manual_seed(test_seed())
        batch = [torch.randint(0, VOCAB, (MBS, SEQ), generator=gen) for _ in range(N_MICRO)]

        def forward_step(it, m):
            tokens = next(it)
            with fp8_context(config):
                out = m(tokens, torch.arange(SEQ).expand(MBS, SEQ), None, labels=torch.roll(tokens, -1, 1))
            return out, lambda o: (o.float().mean(), {})

        sizes = []
        original = amax_table.dist
        try:
            for step in range(2):
                amax_table.dist = counter
                counter.sizes = []
                get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter(batch), model=model,
                                            num_microbatches=N_MICRO, seq_length=SEQ, micro_batch_size=MBS)
                sizes = counter.sizes
        finally:
            amax_table.dist = original
    return sizes


def _layout(moe: bool) -> cost.Layout:
    world = dist.get_world_size()
    return cost.Layout("test", gpus=world, layers=LAYERS, ep=2 if moe else 1, experts=EXPERTS if moe else 0,
                       global_batch=N_MICRO * MBS * world, micro_batch=MBS, seq=SEQ)


def _check(moe: bool):
    def check():
        sizes = _step_sizes(moe)
        layout = _layout(moe)
        assert len(sizes) == cost.collectives_per_step(layout), (sizes, cost.collectives_per_step(layout))
        expected = sorted(v for r in cost.reductions_per_pass(layout) for v in (r.fwd_values, r.bwd_values)) * N_MICRO
        assert sorted(sizes) == sorted(expected), (sorted(sizes), sorted(expected))
        print(f"rank {dist.get_rank()} {'moe' if moe else 'dense'}: {len(sizes)} amax collectives per step, "
              f"sizes {sorted(set(sizes))}", flush=True)
    return check


run_checks([("amax_collectives_dense_match_model", _check(False)), ("amax_collectives_moe_match_model", _check(True))])
ps.destroy()
exit_now()  # skip finalization: see exit_now
