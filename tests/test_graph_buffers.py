"""Who owns what a graphed callable returns: per-microbatch static buffers by default, shared ones only with
`_reuse_graph_input_output_buffers=True`; parameter gradients returned as copies unless
`clone_param_grads_on_return=False`; version bumps and the `check_held_outputs` debug check that catch a
replay writing into values a caller still uses. Without CUDA the callables run eagerly (their outputs and
gradients are fresh tensors); the plan and the replay-side helpers are the code the captured graphs use.
tests/test_gpu_graph_buffers.py runs TransformerEngine's two cases with captured graphs."""
from __future__ import annotations

import copy
import inspect

import pytest
import torch

import fp8_parallel as fp
from fp8_parallel.graphs.runners import HeldOutputs, RunOptions, buffer_plan
from fp8_parallel.pipeline import capture_order
from fp8_parallel.testing import graph_runner_class

pytestmark = pytest.mark.filterwarnings("ignore:fp8_parallel.make_graphed_callables. CUDA is not available")

SEED = 3611


@pytest.fixture
def seed():
    print(f"seed {SEED}")
    return SEED


def _in_flight_pairs(order):
    """(chunk, microbatch) pairs whose forward has run and backward not yet, at each forward step."""
    fwd, bwd, live, pairs = {}, {}, set(), []
    for step in order:
        c = abs(step) - 1
        if step > 0:
            mb = fwd.get(c, 0)
            fwd[c] = mb + 1
            pairs += [((c, mb), other) for other in live if other[0] == c]
            live.add((c, mb))
        else:
            mb = bwd.get(c, 0)
            bwd[c] = mb + 1
            live.discard((c, mb))
    return pairs


@pytest.mark.parametrize("order_args", [(4, 1, 0, None), (4, 2, 0, 2), (6, 2, 1, 2), (3, 2, 0, None)])
def test_default_plan_gives_each_microbatch_its_own_buffers(order_args):
    microbatches, pp, rank, vpp = order_args
    order = capture_order(microbatches, pp, rank, vpp_size=vpp)
    own = buffer_plan(order, microbatches, reuse=False)
    chunks = {abs(s) - 1 for s in order}
    assert set(own) == {(c, mb) for c in chunks for mb in range(microbatches)}
    for c in chunks:
        assert sorted(own[(c, mb)] for mb in range(microbatches)) == list(range(microbatches))
    shared = buffer_plan(order, microbatches, reuse=True)
    assert set(shared) == set(own)
    for a, b in _in_flight_pairs(order):  # sharing never puts two in-flight microbatches on one slot
        assert shared[a] != shared[b], (order, a, b)
    if pp == 1:  # no pipeline: one microbatch in flight at a time, so sharing is one slot per chunk
        assert set(shared.values()) == {0}


def test_defaults_and_names_are_transformer_engine_s():
    params = inspect.signature(fp.make_graphed_callables).parameters
    assert params["_reuse_graph_input_output_buffers"].default is False
    assert "clone_param_grads_on_return" in params and "_clone_param_grads_on_return" in params
    assert params["check_held_outputs"].default is False
    lin = fp.Linear(16, 16)
    with pytest.raises(ValueError, match="clone_param_grads_on_return"):
        fp.make_graphed_callables(lin, (torch.randn(4, 16),), clone_param_grads_on_return=False,
                                  _clone_param_grads_on_return=True)


def _runner(clone: bool, num_inputs: int = 1):
    options = RunOptions(fp8_enabled=False, recipe=None, flag=None, clone_param_grads=clone)
    return graph_runner_class()(lambda x: x, (), None, [True] * num_inputs, options)


@pytest.mark.parametrize("clone", [True, False])
def test_returned_parameter_grads_are_copies_unless_asked_otherwise(clone, seed):
    gen = torch.Generator().manual_seed(seed)
    static = [torch.randn(4, 8, generator=gen), torch.randn(8, 8, generator=gen), None, torch.randn(8, generator=gen)]
    versions = [t._version if t is not None else None for t in static]
    got = _runner(clone)._returned_grads(list(static))
    assert got[0] is static[0]  # an input gradient: the buffer itself (autograd hands it on)
    assert got[2] is None
    for k in (1, 3):
        assert torch.equal(got[k], static[k])
        assert (got[k].data_ptr() != static[k].data_ptr()) == clone
    for t, before in zip(static, versions):  # every written buffer is marked as written
        if t is not None:
            assert t._version > before


def test_a_replay_bumps_versions_so_autograd_refuses_stale_saved_values(seed):
    """What a replay's version bump buys: an op that saved an output for its backward raises there once a
    later replay has written that buffer, instead of differentiating with the new values."""
    from torch.autograd.graph import increment_version

    gen = torch.Generator().manual_seed(seed)
    buffer = torch.randn(4, 8, generator=gen)
    w = torch.randn(8, 8, generator=gen, requires_grad=True)
    held = buffer.detach()  # what a replay hands out
    loss = (held @ w).square().sum()  # saves `held` for w's gradient
    increment_version(buffer)  # the next replay writes the buffer
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_held_outputs_check_names_the_output_and_ignores_dropped_or_reallocated_ones(seed):
    gen = torch.Generator().manual_seed(seed)
    buffers = [torch.randn(4, 8, generator=gen), torch.randn(4, 3, generator=gen)]
    guard = HeldOutputs("graphed callable 0 (Block), microbatch 1")
    out = [b.detach() for b in buffers]
    guard.remember(out)
    with pytest.raises(RuntimeError, match=r"microbatch 1: this replay would overwrite output 0 \(shape \(4, 8\)\)"):
        guard.check(buffers)
    second = out[1]
    del out
    with pytest.raises(RuntimeError, match=r"output 1 \(shape \(4, 3\)\)"):
        guard.check(buffers)
    second.data = torch.empty(1)  # megatron's deallocate_output_tensor: no longer reads the buffer
    guard.check(buffers)
    del second
    guard.check(buffers)


class _Chunk(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = fp.Linear(32, 64)
        self.fc2 = fp.Linear(64, 32)

    def forward(self, x):
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))


def test_outputs_held_across_microbatches_and_hooked_grads_are_the_callers(seed):
    """TransformerEngine's two cases on the CPU path: every microbatch's output kept until the end of an
    interleaved PP2/VPP2 order equals the plain modules'; parameter gradients a hook keeps from two
    backwards are two tensors with the values of each."""
    torch.manual_seed(seed)
    plain = [_Chunk(), _Chunk()]
    graphed = copy.deepcopy(plain)
    microbatches = 4
    order = capture_order(microbatches, 2, 0, vpp_size=2)
    gen = torch.Generator().manual_seed(seed + 1)
    data = [[torch.randn(8, 32, generator=gen) for _ in range(microbatches)] for _ in range(2)]
    grads = [[torch.randn(8, 32, generator=gen) for _ in range(microbatches)] for _ in range(2)]
    samples = [(torch.randn(8, 32, requires_grad=True),) for _ in range(2 * microbatches)]
    calls = fp.make_graphed_callables(tuple(graphed), samples, num_warmup_iters=1, fp8_enabled=True,
                                      fp8_recipe=fp.DelayedScaling(), _order=order)
    kept = []
    hook = graphed[0].fc1.weight.register_hook(lambda g: kept.append(g))

    def run(modules, call):
        outputs, fwd, bwd = {}, [0, 0], [0, 0]
        for step in order:
            c = abs(step) - 1
            if step > 0:
                mb = fwd[c]
                fwd[c] += 1
                with fp.autocast(recipe=fp.DelayedScaling()):
                    outputs[(c, mb)] = call(c, mb, data[c][mb].clone().requires_grad_())
            else:
                mb = bwd[c]
                bwd[c] += 1
                outputs[(c, mb)].backward(grads[c][mb])
        return outputs

    expected = run(plain, lambda c, mb, x: plain[c](x))
    got = run(graphed, lambda c, mb, x: calls[c * microbatches + mb](x))
    hook.remove()
    for key in expected:
        assert torch.equal(got[key], expected[key]), f"output of (chunk, microbatch) {key} differs"
    assert len(kept) == microbatches
    assert len({g.data_ptr() for g in kept}) == microbatches
    assert not torch.equal(kept[0], kept[1])
    for a, b in zip(plain[0].parameters(), graphed[0].parameters()):
        assert torch.equal(a.grad, b.grad)
