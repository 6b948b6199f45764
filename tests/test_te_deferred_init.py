"""TransformerEngine's deferred initialization: the TransformerEngine-style modules built with device="meta"
allocate nothing, and `reset_parameters()` puts them on the default device initialized as the constructor
would have (TransformerEngine's tests/pytorch/test_deferred_init.py checks the same on CUDA)."""
from __future__ import annotations

import pytest
import torch

import fp8_parallel as te
from fp8_parallel.testing import default_device
from te_testing import seed_for

H = 64
BUILDERS = {
    "LayerNorm": lambda **kw: te.LayerNorm(H, zero_centered_gamma=True, **kw),
    "RMSNorm": lambda **kw: te.RMSNorm(H, **kw),
    "Linear": lambda **kw: te.Linear(H, 2 * H, bias=True, **kw),
    "LayerNormLinear": lambda **kw: te.LayerNormLinear(H, 2 * H, bias=True, **kw),
    "LayerNormMLP": lambda **kw: te.LayerNormMLP(H, 2 * H, bias=True, seq_length=32, **kw),
    "GroupedLinear": lambda **kw: te.GroupedLinear(3, H, 2 * H, bias=True, **kw),
    "MultiheadAttention": lambda **kw: te.MultiheadAttention(H, 4, fuse_qkv_params=True, **kw),
    "MultiheadAttention split": lambda **kw: te.MultiheadAttention(H, 4, fuse_qkv_params=False, **kw),
    "TransformerLayer": lambda **kw: te.TransformerLayer(H, 3 * H, 4, fuse_qkv_params=True, seq_length=32, **kw),
}
CORE = ["LayerNorm", "RMSNorm", "Linear", "LayerNormLinear", "LayerNormMLP", "GroupedLinear"]


def _reset_all(model: torch.nn.Module) -> None:
    """What FSDP's and TransformerEngine's deferred initialization do: `reset_parameters()` of every module
    that has one."""
    for module in model.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()


def _run(model: torch.nn.Module, kind: str, x: torch.Tensor) -> tuple:
    """Forward and backward in FP8 (delayed scaling, two steps, so the second uses scales from the first):
    the last output and every parameter's gradient."""
    for _ in range(2):
        for p in model.parameters():
            p.grad = None
        with te.fp8_autocast(fp8_recipe=te.DelayedScaling()):
            out = model(x, [5, 0, 11]) if kind == "GroupedLinear" else model(x)
        out = out[0] if isinstance(out, tuple) else out
        out.float().square().sum().backward()
    return out.detach(), [None if p.grad is None else p.grad.clone() for p in model.parameters()]


def _input(kind: str, seed: int) -> torch.Tensor:
    shape = (16, H) if kind == "GroupedLinear" else (8, 2, H) if "Attention" in kind or "Transformer" in kind else (16, H)
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(default_device(), torch.bfloat16)


@pytest.mark.parametrize("kind", list(BUILDERS))
def test_meta_module_allocates_nothing_and_reset_equals_a_module_built_on_the_device(kind):
    seed = seed_for(f"deferred/{kind}")
    torch.manual_seed(seed)
    lazy = BUILDERS[kind](params_dtype=torch.bfloat16, device="meta")
    tensors = list(lazy.parameters()) + list(lazy.buffers())
    assert tensors and all(t.is_meta for t in tensors), [t.device for t in tensors]
    torch.manual_seed(seed + 1)
    _reset_all(lazy)
    torch.manual_seed(seed + 1)  # the same draws, in the constructor's order
    eager = BUILDERS[kind](params_dtype=torch.bfloat16, device=default_device())
    lazy_params, eager_params = dict(lazy.named_parameters()), dict(eager.named_parameters())
    assert list(lazy_params) == list(eager_params)
    for name, p in lazy_params.items():
        assert p.device == default_device() and p.dtype == torch.bfloat16 and isinstance(p, torch.nn.Parameter)
        assert torch.equal(p, eager_params[name]), name
    for (name, b), (_, b_eager) in zip(lazy.named_buffers(), eager.named_buffers()):
        assert b.device == default_device() and torch.equal(b, b_eager), name
    x = _input(kind, seed)
    torch.manual_seed(seed + 2)  # the same dropout masks
    out_lazy, grads_lazy = _run(lazy, kind, x)
    torch.manual_seed(seed + 2)
    out_eager, grads_eager = _run(eager, kind, x)
    assert torch.equal(out_lazy, out_eager)
    assert all(a is None and b is None or torch.equal(a, b) for a, b in zip(grads_lazy, grads_eager))


@pytest.mark.parametrize("kind", CORE)
def test_forward_before_reset_parameters_says_what_to_do(kind):
    lazy = BUILDERS[kind](device="meta")
    x = torch.randn(16, H)
    with pytest.raises(RuntimeError, match="reset_parameters"):
        lazy(x, [16, 0, 0]) if kind == "GroupedLinear" else lazy(x)


@pytest.mark.parametrize("kind", CORE)
def test_reset_parameters_on_the_device_keeps_the_parameters_and_their_statistics(kind):
    """TransformerEngine's `test_reset_parameters_doesnt_change_parameter_stats`, at its size (hidden 1024):
    new draws of the same distributions into the same parameter objects; `defer_init=True` does nothing."""
    seed = seed_for(f"deferred/stats/{kind}")
    torch.manual_seed(seed)
    hidden = 1024
    build = {"LayerNorm": lambda: te.LayerNorm(hidden), "RMSNorm": lambda: te.RMSNorm(hidden),
             "Linear": lambda: te.Linear(hidden, 2 * hidden), "LayerNormLinear": lambda: te.LayerNormLinear(hidden, 2 * hidden),
             "LayerNormMLP": lambda: te.LayerNormMLP(hidden, 2 * hidden), "GroupedLinear": lambda: te.GroupedLinear(2, hidden, 2 * hidden)}
    module = build[kind]()
    before = {n: (p, p.detach().clone()) for n, p in module.named_parameters()}
    module.reset_parameters(defer_init=True)
    assert all(torch.equal(p, old) for p, old in before.values())
    with torch.no_grad():
        module.reset_parameters()
    for name, p in module.named_parameters():
        param, old = before[name]
        assert p is param, name
        torch.testing.assert_close(p.mean(), old.mean(), atol=1e-3, rtol=1e-3)
        torch.testing.assert_close(p.std(), old.std(), atol=1e-3, rtol=1e-3)
        if old.std() > 0:  # drawn again, not left as they were
            assert not torch.equal(p, old), name


def test_reset_parameters_keeps_parameter_attributes_and_fresh_fp8_state():
    """The marks megatron's DDP and optimizer read (tensor-parallel split, `sequence_parallel`,
    `skip_backward_post_hook` of delayed weight gradients) survive materialization; FP8 state starts fresh."""
    lin = te.Linear(H, 2 * H, tp_size=2, parallel_mode="column", delay_wgrad_compute=True, device="meta")
    norm = te.LayerNorm(H, sequence_parallel=True, device="meta")
    for m in (lin, norm):
        m.reset_parameters()
    assert lin.weight.tensor_model_parallel and lin.weight.partition_dim == 0
    assert lin.weight.skip_backward_post_hook and lin.bias.skip_backward_post_hook
    assert norm.weight.sequence_parallel and norm.bias.sequence_parallel
    assert lin.weight.device == default_device() and lin.fp8.fwd.scale.device == default_device()
    assert lin.fp8.fwd.scale.tolist() == [1.0, 1.0] and not lin.fp8.fwd.amax_history.any()
    assert lin.fp8.fwd.amax_history.shape == te.Linear(H, 2 * H).fp8.fwd.amax_history.shape


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch sees none)")
@pytest.mark.parametrize("kind", list(BUILDERS))
def test_gpu_meta_module_allocates_no_device_memory_until_reset(kind):
    """TransformerEngine's `test_zero_memory_init` and `test_reset_parameters`, at their sizes."""
    heads, head_dim = 16, 64
    hidden = heads * head_dim
    build = {"LayerNorm": lambda **kw: te.LayerNorm(hidden, **kw), "RMSNorm": lambda **kw: te.RMSNorm(hidden, **kw),
             "Linear": lambda **kw: te.Linear(hidden, 2 * hidden, bias=True, **kw),
             "LayerNormLinear": lambda **kw: te.LayerNormLinear(hidden, 2 * hidden, bias=True, **kw),
             "LayerNormMLP": lambda **kw: te.LayerNormMLP(hidden, 2 * hidden, bias=True, seq_length=2048, **kw),
             "GroupedLinear": lambda **kw: te.GroupedLinear(2, hidden, 2 * hidden, **kw),
             "MultiheadAttention": lambda **kw: te.MultiheadAttention(hidden, heads, fuse_qkv_params=True, **kw),
             "MultiheadAttention split": lambda **kw: te.MultiheadAttention(hidden, heads, **kw),
             "TransformerLayer": lambda **kw: te.TransformerLayer(hidden, 3 * hidden, heads, fuse_qkv_params=True,
                                                                  seq_length=2048, **kw)}
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    module = build[kind](params_dtype=torch.bfloat16, device="meta")
    assert torch.cuda.memory_allocated() == before, kind
    _reset_all(module)
    assert torch.cuda.memory_allocated() > before
    assert all(t.is_cuda for t in list(module.parameters()) + list(module.buffers()))


@pytest.mark.parametrize("kind", list(BUILDERS))
def test_modules_still_pickle_and_a_deep_copy_resets_only_itself(kind):
    """The recorded initializers are plain functions and partials: a module pickles as before they existed, and
    `reset_parameters()` of a deep copy draws into the copy, never into the module it was copied from."""
    import copy
    import pickle

    seed = seed_for(f"deferred/copy/{kind}")
    torch.manual_seed(seed)
    module = BUILDERS[kind](device=default_device())
    with torch.no_grad():  # trained values, which a reset replaces (norm gains included)
        for p in module.parameters():
            p.add_(torch.randn_like(p))
    restored = pickle.loads(pickle.dumps(module))
    assert all(torch.equal(a, b) for a, b in zip(module.parameters(), restored.parameters()))
    before = [p.detach().clone() for p in module.parameters()]
    twin = copy.deepcopy(module)
    _reset_all(twin)
    _reset_all(restored)
    assert all(torch.equal(p, old) for p, old in zip(module.parameters(), before))
    assert all(not torch.equal(p, old) for p, old in zip(twin.parameters(), before))
