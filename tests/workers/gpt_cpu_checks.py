"""megatron's own GPTModel (dense and MoE) built with our FP8 spec trains on CPU under cpu_compat, in FP8,
driven by megatron's schedule.

Usage (under torchrun, 4 ranks): gpt_cpu_checks.py   -> PP2 x DP2, EP2 for the MoE model
"""
from __future__ import annotations


import torch
import torch.distributed as dist

import parallel_state as ps
from rank_checks import run_checks, test_seed, exit_now

ps.initialize(tp=1, pp=2, ep=2)

from megatron.core import parallel_state as mpu  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: E402
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

import fp8_parallel as fp  # noqa: E402
from fp8_parallel.megatron import fp8_context, get_gpt_block_spec  # noqa: E402
from fp8_parallel.modules import FP8State  # noqa: E402

VOCAB, SEQ, MBS, N_MICRO = 64, 16, 2, 4


def _loss_func(output: torch.Tensor):
    loss = output.float().mean()
    return loss, {"loss": loss.detach().clone()}


def _forward_step(data_iterator, model):
    tokens = next(data_iterator)
    pos = torch.arange(SEQ).expand(MBS, SEQ)
    labels = torch.roll(tokens, -1, 1)
    with fp8_context(model.config):  # one FP8 scope for the whole pass
        output = model(tokens, pos, None, labels=labels)
    return output, _loss_func


def _train(moe: bool) -> list:
    extra = (
        dict(num_moe_experts=4, moe_router_topk=2, moe_token_dispatcher_type="alltoall", moe_ffn_hidden_size=32,
             add_bias_linear=False, moe_aux_loss_coeff=0.0)
        if moe else {}
    )
    config = TransformerConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
        pipeline_model_parallel_size=2, expert_model_parallel_size=2 if moe else 1,
        pipeline_dtype=torch.float32, fp8_recipe="delayed", fp8_amax_history_len=4, fp8_amax_compute_algo="max",
        **extra,
    )
    config.fp8 = "hybrid"  # megatron 0.16 refuses fp8 + MoE in __post_init__ without TransformerEngine: set it after
    with ps.cpu_compat():
        model_parallel_cuda_manual_seed(test_seed() % 1000)
        model = GPTModel(
            config=config,
            transformer_layer_spec=get_gpt_block_spec(config, num_experts=4 if moe else None),
            vocab_size=VOCAB, max_sequence_length=SEQ,
            pre_process=mpu.is_pipeline_first_stage(), post_process=mpu.is_pipeline_last_stage(),
        )
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        gen = torch.Generator().manual_seed(test_seed())
        batch = [torch.randint(0, VOCAB, (MBS, SEQ), generator=gen) for _ in range(N_MICRO)]  # memorise it
        history = []
        for _ in range(10):
            opt.zero_grad()
            out = get_forward_backward_func()(
                forward_step_func=_forward_step, data_iterator=iter(batch), model=model,
                num_microbatches=N_MICRO, seq_length=SEQ, micro_batch_size=MBS,
            )
            for p in model.parameters():  # data-parallel replicas see the same data; keep them equal anyway
                if p.grad is not None:
                    dist.all_reduce(p.grad, group=mpu.get_data_parallel_group())
                    p.grad /= mpu.get_data_parallel_world_size()
            opt.step()
            if mpu.is_pipeline_last_stage():
                history.append(sum(d["loss"].item() for d in out) / N_MICRO)
    states = [m for m in model.modules() if isinstance(m, FP8State)]
    assert states, "the model has no FP8 layers"
    for m in states:  # FP8 ran in both directions on every rank, and stayed finite
        assert (m.fwd.amax_history[:, 0] > 0).all() and (m.bwd.amax_history[:, 0] > 0).all(), m.fwd.tag
    assert int(fp.nonfinite_amax_count(model)) == 0
    return history


def _check_trains(moe: bool):
    def check():
        history = _train(moe)
        if mpu.is_pipeline_last_stage():
            assert all(torch.isfinite(torch.tensor(history))), history
            assert history[-1] < 0.85 * history[0], history
    return check


run_checks([("gpt_dense_trains_on_cpu", _check_trains(False)), ("gpt_moe_ep2_trains_on_cpu", _check_trains(True))])
ps.destroy()
exit_now()  # skip finalization: see exit_now
