"""Captured CUDA graphs vs eager execution: FP8 megatron layers, in pipeline order, and under megatron's
schedule on two GPUs. Equality is bitwise: replays run the same kernels as eager calls."""
import warnings

import pytest
import torch

import fp8_parallel as fp
from launcher import launch
from seeds import session_seed

pytestmark = pytest.mark.gpu


def test_graphed_layer_stack_in_pipeline_order_equals_eager():
    """2 chunks x 2 FP8 layers, 4 microbatches in PP2/VPP2 rank-0 order, 3 iterations, caching on and off."""
    launch("graph_checks.py", 1, ["stack"], timeout=400, gpus=True, expect_checks=[
        "graphed_stack_matches_eager", "graphed_stack_cached_weights_matches_eager"])


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("vpp", ["0", "2"])
def test_pp2_schedule_replays_graphs_on_both_ranks(vpp):
    launch("graph_checks.py", 2, ["1", "2", vpp], timeout=400, gpus=True, expect_checks=[
        f"graphed_layers_match_plain_tp1_pp2_vpp{vpp}", f"graphed_layers_cached_weights_match_plain_tp1_pp2_vpp{vpp}"])


def test_graphs_under_megatron_ddp_add_weight_gradients_into_main_grad():
    """Graphed layers under megatron's DDP (overlapped reduction) add weight gradients into `main_grad` in the
    backward graph and match the plain model bitwise; a main_grad replaced after capture is refused; a module
    that adds into main_grad itself (`fuse_wgrad_accumulation`) is not added again. bf16, fp16 and fp32
    parameters."""
    launch("graph_checks.py", 1, ["ddp"], timeout=400, gpus=True, expect_checks=[
        f"{check}_{dtype}{suffix}" for check, suffixes in (("ddp_graphs_add_into_main_grad", ("",)),
                                                           ("ddp_graphs_with_fused_wgrad_accumulation", ("", "_in_graph")))
        for dtype in ("bf16", "fp16", "fp32") for suffix in suffixes])


# -- megatron layers that fork the RNG tracker (dropout) -----------------------------------------------------

def _needs_megatron():
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")


def test_dropout_layers_capture_with_graph_safe_rng_and_plain_tracker_is_refused():
    """A TransformerLayer with hidden and attention dropout (and a bare forked dropout) captures when
    megatron's tracker has graph-safe states: fresh masks per replay, forward and backward graphs agree; a
    plain tracker is refused before capture, naming `use_cudagraphable_rng=True`."""
    _needs_megatron()
    launch("graph_checks.py", 1, ["dropout"], timeout=400, gpus=True, expect_checks=[
        "graph_safe_tracker_dropout_captures", "plain_tracker_refused_before_capture"])


def test_graphed_dropout_layer_equals_eager_from_the_same_rng_states():
    _needs_megatron()
    launch("graph_checks.py", 1, ["dropout-eager"], timeout=400, gpus=True, expect_checks=[
        "graphed_dropout_layer_matches_eager"])


# -- parameter dtypes, recipes, weight caching; eager fallbacks ---------------------------------------------

class _Mlp(torch.nn.Module):
    """fc1 -> gelu -> fc2 through `fp8_linear`, with FP8 states of its own (independent of `fp.Linear`'s
    return convention)."""

    def __init__(self, dtype: torch.dtype, gen: torch.Generator):
        super().__init__()
        from fp8_parallel.modules import FP8State

        def param(*shape, scale):
            return torch.nn.Parameter((torch.randn(*shape, generator=gen) * scale).to("cuda", dtype))

        self.w1, self.b1 = param(128, 64, scale=0.125), param(128, scale=0.1)
        self.w2, self.b2 = param(64, 128, scale=0.09), param(64, scale=0.1)
        self.s1 = FP8State("mlp.fc1", device=torch.device("cuda"))
        self.s2 = FP8State("mlp.fc2", device=torch.device("cuda"))

    def forward(self, x, is_first_microbatch=None):
        from fp8_parallel.modules import fp8_linear

        h = torch.nn.functional.gelu(fp8_linear(x, self.w1, self.b1, self.s1, is_first_microbatch))
        return fp8_linear(h, self.w2, self.b2, self.s2, is_first_microbatch)


def _seed() -> int:
    value = session_seed() % (1 << 24)
    print(f"seed {value}")
    return value


def _drive(model, recipe, caching, xs, gs):
    """Per step: two microbatch forwards (each in its own scope), then their backwards; an SGD step."""
    from order_driver import fp8_state

    params = list(model.parameters())
    seen = []
    for step_x, step_g in zip(xs, gs):
        for p in params:
            p.grad = None
        pending = []
        for mb, x in enumerate(step_x):
            inp = x.clone().requires_grad_()
            kwargs = dict(is_first_microbatch=(mb == 0)) if caching else {}
            with fp.autocast(recipe=recipe):
                out = model(inp, **kwargs)
            pending.append((inp, out))
            seen.append(out.detach().clone())
        for (inp, out), g in zip(pending, step_g):
            out.backward(g)
            seen.append(inp.grad.clone())
        seen += [p.grad.clone() for p in params] + fp8_state([model])
        with torch.no_grad():
            for p in params:
                p.add_(p.grad, alpha=-0.05)
    return seen


def _assert_graphed_equals_eager(plain, rows: int, dtype, recipe, caching: bool, gen) -> None:
    """Graph a copy of `plain` (2 microbatches in flight, order [1, 1, -1, -1]); drive both 3 steps with SGD on
    fresh `[rows, 64]` inputs and gradients from `gen`: every output, gradient and FP8 state is finite and
    bitwise equal, and the graphed copy replayed every call."""
    import copy

    graphed = copy.deepcopy(plain)
    sample = torch.randn(rows, 64, generator=gen).to("cuda", dtype).requires_grad_()
    fp.make_graphed_callables(graphed, (sample,), fp8_enabled=True, fp8_recipe=recipe,
                              fp8_weight_caching=caching, order=[1, 1, -1, -1], num_warmup_iters=2)
    xs = [[torch.randn(rows, 64, generator=gen).to("cuda", dtype) for _ in range(2)] for _ in range(3)]
    gs = [[torch.randn(rows, 64, generator=gen).to("cuda", dtype) for _ in range(2)] for _ in range(3)]
    expected = _drive(plain, recipe, caching, xs, gs)
    got = _drive(graphed, recipe, caching, xs, gs)
    assert graphed.forward.replay_count == 6 and graphed.forward.eager_count == 0
    assert len(expected) == len(got)
    for i, (a, b) in enumerate(zip(expected, got)):
        assert torch.isfinite(a.float()).all(), f"item {i}: eager result not finite"
        assert torch.equal(a, b), f"item {i}: max abs diff {(a.float() - b.float()).abs().max()}"


@pytest.mark.parametrize("caching", [False, True], ids=["no-cache", "weight-cache"])
@pytest.mark.parametrize("recipe_name", ["delayed", "current"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_graphed_equals_eager_for_every_parameter_dtype(dtype, recipe_name, caching):
    """Graphed (2 microbatches in flight, order [1, 1, -1, -1]) vs eager twin, 3 steps with SGD: outputs,
    input and parameter gradients, FP8 state bitwise equal and finite, for float32/float16/bfloat16
    parameters, delayed and current scaling, with and without weight caching."""
    seed = _seed()
    recipe = fp.DelayedScaling(amax_history_len=4) if recipe_name == "delayed" else fp.CurrentScaling()
    gen = torch.Generator().manual_seed(seed)
    _assert_graphed_equals_eager(_Mlp(dtype, gen), 32, dtype, recipe, caching, gen)


class _Experts(torch.nn.Module):
    """Two `GroupedLinear`s (fc1 -> gelu -> fc2) over fixed row blocks, as drop-and-pad MoE runs its experts
    (every expert its capacity); one expert gets no rows."""

    SPLITS = [16, 0, 32, 16]

    def __init__(self, dtype: torch.dtype, gen: torch.Generator, grouped: bool):
        super().__init__()
        n = len(self.SPLITS)
        self.fc1 = fp.GroupedLinear(n, 64, 96, params_dtype=dtype, device="cuda")
        self.fc2 = fp.GroupedLinear(n, 96, 64, params_dtype=dtype, device="cuda")
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
        self.fc1.use_grouped_gemm = self.fc2.use_grouped_gemm = grouped

    def forward(self, x, is_first_microbatch=None):
        h = torch.nn.functional.gelu(self.fc1(x, self.SPLITS, is_first_microbatch=is_first_microbatch))
        return self.fc2(h, self.SPLITS, is_first_microbatch=is_first_microbatch)


@pytest.mark.parametrize("grouped", [False, True], ids=["per-expert", "grouped-gemm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_graphed_experts_equal_eager_for_every_parameter_dtype(dtype, grouped):
    """Graphed GroupedLinear experts with fixed splits (drop-and-pad; one expert without rows) vs their eager
    twin, 3 steps with SGD and weight caching: outputs, input and weight gradients and FP8 state bitwise
    equal and finite, for float32/float16/bfloat16 parameters, per-expert and grouped GEMMs."""
    seed = _seed()
    recipe = fp.DelayedScaling(amax_history_len=4)
    gen = torch.Generator().manual_seed(seed)
    _assert_graphed_equals_eager(_Experts(dtype, gen, grouped), sum(_Experts.SPLITS), dtype, recipe, True, gen)


def test_eager_fallbacks_warn_once_count_and_reset_releases_graphs():
    import copy

    seed = _seed()
    gen = torch.Generator().manual_seed(seed)
    recipe = fp.DelayedScaling(amax_history_len=4)
    other = fp.DelayedScaling(amax_history_len=4, amax_compute_algo="most_recent")
    plain = _Mlp(torch.bfloat16, gen)
    graphed = copy.deepcopy(plain)
    sample = torch.randn(32, 64, generator=gen).to("cuda", torch.bfloat16).requires_grad_()
    fp.make_graphed_callables(graphed, (sample,), fp8_enabled=True, fp8_recipe=recipe)
    call = graphed.forward
    x = torch.randn(32, 64, generator=gen).to("cuda", torch.bfloat16)
    with pytest.warns(UserWarning, match="called in a scope with recipe") as caught:
        with fp.autocast(recipe=other):
            a = graphed(x)
    assert any(repr(recipe) in str(w.message) and repr(other) in str(w.message) for w in caught)
    with fp.autocast(recipe=other):
        b = plain(x)
    assert torch.equal(a, b) and call.eager_count == 1 and call.replay_count == 0
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="fp8_parallel: graphed")  # said once already
        with fp.autocast(recipe=other):
            graphed(x)
        with fp.autocast(recipe=other):
            plain(x)
    with pytest.warns(UserWarning, match="FP8 off"):
        graphed(x)
    plain(x)
    with fp.autocast(recipe=recipe):
        a = graphed(x)
    with fp.autocast(recipe=recipe):
        b = plain(x)
    assert torch.equal(a, b) and call.replay_count == 1 and call.eager_count == 3
    call.reset()
    assert not hasattr(call.runners[0], "fwd_graph") and "forward" not in graphed.__dict__
    with fp.autocast(recipe=recipe):
        a = graphed(x)
    with fp.autocast(recipe=recipe):
        b = plain(x)
    assert torch.equal(a, b) and call.replay_count == 1


def test_te_order_and_per_callable_fp8_replay_on_gpu():
    """`_order` returns per-microbatch callables that replay their own graphs in any call order; a
    callable captured with fp8_enabled False (tuple) replays with FP8 off; both equal their eager twins."""
    import copy

    seed = _seed()
    gen = torch.Generator().manual_seed(seed)
    recipe = fp.DelayedScaling(amax_history_len=4)
    plain = [_Mlp(torch.bfloat16, gen) for _ in range(2)]
    graphed = copy.deepcopy(plain)
    samples = [(torch.randn(32, 64, generator=gen).to("cuda", torch.bfloat16).requires_grad_(),) for _ in range(4)]
    calls = fp.make_graphed_callables(tuple(graphed), samples, fp8_enabled=(True, False), fp8_recipe=recipe,
                                      _order=[1, 1, -1, -1])
    assert len(calls) == 4  # (chunk 1: callables 0 and 1) x 2 microbatches: [mb0 l0, mb0 l1, mb1 l0, mb1 l1]
    xs = [torch.randn(32, 64, generator=gen).to("cuda", torch.bfloat16) for _ in range(2)]
    outs = []
    for layers in ([lambda h, m=m: m(h) for m in plain], None):
        got = []
        for mb in (1, 0):  # microbatch 1 first: each callable replays its own microbatch's graphs
            with fp.autocast(recipe=recipe):
                h = layers[0](xs[mb]) if layers else calls[2 * mb](xs[mb])
                with fp.autocast(enabled=False):
                    h = layers[1](h) if layers else calls[2 * mb + 1](h)
            got.append(h.clone())
        outs.append(got)
    assert all(torch.equal(a, b) for a, b in zip(*outs))
    assert [c.replay_count for c in calls] == [1, 1, 1, 1]


@pytest.mark.parametrize("side_stream", [True, False])  # the failing capture last
def test_accumulator_on_the_default_stream_is_named_before_it_breaks_capture(side_stream):
    """A data-parallel wrapper keeps each parameter's gradient accumulator node alive from its construction (as
    megatron's DDP does through `param.expand_as(param)`); made on the default stream, the backward capture
    cannot make that stream wait. The error names the cause and the fix; made on a side stream, capture works."""
    torch.manual_seed(0)
    lin = fp.Linear(64, 64, params_dtype=torch.bfloat16, device="cuda")
    with torch.cuda.stream(torch.cuda.Stream()) if side_stream else torch.cuda.stream(torch.cuda.default_stream()):
        accumulators = [p.expand_as(p).grad_fn.next_functions[0][0] for p in lin.parameters()]
    torch.cuda.synchronize()
    x = torch.randn(32, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    if not side_stream:
        with pytest.raises(RuntimeError, match="side stream"):
            fp.make_graphed_callables(lin, (x,), fp8_enabled=True, fp8_recipe=fp.DelayedScaling())
        _assert_device_rng_usable()
        return
    graphed = fp.make_graphed_callables(lin, (x,), fp8_enabled=True, fp8_recipe=fp.DelayedScaling())
    with fp.autocast(recipe=fp.DelayedScaling()):
        y = graphed(x)
    y.float().sum().backward()
    assert lin.weight.grad is not None and torch.isfinite(lin.weight.grad).all()
    del accumulators


def _assert_device_rng_usable():
    """After a failed capture the device's random ops still work (no RNG state left in capture mode)."""
    torch.cuda.manual_seed(3)
    a = torch.randn(64, device="cuda")
    torch.cuda.manual_seed(3)
    assert torch.equal(a, torch.randn(64, device="cuda"))
    assert torch.nn.functional.dropout(torch.ones(64, device="cuda"), 0.5).count_nonzero() < 64


def test_failed_forward_capture_leaves_the_device_rng_usable():
    """A callable that cannot be captured (it synchronises with the host) raises from make_graphed_callables;
    afterwards weight init and dropout on the device work as before."""
    lin = fp.Linear(64, 64, params_dtype=torch.bfloat16, device="cuda")

    def syncs(x):
        y = lin(x)
        if y.float().abs().sum().item() < 0:  # a host read inside the capture
            y = -y
        return y

    x = torch.randn(32, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    with pytest.raises(RuntimeError):
        fp.make_graphed_callables(syncs, (x,), fp8_enabled=True, fp8_recipe=fp.DelayedScaling())
    _assert_device_rng_usable()
    fp.Linear(64, 64, params_dtype=torch.float32, device="cuda")  # normal_ init on the device
