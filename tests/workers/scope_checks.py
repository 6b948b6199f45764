"""Multi-rank checks of nested FP8 autocast scopes and the amax reduction engine (gloo, every rank asserts).

Usage (under torchrun, 2 or 4 ranks): scope_checks.py
"""
from __future__ import annotations

import math
import os
import time

import torch
import torch.distributed as dist

import fp8_parallel as fp
import parallel_state as ps
from fp8_parallel.modules import Linear
from rank_checks import run_checks, test_seed, exit_now

WORLD = int(os.environ["WORLD_SIZE"])
dist.init_process_group("gloo")  # before parallel_state, so the world group exists for the spy
RANK = dist.get_rank()
WORLD_GROUP = dist.group.WORLD
H = 32


# ---- instrumentation: count and record the all-reduces the engine issues ----------------------------------
class _Spy:
    def __init__(self):
        self.calls = []  # (group ranks, tensor before, tensor after)
        self._orig = dist.all_reduce
        self.active = False

    def __call__(self, tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        before = tensor.detach().clone()
        ranks = dist.get_process_group_ranks(group or WORLD_GROUP)
        out = self._orig(tensor, op=op, group=group, async_op=async_op)
        if not self.active:
            return out
        if not async_op:
            self.calls.append((ranks, before, tensor.detach().clone()))
            return out
        spy = self

        class _Recorded:
            def wait(self, timeout=None):
                result = out.wait(timeout=timeout) if timeout is not None else out.wait()
                spy.calls.append((ranks, before, tensor.detach().clone()))
                return result

        return _Recorded()


SPY = _Spy()
dist.all_reduce = SPY


def _out(y):
    """A layer's output tensor, whether it returns `out` or `(out, bias)`."""
    return y[0] if isinstance(y, tuple) else y


def _gather(t: torch.Tensor, group=None) -> list:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, t.contiguous(), group=group)
    return out


def _assert_same_across(t: torch.Tensor, group=None, what=""):
    for other in _gather(t, group):
        assert torch.equal(other, t), f"{what} differs across ranks"


def _model(n: int, seed: int):
    torch.manual_seed(seed)  # same weights on every rank
    return torch.nn.ModuleList([Linear(H, H) for _ in range(n)])


def _run(layers, x, recipe, group, skip=()):
    with fp.autocast(recipe=recipe, group=group):
        h = x
        for i, layer in enumerate(layers):
            if i not in skip:
                h = torch.tanh(_out(layer(h)))
    return h


def _local_input(step: int, scale: float = 1.0):
    g = torch.Generator().manual_seed(test_seed() + 1000 * step + RANK)
    return (torch.randn(16, H, generator=g) * scale * (1 + RANK)).requires_grad_()


# ---- checks -----------------------------------------------------------------------------------------------
def check_identical_state_from_global_max():
    recipe = fp.DelayedScaling(amax_history_len=8)
    layers = _model(4, 1)
    local = _model(4, 1)  # same weights, no reduction: the local amaxes of the first iteration
    x = _local_input(0)
    _run(local, x.detach().clone().requires_grad_(), recipe, None).sum().backward()
    _run(layers, x, recipe, WORLD_GROUP).sum().backward()
    for lay, loc in zip(layers, local):
        for meta, loc_meta, fmax in ((lay.fp8.fwd, loc.fp8.fwd, 448.0), (lay.fp8.bwd, loc.fp8.bwd, 57344.0)):
            expected = torch.stack(_gather(loc_meta.amax_history[:, 0])).amax(0)
            assert torch.equal(meta.amax_history[:, 0], expected), (meta.amax_history[:, 0], expected)
            torch.testing.assert_close(meta.scale, fmax / expected, rtol=1e-6, atol=0)
            _assert_same_across(meta.amax_history, what="history")
            _assert_same_across(meta.scale, what="scale")
    for step in range(1, 4):  # later iterations stay identical across ranks
        _run(layers, _local_input(step), recipe, WORLD_GROUP).sum().backward()
    for lay in layers:
        for meta in (lay.fp8.fwd, lay.fp8.bwd):
            _assert_same_across(meta.amax_history, what="history")
            _assert_same_across(meta.scale, what="scale")
            assert (meta.amax_history[:, :4] > 0).all()


def _collectives_per_iteration(n_modules: int) -> int:
    recipe = fp.DelayedScaling(amax_history_len=4)
    layers = _model(n_modules, 2)
    _run(layers, _local_input(0), recipe, WORLD_GROUP).sum().backward()  # layouts verified here
    SPY.calls.clear()
    SPY.active = True
    _run(layers, _local_input(1), recipe, WORLD_GROUP).sum().backward()
    SPY.active = False
    calls = list(SPY.calls)
    for ranks, before, after in calls:  # and each one is a MAX over the ranks
        expected = torch.stack(_gather(before)).amax(0)
        assert torch.equal(after, expected)
    return len(calls), sum(c[1].numel() for c in calls)


def check_one_collective_per_scope_and_direction():
    n10, elems10 = _collectives_per_iteration(10)
    n200, elems200 = _collectives_per_iteration(200)
    assert (n10, n200) == (2, 2), (n10, n200)  # (one scope) x (forward, backward)
    header = 4  # fingerprint and slot count travel in front of the amaxes
    assert (elems10, elems200) == (2 * header + 10 * 3, 2 * header + 200 * 3), (elems10, elems200)


def check_nested_scopes_reduce_over_their_own_groups():
    """4 ranks (TP2 x EP2): an outer scope over TP, an inner one over EP (registered only at 4 ranks)."""
    assert WORLD == 4, WORLD
    outer_group, inner_group = ps.get_group("tp"), ps.get_group("ep")
    outer_recipe = fp.DelayedScaling(amax_history_len=4)
    inner_recipe = fp.DelayedScaling(amax_history_len=4, amax_compute_algo="most_recent")
    torch.manual_seed(3)
    a, b, c = Linear(H, H), Linear(H, H), Linear(H, H)
    x = _local_input(0)
    SPY.calls.clear()
    SPY.active = True
    with fp.autocast(recipe=outer_recipe, group=outer_group):
        h = _out(a(x))
        with fp.autocast(recipe=inner_recipe, group=inner_group):
            h = _out(b(h))
        h = _out(c(h))
    h.sum().backward()
    SPY.active = False
    groups = sorted(tuple(r) for r, _, a in SPY.calls if a.numel() > 4)  # reductions, not first-time layout checks
    assert all(tuple(r) in (tuple(ps.get_ranks("tp")), tuple(ps.get_ranks("ep"))) for r, _, _ in SPY.calls)
    tp_ranks, ep_ranks = tuple(ps.get_ranks("tp")), tuple(ps.get_ranks("ep"))
    assert groups == sorted([tp_ranks, tp_ranks, ep_ranks, ep_ranks]), groups
    for lay, group, ranks in ((a, outer_group, tp_ranks), (c, outer_group, tp_ranks), (b, inner_group, ep_ranks)):
        _assert_same_across(lay.fp8.fwd.scale, group, "scale within its group")
        everyone = _gather(lay.fp8.fwd.scale)
        outsiders = [everyone[r] for r in range(WORLD) if r not in ranks]
        assert any(not torch.equal(o, lay.fp8.fwd.scale) for o in outsiders), "reduced beyond its group"


def check_module_that_runs_on_odd_iterations_only():
    recipe = fp.DelayedScaling(amax_history_len=6)
    layers = _model(3, 4)
    for step in range(6):
        before = [l.fp8.fwd.amax_history.clone() for l in layers], [l.fp8.fwd.scale.clone() for l in layers]
        skip = () if step % 2 else (1,)
        _run(layers, _local_input(step), recipe, WORLD_GROUP, skip=skip).sum().backward()
        rolled = [not torch.equal(b, l.fp8.fwd.amax_history) for b, l in zip(before[0], layers)]
        assert rolled == [True, bool(step % 2), True], (step, rolled)
        if not step % 2:
            assert torch.equal(before[1][1], layers[1].fp8.fwd.scale)
            assert torch.equal(before[0][1], layers[1].fp8.fwd.amax_history)
    assert (layers[1].fp8.fwd.amax_history[:, :3] > 0).all() and (layers[1].fp8.fwd.amax_history[:, 3:] == 0).all()


def check_module_called_twice_takes_the_max():
    recipe = fp.DelayedScaling(amax_history_len=4)
    torch.manual_seed(5)
    lin = Linear(H, H)
    x1, x2 = _local_input(0), _local_input(1, scale=3.0)
    with fp.autocast(recipe=recipe, group=WORLD_GROUP):
        y = _out(lin(x1)) + _out(lin(x2))
    y.sum().backward()
    local = torch.maximum(x1.detach().abs().max(), x2.detach().abs().max())
    expected = torch.stack(_gather(local.reshape(1))).amax()
    assert lin.fp8.fwd.amax_history[0, 0] == expected
    assert lin.fp8.fwd.amax_history[0, 1] == 0  # rolled once, not twice


def _checkpoint_variant(kind: str):
    """The checkpointed block (a module called twice, a frozen layer and a no_grad probe inside) gives the
    plain block's outputs, gradients and FP8 state bitwise, with backward amaxes reduced in the iteration."""
    from megatron.core import tensor_parallel

    recipe = fp.DelayedScaling(amax_history_len=4)
    models = []
    for _ in range(2):
        layers = _model(4, 6)  # two trainable layers, a frozen one, a probe
        layers[2].requires_grad_(False)
        models.append(layers)
    plain, ckpt = models

    def block(layers, h):
        a, b, frozen, probe = layers
        h = torch.tanh(_out(a(h)))
        h = h + 0.5 * torch.tanh(_out(a(h)))  # called twice
        with torch.no_grad():
            _out(probe(h))
        h = h + _out(frozen(h))
        return torch.tanh(_out(b(h)))

    for step in range(3):
        x = _local_input(step)
        xc = x.detach().clone().requires_grad_()
        with fp.autocast(recipe=recipe, group=WORLD_GROUP):
            out = block(plain, x)
        out.sum().backward()
        with ps.cpu_compat():
            if kind == "scope_inside_nonreentrant":
                def fn(h):
                    with fp.autocast(recipe=recipe, group=WORLD_GROUP):
                        return block(ckpt, h)
                outc = torch.utils.checkpoint.checkpoint(fn, xc, use_reentrant=False)
                outc.sum().backward()
            elif kind == "megatron_without_output":  # megatron's selective recompute: output discarded
                with fp.autocast(recipe=recipe, group=WORLD_GROUP):
                    recompute = tensor_parallel.CheckpointWithoutOutput(fp8=None)
                    inner = recompute.checkpoint(lambda h: block(ckpt, h), xc)
                    outc = inner * 1.0
                    recompute.discard_output_and_register_recompute(outc)
                outc.sum().backward()
            elif kind == "megatron_scope_inside":  # as our layers under megatron's full recompute
                def inner(h):
                    with fp.autocast(recipe=recipe, group=WORLD_GROUP):  # shares the outer key
                        return block(ckpt, h)
                with fp.autocast(recipe=recipe, group=WORLD_GROUP):
                    outc = tensor_parallel.checkpoint(inner, False, xc)
                outc.sum().backward()
            else:
                with fp.autocast(recipe=recipe, group=WORLD_GROUP):
                    if kind == "torch_nonreentrant":
                        outc = torch.utils.checkpoint.checkpoint(lambda h: block(ckpt, h), xc, use_reentrant=False)
                    elif kind == "torch_reentrant":
                        outc = torch.utils.checkpoint.checkpoint(lambda h: block(ckpt, h), xc, use_reentrant=True)
                    else:
                        outc = tensor_parallel.checkpoint(lambda h: block(ckpt, h), False, xc)
                outc.sum().backward()
        assert torch.equal(out, outc), (kind, step)
        assert torch.equal(x.grad, xc.grad), (kind, step)
        for p, q in zip(plain.parameters(), ckpt.parameters()):
            assert (p.grad is None) == (q.grad is None), (kind, step)
            assert p.grad is None or torch.equal(p.grad, q.grad), (kind, step)
        for p, q in zip(plain.buffers(), ckpt.buffers()):
            assert torch.equal(p, q), (kind, step, "fp8 state")
        for layer in ckpt[:3]:  # reduced in this iteration: one roll per iteration
            assert (layer.fp8.bwd.amax_history[0, : step + 1] > 0).all(), (kind, step)


def check_activation_checkpointing():
    with ps.cpu_compat():
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(123)
    for kind in ("torch_nonreentrant", "torch_reentrant", "megatron", "megatron_without_output",
                 "megatron_scope_inside", "scope_inside_nonreentrant"):
        _checkpoint_variant(kind)


def check_eval_and_no_grad_do_not_update():
    recipe = fp.DelayedScaling(amax_history_len=4)
    layers = _model(2, 7)
    _run(layers, _local_input(0), recipe, WORLD_GROUP).sum().backward()
    state = [b.clone() for b in layers.buffers()]
    SPY.calls.clear()
    SPY.active = True
    with torch.no_grad():
        _run(layers, _local_input(1), recipe, WORLD_GROUP)
    layers.eval()
    with torch.inference_mode():
        _run(layers, _local_input(2), recipe, WORLD_GROUP)
    SPY.active = False
    assert not SPY.calls
    assert all(torch.equal(a, b) for a, b in zip(state, layers.buffers()))


def _reference_update(history, scale, amax, fmax, recipe):
    if not (amax > 0) or not math.isfinite(amax):
        return history, scale
    history = [amax] + history[:-1]
    algo = recipe.amax_compute_algo
    a = max(history) if algo == "max" else history[0] if algo == "most_recent" else algo(torch.tensor([history]).t()).item()
    return history, fmax / a / 2**recipe.margin


def check_updates_equal_per_tensor_reference():
    for algo in ("max", "most_recent", lambda h: h.mean(dim=0)):  # a callable sees TE's [history_len, tensors]
        for length in (1, 5):
            recipe = fp.DelayedScaling(amax_history_len=length, amax_compute_algo=algo, margin=1)
            layers = _model(3, 8)
            ref = {id(m): [([0.0] * length, 1.0) for _ in range(m.num_tensors)]
                   for l in layers for m in (l.fp8.fwd, l.fp8.bwd)}
            for step in range(length + 3):
                SPY.calls.clear()
                SPY.active = True
                _run(layers, _local_input(step), recipe, WORLD_GROUP).sum().backward()
                SPY.active = False
                reductions = [a[4:] for _, _, a in SPY.calls if a.numel() > 4]  # not the 4-element layout checks
                fwd_amax, bwd_amax = reductions[-2:]
                for direction, reduced, fmax in (("fwd", fwd_amax, 448.0), ("bwd", bwd_amax, 57344.0)):
                    metas = [getattr(l.fp8, direction) for l in layers]
                    if direction == "bwd":
                        metas = metas[::-1]  # backward registers in reverse order
                    offset = 0
                    for m in metas:
                        rows = ref[id(m)]
                        for i in range(m.num_tensors):
                            rows[i] = _reference_update(rows[i][0], rows[i][1], reduced[offset + i].item(), fmax, recipe)
                        offset += m.num_tensors
                        torch.testing.assert_close(m.amax_history, torch.tensor([h for h, _ in rows]))
                        torch.testing.assert_close(m.scale, torch.tensor([s for _, s in rows]), rtol=1e-6, atol=0)


def check_mismatched_layouts_raise_quickly():
    recipe = fp.DelayedScaling(amax_history_len=4)
    for variant in ("count", "order"):
        layers = torch.nn.ModuleList([Linear(H, H), Linear(H, H), Linear(H, 2 * H)])
        if variant == "count":  # rank 0 runs one FP8 module fewer
            order = [0, 1] if RANK == 0 else [0, 1, 2]
        else:
            order = [0, 2] if RANK == 0 else [2, 0]
        t0 = time.time()
        try:
            with fp.autocast(recipe=recipe, group=WORLD_GROUP):
                for i in order:
                    layers[i](_local_input(0, 1.0)[:, : layers[i].in_features])
        except fp.AmaxLayoutMismatch as e:
            msg = str(e)
            assert "fp8 autocast scope" in msg and "forward" in msg, msg
            assert time.time() - t0 < 20
        else:
            raise AssertionError(f"{variant}: no AmaxLayoutMismatch")


def check_nonfinite_amaxes_are_counted_not_used():
    recipe = fp.DelayedScaling(amax_history_len=4)
    layers = _model(2, 9)
    _run(layers, _local_input(0), recipe, WORLD_GROUP).sum().backward()
    scales = [l.fp8.fwd.scale.clone() for l in layers]
    x = _local_input(1)
    if RANK == 0:
        x = x.detach().clone()
        x[0, 0] = float("inf")
    with fp.autocast(recipe=recipe, group=WORLD_GROUP):
        layers[0](x)
    assert fp.nonfinite_amax_count(layers).item() == 1
    assert torch.equal(layers[0].fp8.fwd.scale[0], scales[0][0])  # input scale kept
    assert torch.isfinite(layers[0].fp8.fwd.scale).all()


ps.initialize(tp=2, ep=2) if WORLD == 4 else ps.initialize(tp=WORLD)

ONLY = os.environ.get("FP8P_ONLY_CHECK")
NESTED = [("nested_scopes_own_groups", check_nested_scopes_reduce_over_their_own_groups)] if WORLD == 4 else []
run_checks([c for c in [
    ("identical_state_from_global_max", check_identical_state_from_global_max),
    ("one_collective_per_scope_and_direction", check_one_collective_per_scope_and_direction),
    *NESTED,
    ("odd_iterations_module", check_module_that_runs_on_odd_iterations_only),
    ("module_called_twice", check_module_called_twice_takes_the_max),
    ("activation_checkpointing", check_activation_checkpointing),
    ("eval_no_grad_no_update", check_eval_and_no_grad_do_not_update),
    ("updates_equal_reference", check_updates_equal_per_tensor_reference),
    ("nonfinite_counted", check_nonfinite_amaxes_are_counted_not_used),
    ("mismatched_layouts_raise", check_mismatched_layouts_raise_quickly),
] if ONLY is None or c[0] == ONLY])
ps.destroy(destroy_process_group=False)
dist.destroy_process_group()
exit_now()  # skip finalization: see exit_now
