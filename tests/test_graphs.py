"""Graphed FP8 callables, exercised through the eager path they take without CUDA (same recording and
registration code as the captured graphs; the GPU tests compare captured graphs with eager runs)."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch

import fp8_parallel as fp
from fp8_parallel.pipeline import capture_order
from launcher import launch
from order_driver import fp8_state, run_in_order

pytestmark = pytest.mark.filterwarnings("ignore:fp8_parallel.make_graphed_callables. CUDA is not available")

D = 32
RECIPE = fp.DelayedScaling(amax_history_len=4, amax_compute_algo="max")
INNER = fp.DelayedScaling(amax_history_len=3, amax_compute_algo="most_recent", margin=1)


class Block(torch.nn.Module):
    """fc1 -> gelu -> fc2 with a residual; `inner` runs fc2 in a scope of its own (another recipe)."""

    def __init__(self, inner: bool = False):
        super().__init__()
        self.fc1 = fp.Linear(D, 2 * D)
        self.fc2 = fp.Linear(2 * D, D)
        self.inner = inner

    def forward(self, x, is_first_microbatch=None):
        h = torch.nn.functional.gelu(self.fc1(x, is_first_microbatch=is_first_microbatch)[0])
        if self.inner:
            with fp.autocast(recipe=INNER):
                return x + self.fc2(h, is_first_microbatch=is_first_microbatch)[0]
        return x + self.fc2(h, is_first_microbatch=is_first_microbatch)[0]


def _blocks(chunks: int, layers: int, seed: int):
    torch.manual_seed(seed)
    return [[Block(inner=(layer == 1)) for layer in range(layers)] for _ in range(chunks)]


def _fp8_state(blocks):
    return fp8_state(b for chunk in blocks for b in chunk)


def _run_steps(blocks, order, microbatches, steps, seed, caching=False):
    """A pipeline-like driver: per `+c` a microbatch forward of chunk c in its own scope, per `-c` the
    backward of chunk c's oldest pending microbatch; an SGD step per iteration. Returns what it saw."""
    gen = torch.Generator().manual_seed(seed)
    params = [p for chunk in blocks for b in chunk for p in b.parameters()]
    opt = torch.optim.SGD(params, lr=0.05)
    seen = []
    for _ in range(steps):
        data = [[torch.randn(8, D, generator=gen) for _ in range(microbatches)] for _ in blocks]
        grads = [[torch.randn(8, D, generator=gen) for _ in range(microbatches)] for _ in blocks]

        def forward(c, mb):
            x = data[c][mb].requires_grad_()
            with fp.autocast(recipe=RECIPE):
                h = x
                for b in blocks[c]:
                    h = b(h, is_first_microbatch=(mb == 0)) if caching else b(h)
            return x, h

        opt.zero_grad()
        seen += run_in_order(order, len(blocks), forward, lambda c, mb: grads[c][mb])
        seen += [p.grad.clone() for p in params] + _fp8_state(blocks)
        opt.step()
    return seen


def _graph(blocks, order, microbatches, caching=False, warmup=2):
    flat = [b for chunk in blocks for b in chunk]
    samples = [(torch.randn(8, D, requires_grad=True),) for _ in flat]
    return fp.make_graphed_callables(flat, samples, num_warmup_iters=warmup, fp8_enabled=True, fp8_recipe=RECIPE,
                                     fp8_weight_caching=caching, order=order)


@pytest.mark.parametrize("caching", [False, True])
def test_graphed_chunks_in_pipeline_order_match_eager(caching):
    """2 chunks x 2 layers (one with an inner scope of another recipe), 4 microbatches in the order of
    pipeline rank 0 of PP2/VPP2, 3 iterations: outputs, input and parameter gradients, amax histories and
    scales equal the plain modules' exactly, with and without weight caching."""
    order = capture_order(4, 2, 0, vpp_size=2)
    plain = _blocks(2, 2, seed=11)
    _run_steps(plain, order, 4, 1, seed=1)  # non-trivial FP8 state before graphing
    graphed = copy.deepcopy(plain)
    before = _fp8_state(graphed)
    _graph(graphed, order, 4, caching=caching)
    assert all(torch.equal(a, b) for a, b in zip(before, _fp8_state(graphed))), "warm-up changed FP8 state"
    assert all(isinstance(b.forward, fp.GraphedCallable) for chunk in graphed for b in chunk)
    expected = _run_steps(plain, order, 4, 3, seed=5, caching=caching)
    got = _run_steps(graphed, order, 4, 3, seed=5, caching=caching)
    assert len(expected) == len(got)
    for i, (a, b) in enumerate(zip(expected, got)):
        assert torch.equal(a, b), f"item {i} differs: max abs diff {(a - b).abs().max()}"
    assert any(not torch.equal(s, t) for s, t in zip(before, _fp8_state(graphed))), "FP8 state never updated"


def test_graph_weight_cache_follows_flag_and_is_never_stale():
    torch.manual_seed(3)
    block = Block()
    graphed = fp.make_graphed_callables(block, (torch.randn(8, D, requires_grad=True),), fp8_enabled=True,
                                        fp8_recipe=RECIPE, fp8_weight_caching=True, order=[1, 1, -1, -1])
    call = graphed.forward
    assert call.num_microbatches == 2 and len(call.cached_weights) == 2
    x = torch.randn(8, D)
    with fp.autocast(recipe=RECIPE):
        graphed(x)  # microbatch 0: casts
    cached = block.fc1.fp8.weight_fp8._data.clone()
    assert call._flag_value == 0
    with torch.no_grad():
        block.fc1.weight.mul_(2.0)  # an in-place update without a new first microbatch
    with fp.autocast(recipe=RECIPE):
        graphed(x, is_first_microbatch=False)  # would skip, but the weight changed: cast again
    assert call._flag_value == 0 and not torch.equal(block.fc1.fp8.weight_fp8._data, cached)
    recast = block.fc1.fp8.weight_fp8._data.clone()
    with fp.autocast(recipe=RECIPE):
        graphed(x, is_first_microbatch=False)  # unchanged weight: the flag skips the cast
    assert call._flag_value == 1 and torch.equal(block.fc1.fp8.weight_fp8._data, recast)


def test_graphed_module_runs_eagerly_when_the_call_differs_from_the_capture():
    torch.manual_seed(4)
    plain = Block()
    graphed = copy.deepcopy(plain)
    fp.make_graphed_callables(graphed, (torch.randn(8, D, requires_grad=True),), fp8_enabled=True,
                              fp8_recipe=RECIPE, order=[1, 1, -1, -1])
    x = torch.randn(8, D)
    assert torch.equal(graphed(x), plain(x))  # no scope: high precision, eagerly
    with fp.autocast(enabled=False):
        assert torch.equal(graphed(x), plain(x))
    other = fp.DelayedScaling(amax_history_len=4, amax_compute_algo="most_recent")
    with fp.autocast(recipe=other):  # another recipe than the capture's: eagerly, in FP8
        a = graphed(x)
    with fp.autocast(recipe=other):
        b = plain(x)
    assert torch.equal(a, b) and not torch.equal(a, plain(x))
    with fp.autocast(recipe=RECIPE), torch.no_grad():  # no grad: eagerly
        graphed(x)
    graphed.eval()
    with fp.autocast(recipe=RECIPE):  # captured in training mode: eagerly
        graphed(x)
    assert graphed.forward.next_microbatch == 0  # none of these replayed
    graphed.train()
    with fp.autocast(recipe=RECIPE):
        graphed(x)
    assert graphed.forward.next_microbatch == 1  # this one did


def test_bad_calls_and_orders_are_refused_clearly():
    block = Block()
    with pytest.raises(ValueError, match="runs 2 forwards and 1 backwards of chunk 1"):
        fp.make_graphed_callables(block, (torch.randn(8, D),), order=[1, 1, -1, 2, -2, 2, -2, -2])
    with pytest.raises(ValueError, match="backward of chunk 1 before its forward"):
        fp.make_graphed_callables(block, (torch.randn(8, D),), order=[-1, 1])
    with pytest.raises(ValueError, match="sample_args has 3 entries"):
        fp.make_graphed_callables((Block(), Block()), [(torch.randn(8, D),)] * 3, order=[1, -1])
    graphed = fp.make_graphed_callables(block, (torch.randn(8, D, requires_grad=True),), fp8_enabled=True)
    with fp.autocast(recipe=fp.DelayedScaling()), pytest.raises(ValueError, match=r"differ from the sample"):
        graphed(torch.randn(4, D))


def test_cpu_fallback_warns_once_per_call():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fp.make_graphed_callables(Block(), (torch.randn(8, D, requires_grad=True),))
    assert [str(w.message) for w in caught if "CUDA is not available" in str(w.message)] != []
    assert len([w for w in caught if "CUDA is not available" in str(w.message)]) == 1


def test_megatron_layer_stack_in_pipeline_order_matches_eager():
    """megatron TransformerLayers with our spec, 2 chunks x 2 layers, 4 microbatches, 3 iterations."""
    launch("graph_checks.py", 1, ["stack"], timeout=300, expect_checks=[
        "graphed_stack_matches_eager", "graphed_stack_cached_weights_matches_eager"])


def test_megatron_schedule_drives_graphed_layers_tp2_pp2_vpp2():
    """megatron's interleaved schedule with the forward-step adapter matches the plain model exactly."""
    launch("graph_checks.py", 4, ["2", "2", "2"], timeout=400, expect_checks=[
        "graphed_layers_match_plain_tp2_pp2_vpp2", "graphed_layers_cached_weights_match_plain_tp2_pp2_vpp2"])


def test_static_buffers_are_shared_by_microbatches_not_in_flight_together():
    from fp8_parallel.graphs.runners import _lifetime_slots

    slot_of, count = _lifetime_slots(capture_order(8, 1, 0), 8)  # no pipeline: one microbatch at a time
    assert count == {0: 1} and set(slot_of.values()) == {0}
    order = capture_order(4, 2, 0, vpp_size=2)  # [1,1,2,2,1,-2,1,-2,2,-1,2,-1,-2,-2,-1,-1]
    slot_of, count = _lifetime_slots(order, 4)
    assert count == {0: 4, 1: 2}
    in_flight = {}
    fwd, bwd = {}, {}
    for step in order:  # no two microbatches in flight together share a slot
        c = abs(step) - 1
        if step > 0:
            mb = fwd[c] = fwd.get(c, -1) + 1
            assert slot_of[(c, mb)] not in in_flight.setdefault(c, set())
            in_flight[c].add(slot_of[(c, mb)])
        else:
            mb = bwd[c] = bwd.get(c, -1) + 1
            in_flight[c].remove(slot_of[(c, mb)])
