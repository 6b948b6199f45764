"""`make_graphed_callables`: warm-up, capture in a given order, FP8 state saved and restored."""
from __future__ import annotations

import contextlib
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from ..recipe import DelayedScaling, Recipe, snapshot
from ..scopes import Recorder
from .arguments import _flatten_outputs, _Signature
from .graphed_callable import GraphedCallable
from .layout import Layout, expand_samples, layout_of
from .recording import _fp8_states, _restore_fp8_state, _save_fp8_state
from .rng import RngSnapshot, TrackerWatch, graph_safe_generators
from .runners import (HeldOutputs, RunOptions, _EagerRunner, _GradBuffers, _GraphRunner, _SlotBuffers, buffer_plan,
                      main_grad_positions, protocol_positions)


def _uses_cuda_graphs() -> bool:
    return torch.cuda.is_available()


def _per_callable_fp8(fp8_enabled: Union[None, bool, Sequence[bool]], num_callables: int) -> List[bool]:
    if fp8_enabled is None or isinstance(fp8_enabled, bool):
        return [bool(fp8_enabled)] * num_callables
    if isinstance(fp8_enabled, (tuple, list)) and all(isinstance(e, bool) for e in fp8_enabled):
        if len(fp8_enabled) != num_callables:
            raise ValueError(f"make_graphed_callables: fp8_enabled {tuple(fp8_enabled)} has {len(fp8_enabled)} "
                             f"entries for {num_callables} callables")
        return list(fp8_enabled)
    raise TypeError(f"make_graphed_callables: fp8_enabled must be a bool or a tuple of bools (one per callable), "
                    f"got {fp8_enabled!r}")


def _one_of(old: str, old_value: Any, new: str, new_value: Any, default: Any) -> Any:
    """TransformerEngine's renamed arguments: the value of whichever name was given (not both)."""
    if old_value is not None and new_value is not None:
        raise ValueError(f"make_graphed_callables: give {new} or its older name {old}, not both")
    if new_value is not None:
        return new_value
    return old_value if old_value is not None else default


def _check_module(i: int, module: torch.nn.Module) -> None:
    """Hooks would run once while capturing and never on replay; trainable buffers get no gradient."""
    kinds = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
    for path, sub in module.named_modules():
        found = [k.strip("_") for k in kinds if getattr(sub, k, None)]
        if found:
            where = f"its submodule '{path}' ({type(sub).__name__})" if path else "it"
            raise ValueError(f"make_graphed_callables: callable {i} ({type(module).__name__}): {where} has "
                             f"{', '.join(found)}; a CUDA graph would run them once at capture and never again. "
                             f"Remove them before graphing (hooks registered on the returned module afterwards "
                             f"run around every call)")
    for name, buf in module.named_buffers():
        if buf.requires_grad:
            raise ValueError(f"make_graphed_callables: callable {i} ({type(module).__name__}) has buffer '{name}' "
                             f"with requires_grad=True; only parameters can be trained through graphs")


def make_graphed_callables(  # noqa: C901
    modules: Union[Callable, Sequence[Callable]],
    sample_args: Union[tuple, Sequence[tuple]],
    *,
    num_warmup_iters: int = 3,
    allow_unused_input: bool = False,
    sample_kwargs: Optional[Union[dict, Sequence[dict]]] = None,
    fp8_enabled: Union[None, bool, Sequence[bool]] = None,
    fp8_calibrating: Optional[bool] = None,
    fp8_recipe: Optional[Recipe] = None,
    fp8_group: Optional[dist.ProcessGroup] = None,
    fp8_weight_caching: Optional[bool] = None,
    enabled: Union[None, bool, Sequence[bool]] = None,
    calibrating: Optional[bool] = None,
    recipe: Optional[Recipe] = None,
    amax_reduction_group: Optional[dist.ProcessGroup] = None,
    cache_quantized_params: Optional[bool] = None,
    order: Optional[List[int]] = None,
    _order: Optional[List[int]] = None,
    _num_layers_per_chunk: Optional[Union[int, List[int]]] = None,
    _reuse_graph_input_output_buffers: bool = False,
    pool: Optional[Any] = None,
    retain_graph_in_backward: bool = False,
    clone_param_grads_on_return: Optional[bool] = None,
    _clone_param_grads_on_return: Optional[bool] = None,
    pre_warmup_hook: Optional[Callable[[], Any]] = None,
    post_warmup_hook: Optional[Callable[[], Any]] = None,
    capture_time_hooks: Optional[list] = None,
    accumulate_into_main_grad: bool = False,
    check_held_outputs: bool = False,
):
    """Capture forward and backward CUDA graphs of `modules` (callables or `nn.Module`s).

    The arguments are TransformerEngine's (`te.pytorch.make_graphed_callables`), plus `order`. Its 2.x names
    `enabled`, `calibrating`, `recipe`, `amax_reduction_group`, `cache_quantized_params` and the older
    `fp8_enabled`, `fp8_calibrating`, `fp8_recipe`, `fp8_group`, `fp8_weight_caching` are the same arguments
    (give one name of each pair; below, the older names).

    Args:
        modules: one callable, or a sequence. With an order, the sequence is the layers of all chunks, chunk by
            chunk (`_num_layers_per_chunk` each; default an equal split).
        sample_args: a tuple of positional arguments per (chunk, microbatch, layer) in that nesting order, or
            one tuple per callable (reused for every microbatch); a single callable takes one tuple.
        num_warmup_iters: eager forward/backward passes per callable before capture.
        allow_unused_input: allow inputs and parameters that get no gradient.
        sample_kwargs: keyword arguments, laid out like `sample_args` (None values count as absent).
        fp8_enabled: capture in FP8 (a bool, or one bool per callable). A callable captured with FP8 replays
            only inside an enabled scope with `fp8_recipe` (default `DelayedScaling()`); one captured without
            replays only with FP8 off. Other calls run eagerly, with a one-time warning (TransformerEngine
            replays regardless of the caller's scope).
        fp8_calibrating: not supported (NotImplementedError when True).
        fp8_group: when given, replay also needs the caller's scope to reduce over this group.
        fp8_weight_caching: capture weight casts under a device flag set by `is_first_microbatch` on replay.
        order: `+c` forward / `-c` backward of chunk c (1-indexed), one per microbatch, e.g. from
            `fp8_parallel.pipeline.capture_order`; graphs are captured in exactly this order into one pool.
            Without an order every callable gets one forward and one backward graph, forwards captured in
            order and backwards in reverse.
        _order: the same order, TransformerEngine's name; it also selects TransformerEngine's return layout
            (below). Give `order` or `_order`, not both.
        _num_layers_per_chunk: callables per chunk (an int, or one per chunk) when they differ.
        _reuse_graph_input_output_buffers: share static inputs, outputs and input gradients between the
            microbatches of a callable that are never in flight together in the order (TransformerEngine's
            option, off by default as there). Off: each microbatch has its own, so outputs a caller keeps
            from several microbatches stay as they were until that microbatch replays again (next step).
            On: a later microbatch's replay writes into an earlier one's outputs and input gradients; use it
            only where each is consumed before then (megatron's schedule: `graph_megatron_layers` turns it
            on). Each replay bumps the version counter of what it writes, so autograd refuses a backward
            that saved an overwritten value.
        pool: a memory pool handle (`torch.cuda.graph_pool_handle()`) to capture into (default: a new one).
        retain_graph_in_backward: keep the autograd graph when capturing (and running) backwards.
        clone_param_grads_on_return: (or TransformerEngine's earlier `_clone_param_grads_on_return`; default
            True) the parameter gradients a replayed backward returns are copies, so a gradient hook or
            gradient-accumulation code that keeps one keeps its own tensor. False skips the copy: they are
            the graph's static buffers, overwritten by the callable's next backward (`.grad` is still
            accumulated into a tensor of its own by autograd).
        pre_warmup_hook, post_warmup_hook: called once (no arguments) before / after all warm-up passes.
        capture_time_hooks: only None (not implemented; refused with NotImplementedError).
        accumulate_into_main_grad: for parameters under megatron's DistributedDataParallel (a `main_grad` and
            `grad_added_to_main_grad`), add their gradients into `main_grad` inside the backward graphs, as
            megatron's gradient hook would, instead of returning them through a copy; the hook still runs
            (its `grad_added_to_main_grad` is set for it). Not TransformerEngine's; `graph_megatron_layers`
            turns it on. Needs those parameters to get gradient only from their callable. Either way, a
            module inside that adds into `main_grad` itself (`fuse_wgrad_accumulation`) keeps megatron's
            protocol on every replay: the addition is in the graph and the flag is set for the hook.
        check_held_outputs: debug mode (not TransformerEngine's): a replay that would overwrite outputs the
            caller still references from an earlier replay into the same buffers raises a RuntimeError
            instead. It also fires for `y = graphed(x)` in a loop, where the previous `y` is still bound
            during the call; drop (`del`) or clone outputs you are done with.

    Returns:
        Without `_order`: for a module, the module itself with `forward` replaced by a `GraphedCallable`
        (whose calls replay microbatch after microbatch; `module.reset` is set to its `reset` unless the
        module has a `reset` already); for other callables a `GraphedCallable`; a tuple of
        them for a sequence. With `_order` (as TransformerEngine): a tuple of `GraphedMicrobatch` callables,
        one per (chunk, microbatch, layer) in the layout of `sample_args`, each replaying that microbatch's
        graphs (a single callable with one microbatch: that callable alone); modules keep their own
        `forward`. Each has `reset()`, which releases its graphs (later calls
        run eagerly). Without CUDA everything runs eagerly on every call (same semantics; one warning).

    Raises:
        ValueError: a malformed order, sample counts that fit no layout, hooks on a module or any of its
            submodules (TransformerEngine checks the module only; a submodule's hook would silently not run
            on replay), trainable buffers. RuntimeError: the callables fork megatron's RNG tracker without graph-safe states (before
            any capture; the message names the fix). NotImplementedError: `fp8_calibrating=True`,
        `capture_time_hooks`. ValueError also: both names of one argument given.
    """
    fp8_enabled = _one_of("fp8_enabled", fp8_enabled, "enabled", enabled, False)
    fp8_calibrating = _one_of("fp8_calibrating", fp8_calibrating, "calibrating", calibrating, False)
    fp8_recipe = _one_of("fp8_recipe", fp8_recipe, "recipe", recipe, None)
    fp8_group = _one_of("fp8_group", fp8_group, "amax_reduction_group", amax_reduction_group, None)
    fp8_weight_caching = _one_of("fp8_weight_caching", fp8_weight_caching, "cache_quantized_params",
                                 cache_quantized_params, False)
    if capture_time_hooks is not None:
        raise NotImplementedError("make_graphed_callables: capture_time_hooks is not supported; run such hooks "
                                  "around the graphed callables' calls yourself (hooks on the returned module "
                                  "run around every call)")
    for name, hook in (("pre_warmup_hook", pre_warmup_hook), ("post_warmup_hook", post_warmup_hook)):
        if hook is not None and not callable(hook):
            raise TypeError(f"make_graphed_callables: {name}={hook!r} is not callable")
    clone_param_grads = _one_of("_clone_param_grads_on_return", _clone_param_grads_on_return,
                                "clone_param_grads_on_return", clone_param_grads_on_return, True)
    if order is not None and _order is not None:
        raise ValueError("make_graphed_callables: give `order` or TransformerEngine's `_order`, not both")
    if fp8_calibrating:
        raise NotImplementedError("make_graphed_callables: fp8_calibrating=True (amaxes recorded while computing "
                                  "in high precision) is not supported; capture with fp8_enabled=True or False")
    te_layout = _order is not None
    single = not isinstance(modules, (list, tuple))
    funcs = [modules] if single else list(modules)
    layout = layout_of(order if order is not None else _order, len(funcs), _num_layers_per_chunk)
    fp8_per_callable = _per_callable_fp8(fp8_enabled, len(funcs))
    args_list = expand_samples([sample_args] if single else list(sample_args), "sample_args", layout)
    if sample_kwargs is None:
        kwargs_list = [{}] * (len(funcs) * layout.microbatches)
    else:
        kwargs_list = expand_samples([sample_kwargs] if single else list(sample_kwargs), "sample_kwargs", layout)
    if any(fp8_per_callable) and fp8_recipe is None:
        fp8_recipe = DelayedScaling()
    if fp8_recipe is not None:
        fp8_recipe = snapshot(fp8_recipe)  # the recipe as captured: later assignments to it do not change the graphs
    for i, func in enumerate(funcs):
        if isinstance(func, torch.nn.Module):
            _check_module(i, func)
        elif not callable(func):
            raise TypeError(f"make_graphed_callables: callable {i} is a {type(func).__name__}, not callable")
    graphs = _uses_cuda_graphs()
    if not graphs:
        warnings.warn("fp8_parallel.make_graphed_callables: CUDA is not available; the callables run eagerly "
                      "(same FP8 semantics, no graphs)", stacklevel=2)

    generators = tuple(graph_safe_generators()) if graphs else ()
    entries = []  # per callable: dict with its runners (one per microbatch) and the rest
    for i, func in enumerate(funcs):
        module = func if isinstance(func, torch.nn.Module) else None
        original = module.forward if module is not None else func
        params = tuple(p for p in module.parameters() if p.requires_grad) if module is not None else ()
        flag = None
        if fp8_weight_caching:
            device = torch.device("cuda", torch.cuda.current_device()) if graphs else torch.device("cpu")
            flag = torch.zeros(1, dtype=torch.int32, device=device)
        options = RunOptions(fp8_per_callable[i], fp8_recipe if fp8_per_callable[i] else None, flag,
                             allow_unused_input, retain_graph_in_backward, generators, accumulate_into_main_grad,
                             bool(clone_param_grads), check_held_outputs)
        runners = []
        for mb in range(layout.microbatches):
            k = layout.sample_index(i, mb)
            signature, tensors = _Signature.of(args_list[k], kwargs_list[k])
            runner = (_GraphRunner if graphs else _EagerRunner)(
                original, params, signature, [t.requires_grad for t in tensors], options)
            runner.sample = tensors  # capture-time only
            runners.append(runner)
        entries.append(dict(func=func, module=module, original=original, params=params, flag=flag,
                            runners=runners))

    metas = [m for e in entries for m in _fp8_states(e["module"])]
    saved = _save_fp8_state(metas)
    rng = RngSnapshot(list(generators)) if graphs else None
    watch = TrackerWatch()
    cached_weights: Dict[int, List[torch.Tensor]] = {}
    try:
        if pre_warmup_hook is not None:
            pre_warmup_hook()
        cached_weights = _warm_up(entries, num_warmup_iters, graphs)
        if post_warmup_hook is not None:
            post_warmup_hook()
        if graphs:
            watch.refuse_capture_if_forked()
            _capture(entries, layout, pool if pool is not None else torch.cuda.graph_pool_handle(),
                     _reuse_graph_input_output_buffers)
    finally:
        _restore_fp8_state(metas, saved)
        if rng is not None:
            rng.restore()
    for e in entries:
        e.pop("warm_outputs", None)
        e.pop("warm_grads", None)
        e.pop("added_by_module", None)
        for r in e["runners"]:
            del r.sample

    results = []
    for i, e in enumerate(entries):
        training = e["module"].training if e["module"] is not None else True
        name = f"graphed callable {i} ({type(e['func']).__name__})"
        graphed = GraphedCallable(name, e["original"], e["module"], e["runners"], e["params"], training,
                                  fp8_per_callable[i], fp8_recipe if fp8_per_callable[i] else None, fp8_group,
                                  e["flag"], cached_weights.get(i, []))
        if te_layout:
            results.append(graphed)
        elif e["module"] is not None:
            e["module"].forward = graphed
            if not hasattr(e["module"], "reset"):  # as TransformerEngine: `module.reset()` releases its graphs
                e["module"].reset = graphed.reset
            results.append(e["module"])
        else:
            results.append(graphed)
    if te_layout:  # one per (chunk, microbatch, layer), in the layout of the samples
        views: List[Any] = [None] * (len(results) * layout.microbatches)
        for i, graphed in enumerate(results):
            for mb in range(layout.microbatches):
                views[layout.sample_index(i, mb)] = graphed.microbatch(mb)
        return views[0] if single and len(views) == 1 else tuple(views)
    return results[0] if single else tuple(results)


def _warm_up(entries: list, iters: int, graphs: bool) -> Dict[int, List[torch.Tensor]]:
    """Eager forward/backward passes (microbatch 0's samples) under recording scopes; returns the weights each
    callable casts under its weight-caching flag, and stores in each entry the outputs and gradients of its
    last pass (their shapes size the static buffers) and `added_by_module`: the gradient positions of
    parameters under megatron's DDP protocol whose module adds into `main_grad` itself (it sets their
    `grad_added_to_main_grad` in its backward; their returned gradient is a placeholder). The flags are put
    back as they were before the warm-up."""
    cached: Dict[int, List[torch.Tensor]] = {}
    protocol = [protocol_positions(e["runners"][0]) for e in entries]
    flags_before = [(p, p.grad_added_to_main_grad) for positions in protocol for p in positions.values()]
    stream = torch.cuda.Stream() if graphs else None
    if graphs:
        torch.cuda.synchronize()
        stream.wait_stream(torch.cuda.current_stream())
    ctx = torch.cuda.stream(stream) if graphs else contextlib.nullcontext()
    try:
        with ctx:
            for i, e in enumerate(entries):
                runner = e["runners"][0]
                for _ in range(max(iters, 1)):
                    inputs = [x.detach().requires_grad_(rg) for x, rg in zip(runner.sample, runner.requires_grad)]
                    recorder = Recorder(runner.device(), runner.flag)
                    with torch.enable_grad():
                        outputs = runner._record(inputs, recorder)
                    flat = _flatten_outputs(outputs)[0]
                    for p in protocol[i].values():
                        p.grad_added_to_main_grad = False
                    grads = runner._grads(flat, inputs, [torch.ones_like(o) if o.requires_grad else None for o in flat])
                    cached[i] = _unique(recorder.cached_weights)
                e["warm_outputs"] = [o.detach().requires_grad_(o.requires_grad) for o in flat]
                e["warm_grads"] = [g.detach() if g is not None else None for g in grads]
                e["added_by_module"] = {k for k, p in protocol[i].items() if p.grad_added_to_main_grad}
    finally:
        for p, value in flags_before:
            p.grad_added_to_main_grad = value
    if graphs:
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
    return cached


def _capture(entries: list, layout: Layout, pool, reuse: bool) -> None:
    """Forward and backward graphs in the layout's order, all into `pool`, with the static buffers of
    `buffer_plan` (inputs, outputs and input gradients per slot; parameter gradients per callable)."""
    slot_of = buffer_plan(layout.order, layout.microbatches, reuse)
    slot_buffers: Dict[Tuple[int, int], _SlotBuffers] = {}
    grad_buffers: Dict[Tuple[int, int], _GradBuffers] = {}
    for i, e in enumerate(entries):
        outs = e.pop("warm_outputs")
        grads = e.pop("warm_grads")
        # no gradient buffer where the backward graph adds into `main_grad`, or the module does
        for k in set(main_grad_positions(e["runners"][0])) | e.pop("added_by_module"):
            grads[k] = None
        num_inputs = len(e["runners"][0].requires_grad)
        grad_outputs = [torch.empty_like(o) if o.requires_grad else None for o in outs]  # copied in per replay
        param_grads = [torch.empty_like(g) if g is not None else None for g in grads[num_inputs:]]
        shared_input_grads = [torch.empty_like(g) if g is not None else None for g in grads[:num_inputs]]
        chunk = layout.chunk_of(i)
        for (c, mb), slot in slot_of.items():
            if c == chunk and (i, slot) not in slot_buffers:
                runner = e["runners"][mb]
                name = f"graphed callable {i} ({type(e['func']).__name__}), microbatch {mb}"
                slot_buffers[(i, slot)] = _SlotBuffers(
                    [x.detach().clone().requires_grad_(rg) for x, rg in zip(runner.sample, runner.requires_grad)],
                    [torch.empty_like(o) for o in outs], HeldOutputs(name))
                # sharing mode: a backward's input gradients are consumed before the callable's next backward
                input_grads = shared_input_grads if reuse else [
                    torch.empty_like(g) if g is not None else None for g in grads[:num_inputs]]
                grad_buffers[(i, slot)] = _GradBuffers(grad_outputs, input_grads + param_grads)
    torch.cuda.synchronize()
    fwd_next: Dict[int, int] = {}
    bwd_next: Dict[int, int] = {}
    for step in layout.order:
        chunk = abs(step) - 1
        ids = layout.callables_of(chunk)
        if step > 0:
            mb = fwd_next.get(chunk, 0)
            fwd_next[chunk] = mb + 1
            for i in ids:
                runner = entries[i]["runners"][mb]
                static = slot_buffers[(i, slot_of[(chunk, mb)])]
                for buf, x in zip(static.inputs, runner.sample):  # this microbatch's sample values
                    with torch.no_grad():
                        buf.copy_(x)
                runner.capture_forward(static, pool)
        else:
            mb = bwd_next.get(chunk, 0)
            bwd_next[chunk] = mb + 1
            for i in reversed(ids):
                entries[i]["runners"][mb].capture_backward(grad_buffers[(i, slot_of[(chunk, mb)])], pool)
    torch.cuda.synchronize()


def _unique(tensors: List[torch.Tensor]) -> List[torch.Tensor]:
    seen, out = set(), []
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out
