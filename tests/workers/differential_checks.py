"""Multi-rank half of the differential suite (gloo; every rank asserts; tolerances in differential_common.py).

Usage (under torchrun):
  differential_checks.py tp     (4 ranks) TP 1, 2, 4 in turn: ColumnParallelLinear -> gelu -> RowParallelLinear
                                and LayerNormColumnParallelLinear, aligned / unaligned sizes, SP on / off,
                                delayed / current scaling, frozen fc1 + no_grad call + a module called twice,
                                bfloat16 parameters; against float64 from the gathered weights and against the
                                same modules with the scope disabled; FP8 state equal over the amax domain and
                                backward histories updated each step. Negative controls at TP4: a dropped TP sum
                                and a weight scale_inv off by one E4M3 step fail the same comparison.
  differential_checks.py layer  (2 ranks) GroupedLinear experts with different routing per rank (empty experts)
                                in one expert amax domain; megatron TransformerBlock of our spec (TP2 + SP):
                                FP8 vs high precision, config recompute full / selective and torch checkpoint
                                equal to no recompute, a frozen layer and a no_grad call between steps.
"""
from __future__ import annotations

import contextlib
import copy
import sys
from typing import Dict, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

import fp8_parallel as fp
import parallel_state as ps
from differential_common import (
    CHAIN_GRAD_TOL, HP_TOL, LAYER_GRAD_TOL, LAYER_OUT_TOL, assert_within, errors, fails_within, weight_scale_inv_off,
)
from rank_checks import run_checks, test_seed, exit_now

# Delayed scaling casts with the amaxes of earlier steps, and every step here draws fresh random data (a few
# dozen tokens), whose amax can grow ~2x over the history's: with margin 0 those values saturated (seed
# 2861775549: TP2 bfloat16 output 0.080 off at step 2; seeds 2233635159, 708325428: an expert's tokens grew
# 3 -> 13 and its grad_output amax 1.8x, weight grad 0.15 off). That lag is the recipe's documented behaviour,
# not what these checks are about: margin 2 casts with a quarter of the scale, so an amax may grow 4x without
# saturating, and the casts' relative precision is unchanged (the values stay far above the smallest normals).
RECIPES = {"delayed": lambda: fp.DelayedScaling(amax_history_len=4, margin=2), "current": lambda: fp.CurrentScaling()}
SIZES = {"aligned": (64, 128), "unaligned": {1: (30, 50), 2: (30, 50), 4: (24, 40)}}  # hidden, ffn
STEPS = 3


def _sizes(name: str, tp: int):
    return SIZES["aligned"] if name == "aligned" else SIZES["unaligned"][tp]


def _gather(t: torch.Tensor, dim: int) -> torch.Tensor:
    parts = [torch.empty_like(t) for _ in range(ps.get_size("tp"))]
    dist.all_gather(parts, t.contiguous(), group=ps.get_group("tp"))
    return torch.cat(parts, dim=dim)


@contextlib.contextmanager
def _together(what: str):
    """Run a block of local assertions; every rank learns whether any rank failed (all-reduce MAX) before
    going on, so a failure on one rank never leaves the others waiting in the next collective."""
    failure = None
    try:
        yield
    except AssertionError as e:
        failure = e
    flag = torch.tensor([0 if failure is None else 1])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if failure is not None:
        raise failure
    if flag.item():
        raise AssertionError(f"{what}: failed on another rank")


def _same_over(group, t: torch.Tensor, what: str) -> None:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    assert all(torch.equal(p, t) for p in parts), f"{what} differs within its amax domain: {parts}"


def _config(hidden: int, ffn: int, sp: bool, dtype=torch.float32, ln: bool = False):
    from megatron.core.transformer.transformer_config import TransformerConfig

    heads = ps.get_size("tp")  # (unused by the linears; megatron wants a multiple of TP)
    return TransformerConfig(num_layers=1, hidden_size=hidden, ffn_hidden_size=ffn, num_attention_heads=heads,
                             use_cpu_initialization=True, tensor_model_parallel_size=ps.get_size("tp"),
                             sequence_parallel=sp, params_dtype=dtype, normalization="LayerNorm")


class _MLP:
    """fc1 (Column or LayerNormColumn) -> gelu -> fc2 (Row), with the float64 reference of its gathered weights."""

    def __init__(self, hidden: int, ffn: int, sp: bool, dtype, layernorm: bool, seed: int):
        cfg = _config(hidden, ffn, sp, dtype)
        torch.manual_seed(seed % 100003)
        # std 1/sqrt(fan_in): pre-activations at the inputs' scale, as in a trained model. With std 1 they were
        # ~10x larger, and gelu' taken at the FP8 forward's pre-activation (off by its FP8 error where gelu'
        # changes fastest) pushed fc1's gradient errors up to 0.25 (see differential_common)
        init = lambda w: torch.nn.init.normal_(w, std=w.shape[1] ** -0.5)  # noqa: E731
        col = fp.LayerNormColumnParallelLinear if layernorm else fp.ColumnParallelLinear
        self.fc1 = col(hidden, ffn, config=cfg, init_method=init, bias=True, gather_output=False,
                       skip_bias_add=False, is_expert=False)
        self.fc2 = fp.RowParallelLinear(ffn, hidden, config=cfg, init_method=init, bias=True,
                                        input_is_parallel=True, skip_bias_add=False, is_expert=False)
        with torch.no_grad():
            gen = torch.Generator().manual_seed(seed + 17 + ps.get_rank("tp"))  # per-shard values
            self.fc1.bias.copy_(torch.randn(self.fc1.bias.shape, generator=gen))
            if layernorm:
                g = torch.Generator().manual_seed(seed + 3)  # replicated over TP
                self.fc1.layer_norm_weight.copy_(1 + 0.3 * torch.randn(hidden, generator=g))
                self.fc1.layer_norm_bias.copy_(0.3 * torch.randn(hidden, generator=g))
        self.sp, self.layernorm = sp, layernorm

    def params(self):
        return [*self.fc1.parameters(), *self.fc2.parameters()]

    def run(self, x_full, dy_full, recipe, enabled=True, twice=False, probe=None) -> Dict[str, torch.Tensor]:
        """One step on the full input (SP: this rank's sequence shard); results gathered to full tensors."""
        tp_rank, tp = ps.get_rank("tp"), ps.get_size("tp")
        shard = (lambda t: t.chunk(tp, dim=0)[tp_rank]) if self.sp else (lambda t: t)
        for p in self.params():
            p.grad = None
        x = shard(x_full).detach().clone().requires_grad_()
        with ps.cpu_compat(), fp.autocast(enabled=enabled, recipe=recipe, group=ps.dense_amax_group()):
            h, _ = self.fc1(x)
            y, _ = self.fc2(F.gelu(h))
            if twice:  # the same modules again in the same scope
                h2, _ = self.fc1(x * 0.5)
                y = y + self.fc2(F.gelu(h2))[0]
            if probe is not None:
                with torch.no_grad():  # a logging probe inside the training scope
                    self.fc2(F.gelu(self.fc1(shard(probe))[0]))
        with _together("contiguous outputs"):
            assert y.is_contiguous() and h.is_contiguous(), "an FP8 linear returned a strided output"
        with ps.cpu_compat():
            y.backward(shard(dy_full).to(y.dtype))
        for p in self.params():  # as megatron's finalize_model_grads does for sequence-parallel params
            if getattr(p, "sequence_parallel", False) and p.grad is not None:
                dist.all_reduce(p.grad, group=ps.get_group("tp"))
        full = (lambda t: _gather(t, 0)) if self.sp else (lambda t: t)
        got = {"output": full(y.detach()), "input grad": full(x.grad),
               "fc1 bias grad": _gather(self.fc1.bias.grad, 0), "fc2 weight grad": _gather(self.fc2.weight.grad, 1),
               "fc2 bias grad": self.fc2.bias.grad}
        if self.fc1.weight.requires_grad:
            got["fc1 weight grad"] = _gather(self.fc1.weight.grad, 0)
        if self.layernorm:
            got["ln weight grad"] = self.fc1.layer_norm_weight.grad
            got["ln bias grad"] = self.fc1.layer_norm_bias.grad
        return got

    def reference(self, x_full, dy_full, twice=False) -> Dict[str, torch.Tensor]:
        """float64 forward and backward from the gathered weights."""
        w1 = _gather(self.fc1.weight.detach(), 0).double().requires_grad_()
        b1 = _gather(self.fc1.bias.detach(), 0).double().requires_grad_()
        w2 = _gather(self.fc2.weight.detach(), 1).double().requires_grad_()
        b2 = self.fc2.bias.detach().double().requires_grad_()
        x = x_full.double().requires_grad_()
        ln = [self.fc1.layer_norm_weight.detach().double().requires_grad_(),
              self.fc1.layer_norm_bias.detach().double().requires_grad_()] if self.layernorm else None

        def mlp(inp):
            if ln is not None:
                inp = F.layer_norm(inp, (inp.shape[-1],), ln[0], ln[1], self.fc1.eps)
            return F.linear(F.gelu(F.linear(inp, w1, b1)), w2, b2)

        y = mlp(x) + (mlp(x * 0.5) if twice else 0)
        y.backward(dy_full.double())
        ref = {"output": y, "input grad": x.grad, "fc1 bias grad": b1.grad, "fc2 weight grad": w2.grad,
               "fc2 bias grad": b2.grad}
        if self.fc1.weight.requires_grad:
            ref["fc1 weight grad"] = w1.grad
        if ln is not None:
            ref["ln weight grad"], ref["ln bias grad"] = ln[0].grad, ln[1].grad
        return ref

    def check_state(self, recipe_name: str, step: int) -> None:
        """FP8 state equal over the amax domain; forward and backward amaxes of this step recorded."""
        for name, m in (("fc1", self.fc1), ("fc2", self.fc2)):
            for t in (m.fp8.fwd.scale, m.fp8.bwd.scale, m.fp8.fwd.amax_history, m.fp8.bwd.amax_history):
                _same_over(ps.dense_amax_group(), t, f"{name} FP8 state")
            with _together("histories updated"):
                if recipe_name == "delayed":
                    assert (m.fp8.fwd.amax_history[:, 0] > 0).all(), f"step {step}: {name} forward amax not recorded"
                    assert (m.fp8.bwd.amax_history[:, 0] > 0).all(), f"step {step}: {name} backward history not updated"


def _mlp_case(sizes: str, recipe_name: str, sp: bool = False, layernorm: bool = False, dtype=torch.float32,
              frozen_twice_probe: bool = False):
    def check():
        seed = test_seed()
        tp = ps.get_size("tp")
        hidden, ffn = _sizes(sizes, tp)
        print(f"tp{tp} {sizes} {recipe_name} sp={sp} ln={layernorm} {dtype}: seed {seed}", flush=True)
        mlp = _MLP(hidden, ffn, sp, dtype, layernorm, seed)
        if frozen_twice_probe:
            mlp.fc1.weight.requires_grad_(False)
        recipe = RECIPES[recipe_name]()
        gen = torch.Generator().manual_seed(seed + 1)  # identical data on every rank
        seq = 4 * tp if sp else 7  # 7 x 3 = 21 tokens: unaligned
        for step in range(STEPS):
            x = (torch.randn(seq, 3, hidden, generator=gen) * 2).to(dtype)
            dy = torch.randn(seq, 3, hidden, generator=gen)
            twice, probe = frozen_twice_probe, (x * 0.25 if frozen_twice_probe else None)
            ref = mlp.reference(x, dy, twice=twice)
            got = mlp.run(x, dy, recipe, twice=twice, probe=probe)
            with _together(f"step {step} vs float64"):
                # fc1's and the input's gradients pass two E5M2 casts (fc2's and fc1's grad_output)
                errs = assert_within(got, ref, f"rank {dist.get_rank()} step {step}", grad_tol=CHAIN_GRAD_TOL)
                assert errs["output"] > 3e-3, f"no FP8 rounding in the output ({errs}): the FP8 path did not run"
            mlp.check_state(recipe_name, step)
            hp = mlp.run(x, dy, recipe, enabled=False, twice=twice)
            tol = HP_TOL[dtype] * (10 if dtype == torch.float32 else 1)  # through gelu and a TP sum
            with _together(f"step {step} high precision"):
                assert_within(hp, ref, f"rank {dist.get_rank()} high-precision path step {step}", tol, tol)
            print(f"rank {dist.get_rank()} step {step}: {errs}", flush=True)
            if frozen_twice_probe:  # an inference call in its own scope between training steps
                with torch.no_grad(), ps.cpu_compat(), fp.autocast(recipe=recipe, group=ps.dense_amax_group()):
                    mlp.fc2(F.gelu(mlp.fc1(x * 5)[0]))
    return check


@contextlib.contextmanager
def _tp_sum_dropped():
    """A deliberate bug: the row-parallel output is not summed over TP (the all-reduce of float outputs is
    skipped; amax reductions, which use MAX, still run)."""
    original = dist.all_reduce

    def buggy(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if op == dist.ReduceOp.SUM and group is ps.get_group("tp") and tensor.dim() >= 2:
            return None
        return original(tensor, op=op, group=group, async_op=async_op)

    dist.all_reduce = buggy
    try:
        yield
    finally:
        dist.all_reduce = original


def _negative_control(bug):
    def check():
        seed = test_seed()
        tp = ps.get_size("tp")
        hidden, ffn = _sizes("unaligned", tp)
        mlp = _MLP(hidden, ffn, False, torch.float32, False, seed)
        recipe = RECIPES["delayed"]()
        gen = torch.Generator().manual_seed(seed + 2)
        x, dy = torch.randn(7, 3, hidden, generator=gen) * 2, torch.randn(7, 3, hidden, generator=gen)
        ref = mlp.reference(x, dy)
        good = mlp.run(x, dy, recipe)
        with _together("without the bug"):
            assert not fails_within(good, ref, grad_tol=CHAIN_GRAD_TOL), errors(good, ref)
        with bug():
            bad = mlp.run(x, dy, recipe)
        assert fails_within(bad, ref, grad_tol=CHAIN_GRAD_TOL), \
            f"rank {dist.get_rank()}: the deliberate bug passed: {errors(bad, ref)}"
        print(f"rank {dist.get_rank()} negative control caught: {errors(bad, ref)}", flush=True)
    return check


TP_CASES = {
    1: {"mlp_unaligned_delayed": dict(sizes="unaligned", recipe_name="delayed"),
        "lncl_aligned_current": dict(sizes="aligned", recipe_name="current", layernorm=True),
        "mlp_frozen_no_grad_twice_delayed": dict(sizes="unaligned", recipe_name="delayed", frozen_twice_probe=True)},
    2: {"mlp_aligned_delayed": dict(sizes="aligned", recipe_name="delayed"),
        "mlp_unaligned_current": dict(sizes="unaligned", recipe_name="current"),
        "mlp_sp_unaligned_delayed": dict(sizes="unaligned", recipe_name="delayed", sp=True),
        "lncl_sp_current": dict(sizes="aligned", recipe_name="current", sp=True, layernorm=True),
        "mlp_frozen_no_grad_twice_delayed": dict(sizes="unaligned", recipe_name="delayed", frozen_twice_probe=True),
        "mlp_bf16_delayed": dict(sizes="unaligned", recipe_name="delayed", dtype=torch.bfloat16)},
    4: {"mlp_unaligned_delayed": dict(sizes="unaligned", recipe_name="delayed"),
        "mlp_sp_aligned_current": dict(sizes="aligned", recipe_name="current", sp=True),
        "lncl_sp_unaligned_delayed": dict(sizes="unaligned", recipe_name="delayed", sp=True, layernorm=True)},
}
TP_NEGATIVE = ["tp4_negative_control_dropped_tp_sum", "tp4_negative_control_scale_off"]


def tp_check_names():
    """The names of the `tp` mode's checks (the launcher expects every one on every rank)."""
    return [f"tp{tp}_{name}" for tp, cases in TP_CASES.items() for name in cases] + TP_NEGATIVE


def tp_checks():
    checks = []
    for tp, cases in TP_CASES.items():
        def setup(tp=tp):
            if ps.is_initialized():
                ps.destroy(destroy_process_group=False)
            ps.initialize(tp=tp)
        checks.append((f"tp{tp}_setup", setup))
        checks += [(f"tp{tp}_{name}", _mlp_case(**kw)) for name, kw in cases.items()]
    checks += [(TP_NEGATIVE[0], _negative_control(_tp_sum_dropped)),
               (TP_NEGATIVE[1], _negative_control(lambda: weight_scale_inv_off(1.125)))]
    return checks


# ---- layer mode: grouped experts and a megatron TransformerBlock ------------------------------------------------

def _grouped_case(recipe_name: str):
    def check():
        from megatron.core.transformer.transformer_config import TransformerConfig
        from fp8_parallel.modules.grouped import GroupedLinear

        seed = test_seed()
        print(f"grouped {recipe_name}: seed {seed}", flush=True)
        n, d_in, d_out = 4, 30, 20
        cfg = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=2, use_cpu_initialization=True,
                                perform_initialization=False, params_dtype=torch.float32)
        lin = GroupedLinear(n, d_in, d_out, partition="column", config=cfg, init_method=None, bias=True)
        gen = torch.Generator().manual_seed(seed)  # identical experts on both ranks (expert-data-parallel)
        with torch.no_grad():
            for i in range(n):
                getattr(lin, f"weight{i}").copy_(torch.randn(d_out, d_in, generator=gen) / d_in**0.5)
                getattr(lin, f"bias{i}").copy_(torch.randn(d_out, generator=gen))
        recipe = RECIPES[recipe_name]()  # delayed: margin 2, an expert's token count jumps between steps
        rank = dist.get_rank()
        # different routing per rank; rank 0 leaves expert 1 empty, rank 1 experts 0 and 3, expert 2 is empty on
        # both ranks in step 1
        routing = {0: [[5, 0, 9, 3], [4, 0, 0, 13]], 1: [[0, 7, 2, 0], [0, 11, 0, 0]]}
        local = torch.Generator().manual_seed(seed + 100 + rank)
        for step in range(2 * len(routing[rank])):
            splits = routing[rank][step % 2]
            x = (torch.randn(sum(splits), d_in, generator=local) * 2).requires_grad_()
            dy = torch.randn(sum(splits), d_out, generator=local)
            for p in lin.parameters():
                p.grad = None
            before = [(st.fwd.amax_history.clone(), st.bwd.amax_history.clone()) for st in lin.fp8]
            with ps.cpu_compat(), fp.autocast(recipe=recipe, group=ps.expert_amax_group()):
                y = lin(x, splits)
            y.backward(dy)
            # float64 reference, expert by expert
            x64 = x.detach().double().requires_grad_()
            ws = [getattr(lin, f"weight{i}").detach().double().requires_grad_() for i in range(n)]
            bs = [getattr(lin, f"bias{i}").detach().double().requires_grad_() for i in range(n)]
            y64 = torch.cat([F.linear(c, ws[i], bs[i]) for i, c in enumerate(torch.split(x64, splits))])
            y64.backward(dy.double())
            got = {"output": y.detach(), "input grad": x.grad}
            ref = {"output": y64, "input grad": x64.grad}
            nonzero = []
            for i in range(n):
                if splits[i]:
                    got[f"weight{i} grad"], ref[f"weight{i} grad"] = getattr(lin, f"weight{i}").grad, ws[i].grad
                    got[f"bias{i} grad"], ref[f"bias{i} grad"] = getattr(lin, f"bias{i}").grad, bs[i].grad
                else:  # an empty expert: zero gradients
                    for name in (f"weight{i}", f"bias{i}"):
                        g = getattr(lin, name).grad
                        if g is not None and g.abs().any():
                            nonzero.append(name)
            with _together(f"step {step} experts vs float64"):
                assert not nonzero, f"experts without tokens got non-zero gradients: {nonzero}"
                assert_within(got, ref, f"rank {rank} step {step} splits {splits}")
            # every expert's FP8 state agrees over the expert amax domain; amax = max over the ranks
            for i in range(n):
                st = lin.fp8[i]
                for t in (st.fwd.scale, st.bwd.scale, st.fwd.amax_history, st.bwd.amax_history):
                    _same_over(ps.expert_amax_group(), t, f"expert {i} FP8 state")
                rows = torch.split(x.detach(), splits)[i]
                mine = rows.abs().max() if rows.numel() else torch.zeros(())
                dist.all_reduce(mine, op=dist.ReduceOp.MAX, group=ps.expert_amax_group())
                if recipe_name != "delayed":  # current scaling keeps no amax history
                    continue
                # an expert without tokens on every rank keeps its history (not rolled); else the max over ranks
                if mine.item() == 0:
                    assert torch.equal(st.fwd.amax_history[0], before[i][0][0]), (i, step, st.fwd.amax_history)
                else:
                    assert st.fwd.amax_history[0, 0].item() == mine.item(), (i, step, st.fwd.amax_history, mine)
                grads = torch.split(dy, splits)[i]
                gmine = grads.abs().max() if grads.numel() else torch.zeros(())
                dist.all_reduce(gmine, op=dist.ReduceOp.MAX, group=ps.expert_amax_group())
                if gmine.item() == 0:
                    assert torch.equal(st.bwd.amax_history[0], before[i][1][0]), (i, step, st.bwd.amax_history)
                else:
                    assert st.bwd.amax_history[0, 0].item() == gmine.item(), (i, step, st.bwd.amax_history, gmine)
    return check


def _block(seed: int, recompute: Optional[str] = None):
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_block import TransformerBlock
    from megatron.core.transformer.transformer_config import TransformerConfig
    from fp8_parallel.megatron import get_gpt_block_spec

    extra = {}
    if recompute == "full":
        extra = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    elif recompute == "selective":
        extra = dict(recompute_granularity="selective")
    cfg = TransformerConfig(num_layers=2, hidden_size=48, num_attention_heads=4, ffn_hidden_size=80,
                            use_cpu_initialization=True, tensor_model_parallel_size=ps.get_size("tp"),
                            sequence_parallel=True, params_dtype=torch.float32, hidden_dropout=0.0,
                            attention_dropout=0.0, **extra)
    with ps.cpu_compat():
        model_parallel_cuda_manual_seed(seed % 100003)
        return TransformerBlock(cfg, get_gpt_block_spec(cfg)), cfg


def _block_run(block, x_full, dy_full, recipe, enabled=True, checkpoint_fn=None, probe=None):
    tp_rank, tp = ps.get_rank("tp"), ps.get_size("tp")
    x = x_full.chunk(tp, dim=0)[tp_rank].detach().clone().requires_grad_()
    block.zero_grad(set_to_none=True)
    with ps.cpu_compat():
        with fp.autocast(enabled=enabled, recipe=recipe, group=ps.dense_amax_group()):
            if checkpoint_fn is not None:
                y = checkpoint_fn(lambda h: block(hidden_states=h, attention_mask=None), x)
            else:
                y = block(hidden_states=x, attention_mask=None)
            if probe is not None:
                with torch.no_grad():
                    block(hidden_states=probe.chunk(tp, dim=0)[tp_rank], attention_mask=None)
        y.backward(dy_full.chunk(tp, dim=0)[tp_rank])
    for p in block.parameters():
        if getattr(p, "sequence_parallel", False) and p.grad is not None:
            dist.all_reduce(p.grad, group=ps.get_group("tp"))
    got = {"output": _gather(y.detach(), 0), "input grad": _gather(x.grad, 0)}
    for name, p in block.named_parameters():
        if p.grad is not None:
            got[name] = p.grad.clone()
    return got


def _block_fp8_vs_hp():
    seed = test_seed()
    print(f"block fp8 vs high precision: seed {seed}", flush=True)
    block, cfg = _block(seed)
    recipe = RECIPES["delayed"]()
    gen = torch.Generator().manual_seed(seed + 5)
    for step in range(STEPS):
        x, dy = torch.randn(8, 2, 48, generator=gen), torch.randn(8, 2, 48, generator=gen)
        hp = _block_run(block, x, dy, recipe, enabled=False)
        got = _block_run(block, x, dy, recipe)
        print(f"rank {dist.get_rank()} step {step}: {errors(got, hp)}", flush=True)
        with _together(f"step {step} FP8 vs high precision"):
            errs = assert_within(got, hp, f"rank {dist.get_rank()} step {step}", LAYER_OUT_TOL, LAYER_GRAD_TOL)
            # (the output is dominated by the residual path; the weight gradients show the FP8 rounding)
            assert max(errs.values()) > 1e-2, f"no FP8 rounding anywhere ({errs}): the FP8 path did not run"
        for name, m in block.named_modules():
            if isinstance(m, fp.FP8State):
                for t in (m.fwd.scale, m.bwd.scale, m.fwd.amax_history, m.bwd.amax_history):
                    _same_over(ps.dense_amax_group(), t, name)
                with _together(f"step {step} histories"):
                    assert (m.fwd.amax_history[:, 0] > 0).all() and (m.bwd.amax_history[:, 0] > 0).all(), \
                        f"step {step}: {name} history not updated"


def _block_equal_to_plain(recompute: Optional[str] = None, torch_ckpt: bool = False, frozen_probe: bool = False):
    """A variant (recompute, checkpoint, frozen layer + no_grad calls) gives bitwise the plain block's results."""
    def check():
        from torch.utils.checkpoint import checkpoint

        seed = test_seed()
        print(f"block recompute={recompute} torch_ckpt={torch_ckpt} frozen_probe={frozen_probe}: seed {seed}",
              flush=True)
        plain, _ = _block(seed)
        variant, _ = _block(seed, recompute)
        variant.load_state_dict(plain.state_dict())
        if frozen_probe:
            for m in (plain, variant):
                for p in m.layers[0].mlp.parameters():
                    p.requires_grad_(False)
        recipe = RECIPES["delayed"]()
        gen = torch.Generator().manual_seed(seed + 6)
        for step in range(STEPS):
            x, dy = torch.randn(8, 2, 48, generator=gen), torch.randn(8, 2, 48, generator=gen)
            probe = x if frozen_probe else None  # the same input: the same amaxes, so no change is expected
            fns = [None]
            if torch_ckpt:
                fns = [lambda f, h: checkpoint(f, h, use_reentrant=True),
                       lambda f, h: checkpoint(f, h, use_reentrant=False)]
            ref = _block_run(plain, x, dy, recipe)
            hp = _block_run(plain, x, dy, recipe, enabled=False)
            with _together(f"plain step {step}"):
                assert_within(ref, hp, f"plain step {step}", LAYER_OUT_TOL, LAYER_GRAD_TOL)
            before = copy.deepcopy(variant.state_dict())
            for fn in fns:
                variant.load_state_dict(before)
                got = _block_run(variant, x, dy, recipe, checkpoint_fn=fn, probe=probe)
                with _together(f"step {step} variant equals plain"):
                    assert got.keys() == ref.keys(), (sorted(got), sorted(ref))
                    for k in ref:
                        assert torch.equal(got[k], ref[k]), \
                            f"step {step}: {k} differs, {errors({k: got[k]}, {k: ref[k]})}"
                    for name, m in variant.named_modules():
                        if isinstance(m, fp.FP8State):
                            assert (m.bwd.amax_history[:, 0] > 0).all(), f"step {step}: {name} backward not reduced"
            with _together(f"step {step} state equals plain"):
                for (n, a), b in zip(variant.state_dict().items(), plain.state_dict().values()):
                    if isinstance(a, torch.Tensor):
                        assert torch.equal(a, b), f"step {step}: {n} differs from the plain block"
            if frozen_probe:  # an inference call in its own scope between training steps
                with torch.no_grad(), ps.cpu_compat(), fp.autocast(recipe=recipe, group=ps.dense_amax_group()):
                    variant(hidden_states=(x * 3).chunk(2, dim=0)[ps.get_rank("tp")], attention_mask=None)
    return check


def layer_checks():
    ps.initialize(tp=2)
    return [
        ("grouped_empty_experts_delayed", _grouped_case("delayed")),
        ("grouped_empty_experts_current", _grouped_case("current")),
        ("block_fp8_vs_high_precision", _block_fp8_vs_hp),
        ("block_recompute_full", _block_equal_to_plain("full")),
        ("block_recompute_selective", _block_equal_to_plain("selective")),
        ("block_torch_checkpoint", _block_equal_to_plain(torch_ckpt=True)),
        ("block_frozen_and_no_grad", _block_equal_to_plain(frozen_probe=True)),
    ]


if __name__ == "__main__":
    MODE = sys.argv[1]
    if MODE == "tp":
        ps.initialize(tp=1)
        CHECKS = tp_checks()
        if len(sys.argv) > 2:  # only the checks whose names start with one of these (e.g. "tp4")
            CHECKS = [c for c in CHECKS if c[0].startswith(tuple(sys.argv[2:]))]
    elif MODE == "layer":
        CHECKS = layer_checks()
        if len(sys.argv) > 2:  # only the checks whose names start with one of these (e.g. "grouped")
            CHECKS = [c for c in CHECKS if c[0].startswith(tuple(sys.argv[2:]))]
    else:
        raise SystemExit(f"unknown mode {MODE!r}: expected 'tp' or 'layer'")
    run_checks(CHECKS)
    ps.destroy()
    exit_now()  # skip finalization: see exit_now
