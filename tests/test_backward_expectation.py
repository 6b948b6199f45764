"""Which FP8 calls expect a backward, and activation recompute recognised from the checkpoint machinery.

Single process (no reduction group): each test compares against a plain run of the same modules, or against
the grad-output amax taken from the autograd graph itself.
"""
import copy

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
from seeds import session_seed

import fp8_parallel as fp
from fp8_parallel.modules import Linear
from fp8_parallel.testing import backward_done, current_key, pending_backward

H = 32
RECIPE = fp.DelayedScaling(amax_history_len=4)


def _seed() -> int:
    seed = session_seed()
    print(f"seed {seed}")
    return seed


def _out(y):
    return y[0] if isinstance(y, tuple) else y


def _layers(n: int, seed: int) -> torch.nn.ModuleList:
    torch.manual_seed(seed)
    return torch.nn.ModuleList([Linear(H, H) for _ in range(n)])


def _input(seed: int, step: int, grad: bool = True) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + 7919 * step)
    return (torch.randn(16, H, generator=g) * (1 + step)).requires_grad_(grad)


def _grad_amax_hook(store: list):
    return lambda g: store.append(g.detach().abs().max())


def test_no_grad_call_and_frozen_layers_do_not_stop_the_backward_reduction():
    """A `torch.no_grad()` probe and a frozen layer on a non-grad input expect no backward; a frozen layer
    whose input requires grad runs one. The backward table is reduced in the same iteration, each module's
    grad-output amax is exactly what autograd passed it, and the pending count ends at zero."""
    seed = _seed()
    frozen_first, trainable, frozen_mid, probe = _layers(4, seed)
    frozen_first.requires_grad_(False)
    frozen_mid.requires_grad_(False)
    for step in range(3):
        grads = {"trainable": [], "frozen_mid": []}
        with fp.autocast(recipe=RECIPE):
            key = current_key()
            h = torch.tanh(_out(frozen_first(_input(seed, step, grad=False))))  # no node: expects nothing
            with torch.no_grad():
                _out(probe(h))  # a logging probe: expects nothing
            t = _out(trainable(h))
            t.register_hook(_grad_amax_hook(grads["trainable"]))
            m = _out(frozen_mid(torch.tanh(t)))  # frozen weight, grad-requiring input: its backward runs
            m.register_hook(_grad_amax_hook(grads["frozen_mid"]))
        (m.float() ** 2).sum().backward()
        assert pending_backward(key) == 0 and backward_done(key), (step, pending_backward(key))
        assert torch.equal(trainable.fp8.bwd.amax_history[0, 0], grads["trainable"][0]), step
        assert torch.equal(frozen_mid.fp8.bwd.amax_history[0, 0], grads["frozen_mid"][0]), step
        assert (trainable.fp8.bwd.amax_history[0, : step + 1] > 0).all(), step  # rolled once per iteration
        for idle in (frozen_first, probe):  # no backward ran: history and scale untouched
            assert torch.equal(idle.fp8.bwd.amax_history, torch.zeros_like(idle.fp8.bwd.amax_history))
            assert torch.equal(idle.fp8.bwd.scale, torch.ones_like(idle.fp8.bwd.scale))
        assert (probe.fp8.fwd.amax_history[:, : step + 1] > 0).all()  # its forward still registered


def test_no_grad_call_leaves_no_recompute_state_and_checkpoint_stays_exact():
    """An FP8 call under `torch.no_grad()` in a training scope keeps nothing for a recompute: modules can be
    deep-copied, and a later non-reentrant checkpoint recomputes with its own first pass's scales, so its
    gradients are bitwise those of the plain modules."""
    seed = _seed()
    plain, ckpt = _layers(2, seed), _layers(2, seed)

    def block(layers, h):
        for layer in layers:
            h = torch.tanh(_out(layer(h)))
        return h

    for step in range(4):
        x = _input(seed, step)
        xc = x.detach().clone().requires_grad_()
        with fp.autocast(recipe=RECIPE):
            if step == 0:
                with torch.no_grad():
                    block(plain, x)
            out = block(plain, x)
        out.sum().backward()
        with fp.autocast(recipe=RECIPE):
            if step == 0:
                with torch.no_grad():
                    block(ckpt, xc)
            outc = torch_checkpoint.checkpoint(lambda h: block(ckpt, h), xc, use_reentrant=False)
        outc.sum().backward()
        copy.deepcopy(ckpt)  # nothing of an iteration is left on the modules
        assert torch.equal(out, outc), step
        assert torch.equal(x.grad, xc.grad), step
        for p, q in zip(plain.parameters(), ckpt.parameters()):
            assert torch.equal(p.grad, q.grad), step
        for p, q in zip(plain.buffers(), ckpt.buffers()):
            assert torch.equal(p, q), step
        assert (ckpt[0].fp8.bwd.amax_history[0, : step + 1] > 0).all(), step


def _block_with_extras(layers, h, frozen, probe):
    """Two trainable layers, the first called twice, a frozen layer on the same input, a no_grad probe."""
    a, b = layers
    y = torch.tanh(_out(a(h)))
    y = y + 0.5 * torch.tanh(_out(a(y)))  # a module called twice
    with torch.no_grad():
        _out(probe(y))
    y = y + _out(frozen(y))
    return torch.tanh(_out(b(y)))


def _checkpointed(kind: str, fn, x):
    if kind == "plain":
        return fn(x)
    if kind == "torch_reentrant":
        return torch_checkpoint.checkpoint(fn, x, use_reentrant=True)
    if kind == "torch_nonreentrant":
        return torch_checkpoint.checkpoint(fn, x, use_reentrant=False)
    if kind == "torch_nonreentrant_no_early_stop":
        with torch_checkpoint.set_checkpoint_early_stop(False):
            return torch_checkpoint.checkpoint(fn, x, use_reentrant=False)
    raise ValueError(kind)


@pytest.mark.parametrize("kind", ["torch_reentrant", "torch_nonreentrant", "torch_nonreentrant_no_early_stop"])
@pytest.mark.parametrize("scope_inside", [False, True])
def test_checkpoint_matches_plain_modules_bitwise(kind, scope_inside):
    """Checkpointed FP8 blocks (with a module called twice, a frozen layer and a no_grad probe inside) give
    the plain modules' outputs, gradients and FP8 state bitwise, with backward amaxes reduced in the same
    iteration, over several iterations (the scales change between a first pass and its recompute). With
    the scope opened inside the checkpointed function as well."""
    seed = _seed()
    models = {}
    for name in ("plain", kind):
        layers = _layers(2, seed)
        torch.manual_seed(seed + 1)
        frozen, probe = Linear(H, H), Linear(H, H)
        frozen.requires_grad_(False)
        models[name] = (layers, frozen, probe)

    def run(name, x, step):
        layers, frozen, probe = models[name]

        def fn(h):
            if scope_inside:
                with fp.autocast(recipe=RECIPE):
                    return _block_with_extras(layers, h, frozen, probe)
            return _block_with_extras(layers, h, frozen, probe)

        if scope_inside:
            out = _checkpointed(name, fn, x)
        else:
            with fp.autocast(recipe=RECIPE):
                out = _checkpointed(name, fn, x)
        out.float().pow(2).sum().backward()
        return out

    for step in range(4):
        x = _input(seed, step)
        xc = x.detach().clone().requires_grad_()
        out, outc = run("plain", x, step), run(kind, xc, step)
        assert torch.equal(out, outc), step
        assert torch.equal(x.grad, xc.grad), step
        plain_mods, ckpt_mods = torch.nn.ModuleList(models["plain"]), torch.nn.ModuleList(models[kind])
        for (n, p), q in zip(plain_mods.named_parameters(), ckpt_mods.parameters()):
            assert (p.grad is None) == (q.grad is None) and (p.grad is None or torch.equal(p.grad, q.grad)), (step, n)
        for (n, p), q in zip(plain_mods.named_buffers(), ckpt_mods.buffers()):
            assert torch.equal(p, q), (step, n)
        layers, frozen, _ = models[kind]
        for m in (*layers, frozen):  # backward amaxes reduced in this iteration (rolled once per iteration)
            assert (m.fp8.bwd.amax_history[0, : min(step + 1, 4)] > 0).all(), step
        for m in ckpt_mods.modules():
            assert not [k for k in vars(m) if "record" in k], "no recompute state on modules"
        copy.deepcopy(ckpt_mods)


def test_reentrant_checkpoint_retain_graph_backward_twice():
    """A retained graph's second backward recomputes with the same first-pass scales and settles nothing
    twice: gradients of both backwards are bitwise those of plain modules doing the same."""
    seed = _seed()
    plain, ckpt = _layers(2, seed), _layers(2, seed)

    def fn(layers):
        return lambda h: torch.tanh(_out(layers[1](torch.tanh(_out(layers[0](h))))))

    for step in range(2):
        x = _input(seed, step)
        xc = x.detach().clone().requires_grad_()
        with fp.autocast(recipe=RECIPE):
            out = fn(plain)(x)
        with fp.autocast(recipe=RECIPE):
            key = current_key()
            outc = torch_checkpoint.checkpoint(fn(ckpt), xc, use_reentrant=True)
        for again in (True, False):
            out.sum().backward(retain_graph=again)
            outc.sum().backward(retain_graph=again)
            assert pending_backward(key) == 0 and backward_done(key), (step, pending_backward(key))
            for p, q in zip(plain.parameters(), ckpt.parameters()):
                assert torch.equal(p.grad, q.grad), (step, again)
                p.grad = q.grad = None
        for p, q in zip(plain.buffers(), ckpt.buffers()):
            assert torch.equal(p, q), step


def test_checkpoint_without_grad_inputs_expects_no_backward():
    """A reentrant checkpoint whose inputs and parameters need no grad builds no node: its FP8 calls expect
    nothing and the scope's backward reduction still runs for the rest."""
    seed = _seed()
    frozen, trainable = _layers(2, seed)
    frozen.requires_grad_(False)
    with fp.autocast(recipe=RECIPE):
        key = current_key()
        h = torch_checkpoint.checkpoint(lambda t: _out(frozen(t)), _input(seed, 0, grad=False), use_reentrant=True)
        out = _out(trainable(h))
    out.sum().backward()
    assert pending_backward(key) == 0 and backward_done(key)
    assert trainable.fp8.bwd.amax_history[0, 0] > 0
