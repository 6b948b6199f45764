"""Graphed FP8 callables, exercised through the eager path they take without CUDA (same recording and
registration code as the captured graphs; the GPU tests compare captured graphs with eager runs)."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch

import fp8_parallel as fp
from fp8_parallel.graphs import GraphedMicrobatch
from fp8_parallel.pipeline import capture_order
from launcher import launch
from seeds import session_seed
from order_driver import fp8_state, run_in_order

HEAVY = pytest.mark.xdist_group("heavy")  # 4+ torchrun ranks: one at a time (--dist loadgroup)

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
        h = torch.nn.functional.gelu(_out(self.fc1(x, is_first_microbatch=is_first_microbatch)))
        if self.inner:
            with fp.autocast(recipe=INNER):
                return x + _out(self.fc2(h, is_first_microbatch=is_first_microbatch))
        return x + _out(self.fc2(h, is_first_microbatch=is_first_microbatch))


def _out(y):
    """fp.Linear's output, whether it returns a tensor or megatron's (output, bias) pair."""
    return y[0] if isinstance(y, tuple) else y


def _blocks(chunks: int, layers: int, seed: int):
    torch.manual_seed(seed)
    return [[Block(inner=(layer == 1)) for layer in range(layers)] for _ in range(chunks)]


def _fp8_state(blocks):
    return fp8_state(b for chunk in blocks for b in chunk)


def _run_steps(blocks, order, microbatches, steps, seed, caching=False, call=None):
    """A pipeline-like driver: per `+c` a microbatch forward of chunk c in its own scope, per `-c` the
    backward of chunk c's oldest pending microbatch; an SGD step per iteration. Returns what it saw.
    `call(c, mb, layer, h)` runs one layer (default: the block itself)."""
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
                for layer, b in enumerate(blocks[c]):
                    kwargs = dict(is_first_microbatch=(mb == 0)) if caching else {}
                    h = call(c, mb, layer, h, **kwargs) if call is not None else b(h, **kwargs)
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
    other = fp.DelayedScaling(amax_history_len=4, amax_compute_algo="most_recent")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert torch.equal(graphed(x), plain(x))  # no scope: high precision, eagerly
        with fp.autocast(enabled=False):
            assert torch.equal(graphed(x), plain(x))
        for _ in range(2):
            with fp.autocast(recipe=other):  # another recipe than the capture's: eagerly, in FP8
                a = graphed(x)
            with fp.autocast(recipe=other):
                b = plain(x)
        assert torch.equal(a, b) and not torch.equal(a, plain(x))
        with fp.autocast(recipe=RECIPE), torch.no_grad():  # no grad: eagerly, by design (no warning)
            graphed(x)
        graphed.eval()
        with fp.autocast(recipe=RECIPE):  # captured in training mode: eagerly, by design (no warning)
            graphed(x)
    said = [str(w.message) for w in caught if "runs eagerly" in str(w.message)]
    assert len(said) == 2, said  # once per reason: FP8 off (no scope and a disabled scope), another recipe
    assert "FP8 off" in said[0] and repr(RECIPE) in said[0]
    assert repr(RECIPE) in said[1] and repr(other) in said[1]
    call = graphed.forward
    assert call.next_microbatch == 0 and call.replay_count == 0 and call.eager_count == 6  # none replayed
    graphed.train()
    with fp.autocast(recipe=RECIPE):
        graphed(x)
    assert call.next_microbatch == 1 and call.replay_count == 1 and call.eager_count == 6  # this one did


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
    launch("graph_checks.py", 1, ["stack"], timeout=900, expect_checks=[
        "graphed_stack_matches_eager", "graphed_stack_cached_weights_matches_eager"])


@HEAVY
def test_megatron_schedule_drives_graphed_layers_tp2_pp2_vpp2():
    """megatron's interleaved schedule with the forward-step adapter matches the plain model exactly."""
    launch("graph_checks.py", 4, ["2", "2", "2"], timeout=1200, expect_checks=[
        "graphed_layers_match_plain_tp2_pp2_vpp2", "graphed_layers_cached_weights_match_plain_tp2_pp2_vpp2"])


def test_static_buffers_are_shared_by_microbatches_not_in_flight_together():
    from fp8_parallel.testing import lifetime_slots

    slot_of, count = lifetime_slots(capture_order(8, 1, 0), 8)  # no pipeline: one microbatch at a time
    assert count == {0: 1} and set(slot_of.values()) == {0}
    order = capture_order(4, 2, 0, vpp_size=2)  # [1,1,2,2,1,-2,1,-2,2,-1,2,-1,-2,-2,-1,-1]
    slot_of, count = lifetime_slots(order, 4)
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


def test_main_grad_protocol_is_recognised_and_a_moved_buffer_is_told_apart():
    """Which parameters the backward graphs accumulate into `main_grad` for (megatron DDP's two attributes, a
    buffer of the parameter's shape), and the address a replay checks: an equal view passes; a copy, another
    offset, shape or stride, no tensor, or the same tensor object whose storage was allocated again (as
    megatron's grad-buffer offload and restore do) fail."""
    from fp8_parallel.graphs.runners import buffer_address, follows_main_grad_protocol

    p = torch.nn.Parameter(torch.randn(4, 3))
    assert not follows_main_grad_protocol(p)
    p.main_grad = torch.zeros(4, 3)
    assert not follows_main_grad_protocol(p), "main_grad without DDP's flag"
    p.grad_added_to_main_grad = False
    assert follows_main_grad_protocol(p)
    p.main_grad = torch.zeros(12)
    assert not follows_main_grad_protocol(p), "a main_grad of another shape"

    buffer = torch.zeros(20)
    captured = buffer[4:16].view(4, 3)
    address = buffer_address(captured)
    assert buffer_address(buffer[4:16].view(4, 3)) == address, "an equal view of the same memory"
    assert buffer_address(captured.clone()) != address
    assert buffer_address(buffer[0:12].view(4, 3)) != address, "another offset"
    assert buffer_address(buffer[4:16].view(3, 4)) != address
    assert buffer_address(buffer.as_strided((4, 3), (1, 4), 4)) != address, "other strides"
    assert buffer_address(None) is None
    storage = buffer.untyped_storage()
    storage.resize_(2 * storage.nbytes())  # new memory, allocated while the old is still held: another address
    assert buffer_address(captured) != address, "storage allocated again under the same tensor object"


# -- TransformerEngine's surface ------------------------------------------------------------------------------

@pytest.fixture
def seed():
    value = session_seed() % (1 << 24)
    print(f"seed {value}")
    return value


def test_te_order_returns_one_callable_per_chunk_microbatch_and_layer(seed):
    """`_order` (TE's name), chunks of 1 and 2 layers (`_num_layers_per_chunk`), 2 microbatches in PP2/VPP2
    rank-0 order: a flat tuple of per-(chunk, microbatch, layer) callables, as TE returns; modules keep their
    own forward; driving those callables in the order matches the plain modules exactly over 3 steps."""
    order = capture_order(2, 2, 0, vpp_size=2)
    torch.manual_seed(seed)
    plain = [[Block()], [Block(), Block(inner=True)]]
    _run_steps(plain, order, 2, 1, seed=seed + 1)
    graphed = copy.deepcopy(plain)
    flat = [b for chunk in graphed for b in chunk]
    samples = [(torch.randn(8, D, requires_grad=True),) for _ in range(3 * 2)]  # (chunk, microbatch, layer)
    calls = fp.make_graphed_callables(tuple(flat), samples, num_warmup_iters=2, fp8_enabled=True, fp8_recipe=RECIPE,
                                      _order=order, _num_layers_per_chunk=[1, 2],
                                      _reuse_graph_input_output_buffers=True)
    assert isinstance(calls, tuple) and len(calls) == 6
    assert all(not isinstance(b.forward, fp.GraphedCallable) for b in flat)
    first = [0, 1]  # chunk c's first callable; its samples start at first[c] * microbatches (TE's layout)

    def index(c, mb, layer):
        return first[c] * 2 + mb * len(graphed[c]) + layer

    for c, chunk in enumerate(graphed):
        for mb in range(2):
            for layer, block in enumerate(chunk):
                view = calls[index(c, mb, layer)]
                assert view.graphed.module is block and view.microbatch == mb
    expected = _run_steps(plain, order, 2, 3, seed=seed + 2)
    got = _run_steps(graphed, order, 2, 3, seed=seed + 2, call=lambda c, mb, layer, h: calls[index(c, mb, layer)](h))
    assert len(expected) == len(got)
    for i, (a, b) in enumerate(zip(expected, got)):
        assert torch.equal(a, b), f"item {i} differs: max abs diff {(a - b).abs().max()}"
    assert all(v.replay_count == 3 and v.eager_count == 0 for v in calls)
    assert all(v.graphed.replay_count == 6 for v in calls)


def test_te_order_keywords_are_checked():
    block = Block()
    x = (torch.randn(8, D, requires_grad=True),)
    with pytest.raises(ValueError, match="not both"):
        fp.make_graphed_callables(block, x, order=[1, -1], _order=[1, -1])
    with pytest.raises(NotImplementedError, match="fractional"):
        fp.make_graphed_callables(block, x, _order=[1, -1.5, -1])
    with pytest.raises(ValueError, match=r"layers per chunk \[1, 2\]"):
        fp.make_graphed_callables((Block(), Block()), [x] * 4, _order=[1, 2, -2, -1], _num_layers_per_chunk=[1, 2])
    with pytest.raises(ValueError, match="_num_layers_per_chunk needs an order"):
        fp.make_graphed_callables(block, x, _num_layers_per_chunk=1)
    one = fp.make_graphed_callables(block, x, fp8_enabled=None, fp8_weight_caching=None, _order=[1, -1])
    assert isinstance(one, GraphedMicrobatch) and one.graphed.module is block  # TE: one callable, one graph
    assert not isinstance(block.forward, fp.GraphedCallable)


def test_per_callable_fp8_enabled_tuple_is_honoured(seed):
    """fp8_enabled=(True, False): the first callable is captured in FP8 and replays in the FP8 scope, the
    second in high precision and replays with FP8 off (each equal to its plain module there); each runs
    eagerly, with a warning, where its capture does not apply."""
    torch.manual_seed(seed)
    plain = [Block(), Block()]
    graphed = copy.deepcopy(plain)
    fp.make_graphed_callables(tuple(graphed), [(torch.randn(8, D, requires_grad=True),)] * 2,
                              fp8_enabled=(True, False), fp8_recipe=RECIPE)
    assert graphed[0].forward.fp8_enabled and not graphed[1].forward.fp8_enabled
    x = torch.randn(8, D)
    results = []
    for blocks in (plain, graphed):
        with fp.autocast(recipe=RECIPE):
            h = blocks[0](x)
            with fp.autocast(enabled=False):
                results.append(blocks[1](h))
    assert torch.equal(results[0], results[1])
    assert [b.forward.replay_count for b in graphed] == [1, 1]
    with pytest.warns(UserWarning, match="captured without FP8 but is called inside an enabled FP8 scope"):
        with fp.autocast(recipe=RECIPE):
            graphed[1](x)
    assert graphed[1].forward.eager_count == 1 and graphed[1].forward.replay_count == 1
    with pytest.raises(ValueError, match=r"fp8_enabled \(True,\) has 1 entries for 2 callables"):
        fp.make_graphed_callables((Block(), Block()), [(x,)] * 2, fp8_enabled=(True,))
    with pytest.raises(TypeError, match="fp8_enabled must be a bool or a tuple of bools"):
        fp.make_graphed_callables((Block(), Block()), [(x,)] * 2, fp8_enabled=(1, 0))


def test_te_keywords_are_accepted_or_refused_clearly(seed):
    """TE's keyword names: calibration is refused by name; retain_graph_in_backward, fp8_group and the others
    are accepted and the graphed module still equals the plain one."""
    torch.manual_seed(seed)
    x = (torch.randn(8, D, requires_grad=True),)
    with pytest.raises(NotImplementedError, match="fp8_calibrating=True"):
        fp.make_graphed_callables(Block(), x, fp8_enabled=True, fp8_calibrating=True)
    plain = Block()
    graphed = copy.deepcopy(plain)
    fp.make_graphed_callables(graphed, x, num_warmup_iters=1, allow_unused_input=True, sample_kwargs={},
                              fp8_enabled=True, fp8_calibrating=False, fp8_recipe=RECIPE, fp8_group=None,
                              fp8_weight_caching=False, pool=None, retain_graph_in_backward=True)
    data = torch.randn(8, D)
    grads = []
    for block in (plain, graphed):
        inp = data.clone().requires_grad_()
        with fp.autocast(recipe=RECIPE):
            out = block(inp)
        out.backward(torch.ones_like(out))
        grads.append((out.detach(), inp.grad, block.fc1.weight.grad))
    assert graphed.forward.replay_count == 1
    assert all(torch.equal(a, b) for a, b in zip(*grads))


class _Counting(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = Block()

    def forward(self, x):
        return self.inner(x)


def test_modules_with_hooks_are_refused_and_later_hooks_run_per_call():
    x = (torch.randn(8, D, requires_grad=True),)
    block = Block()
    block.register_forward_hook(lambda m, i, o: None)
    with pytest.raises(ValueError, match="callable 0 \\(Block\\): it has forward_hooks"):
        fp.make_graphed_callables(block, x)
    wrapped = _Counting()
    wrapped.inner.fc1.register_full_backward_pre_hook(lambda m, g: None)
    with pytest.raises(ValueError, match="submodule 'inner.fc1' .* has backward_pre_hooks"):
        fp.make_graphed_callables(wrapped, x)
    odd = Block()
    odd.register_buffer("trained", torch.zeros(2, requires_grad=True))
    with pytest.raises(ValueError, match="buffer 'trained' with requires_grad=True"):
        fp.make_graphed_callables(odd, x)
    graphed = fp.make_graphed_callables(Block(), x, fp8_enabled=True, fp8_recipe=RECIPE)
    calls = []
    graphed.register_forward_hook(lambda m, i, o: calls.append(1))
    for _ in range(2):
        with fp.autocast(recipe=RECIPE):
            graphed(torch.randn(8, D))
    assert len(calls) == 2 and graphed.forward.replay_count == 2


def test_reset_releases_graphs_and_later_calls_run_eagerly(seed):
    torch.manual_seed(seed)
    x = (torch.randn(8, D, requires_grad=True),)
    plain = Block()
    graphed = copy.deepcopy(plain)
    fp.make_graphed_callables(graphed, x, fp8_enabled=True, fp8_recipe=RECIPE, order=[1, 1, -1, -1])
    call = graphed.forward
    data = torch.randn(8, D)
    for block in (graphed, plain):
        with fp.autocast(recipe=RECIPE):
            block(data)
    assert call.replay_count == 1 and call.next_microbatch == 1
    call.rewind()
    assert call.next_microbatch == 0
    graphed.reset()  # set on the module, as TransformerEngine does
    assert "forward" not in graphed.__dict__ and "reset" not in graphed.__dict__  # the module as it was
    with fp.autocast(recipe=RECIPE):
        a = graphed(data)
    with fp.autocast(recipe=RECIPE):
        b = plain(data)
    assert torch.equal(a, b) and call.replay_count == 1
    # TE layout: resetting one microbatch's callable leaves the others replaying
    blocks = (Block(), Block())
    calls = fp.make_graphed_callables(blocks, [x] * 4, fp8_enabled=True, fp8_recipe=RECIPE, _order=[1, -1, 1, -1])
    assert len(calls) == 4
    calls[0].reset()
    with fp.autocast(recipe=RECIPE):
        h = calls[1](calls[0](data))
    with fp.autocast(recipe=RECIPE):
        calls[3](calls[2](data))
    assert [(c.replay_count, c.eager_count) for c in calls] == [(0, 1), (1, 0), (1, 0), (1, 0)]
    assert h.shape == data.shape


def test_a_plain_megatron_rng_tracker_forked_by_the_callables_is_refused(monkeypatch):
    """Item: graphs of code that forks megatron's RNG tracker need its graph-safe states; a plain tracker that
    the warm-up forked is refused before capture, with the fix in the message (CPU: the detection itself)."""
    import parallel_state as ps
    from megatron.core.tensor_parallel import random as mrandom

    from fp8_parallel.graphs.rng import TrackerWatch, graph_safe_generators

    monkeypatch.setattr(mrandom, "_CUDA_RNG_STATE_TRACKER", None)
    monkeypatch.setattr(mrandom, "_CUDA_RNG_STATE_TRACKER_INITIALIZED", False)
    assert TrackerWatch().forked() == [] and graph_safe_generators() == []  # no tracker: nothing to do
    with ps.cpu_compat():
        mrandom.model_parallel_cuda_manual_seed(1234, tp_rank=0, ep_rank=0, etp_rank=0, force_reset_rng=True)
        assert graph_safe_generators() == []  # plain states: nothing to register
        untouched = TrackerWatch()
        torch.nn.functional.dropout(torch.randn(4, 4), 0.5)  # dropout outside the tracker
        assert untouched.forked() == []
        untouched.refuse_capture_if_forked()
        watch = TrackerWatch()
        with mrandom.get_cuda_rng_tracker().fork():
            torch.nn.functional.dropout(torch.randn(4, 4), 0.5)
    assert watch.forked() == ["model-parallel-rng"]
    with pytest.raises(RuntimeError, match=r"use_cudagraphable_rng=True"):
        watch.refuse_capture_if_forked()
