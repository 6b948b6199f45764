"""The block a user gets from `fp8_parallel.megatron.get_gpt_block_spec`, on megatron's real GPTModel.

Usage (under torchrun):
  megatron_block_checks.py recompute   (2 ranks) full recompute with config.fp8 equals no recompute, TP1 and TP2
  megatron_block_checks.py moe         (4 ranks) Megatron-LM-style start-up (megatron's groups only, EP2): expert
                                        amaxes agree over the expert amax domain, dense ones over the dense group
"""
from __future__ import annotations

import copy
import sys

import torch
import torch.distributed as dist

from rank_checks import run_checks, test_seed, exit_now

import parallel_state as ps

VOCAB, SEQ, MBS = 64, 16, 2


def _config(tp: int, ep: int = 1, **extra):
    from megatron.core.transformer.transformer_config import TransformerConfig

    moe = ep > 1
    cfg = TransformerConfig(
        num_layers=2, hidden_size=64, num_attention_heads=4, use_cpu_initialization=True,
        tensor_model_parallel_size=tp, sequence_parallel=tp > 1, expert_model_parallel_size=ep,
        pipeline_dtype=torch.float32, hidden_dropout=0.0, attention_dropout=0.0,
        fp8=None if moe else "hybrid", fp8_recipe="delayed", fp8_amax_history_len=4, fp8_amax_compute_algo="max",
        **(dict(num_moe_experts=4, moe_router_topk=2, moe_token_dispatcher_type="alltoall", moe_ffn_hidden_size=64,
                add_bias_linear=False) if moe else {}),
        **extra,
    )
    if moe:  # megatron 0.16 refuses fp8 + MoE in __post_init__ without TransformerEngine: set it after
        cfg.fp8 = "hybrid"
    return cfg


def _gpt(cfg, spec):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(test_seed() % 1000)
    torch.manual_seed(test_seed() % 1000)
    return GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=SEQ)


def _steps(model, steps: int = 2, per_rank_data: bool = False):
    """`steps` training steps called the way a user's loop calls the model (no caller scope: the block opens
    it from config.fp8), SGD between them; returns [(loss, grads)] per step."""
    seed = test_seed() + (dist.get_rank() if per_rank_data else 0)
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        tokens = torch.randint(0, VOCAB, (MBS, SEQ), generator=gen)
        model.zero_grad(set_to_none=True)
        loss = model(tokens, torch.arange(SEQ).expand(MBS, SEQ), None, labels=torch.roll(tokens, -1, 1)).float().mean()
        loss.backward()
        grads = [(n, p.grad.clone()) for n, p in model.named_parameters() if p.grad is not None]
        out.append((loss.detach(), grads))
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p.add_(p.grad, alpha=-0.1)
    return out


def _fp8_states(model):
    from fp8_parallel.modules import FP8State

    return [(n, m) for n, m in model.named_modules() if isinstance(m, FP8State)]


def _recompute_matches(tp: int):
    """TP `tp`: GPTModel from get_gpt_block_spec with config.fp8; full recompute (uniform, block) gives the
    losses and gradients of the run without recompute, bitwise, over two steps (the second with the scales
    the first one's reductions produced). The recompute really ran: layer 0 runs forward twice per step."""
    from fp8_parallel.megatron import FP8TransformerLayer, get_gpt_block_spec
    from fp8_parallel.megatron_block import FP8TransformerBlock

    ps.initialize(tp=tp)
    try:
        with ps.cpu_compat():
            cfg = _config(tp)
            spec = get_gpt_block_spec(cfg)
            assert spec.module is FP8TransformerBlock and len(spec.submodules.layer_specs) == cfg.num_layers
            plain = _gpt(cfg, spec)  # GPTModel builds a plain TransformerBlock from the spec's submodules
            assert type(plain.decoder) is FP8TransformerBlock, type(plain.decoder)
            assert all(type(layer) is FP8TransformerLayer for layer in plain.decoder.layers)
            state = copy.deepcopy(plain.state_dict())
            expected = _steps(plain)
            assert all((m.fwd.amax_history[:, 0] > 0).all() and (m.bwd.amax_history[:, 0] > 0).all()
                       for _, m in _fp8_states(plain)), "the FP8 path did not run"
            for method in ("uniform", "block"):
                rcfg = _config(tp, recompute_granularity="full", recompute_method=method, recompute_num_layers=1)
                model = _gpt(rcfg, get_gpt_block_spec(rcfg))
                model.load_state_dict(state)
                calls = []
                model.decoder.layers[0].register_forward_pre_hook(lambda *a: calls.append(1))
                got = _steps(model)
                assert len(calls) == 2 * len(got), (method, len(calls))  # first pass + recompute, per step
                for step, ((loss, grads), (eloss, egrads)) in enumerate(zip(got, expected)):
                    assert torch.equal(loss, eloss), (tp, method, step, loss, eloss)
                    assert [n for n, _ in grads] == [n for n, _ in egrads]
                    for (name, g), (_, e) in zip(grads, egrads):
                        assert torch.equal(g, e), f"TP{tp} {method} step {step} {name}: {(g - e).abs().max()}"
        print(f"seed {test_seed()}: rank {dist.get_rank()} TP{tp} recompute == plain", flush=True)
    finally:
        ps.destroy(destroy_process_group=False)


def check_full_recompute_tp1():
    _recompute_matches(1)


def check_full_recompute_tp2():
    _recompute_matches(2)


def _same_over(ranks, mine: torch.Tensor, everyone) -> bool:
    return all(torch.equal(everyone[r], mine) for r in ranks)


def check_moe_expert_amaxes_over_expert_domain():
    """Megatron-LM's start-up (megatron's `initialize_model_parallel` only, EP2 on 4 ranks, each rank its own
    data), MoE GPTs built from `moe_block_spec` (what `--spec fp8_parallel.megatron_lm moe_block_spec` gives)
    and from `get_gpt_block_spec(..., moe_grouped_gemm=True)`, no scope or group set up by the caller: every
    expert FP8 state (histories and scales, both directions) is equal over the ranks that hold the same
    experts and differs from the other experts' ranks; every dense FP8 state is equal over the dense group."""
    from megatron.core import parallel_state as mpu

    from fp8_parallel.expert_scope import expert_amax_group
    from fp8_parallel.megatron import get_gpt_block_spec
    from fp8_parallel.megatron_lm import moe_block_spec

    assert not ps.is_initialized()
    world = dist.get_world_size()
    keys = [None] * world
    dist.all_gather_object(keys, (mpu.get_pipeline_model_parallel_rank(), mpu.get_expert_model_parallel_rank()))
    domain = [r for r in range(world) if keys[r] == keys[dist.get_rank()]]
    others = [r for r in range(world) if r not in domain]
    dense = dist.get_process_group_ranks(mpu.get_amax_reduction_group(with_context_parallel=True))
    assert len(domain) == 2 and others and sorted(dense) == list(range(world)), (domain, dense)
    cfg = _config(tp=1, ep=2)
    for variant, spec in (("sequential", moe_block_spec),
                          ("grouped", get_gpt_block_spec(cfg, num_experts=4, moe_grouped_gemm=True))):
        with ps.cpu_compat():
            model = _gpt(cfg, spec)
            assert sorted(dist.get_process_group_ranks(expert_amax_group())) == domain, variant
            _steps(model, per_rank_data=True)
        states = _fp8_states(model)
        expert_states = [(n, m) for n, m in states if ".experts." in n]
        assert expert_states and len(expert_states) < len(states), [n for n, _ in states]
        differs = 0
        for name, m in states:
            for label, t in (("fwd.amax_history", m.fwd.amax_history), ("fwd.scale", m.fwd.scale),
                             ("bwd.amax_history", m.bwd.amax_history), ("bwd.scale", m.bwd.scale)):
                everyone = [torch.empty_like(t) for _ in range(world)]
                dist.all_gather(everyone, t)
                if ".experts." in name:
                    assert _same_over(domain, t, everyone), f"{variant} {name}.{label} differs in its expert domain"
                    differs += not _same_over(others, t, everyone)
                else:
                    assert _same_over(dense, t, everyone), f"{variant} {name}.{label} differs in the dense group"
            assert (m.fwd.amax_history[:, 0] > 0).all(), f"{variant} {name}: no forward amax recorded"
        # the other experts' ranks hold other weights and see other tokens: a reduction over the world would
        # make these equal as well
        assert differs > 0, f"{variant}: expert FP8 states equal on every rank (reduced over the world?)"
        print(f"seed {test_seed()}: rank {dist.get_rank()} {variant}: expert domain {domain}, "
              f"{len(expert_states)} expert states, {differs} differing from other experts' ranks", flush=True)


def check_stale_expert_domain_is_refused():
    """megatron's groups rebuilt after a model was built: the expert domain of the old groups is not used; FP8
    experts ask for it to be built (not the world group), and `ensure_megatron_expert_domain` builds it."""
    from megatron.core import parallel_state as mpu

    from fp8_parallel.expert_scope import ensure_megatron_expert_domain, expert_amax_group

    old = expert_amax_group()
    mpu.destroy_model_parallel()
    mpu.initialize_model_parallel(expert_model_parallel_size=2)
    try:
        expert_amax_group()
    except RuntimeError as e:
        assert "ensure_megatron_expert_domain" in str(e) and "get_gpt_block_spec" in str(e), e
    else:
        raise AssertionError("a stale expert amax domain was used")
    new = ensure_megatron_expert_domain()
    assert new is not old and expert_amax_group() is new
    assert dist.get_process_group_ranks(new) == dist.get_process_group_ranks(old)


if __name__ == "__main__":
    mode = sys.argv[1]
    print(f"seed {test_seed()} mode {mode}", flush=True)
    if mode == "recompute":
        dist.init_process_group("gloo")
        run_checks([("full_recompute_tp1", check_full_recompute_tp1), ("full_recompute_tp2", check_full_recompute_tp2)])
    elif mode == "moe":
        from megatron.core import parallel_state as mpu

        dist.init_process_group("gloo")
        mpu.initialize_model_parallel(expert_model_parallel_size=2)  # what Megatron-LM's start-up does
        run_checks([("moe_expert_amaxes_over_expert_domain", check_moe_expert_amaxes_over_expert_domain),
                    ("stale_expert_domain_is_refused", check_stale_expert_domain_is_refused)])
        mpu.destroy_model_parallel()
    else:
        raise SystemExit(f"unknown mode {mode!r}: expected 'recompute' or 'moe'")
    dist.destroy_process_group()
    exit_now()  # skip finalization: see exit_now
