"""Multi-rank checks of the parallel FP8 modules and the megatron integration (gloo, every rank asserts).

Usage (under torchrun): module_checks.py mlp      (2 ranks: TP2 with and without SP vs a single-rank model)
                        module_checks.py gpt      (8 ranks: GPTModel dense TP2xPP2 and MoE TP2xPP2xEP2)
"""
from __future__ import annotations

import sys

import torch
import torch.distributed as dist

import fp8_parallel as fp
import parallel_state as ps
from rank_checks import run_checks, test_seed, exit_now

D, F, TOKENS = 64, 128, 32


def _mlp_config(sp: bool):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=1, hidden_size=D, ffn_hidden_size=F, num_attention_heads=4, use_cpu_initialization=True,
        tensor_model_parallel_size=ps.get_size("tp"), sequence_parallel=sp, params_dtype=torch.float32,
    )


def _tp_mlp(config):
    init = torch.nn.init.normal_
    fc1 = fp.ColumnParallelLinear(D, F, config=config, init_method=init, bias=True, gather_output=False)
    fc2 = fp.RowParallelLinear(F, D, config=config, init_method=init, bias=True, input_is_parallel=True,
                               skip_bias_add=False)
    return fc1, fc2


def _assert_rel(a: torch.Tensor, b: torch.Tensor, tol: float, what: str) -> None:
    """Norm-wise relative error: identical FP8 casts except where an fp32 accumulation-order difference moves
    a value across an FP8 rounding boundary (one E5M2 step is 25%), which elementwise tolerances cannot take."""
    rel = ((a.double() - b.double()).norm() / b.double().norm()).item()
    assert rel < tol, f"{what}: relative error {rel:.2e} >= {tol:.0e}"


def _gather_full(t: torch.Tensor, dim: int) -> torch.Tensor:
    parts = [torch.empty_like(t) for _ in range(ps.get_size("tp"))]
    dist.all_gather(parts, t.contiguous(), group=ps.get_group("tp"))
    return torch.cat(parts, dim=dim)


def _loss(y: torch.Tensor, weights) -> torch.Tensor:
    """`sum(y^2)`, or `sum(y * weights)`: a loss whose gradient does not depend on `y`, so both sides of a
    comparison cast the same grad_output (an fp32 sum-order difference in `y` moving a value across an E5M2
    rounding boundary, one 25% step, would otherwise show in the gradients for some seeds)."""
    return (y.float() ** 2).sum() if weights is None else (y.float() * weights).sum()


def _run_tp(fc1, fc2, x_full, sp, recipe, is_first=None, loss_weights=None):
    tp_rank, tp = ps.get_rank("tp"), ps.get_size("tp")
    x = x_full.chunk(tp, dim=0)[tp_rank] if sp else x_full  # [s, b, h]; SP shards the sequence
    x = x.detach().clone().requires_grad_()
    with ps.cpu_compat(), fp.autocast(recipe=recipe, group=ps.dense_amax_group()):
        h, _ = fc1(x, is_first_microbatch=is_first)
        y, _ = fc2(torch.nn.functional.gelu(h), is_first_microbatch=is_first)
    if loss_weights is not None and sp:  # the rank's sequence shard of the output
        loss_weights = loss_weights.chunk(tp, dim=0)[tp_rank]
    with ps.cpu_compat():
        _loss(y, loss_weights).backward()
    for p in list(fc1.parameters()) + list(fc2.parameters()):  # as megatron's finalize_model_grads does
        if getattr(p, "sequence_parallel", False) and p.grad is not None:
            dist.all_reduce(p.grad, group=ps.get_group("tp"))
    y_full = _gather_full(y, 0) if sp else y
    gx = _gather_full(x.grad, 0) if sp else x.grad
    return y_full, gx


def _run_ref(l1, l2, x_full, recipe, loss_weights=None):
    x = x_full.detach().clone().requires_grad_()
    with fp.autocast(recipe=recipe, group=None):
        y = l2(torch.nn.functional.gelu(l1(x)))
    _loss(y, loss_weights).backward()
    return y, x.grad


def _reference_from(fc1, fc2):
    l1, l2 = fp.Linear(D, F), fp.Linear(F, D)
    with torch.no_grad():
        l1.weight.copy_(_gather_full(fc1.weight, 0))
        l1.bias.copy_(_gather_full(fc1.bias, 0))
        l2.weight.copy_(_gather_full(fc2.weight, 1))
        l2.bias.copy_(fc2.bias)
    return l1, l2


def _set_scales(mods, gen):
    for m in mods:  # identical, non-trivial scales on both sides
        m.fp8.fwd.scale.copy_(torch.rand(2, generator=gen) * 20 + 5)
        m.fp8.bwd.scale.copy_(torch.rand(1, generator=gen) * 2000 + 500)


def check_tp_matches_single_rank(sp: bool):
    def check():
        config = _mlp_config(sp)
        torch.manual_seed(test_seed() % 1000)
        fc1, fc2 = _tp_mlp(config)
        l1, l2 = _reference_from(fc1, fc2)
        recipe = fp.DelayedScaling(amax_history_len=4)
        gen = torch.Generator().manual_seed(test_seed())
        for step in range(3):
            x = torch.randn(TOKENS // 2, 2, D, generator=gen)  # [seq, batch, hidden], same on all ranks
            if step == 0:
                g = torch.Generator().manual_seed(test_seed() + 5)
                _set_scales([fc1, fc2], g)
                g = torch.Generator().manual_seed(test_seed() + 5)
                _set_scales([l1, l2], g)
            for p in list(fc1.parameters()) + list(fc2.parameters()) + list(l1.parameters()) + list(l2.parameters()):
                p.grad = None
            w = torch.randn(TOKENS // 2, 2, D, generator=gen)  # loss weights: the same grad_output on both sides
            y, gx = _run_tp(fc1, fc2, x, sp, recipe, loss_weights=w)
            yr, gxr = _run_ref(l1, l2, x, recipe, loss_weights=w)
            # identical FP8 casts; only fp32 accumulation order differs (row-parallel partial sums)
            torch.testing.assert_close(y, yr, rtol=1e-4, atol=1e-4)
            _assert_rel(gx, gxr, 1e-3, "input grad")
            _assert_rel(_gather_full(fc1.weight.grad, 0), l1.weight.grad, 1e-3, "fc1 weight grad")
            _assert_rel(_gather_full(fc1.bias.grad, 0), l1.bias.grad, 1e-3, "fc1 bias grad")
            _assert_rel(_gather_full(fc2.weight.grad, 1), l2.weight.grad, 1e-3, "fc2 weight grad")
            _assert_rel(fc2.bias.grad, l2.bias.grad, 1e-3, "fc2 bias grad")
            # amaxes were reduced over the TP domain: the FP8 state equals the unsharded model's
            for m, r in ((fc1, l1), (fc2, l2)):
                for a, b in ((m.fp8.fwd, r.fp8.fwd), (m.fp8.bwd, r.fp8.bwd)):
                    torch.testing.assert_close(a.amax_history, b.amax_history, rtol=1e-6, atol=0)
                    torch.testing.assert_close(a.scale, b.scale, rtol=1e-6, atol=0)
        # and within FP8 tolerance of the high-precision model
        with torch.no_grad():
            x = torch.randn(TOKENS // 2, 2, D, generator=gen)
            hp = torch.nn.functional.linear(torch.nn.functional.gelu(torch.nn.functional.linear(x, l1.weight, l1.bias)), l2.weight, l2.bias)
        y, _ = _run_tp(fc1, fc2, x, sp, recipe)
        rel = ((y.detach() - hp).norm() / hp.norm()).item()
        assert rel < 0.08, rel
    return check


def check_fused_wgrad_accumulation_under_ddp():
    """Our TP2 linears under megatron's DistributedDataParallel with `fuse_wgrad_accumulation` (set by
    `fp8_parallel.megatron.fuse_wgrad_accumulation`): after two microbatches each main_grad equals that of the
    same model without fusion (float32 parameters: float32 rounding apart), with FP8 (delayed) and with FP8
    off; the weights' protocol flags are set and their `.grad` is None after DDP's hooks; biases go through
    autograd as before."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from fp8_parallel.megatron import fuse_wgrad_accumulation

    config = _mlp_config(False)
    grads = {}
    for fuse in (False, True):
        torch.manual_seed(test_seed() % 1000)
        fc1, fc2 = _tp_mlp(config)
        with ps.cpu_compat():
            ddp = DistributedDataParallel(config=config, module=torch.nn.ModuleList([fc1, fc2]),
                                          ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True))
        if fuse:
            assert fuse_wgrad_accumulation(ddp) == 2
        for recipe in (fp.DelayedScaling(amax_history_len=4), None):
            ddp.zero_grad_buffer()
            gen = torch.Generator().manual_seed(test_seed())
            for _ in range(2):
                x = torch.randn(TOKENS // 2, 2, D, generator=gen)
                with ps.cpu_compat(), fp.autocast(enabled=recipe is not None, recipe=recipe or fp.DelayedScaling(),
                                                  group=ps.dense_amax_group()):
                    h, _ = fc1(x)
                    y, _ = fc2(torch.nn.functional.gelu(h))
                with ps.cpu_compat():
                    (y.float() ** 2).sum().backward()
            for p in (fc1.weight, fc2.weight):
                assert p.grad is None and p.grad_added_to_main_grad == fuse, (fuse, recipe)
            assert not fc1.bias.grad_added_to_main_grad
            grads[fuse, recipe is None] = [p.main_grad.clone() for p in (fc1.weight, fc1.bias, fc2.weight, fc2.bias)]
    for fp8_off in (False, True):
        for i, (a, b) in enumerate(zip(grads[True, fp8_off], grads[False, fp8_off])):
            assert a.abs().sum() > 0, (fp8_off, i)
            _assert_rel(a, b, 1e-6, f"main_grad {i} (fp8 off: {fp8_off})")
    # a weight without main_grad (no DDP): the training forward names it by its name in the model
    bare = torch.nn.ModuleList(_tp_mlp(config))
    assert fuse_wgrad_accumulation(bare) == 2
    try:
        with ps.cpu_compat():
            bare[1](torch.randn(TOKENS // 2, 2, F // ps.get_size("tp")))
    except RuntimeError as err:
        assert "RowParallelLinear(fuse_wgrad_accumulation=True): parameter '1.weight'" in str(err), err
    else:
        raise AssertionError("fused accumulation without main_grad did not raise")


def check_sp_fp8_gather_equals_bf16_gather():
    """Sequence parallel with delayed scaling gathers FP8 bytes (uint8) instead of bf16: outputs, gradients
    and FP8 state are bitwise those of the high-precision gather; a scope whose amax domain does not cover TP
    (scales could differ between shards) gathers in high precision."""
    config = _mlp_config(True)
    torch.manual_seed(test_seed() % 1000)
    fc1, fc2 = _tp_mlp(config)
    ref1, ref2 = _tp_mlp(config)
    ref1.load_state_dict(fc1.state_dict())
    ref2.load_state_dict(fc2.state_dict())
    assert not ref1.fp8_input_gather  # off by default
    fc1.fp8_input_gather = True
    recipe = fp.DelayedScaling(amax_history_len=4)
    gathered = []
    name = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"  # what we call
    original = getattr(dist, name)

    def counting(out, inp, *args, **kwargs):
        gathered.append(out.dtype)
        return original(out, inp, *args, **kwargs)

    gen = torch.Generator().manual_seed(test_seed())
    setattr(dist, name, counting)
    try:
        for step in range(3):
            x = torch.randn(TOKENS // 2, 2, D, generator=gen)
            for p in [*fc1.parameters(), *fc2.parameters(), *ref1.parameters(), *ref2.parameters()]:
                p.grad = None
            gathered.clear()
            y, gx = _run_tp(fc1, fc2, x, True, recipe)
            assert gathered and all(d == torch.uint8 for d in gathered), gathered
            gathered.clear()
            yr, gxr = _run_tp(ref1, ref2, x, True, recipe)
            assert torch.uint8 not in gathered, gathered  # (megatron gathers through its own binding)
            assert torch.equal(y, yr) and torch.equal(gx, gxr), step
            for a, b in zip([*fc1.parameters(), *fc2.parameters()], [*ref1.parameters(), *ref2.parameters()]):
                assert torch.equal(a.grad, b.grad), step
            for a, b in zip([*fc1.fp8.state_dict().values(), *fc2.fp8.state_dict().values()],
                            [*ref1.fp8.state_dict().values(), *ref2.fp8.state_dict().values()]):
                assert torch.equal(a, b), step
        gathered.clear()
        x = torch.randn(TOKENS // 2, 2, D, generator=gen)
        own = [dist.new_group([r]) for r in range(dist.get_world_size())][dist.get_rank()]
        with ps.cpu_compat(), fp.autocast(recipe=recipe, group=own):  # amaxes not shared over TP: scales may differ
            fc1(x.chunk(2, dim=0)[ps.get_rank("tp")])
        assert torch.uint8 not in gathered, gathered
    finally:
        setattr(dist, name, original)


def check_weight_caching():
    config = _mlp_config(False)
    torch.manual_seed(1)
    fc1, fc2 = _tp_mlp(config)
    recipe = fp.DelayedScaling(amax_history_len=4)
    gen = torch.Generator().manual_seed(test_seed())
    casts = []
    from fp8_parallel.testing import casts_wrapped

    def counting_cast(cast, x, *args, **kwargs):
        casts.append(tuple(x.shape))
        return cast(x, *args, **kwargs)

    with casts_wrapped(counting_cast):
        opt = torch.optim.SGD(list(fc1.parameters()) + list(fc2.parameters()), lr=0.1)
        for step in range(2):
            for mb in range(3):
                casts.clear()
                _run_tp(fc1, fc2, torch.randn(8, 2, D, generator=gen), False, recipe, is_first=(mb == 0))
                weight_casts = [c for c in casts if c in (tuple(fc1.weight.shape), tuple(fc2.weight.shape))]
                assert len(weight_casts) == (2 if mb == 0 else 0), (step, mb, casts)
            cached = fc1.fp8.weight_fp8
            ptr = cached._data.data_ptr()
            opt.step()
            opt.zero_grad()
        # after the optimizer step the first microbatch recast into the same buffer, with the new weights
        assert fc1.fp8.weight_fp8._data.data_ptr() == ptr
        # an optimizer step without a new first microbatch: the stale cache is not used, the weights are recast
        _run_tp(fc1, fc2, torch.randn(8, 2, D, generator=gen), False, recipe, is_first=False)
        opt.step()
        casts.clear()
        _run_tp(fc1, fc2, torch.randn(8, 2, D, generator=gen), False, recipe, is_first=False)
        weight_casts = [c for c in casts if c in (tuple(fc1.weight.shape), tuple(fc2.weight.shape))]
        assert len(weight_casts) == 2, casts
    # the cached weight carries the scale_inv it was cast with, and its transpose is never stale
    w8 = fc1.fp8.weight_fp8
    _run_tp(fc1, fc2, torch.randn(8, 2, D, generator=gen), False, recipe, is_first=True)
    assert torch.equal(w8._scale_inv, fc1.fp8.weight_fp8._scale_inv)
    with torch.no_grad():
        fc1.weight.add_(1.0)
    _run_tp(fc1, fc2, torch.randn(8, 2, D, generator=gen), False, recipe, is_first=True)
    w8 = fc1.fp8.weight_fp8
    torch.testing.assert_close(w8.transpose_2d().dequantize(torch.float32), w8.dequantize(torch.float32).t())
    from fp8_parallel.quantize import quantize

    expected = quantize(fc1.weight.detach(), w8._scale_inv.reciprocal().reshape(1), torch.float8_e4m3fn)
    assert torch.equal(w8._data.view(torch.uint8), expected._data.view(torch.uint8))  # the updated weights


def check_state_dict_round_trip_and_tp2_to_tp1():
    config = _mlp_config(False)
    torch.manual_seed(2)
    fc1, fc2 = _tp_mlp(config)
    recipe = fp.DelayedScaling(amax_history_len=4)
    gen = torch.Generator().manual_seed(test_seed())
    for _ in range(2):
        _run_tp(fc1, fc2, torch.randn(8, 2, D, generator=gen), False, recipe)
    sd1 = fc1.state_dict()
    assert all(isinstance(v, torch.Tensor) for k, v in sd1.items() if k.startswith("fp8.")), sd1.keys()
    assert sd1["fp8.fwd.amax_history"].shape == (2, 4) and sd1["fp8.recipe"].tolist()[:4] == [1, 1, 0, 4]
    # round trip into a fresh TP2 module
    fresh1, fresh2 = _tp_mlp(config)
    fresh1.load_state_dict(sd1)
    fresh2.load_state_dict(fc2.state_dict())
    for a, b in ((fc1, fresh1), (fc2, fresh2)):
        for k, v in a.state_dict().items():
            if v is not None and isinstance(v, torch.Tensor):
                assert torch.equal(v, b.state_dict()[k]), k
    # TP2 state into a TP1 (single-rank) model: same outputs
    l1, l2 = _reference_from(fc1, fc2)
    for src, dst in ((fc1, l1), (fc2, l2)):
        dst.fp8.load_state_dict(src.fp8.state_dict())
    x = torch.randn(8, 2, D, generator=gen)
    with torch.no_grad():
        with ps.cpu_compat(), fp.autocast(recipe=recipe, group=ps.dense_amax_group()):
            y = fc2(torch.nn.functional.gelu(fc1(x)[0]))[0]
        with fp.autocast(recipe=recipe, group=None):
            yr = l2(torch.nn.functional.gelu(l1(x)))
    torch.testing.assert_close(y, yr, rtol=1e-4, atol=1e-4)


def _dist_checkpoint_round_trip(model, build):
    """megatron's dist_checkpointing saves the FP8 state with the model (replicated over TP and DP) and a
    fresh model loads it back exactly."""
    import os
    import shutil

    from megatron.core import dist_checkpointing

    from launch.train.children import start_checkpoint_writer_queue

    start_checkpoint_writer_queue()  # megatron's own manager would import this script (and torch) in a child
    path = f"/tmp/fp8p-ckpt-{test_seed()}"
    if dist.get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)
        os.makedirs(path)
    dist.barrier()
    with ps.cpu_compat():
        dist_checkpointing.save(model.sharded_state_dict(), path)
        fresh = build()
        assert not all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values())
                       if isinstance(a, torch.Tensor))
        fresh.load_state_dict(dist_checkpointing.load(fresh.sharded_state_dict(), path))
    theirs = fresh.state_dict()
    fp8_keys = [k for k in model.state_dict() if ".fp8." in k]
    assert fp8_keys, "no FP8 state in the state dict"
    for k, v in model.state_dict().items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(v, theirs[k]), k
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)


def _dense_block_spec():
    from fp8_parallel.megatron_lm import block_spec

    return block_spec


def _gpt_checks():  # noqa: C901
    from megatron.core import parallel_state as mpu
    from megatron.core.models.gpt import GPTModel
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig
    from fp8_parallel.megatron import fp8_context, get_gpt_block_spec
    from fp8_parallel.modules import FP8State

    def run(moe: bool, grouped: bool = False):  # noqa: C901
        extra = dict(num_moe_experts=4, moe_router_topk=2, moe_token_dispatcher_type="alltoall",
                     moe_ffn_hidden_size=64, add_bias_linear=False) if moe else {}
        with ps.cpu_compat():
            model_parallel_cuda_manual_seed(test_seed() % 1000)
            cfg = TransformerConfig(
                num_layers=4, hidden_size=64, num_attention_heads=4, use_cpu_initialization=True,
                tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                expert_model_parallel_size=2 if moe else 1, sequence_parallel=True, pipeline_dtype=torch.float32,
                fp8=None if moe else "hybrid", fp8_recipe="delayed", fp8_amax_history_len=4,
                fp8_amax_compute_algo="max", **extra,
                # dense: FP8 + PP + full recompute (megatron's reentrant checkpoint) + weight caching
                **({} if moe else dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)),
            )
            if moe:  # megatron 0.16 refuses fp8 + MoE in __post_init__ without TransformerEngine: set it after
                cfg.fp8 = "hybrid"
            # dense: config-driven FP8 (megatron's schedule passes is_first_microbatch); megatron 0.16 would send
            # full recompute through TransformerEngine when config.fp8 is set, so the dense model uses the
            # block spec whose block recomputes through megatron's own checkpoint
            recipe = fp.DelayedScaling(amax_history_len=4, amax_compute_algo="max")
            model = GPTModel(
                config=cfg, transformer_layer_spec=_dense_block_spec() if not moe else get_gpt_block_spec(cfg, num_experts=4, moe_grouped_gemm=grouped),
                vocab_size=128, max_sequence_length=32,
                pre_process=mpu.is_pipeline_first_stage(), post_process=mpu.is_pipeline_last_stage(),
            )
            opt = torch.optim.Adam(model.parameters(), lr=3e-3)
            gen = torch.Generator().manual_seed(test_seed())
            batches = [torch.randint(0, 128, (2, 32), generator=gen) for _ in range(4)]

            def loss_func(out):
                loss = out.float().mean()
                return loss, {"loss": loss.detach().clone()}

            def forward_step(it, m):
                t = next(it)
                scope = fp8_context(cfg) if cfg.fp8 else fp.autocast(recipe=recipe, group=ps.dense_amax_group())
                with scope:
                    out = m(t, torch.arange(32).expand(2, 32), None, labels=torch.roll(t, -1, 1))
                return out, loss_func

            losses = []
            for _ in range(4):  # 4 steps: the loss falls below 0.9x by then; each costs seconds on 8 ranks
                opt.zero_grad()
                out = get_forward_backward_func()(
                    forward_step_func=forward_step, data_iterator=iter(batches), model=model,
                    num_microbatches=4, seq_length=32, micro_batch_size=2,
                )
                for p in model.parameters():  # sequence-parallel norms: their grads sum over TP
                    if getattr(p, "sequence_parallel", False) and p.grad is not None:
                        dist.all_reduce(p.grad, group=mpu.get_tensor_model_parallel_group())
                for p in model.parameters():  # keep DP/expert-DP replicas in step
                    if p.grad is not None:
                        g = mpu.get_expert_data_parallel_group() if not getattr(p, "allreduce", True) else mpu.get_data_parallel_group()
                        dist.all_reduce(p.grad, group=g)
                        p.grad /= dist.get_world_size(g)
                opt.step()
                if mpu.is_pipeline_last_stage():
                    losses.append(sum(d["loss"].item() for d in out) / 4)
        if mpu.is_pipeline_last_stage():
            print(f"rank {dist.get_rank()}: {'MoE' if moe else 'dense'} losses {losses}", flush=True)
            assert losses[-1] < 0.9 * losses[0], losses
        if not moe:
            _dist_checkpoint_round_trip(model, lambda: GPTModel(
                config=cfg, transformer_layer_spec=_dense_block_spec(), vocab_size=128, max_sequence_length=32,
                pre_process=mpu.is_pipeline_first_stage(), post_process=mpu.is_pipeline_last_stage()))
        states = [(n, m) for n, m in model.named_modules() if isinstance(m, FP8State)]
        assert states and all((m.fwd.amax_history[:, 0] > 0).all() for _, m in states)
        # with config.fp8 set, megatron's schedule drives the weight cache (is_first_microbatch)
        if not moe:
            assert cfg.fp8 and type(model.decoder).__name__ == "FP8TransformerBlock", "dense GPT must run config-driven FP8"
        if cfg.fp8:
            cached = [n for n, m in model.named_modules()
                      if isinstance(getattr(m, "fp8", None), FP8State) and m.fp8.weight_fp8 is not None]
            assert cached, "megatron's is_first_microbatch protocol cached no FP8 weight"
        for name, m in states:
            expert = ".experts." in name
            group = ps.expert_amax_group() if expert else ps.dense_amax_group()
            for t in (m.fwd.scale, m.bwd.scale, m.fwd.amax_history):
                parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
                dist.all_gather(parts, t, group=group)
                assert all(torch.equal(p, t) for p in parts), f"{name} differs within its amax domain"
        return states

    def dense():
        run(False)

    def moe():
        states = run(True)
        assert any(".experts." in n for n, _ in states)

    def moe_grouped():
        states = run(True, grouped=True)
        assert any(".experts.linear_fc1.fp8." in n for n, _ in states)

    return [("gpt_dense_tp2_pp2_fp8", dense), ("gpt_moe_tp2_pp2_ep2_fp8", moe),
            ("gpt_moe_grouped_tp2_pp2_ep2_fp8", moe_grouped)]


def _expert_linear(layer, i: int, name: str):
    """(weight, FP8State) of local expert `i`'s `name` projection, for either experts module."""
    experts = layer.experts
    if hasattr(experts, "local_experts"):  # megatron SequentialMLP of FP8 linears
        lin = getattr(experts.local_experts[i], name)
        return lin.weight, lin.fp8
    grouped = getattr(experts, name)  # FP8GroupedMLP
    return getattr(grouped, f"weight{i}"), grouped.fp8[i]


def check_ep2_moe_matches_unsharded_experts(grouped: bool):
  def check():
      """MoE layer with EP=2 (4 ranks: expert-DP 2) vs all experts computed locally with the same weights and
      scales: outputs, input grads, expert weight grads (summed over the expert's EP group), and expert amaxes
      reduced over the expert domain only."""
      from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
      from megatron.core.transformer.moe.moe_layer import MoELayer
      from megatron.core.transformer.transformer_config import TransformerConfig
      from fp8_parallel.megatron import get_gpt_layer_spec

      n_exp, hidden, ffn = 4, 32, 64
      with ps.cpu_compat():
          model_parallel_cuda_manual_seed(7)
          cfg = TransformerConfig(
              num_layers=1, hidden_size=hidden, num_attention_heads=4, use_cpu_initialization=True,
              expert_model_parallel_size=2, num_moe_experts=n_exp, moe_router_topk=2, moe_ffn_hidden_size=ffn,
              moe_token_dispatcher_type="alltoall", add_bias_linear=False, params_dtype=torch.float32,
          )
          spec = get_gpt_layer_spec(num_experts=n_exp, moe_grouped_gemm=grouped).submodules.mlp
          layer = MoELayer(cfg, submodules=spec.submodules, layer_number=1)
      # every expert parameter is reduced over expert-DP by megatron's DDP (both expert modules)
      assert all(getattr(p, "allreduce", True) is False for p in layer.experts.parameters()), grouped
      local = [i for i in range(2)]  # local expert indices
      ep_rank, ep_group = ps.get_rank("ep"), ps.get_group("ep")
      # every expert's weights, gathered from the EP rank that holds it
      full = {}
      for name in ("linear_fc1", "linear_fc2"):
          mine = torch.stack([_expert_linear(layer, i, name)[0].detach() for i in local])
          parts = [torch.empty_like(mine) for _ in range(2)]
          dist.all_gather(parts, mine, group=ep_group)
          full[name] = torch.cat(parts)  # [n_exp, out, in], global expert order
      refs = []
      for e in range(n_exp):
          l1, l2 = fp.Linear(hidden, ffn, bias=False), fp.Linear(ffn, hidden, bias=False)
          with torch.no_grad():
              l1.weight.copy_(full["linear_fc1"][e])
              l2.weight.copy_(full["linear_fc2"][e])
          refs.append((l1, l2))
      gen = torch.Generator().manual_seed(11)  # identical scales for expert e on both sides
      for e in range(n_exp):
          s = (torch.rand(2, generator=gen) * 10 + 5, torch.rand(1, generator=gen) * 1000 + 500,
               torch.rand(2, generator=gen) * 10 + 5, torch.rand(1, generator=gen) * 1000 + 500)
          sides = [(refs[e][0].fp8, refs[e][1].fp8)]
          if e // 2 == ep_rank:
              sides.append(tuple(_expert_linear(layer, e - 2 * ep_rank, n)[1] for n in ("linear_fc1", "linear_fc2")))
          for fc1, fc2 in sides:
              fc1.fwd.scale.copy_(s[0]); fc1.bwd.scale.copy_(s[1])
              fc2.fwd.scale.copy_(s[2]); fc2.bwd.scale.copy_(s[3])
      x = torch.randn(8, 2, hidden, generator=torch.Generator().manual_seed(test_seed() + dist.get_rank()))
      recipe = fp.DelayedScaling(amax_history_len=4)
      xl = x.clone().requires_grad_()
      with ps.cpu_compat():
          with fp.autocast(recipe=recipe, group=ps.dense_amax_group()):
              out, _ = layer(xl)
          out.float().pow(2).sum().backward()
          xr = x.reshape(-1, hidden).clone().requires_grad_()
          probs, routing_map = layer.router(xr)  # the same router, so its gradient path is in the reference
      ref_out = torch.zeros_like(xr)
      with fp.autocast(recipe=recipe, group=None):
          for e, (l1, l2) in enumerate(refs):
              rows = routing_map[:, e].nonzero().squeeze(1)
              if rows.numel():
                  # megatron's experts scale the activation by the routing prob before fc2
                  h = cfg.activation_func(l1(xr[rows])) * probs[rows, e : e + 1]
                  ref_out = ref_out.index_add(0, rows, l2(h))
      with ps.cpu_compat():  # the router's backward is megatron code too
          ref_out.float().pow(2).sum().backward()
      _assert_rel(out.reshape(-1, hidden).detach(), ref_out.detach(), 1e-4, "MoE output")
      _assert_rel(xl.grad.reshape(-1, hidden), xr.grad, 1e-3, "MoE input grad")
      for e in range(n_exp):  # every rank takes part in every collective
          for j, name in enumerate(("linear_fc1", "linear_fc2")):
              ref_lin = refs[e][j]
              # the expert's weight grad sums the tokens of its EP group's ranks
              g = ref_lin.weight.grad if ref_lin.weight.grad is not None else torch.zeros_like(ref_lin.weight)
              dist.all_reduce(g, group=ep_group)
              # its amaxes: max over every rank that routed tokens to it (EP group x expert domain)
              ref_amax = ref_lin.fp8.fwd.amax_history[:, 0].clone()
              dist.all_reduce(ref_amax, op=dist.ReduceOp.MAX)
              if e // 2 == ep_rank:
                  weight, state = _expert_linear(layer, e - 2 * ep_rank, name)
                  _assert_rel(weight.grad, g, 1e-3, f"expert {e} {name} weight grad")
                  assert torch.equal(state.fwd.amax_history[:, 0], ref_amax), (name, e)
      # expert state is identical across the expert domain and differs across EP ranks (other experts)
      st = _expert_linear(layer, 0, "linear_fc1")[1].fwd.amax_history.clone()
      parts = [torch.empty_like(st) for _ in range(dist.get_world_size(ps.expert_amax_group()))]
      dist.all_gather(parts, st, group=ps.expert_amax_group())
      assert all(torch.equal(p, st) for p in parts)

  return check

def check_ep2_drop_and_pad_matches_megatrons_experts(grouped: bool):
  def check():
      """megatron's drop-and-pad (capacity factor 0.75, inputs padded to capacity) with EP=2: our experts and
      megatron's own local-spec experts (its SequentialMLP of its linears), same router and expert weights,
      give the same output, input grad and expert weight grads in high precision (fp32, rel < 1e-5); every
      local expert gets exactly its padded capacity of rows (also the experts that routed no token here); the
      FP8 forward (current scaling) stays within FP8 error of megatron's and differs from the high-precision
      one."""
      from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
      from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
      from megatron.core.transformer.moe.moe_layer import MoELayer
      from megatron.core.transformer.transformer_config import TransformerConfig
      from fp8_parallel.megatron import get_gpt_layer_spec

      n_exp, hidden, ffn, tokens, topk, factor = 4, 32, 64, 16, 2, 0.75
      cfg = TransformerConfig(
          num_layers=1, hidden_size=hidden, num_attention_heads=4, use_cpu_initialization=True,
          expert_model_parallel_size=2, num_moe_experts=n_exp, moe_router_topk=topk, moe_ffn_hidden_size=ffn,
          moe_token_dispatcher_type="alltoall", add_bias_linear=False, params_dtype=torch.float32,
          moe_expert_capacity_factor=factor, moe_pad_expert_input_to_capacity=True,
      )
      layers = {}
      with ps.cpu_compat():
          for name, spec in (("megatron", get_gpt_layer_local_spec(num_experts=n_exp, moe_grouped_gemm=False)),
                             ("ours", get_gpt_layer_spec(num_experts=n_exp, moe_grouped_gemm=grouped))):
              model_parallel_cuda_manual_seed(7)
              layers[name] = MoELayer(cfg, submodules=spec.submodules.mlp.submodules, layer_number=1)
      theirs, ours = layers["megatron"], layers["ours"]
      with torch.no_grad():
          ours.router.weight.copy_(theirs.router.weight)
          for i in range(n_exp // 2):
              for name in ("linear_fc1", "linear_fc2"):
                  _expert_linear(ours, i, name)[0].copy_(getattr(theirs.experts.local_experts[i], name).weight)
      capacity = -(-tokens * topk * factor // n_exp)  # megatron's get_capacity: ceil(tokens * topk / experts * f)
      seen = []
      ours.experts.register_forward_pre_hook(lambda _m, args: seen.append(torch.as_tensor(args[1]).tolist()))
      x = torch.randn(tokens // 2, 2, hidden, generator=torch.Generator().manual_seed(test_seed() + dist.get_rank()))
      results = {}
      # the high-precision run of ours last: its expert weight grads are the ones left on the parameters
      for name, layer, recipe in (("megatron", theirs, None), ("ours_fp8", ours, fp.Float8CurrentScaling()),
                                  ("ours", ours, None)):
          xl = x.clone().requires_grad_()
          layer.zero_grad(set_to_none=True)
          with ps.cpu_compat(), fp.autocast(enabled=recipe is not None, recipe=recipe, group=ps.dense_amax_group()):
              out, _ = layer(xl)
              out.float().pow(2).sum().backward()
          results[name] = (out.detach(), xl.grad)
          if name == "megatron":
              with ps.cpu_compat(), torch.no_grad():
                  _, routing_map = layer.router(x.reshape(-1, hidden))
              kept = int(routing_map.sum())
              # tokens were dropped: fewer than tokens x topk assignments, at most `capacity` per expert
              assert kept < tokens * topk and int(routing_map.sum(0).max()) <= capacity, (kept, routing_map.sum(0))
      assert len(seen) == 2 and all(s == [capacity * 2] * (n_exp // 2) for s in seen), (seen, capacity)
      out_m, grad_m = results["megatron"]
      _assert_rel(results["ours"][0], out_m, 1e-5, "drop-and-pad output")
      _assert_rel(results["ours"][1], grad_m, 1e-5, "drop-and-pad input grad")
      for i in range(n_exp // 2):
          for name in ("linear_fc1", "linear_fc2"):
              ref = getattr(theirs.experts.local_experts[i], name).weight.grad
              _assert_rel(_expert_linear(ours, i, name)[0].grad, ref, 1e-5, f"expert {i} {name} weight grad")
      out_fp8 = results["ours_fp8"][0]
      rel = ((out_fp8 - out_m).norm() / out_m.norm()).item()
      assert 0 < rel < 0.1, f"FP8 drop-and-pad output: relative error {rel:.3e} vs megatron's high precision"

  return check

if __name__ == "__main__":  # megatron's checkpoint writer spawns processes that import this module
    MODE = sys.argv[1]
    if MODE == "mlp":
        ps.initialize(tp=2)
        checks = [
            ("tp2_matches_single_rank", check_tp_matches_single_rank(False)),
            ("tp2_sp_matches_single_rank", check_tp_matches_single_rank(True)),
            ("sp_fp8_gather_equals_bf16_gather", check_sp_fp8_gather_equals_bf16_gather),
            ("weight_caching", check_weight_caching),
            ("state_dict_tp2_to_tp1", check_state_dict_round_trip_and_tp2_to_tp1),
            ("fused_wgrad_accumulation_under_ddp", check_fused_wgrad_accumulation_under_ddp),
        ]
    elif MODE == "ep":
        ps.initialize(ep=2)
        checks = [("ep2_moe_sequential_matches_unsharded", check_ep2_moe_matches_unsharded_experts(False)),
                  ("ep2_moe_grouped_matches_unsharded", check_ep2_moe_matches_unsharded_experts(True)),
                  ("ep2_drop_and_pad_sequential_matches_megatron", check_ep2_drop_and_pad_matches_megatrons_experts(False)),
                  ("ep2_drop_and_pad_grouped_matches_megatron", check_ep2_drop_and_pad_matches_megatrons_experts(True))]
    else:
        ps.initialize(tp=2, pp=2, ep=2)
        checks = _gpt_checks()
    run_checks(checks)
    ps.destroy()
    exit_now()  # skip finalization: see exit_now
