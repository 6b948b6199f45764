"""megatron's real schedule drives graphed FP8 transformer layers (`graph_megatron_layers`) and matches the
plain model exactly: losses, gradients and FP8 state, every step, every rank.

Usage (under torchrun): graph_checks.py TP PP VPP   (VPP 0 = no interleaving)
                        graph_checks.py stack        (1 rank: 2 chunks x 2 layers driven in a pipeline order)
                        graph_checks.py dropout      (1 GPU: layers that fork megatron's RNG tracker)
                        graph_checks.py dropout-eager (1 GPU: a graphed dropout layer equals its eager twin)
                        graph_checks.py ddp          (1 GPU: under megatron's DDP, graphs add into main_grad)
On CPU (gloo) the graphed layers take the eager path of make_graphed_callables; on GPUs (NCCL) they replay
CUDA graphs.
"""
from __future__ import annotations

import functools
import sys
import warnings

import torch
import torch.distributed as dist

import fp8_parallel as fp
import parallel_state as ps
from rank_checks import run_checks, test_seed, exit_now

MODE = sys.argv[1] if sys.argv[1] in ("stack", "dropout", "dropout-eager", "ddp") else "schedule"
STACK = MODE == "stack"
TP, PP, VPP = (int(a) for a in sys.argv[1:4]) if MODE == "schedule" else (1, 1, 0)
VPP = VPP or None
GPU = torch.cuda.is_available()
if GPU:
    torch.cuda.set_device(int(__import__("os").environ.get("LOCAL_RANK", "0")))
ps.initialize(tp=TP, pp=PP, vpp=VPP, backend="nccl" if GPU else "gloo")

from megatron.core import parallel_state as mpu  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: E402
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

from fp8_parallel.megatron import get_gpt_block_spec  # noqa: E402
from fp8_parallel.meta import FP8Meta  # noqa: E402
from fp8_parallel.pipeline import graph_megatron_layers  # noqa: E402
from order_driver import fp8_state, run_in_order  # noqa: E402

VOCAB, SEQ, MBS, M, STEPS = 64, 32, 2, 4, 3
LAYERS_PER_CHUNK = 2
RECIPE = fp.DelayedScaling(amax_history_len=4, amax_compute_algo="max")
DTYPE = torch.bfloat16 if GPU else torch.float32


def _config(dtype: torch.dtype = DTYPE) -> TransformerConfig:
    chunks = VPP or 1
    return TransformerConfig(
        num_layers=PP * chunks * LAYERS_PER_CHUNK, hidden_size=64, num_attention_heads=4,
        use_cpu_initialization=True, tensor_model_parallel_size=TP, sequence_parallel=TP > 1,
        pipeline_model_parallel_size=PP, virtual_pipeline_model_parallel_size=VPP,
        pipeline_dtype=dtype, params_dtype=dtype, bf16=GPU and dtype == torch.bfloat16,
        fp16=GPU and dtype == torch.float16, hidden_dropout=0.0, attention_dropout=0.0,
        overlap_p2p_comm=VPP is not None, batch_p2p_comm=VPP is None,
    )


def _build(cfg):
    model_parallel_cuda_manual_seed(test_seed() % 1000, use_cudagraphable_rng=GPU)
    torch.manual_seed(test_seed() % 1000)
    chunks = []
    for v in range(VPP or 1):
        stage = dict(vp_stage=v) if VPP else {}
        chunk = GPTModel(
            config=cfg, transformer_layer_spec=get_gpt_block_spec(cfg, vp_stage=v if VPP else None),
            vocab_size=VOCAB, max_sequence_length=SEQ,
            pre_process=mpu.is_pipeline_first_stage(ignore_virtual=False, **stage),
            post_process=mpu.is_pipeline_last_stage(ignore_virtual=False, **stage), **stage,
        )
        if GPU and (cfg.bf16 or cfg.fp16):  # as megatron trains in 16 bits: inputs cast on the first stage,
            from megatron.core.transformer.module import Float16Module  # the loss back to fp32

            chunk = Float16Module(cfg, chunk.cuda())
        elif GPU:
            chunk = chunk.cuda()
        chunks.append(chunk)
    return chunks


def _train(chunks, cfg, graphed, caching: bool):
    """STEPS steps of megatron's schedule; returns per step: losses, all gradients, all FP8 state."""
    gen = torch.Generator().manual_seed(test_seed())
    batches = [torch.randint(0, VOCAB, (MBS, SEQ), generator=gen) for _ in range(M)]
    device = torch.device("cuda") if GPU else torch.device("cpu")
    first_of = {}  # plain runs: megatron's is_first_microbatch protocol, set per chunk

    def loss_func(out):
        loss = out.float().mean()
        return loss, {"loss": loss.detach().clone()}

    def forward_step(it, chunk):
        t = next(it).to(device)
        if caching and graphed is None:
            k = first_of.get(id(chunk), 0)
            first_of[id(chunk)] = (k + 1) % M
            if k == 0:
                for m in chunk.modules():
                    if hasattr(m, "is_first_microbatch"):
                        m.is_first_microbatch = True
        with fp.autocast(recipe=RECIPE, group=ps.dense_amax_group()):
            out = chunk(t, torch.arange(SEQ, device=device).expand(MBS, SEQ), None, labels=torch.roll(t, -1, 1))
        return out, loss_func

    step_func = graphed.forward_step(forward_step) if graphed is not None else forward_step
    params = [p for c in chunks for p in c.parameters()]
    seen = []
    for _ in range(STEPS):
        for p in params:
            p.grad = None
        out = get_forward_backward_func()(
            forward_step_func=step_func, data_iterator=[iter(batches) for _ in chunks] if VPP else iter(batches),
            model=chunks if VPP else chunks[0], num_microbatches=M, seq_length=SEQ, micro_batch_size=MBS,
        )
        for p in params:  # sequence-parallel norms: their grads sum over TP
            if getattr(p, "sequence_parallel", False) and p.grad is not None:
                dist.all_reduce(p.grad, group=mpu.get_tensor_model_parallel_group())
        losses = [d["loss"] for d in out] if out else []
        grads = [p.grad.clone() for p in params if p.grad is not None]
        state = [t.clone() for c in chunks for m in c.modules() if isinstance(m, FP8Meta)
                 for t in (m.amax_history, m.scale)]
        seen.append((losses, grads, state))
        with torch.no_grad():
            for p in params:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-0.1)
    return seen


def _compare(caching: bool):
    def check():
        cfg = _config()
        with ps.cpu_compat() if not GPU else _null():
            plain_chunks = _build(cfg)
            graphed_chunks = _build(cfg)
            for a, b in zip(plain_chunks, graphed_chunks):
                b.load_state_dict(a.state_dict())
            graphed = graph_megatron_layers(graphed_chunks, cfg, num_microbatches=M, seq_length=SEQ,
                                            micro_batch_size=MBS, fp8_recipe=RECIPE, fp8_weight_caching=caching,
                                            num_warmup_iters=2)
            expected = _train(plain_chunks, cfg, None, caching)
            got = _train(graphed_chunks, cfg, graphed, caching)
        for calls in graphed.graphed:
            for call in calls:
                assert call.replay_count == STEPS * M and call.eager_count == 0, (call.replay_count, call.eager_count)
        graphed.reset()  # releases every layer's graphs: the layers get their own forward back
        assert not any(isinstance(layer.forward, fp.GraphedCallable) for ls in graphed.layers for layer in ls)
        for step, ((l1, g1, s1), (l2, g2, s2)) in enumerate(zip(expected, got)):
            assert len(g1) == len(g2) and g1 and len(s1) == len(s2) and s1
            for what, xs, ys in (("loss", l1, l2), ("grad", g1, g2), ("fp8 state", s1, s2)):
                for i, (x, y) in enumerate(zip(xs, ys)):
                    assert torch.equal(x, y), f"step {step} {what} {i}: max abs diff {(x.float() - y.float()).abs().max()}"
        final = expected[-1][2]
        assert any((t > 0).any() for t in final[::2]), "no amax recorded"
        assert not all(torch.equal(a, b) for a, b in zip(expected[0][2], final)), "FP8 state never changed"

    return check


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _stack_layers(cfg, chunks: int, per_chunk: int):
    from megatron.core.transformer.spec_utils import build_module
    from fp8_parallel.megatron import get_gpt_layer_spec

    model_parallel_cuda_manual_seed(test_seed() % 1000, use_cudagraphable_rng=GPU)
    torch.manual_seed(test_seed() % 1000)
    layers = [[build_module(get_gpt_layer_spec(), config=cfg, layer_number=c * per_chunk + i + 1)
               for i in range(per_chunk)] for c in range(chunks)]
    return [[layer.cuda() if GPU else layer for layer in chunk] for chunk in layers]


def _drive_stack(layers, order, steps, caching: bool):
    """Per `+c` a microbatch forward of chunk c (its own FP8 scope), per `-c` the backward of chunk c's
    oldest pending microbatch with fresh random gradients; an SGD step per iteration."""
    device = torch.device("cuda") if GPU else torch.device("cpu")
    gen = torch.Generator().manual_seed(test_seed())
    params = [p for chunk in layers for layer in chunk for p in layer.parameters()]
    seen = []
    for _ in range(steps):
        shape = (SEQ, MBS, 64)
        data = [[torch.randn(shape, generator=gen).to(device, DTYPE) for _ in range(M)] for _ in layers]
        grads = [[torch.randn(shape, generator=gen).to(device, DTYPE) for _ in range(M)] for _ in layers]

        def forward(c, mb):
            x = data[c][mb].requires_grad_()
            with fp.autocast(recipe=RECIPE):
                h = x
                for layer in layers[c]:
                    if caching and mb == 0 and not isinstance(layer.forward, fp.GraphedCallable):
                        for m in layer.modules():  # megatron's is_first_microbatch protocol, eager layers
                            if hasattr(m, "is_first_microbatch"):
                                m.is_first_microbatch = True
                    h = layer(hidden_states=h)[0]
            return x, h

        for p in params:
            p.grad = None
        seen += run_in_order(order, len(layers), forward, lambda c, mb: grads[c][mb])
        seen += [p.grad.clone() for p in params]
        seen += fp8_state(layer for chunk in layers for layer in chunk)
        with torch.no_grad():
            for p in params:
                p.add_(p.grad, alpha=-0.1)
    return seen


def _compare_stack(caching: bool):
    def check():
        from fp8_parallel.pipeline import capture_order

        cfg = _config()
        cfg.num_layers = 4
        order = capture_order(M, 2, 0, vpp_size=2)  # pipeline rank 0's order of PP2 / VPP2
        with ps.cpu_compat() if not GPU else _null():
            plain = _stack_layers(cfg, 2, 2)
            graphed = _stack_layers(cfg, 2, 2)
            for a, b in zip(sum(plain, []), sum(graphed, [])):
                b.load_state_dict(a.state_dict())
            device = torch.device("cuda") if GPU else torch.device("cpu")
            samples = [{"hidden_states": torch.randn(SEQ, MBS, 64, device=device, dtype=DTYPE, requires_grad=True)}
                       for _ in range(4)]
            fp.make_graphed_callables(sum(graphed, []), [()] * 4, sample_kwargs=samples, fp8_enabled=True,
                                      fp8_recipe=RECIPE, fp8_weight_caching=caching, order=order,
                                      num_warmup_iters=2)
            expected = _drive_stack(plain, order, STEPS, caching)
            got = _drive_stack(graphed, order, STEPS, caching)
        assert all(layer.forward.replay_count == STEPS * M for chunk in graphed for layer in chunk)
        assert len(expected) == len(got)
        for i, (x, y) in enumerate(zip(expected, got)):
            assert torch.equal(x, y), f"item {i}: max abs diff {(x.float() - y.float()).abs().max()}"

    return check


# -- layers that fork megatron's RNG tracker (dropout) -------------------------------------------------------

def _seed_tracker(graph_safe: bool) -> None:
    model_parallel_cuda_manual_seed(test_seed() % 1000, use_cudagraphable_rng=graph_safe, force_reset_rng=True)
    torch.manual_seed(test_seed() % 1000)


def _dropout_layer():
    """Our spec's TransformerLayer with hidden and attention dropout 0.1 (attention dropout forks the tracker)."""
    from megatron.core.transformer.spec_utils import build_module
    from fp8_parallel.megatron import get_gpt_layer_spec

    cfg = _config()
    cfg.num_layers, cfg.hidden_dropout, cfg.attention_dropout = 1, 0.1, 0.1
    cfg.fp8_amax_history_len = RECIPE.amax_history_len  # FP8 state sized for the recipe: a refused capture leaves it as it was
    return build_module(get_gpt_layer_spec(), config=cfg, layer_number=1).cuda()


class _ForkedDropout(torch.nn.Module):
    """`dropout(x * w, 0.5)` under megatron's model-parallel RNG fork, as megatron's attention does."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.rand(256, device="cuda") + 0.5)

    def forward(self, x):
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        with get_cuda_rng_tracker().fork():
            return torch.nn.functional.dropout(x * self.w, 0.5)


def _hidden(requires_grad: bool = True):
    return torch.randn(SEQ, MBS, 64, device="cuda", dtype=DTYPE, requires_grad=requires_grad)


def _check_graph_safe_tracker_dropout():
    """With graph-safe tracker states (`use_cudagraphable_rng=True`) a forking layer captures; every replay
    draws a fresh mask from the tracker; forward and backward graphs agree on it; the TransformerLayer with
    dropout captures in FP8 and without, and replays with finite outputs and gradients."""
    _seed_tracker(graph_safe=True)
    drop = fp.make_graphed_callables(_ForkedDropout(), (torch.randn(64, 256, device="cuda", requires_grad=True),),
                                     num_warmup_iters=2)
    x = torch.rand(64, 256, device="cuda") + 0.5  # no zeros: a zero output means dropped
    outs = []
    for _ in range(2):
        inp = x.clone().requires_grad_()
        out = drop(inp)
        out.backward(torch.ones_like(out))
        kept = out != 0
        assert 0.4 < kept.float().mean().item() < 0.6, kept.float().mean()
        assert torch.equal(inp.grad, torch.where(kept, 2.0 * drop.w.detach(), torch.zeros_like(x))), \
            "the backward graph used another mask than the forward graph"
        outs.append(kept)
    assert drop.forward.replay_count == 2 and not torch.equal(outs[0], outs[1]), "a replay repeated its mask"

    for fp8 in (False, True):
        layer = _dropout_layer()
        fp.make_graphed_callables(layer, (), sample_kwargs={"hidden_states": _hidden()}, fp8_enabled=fp8,
                                  fp8_recipe=RECIPE, num_warmup_iters=2)
        x = _hidden(requires_grad=False)
        seen = []
        for _ in range(2):
            inp = x.clone().requires_grad_()
            with fp.autocast(recipe=RECIPE) if fp8 else fp.autocast(enabled=False):
                out = layer(hidden_states=inp)[0]
            out.float().square().mean().backward()
            assert torch.isfinite(out).all() and torch.isfinite(inp.grad).all()
            assert all(torch.isfinite(p.grad).all() for p in layer.parameters() if p.grad is not None)
            seen.append(out.detach().clone())
        assert layer.forward.replay_count == 2 and layer.forward.eager_count == 0
        if not fp8:  # same weights and input: only dropout makes the two replays differ
            assert not torch.equal(seen[0], seen[1]), "dropout drew the same masks on two replays"


def _check_plain_tracker_refused():
    """A tracker seeded without graph-safe states, forked by the layer: a clear error before capture (naming
    the fix), FP8 state untouched, and the layer still runs eagerly afterwards."""
    _seed_tracker(graph_safe=False)
    layer = _dropout_layer()
    before = fp8_state([layer])
    try:
        fp.make_graphed_callables(layer, (), sample_kwargs={"hidden_states": _hidden()}, fp8_enabled=True,
                                  fp8_recipe=RECIPE, num_warmup_iters=1)
    except RuntimeError as e:
        assert "use_cudagraphable_rng=True" in str(e) and "RNG tracker" in str(e), str(e)
    else:
        raise AssertionError("a plain RNG tracker forked by the layer was not refused")
    assert not torch.cuda.is_current_stream_capturing()
    assert all(torch.equal(a, b) for a, b in zip(before, fp8_state([layer])))
    assert not isinstance(layer.forward, fp.GraphedCallable)
    with fp.autocast(recipe=RECIPE):
        out = layer(hidden_states=_hidden())[0]
    assert torch.isfinite(out).all()


def _check_dropout_layer_matches_eager():
    """Graphed and eager twins of a TransformerLayer with dropout, started from the same RNG states (torch's
    and the tracker's): equal outputs and gradients, bitwise, on two consecutive calls."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    _seed_tracker(graph_safe=True)
    plain = _dropout_layer()
    graphed = _dropout_layer()  # a twin with the same weights (a deep copy would try to copy process groups)
    graphed.load_state_dict(plain.state_dict())
    fp.make_graphed_callables(graphed, (), sample_kwargs={"hidden_states": _hidden()}, num_warmup_iters=2)
    generators = list(get_cuda_rng_tracker().get_states().values())
    start = (torch.cuda.get_rng_state(), [g.get_state() for g in generators])
    xs = [_hidden(requires_grad=False) for _ in range(2)]
    results = []
    for layer in (plain, graphed):
        torch.cuda.set_rng_state(start[0])
        for g, state in zip(generators, start[1]):
            g.set_state(state)
        seen = []
        for x in xs:
            inp = x.clone().requires_grad_()
            out = layer(hidden_states=inp)[0]
            out.float().square().mean().backward()
            seen += [out.detach().clone(), inp.grad]
        seen += [p.grad.clone() for p in layer.parameters()]
        results.append(seen)
    assert graphed.forward.replay_count == 2
    for i, (a, b) in enumerate(zip(*results)):
        assert torch.equal(a, b), f"item {i}: max abs diff {(a.float() - b.float()).abs().max()}"


# -- megatron's DistributedDataParallel: weight gradients added into main_grad inside the backward graphs --------

def _ddp_wrapped(chunk, cfg):
    """`chunk` under megatron's DDP (fp32 main grads, reduction overlapped with backward, so its gradient hook
    must see every parameter), built on a side stream as backward capture needs."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=True)
    with torch.cuda.stream(torch.cuda.Stream()):
        model = DistributedDataParallel(config=cfg, ddp_config=ddp_config, module=chunk)
    torch.cuda.synchronize()
    return model


def _train_ddp(model, cfg, graphed, steps: int):
    """`steps` steps of megatron's schedule with its DDP (no_sync over the microbatches, finish_grad_sync at the
    end); returns per step: losses, every main_grad, every parameter's `grad` after the step (megatron's hook
    leaves None), its `grad_added_to_main_grad` flag, and the FP8 state."""
    from megatron.core.distributed import finalize_model_grads

    cfg.no_sync_func, cfg.finalize_model_grads_func = model.no_sync, finalize_model_grads
    gen = torch.Generator().manual_seed(test_seed())
    batches = [torch.randint(0, VOCAB, (MBS, SEQ), generator=gen) for _ in range(M)]
    pos = torch.arange(SEQ, device="cuda").expand(MBS, SEQ)

    def loss_func(out):
        loss = out.float().mean()
        return loss, {"loss": loss.detach().clone()}

    def forward_step(it, chunk):
        t = next(it).cuda()
        with fp.autocast(recipe=RECIPE, group=ps.dense_amax_group()):
            out = chunk(t, pos, None, labels=torch.roll(t, -1, 1))
        return out, loss_func

    step_func = graphed.forward_step(forward_step) if graphed is not None else forward_step
    params = [p for p in model.parameters() if p.requires_grad]
    seen = []
    for _ in range(steps):
        model.zero_grad_buffer()
        out = get_forward_backward_func()(forward_step_func=step_func, data_iterator=iter(batches), model=model,
                                          num_microbatches=M, seq_length=SEQ, micro_batch_size=MBS)
        state = [t.clone() for m in model.modules() if isinstance(m, FP8Meta) for t in (m.amax_history, m.scale)]
        seen.append(([d["loss"] for d in out], [p.main_grad.clone() for p in params],
                     [p.grad for p in params], [p.grad_added_to_main_grad for p in params], state))
        with torch.no_grad():
            for p in params:
                p.add_(p.main_grad.to(p.dtype), alpha=-0.1)
    return seen


def _check_ddp_graphs_add_into_main_grad(dtype: torch.dtype):
    """Plain and graphed twins under megatron's DDP with `dtype` parameters, 3 steps of 4 microbatches: losses, main grads and FP8
    state equal bitwise; megatron's hook ran for every parameter (no `grad` left; its overlapped reduction,
    which asserts that every parameter reported, finished); the graphed layers' weights went through the
    main_grad protocol. A main_grad replaced after capture is refused at the next backward."""
    cfg = _config(dtype)
    plain_model, graphed_model = _build(cfg)[0], _build(cfg)[0]
    graphed_model.load_state_dict(plain_model.state_dict())
    plain, graphed_ddp = _ddp_wrapped(plain_model, cfg), _ddp_wrapped(graphed_model, cfg)
    graphed = graph_megatron_layers([graphed_ddp], cfg, num_microbatches=M, seq_length=SEQ, micro_batch_size=MBS,
                                    fp8_recipe=RECIPE, num_warmup_iters=2)
    expected = _train_ddp(plain, cfg, None, STEPS)
    got = _train_ddp(graphed_ddp, cfg, graphed, STEPS)
    layer_params = {id(p) for ls in graphed.layers for layer in ls for p in layer.parameters()}
    names = [n for n, p in graphed_ddp.named_parameters() if p.requires_grad] * 2
    in_layers = [id(p) in layer_params for p in graphed_ddp.parameters() if p.requires_grad]
    assert any(in_layers) and not all(in_layers), "the check needs graphed and eager parameters"
    for step, (a, b) in enumerate(zip(expected, got)):
        for what, xs, ys in (("loss", a[0], b[0]), ("main_grad", a[1], b[1]), ("fp8 state", a[4], b[4])):
            assert len(xs) == len(ys) and xs, (what, len(xs), len(ys))
            for i, (x, y) in enumerate(zip(xs, ys)):
                assert torch.equal(x, y), f"step {step} {what} {i}: max abs diff {(x.float() - y.float()).abs().max()}"
        assert all(g is None for g in a[2] + b[2]), "megatron's hook left a .grad"
        flagged = [n for n, f in zip(names, a[3] + b[3]) if f]
        assert not flagged, f"grad_added_to_main_grad left set after the backward: {flagged[:4]}"
        assert all(torch.isfinite(x).all() for x in b[1]) and any(x.abs().sum() > 0 for x in b[1])
    for calls in graphed.graphed:
        for call in calls:
            assert call.replay_count == STEPS * M and call.eager_count == 0, (call.replay_count, call.eager_count)
            trainable = [p for p in call.params if p.requires_grad]
            assert trainable and all(len(r.main_grads) == len(trainable) for r in call.runners), \
                "a graphed layer's parameters did not take the main_grad path"
    victim = next(p for p in graphed.layers[0][0].parameters() if p.requires_grad)
    victim.main_grad = victim.main_grad.clone()
    try:
        _train_ddp(graphed_ddp, cfg, graphed, 1)
    except RuntimeError as e:
        assert "is not the memory it was at capture" in str(e), str(e)
    else:
        raise AssertionError("a main_grad replaced after capture was not refused")
    graphed.reset()


class _FusedAccumulation(torch.nn.Module):
    """Two TransformerEngine-style FP8 linears, one adding its weight gradient into `main_grad` itself
    (`fuse_wgrad_accumulation=True`), one returning it."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.fused = fp.Linear(64, 128, params_dtype=dtype, device="cuda", fuse_wgrad_accumulation=True)
        self.plain = fp.Linear(128, 64, params_dtype=dtype, device="cuda")

    def forward(self, x):
        return self.plain(torch.nn.functional.gelu(self.fused(x)))


OTHER_RECIPE = fp.DelayedScaling(amax_history_len=4, amax_compute_algo="max", margin=1)


def _check_ddp_graphs_with_fused_wgrad_accumulation(dtype: torch.dtype, accumulate: bool):
    """Under megatron's DDP with `dtype` parameters, a graphed callable (`accumulate_into_main_grad` on or off)
    holding a module that adds into main_grad itself: that addition happens once per replay (the graph adds
    nothing more for it), and its weight is flagged for megatron's hook every time the hook sees it (its
    `zero_grad_buffer` clears the flags each step), which a hook of our own, running just before megatron's,
    records. Each step's second microbatch runs under another recipe, so the graphed callable runs it
    eagerly: its gradients, after a replay in the same step, must be added by the hook. Main grads match the
    eager twin bitwise."""
    cfg = _config(dtype)
    torch.manual_seed(test_seed() % 1000)
    plain_module = _FusedAccumulation(dtype)
    graphed_module = _FusedAccumulation(dtype)
    graphed_module.load_state_dict(plain_module.state_dict())
    plain, graphed = _ddp_wrapped(plain_module, cfg), _ddp_wrapped(graphed_module, cfg)
    sample = torch.randn(32, 64, device="cuda", dtype=dtype, requires_grad=True)
    fp.make_graphed_callables(graphed_module, (sample,), fp8_enabled=True, fp8_recipe=RECIPE, num_warmup_iters=2,
                              accumulate_into_main_grad=accumulate)
    flags_seen = {id(m): [] for m in (plain_module, graphed_module)}
    hooks = [m.fused.weight.register_post_accumulate_grad_hook(
        lambda p, seen=flags_seen[id(m)]: seen.append(bool(p.grad_added_to_main_grad)))  # noqa: B008 (binds this m's list)
        for m in (plain_module, graphed_module)]
    gen = torch.Generator().manual_seed(test_seed())
    xs = [[torch.randn(32, 64, generator=gen).to("cuda", dtype) for _ in range(2)] for _ in range(STEPS)]
    results = []
    for model in (plain, graphed):
        seen = []
        params = [p for p in model.parameters() if p.requires_grad]
        for step_x in xs:
            model.zero_grad_buffer()
            with model.no_sync():
                with fp.autocast(recipe=RECIPE):
                    out = model(step_x[0].clone().requires_grad_())
                out.float().square().mean().backward()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the graphed callable's one-time eager-fallback warning
                with fp.autocast(recipe=OTHER_RECIPE):
                    out = model(step_x[1].clone().requires_grad_())
            out.float().square().mean().backward()
            model.finish_grad_sync()
            assert all(p.grad is None for p in params), "megatron's hook left a .grad"
            seen += [p.main_grad.clone() for p in params]
            with torch.no_grad():
                for p in params:
                    p.add_(p.main_grad.to(p.dtype), alpha=-0.1)
        results.append(seen)
    for h in hooks:
        h.remove()
    assert graphed_module.forward.replay_count == STEPS and graphed_module.forward.eager_count == STEPS
    for m, kind in ((plain_module, "plain"), (graphed_module, "graphed")):
        seen = flags_seen[id(m)]
        assert len(seen) == 2 * STEPS and all(seen), f"{kind}: the fused weight's flag as megatron's hook saw it: {seen}"
    for i, (a, b) in enumerate(zip(*results)):
        assert torch.isfinite(a).all() and a.abs().sum() > 0, f"main_grad {i}: not finite or all zero"
        assert torch.equal(a, b), f"main_grad {i}: max abs diff {(a - b).abs().max()}"


if __name__ == "__main__":
    if MODE == "ddp":
        dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
        run_checks([(f"ddp_graphs_add_into_main_grad_{n}", functools.partial(_check_ddp_graphs_add_into_main_grad, d))
                    for n, d in dtypes.items()]
                   + [(f"ddp_graphs_with_fused_wgrad_accumulation_{n}{'_in_graph' if acc else ''}",
                       functools.partial(_check_ddp_graphs_with_fused_wgrad_accumulation, d, acc))
                      for n, d in dtypes.items() for acc in (False, True)])
        ps.destroy()
        exit_now()
    if MODE == "dropout":
        run_checks([("graph_safe_tracker_dropout_captures", _check_graph_safe_tracker_dropout),
                    ("plain_tracker_refused_before_capture", _check_plain_tracker_refused)])
        ps.destroy()
        exit_now()
    if MODE == "dropout-eager":
        run_checks([("graphed_dropout_layer_matches_eager", _check_dropout_layer_matches_eager)])
        ps.destroy()
        exit_now()
    if STACK:
        run_checks([("graphed_stack_matches_eager", _compare_stack(False)),
                    ("graphed_stack_cached_weights_matches_eager", _compare_stack(True))])
        ps.destroy()
        exit_now()
    tag = f"tp{TP}_pp{PP}_vpp{VPP or 0}"
    run_checks([(f"graphed_layers_match_plain_{tag}", _compare(False)),
                (f"graphed_layers_cached_weights_match_plain_{tag}", _compare(True))])
    ps.destroy()
    exit_now()  # skip finalization: see exit_now
