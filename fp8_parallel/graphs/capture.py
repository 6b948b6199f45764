"""`make_graphed_callables`: warm-up, capture in a given order, FP8 state saved and restored."""
from __future__ import annotations

import contextlib
import sys
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

from ..recipe import DelayedScaling, Recipe
from ..scopes import Recorder
from .arguments import _flatten_outputs, _Signature
from .graphed_callable import GraphedCallable
from .recording import _fp8_states, _restore_fp8_state, _save_fp8_state
from .runners import _EagerRunner, _GradBuffers, _GraphRunner, _lifetime_slots, _SlotBuffers


def _uses_cuda_graphs() -> bool:
    return torch.cuda.is_available()


def _layout_of_order(order: Optional[List[int]], num_callables: int) -> Tuple[int, int, List[int]]:
    """(chunks, microbatches, order) for `order` (None: one chunk, one microbatch)."""
    if order is None:
        return 1, 1, [1, -1]
    chunks = max(abs(c) for c in order) if order else 0
    if not order or any(c == 0 for c in order) or len(order) % (2 * chunks):
        raise ValueError(f"make_graphed_callables: order {order} is not a list of +c/-c chunk ids (1-indexed) with "
                         f"one forward and one backward per chunk and microbatch")
    microbatches = len(order) // (2 * chunks)
    for c in range(1, chunks + 1):
        if order.count(c) != microbatches or order.count(-c) != microbatches:
            raise ValueError(f"make_graphed_callables: order {order} runs {order.count(c)} forwards and "
                             f"{order.count(-c)} backwards of chunk {c}; expected {microbatches} each")
    done: Dict[int, int] = {}
    for c in order:
        done[c] = done.get(c, 0) + 1
        if c < 0 and done[c] > done.get(-c, 0):
            raise ValueError(f"make_graphed_callables: order {order} runs a backward of chunk {-c} before its forward")
    if num_callables % chunks:
        raise ValueError(f"make_graphed_callables: {num_callables} callables do not split into {chunks} chunks")
    return chunks, microbatches, list(order)


def make_graphed_callables(
    modules: Union[Callable, Sequence[Callable]],
    sample_args: Union[tuple, Sequence[tuple]],
    *,
    num_warmup_iters: int = 3,
    allow_unused_input: bool = False,
    sample_kwargs: Optional[Union[dict, Sequence[dict]]] = None,
    fp8_enabled: bool = False,
    fp8_recipe: Optional[Recipe] = None,
    fp8_group: Optional[dist.ProcessGroup] = None,
    fp8_weight_caching: bool = False,
    order: Optional[List[int]] = None,
    pool: Optional[Any] = None,
):
    """Capture forward and backward CUDA graphs of `modules` (callables or `nn.Module`s).

    Args:
        modules: one callable, or a sequence. With `order`, the sequence is the layers of all chunks, chunk by
            chunk (each chunk has `len(modules) // chunks` layers).
        sample_args: a tuple of positional arguments per (chunk, microbatch, layer) in that nesting order, or
            one tuple per callable (reused for every microbatch); a single callable takes one tuple.
        num_warmup_iters: eager forward/backward passes per callable before capture.
        allow_unused_input: allow inputs and parameters that get no gradient.
        sample_kwargs: keyword arguments, laid out like `sample_args` (None values count as absent).
        fp8_enabled, fp8_recipe: run the captured callables in FP8 with this recipe (default
            `DelayedScaling()`); replay needs an enabled caller scope with the same recipe.
        fp8_group: when given, replay also needs the caller's scope to reduce over this group.
        fp8_weight_caching: capture weight casts under a device flag set by `is_first_microbatch` on replay.
        order: `+c` forward / `-c` backward of chunk c (1-indexed), one per microbatch, e.g. from
            `fp8_parallel.pipeline.capture_order`; graphs are captured in exactly this order into one pool.
            Without it every callable gets one forward and one backward graph, forwards captured in order and
            backwards in reverse.
        pool: a memory pool handle (`torch.cuda.graph_pool_handle()`) to capture into (default: a new one).

    Returns:
        For a module, the module itself with `forward` replaced by a `GraphedCallable`; for other callables
        a `GraphedCallable`; a tuple of them for a sequence. Without CUDA they run eagerly on every call
        (same semantics; one warning).
    """
    single = not isinstance(modules, (list, tuple))
    funcs = [modules] if single else list(modules)
    chunks, microbatches, order = _layout_of_order(order, len(funcs))
    layers = len(funcs) // chunks
    args_list = _expand_samples([sample_args] if single else list(sample_args), "sample_args", len(funcs), microbatches, layers)
    if sample_kwargs is None:
        kwargs_list = [{}] * (len(funcs) * microbatches)
    else:
        kwargs_list = _expand_samples([sample_kwargs] if single else list(sample_kwargs), "sample_kwargs", len(funcs), microbatches, layers)
    if fp8_enabled and fp8_recipe is None:
        fp8_recipe = DelayedScaling()
    graphs = _uses_cuda_graphs()
    if not graphs:
        warnings.warn("fp8_parallel.make_graphed_callables: CUDA is not available; the callables run eagerly "
                      "(same FP8 semantics, no graphs)", stacklevel=2)

    generators = tuple(_graph_safe_rng_generators()) if graphs else ()

    def index(chunk: int, mb: int, layer: int) -> int:
        return chunk * microbatches * layers + mb * layers + layer

    entries = []  # per callable: dict with its runners (one per microbatch) and the rest
    for i, func in enumerate(funcs):
        module = func if isinstance(func, torch.nn.Module) else None
        if module is not None:
            if module._forward_hooks or module._forward_pre_hooks or module._backward_hooks:
                raise ValueError(f"make_graphed_callables: module {i} ({type(module).__name__}) has hooks; graphs "
                                 f"would not run them")
        original = module.forward if module is not None else func
        params = tuple(p for p in module.parameters() if p.requires_grad) if module is not None else ()
        flag = None
        if fp8_weight_caching:
            device = torch.device("cuda", torch.cuda.current_device()) if graphs else torch.device("cpu")
            flag = torch.zeros(1, dtype=torch.int32, device=device)
        chunk, layer = divmod(i, layers)
        runners = []
        for mb in range(microbatches):
            k = index(chunk, mb, layer)
            signature, tensors = _Signature.of(args_list[k], kwargs_list[k])
            requires = [t.requires_grad for t in tensors]
            cls = _GraphRunner if graphs else _EagerRunner
            runner = cls(original, params, signature, requires, fp8_enabled, fp8_recipe, flag, allow_unused_input,
                         generators)
            runner.sample = tensors  # capture-time only
            runners.append(runner)
        entries.append(dict(func=func, module=module, original=original, params=params, flag=flag,
                            runners=runners))

    metas = [m for e in entries for m in _fp8_states(e["module"])]
    saved = _save_fp8_state(metas)
    cached_weights: Dict[int, List[torch.Tensor]] = {}
    try:
        cached_weights = _warm_up(entries, num_warmup_iters, graphs)
        if graphs:
            _capture(entries, order, layers, microbatches, pool if pool is not None else torch.cuda.graph_pool_handle())
    finally:
        _restore_fp8_state(metas, saved)
    for e in entries:
        e.pop("warm_outputs", None)
        e.pop("warm_grads", None)
        for r in e["runners"]:
            del r.sample

    results = []
    for i, e in enumerate(entries):
        training = e["module"].training if e["module"] is not None else True
        name = f"graphed callable {i} ({type(e['func']).__name__})"
        graphed = GraphedCallable(name, e["original"], e["module"], e["runners"], e["params"],
                                  training, fp8_enabled, fp8_recipe, fp8_group, e["flag"], cached_weights.get(i, []))
        if e["module"] is not None:
            e["module"].forward = graphed
            results.append(e["module"])
        else:
            results.append(graphed)
    return results[0] if single else tuple(results)


def _expand_samples(samples: list, what: str, num_funcs: int, microbatches: int, layers: int) -> list:
    """Per (chunk, microbatch, layer) samples; one per callable is reused for every microbatch (cloned)."""
    if len(samples) == num_funcs * microbatches:
        return samples
    if len(samples) == num_funcs:
        chunks = num_funcs // layers
        out = []
        for chunk in range(chunks):
            for mb in range(microbatches):
                for layer in range(layers):
                    s = samples[chunk * layers + layer]
                    out.append(s if mb == 0 else pytree.tree_map(
                        lambda x: x.detach().clone().requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) else x, s))
        return out
    raise ValueError(f"make_graphed_callables: {what} has {len(samples)} entries; expected one per callable "
                     f"({num_funcs}) or one per (chunk, microbatch, layer) ({num_funcs * microbatches})")


def _warm_up(entries: list, iters: int, graphs: bool) -> Dict[int, List[torch.Tensor]]:
    """Eager forward/backward passes (microbatch 0's samples) under recording scopes; returns the weights each
    callable casts under its weight-caching flag, and stores in each entry the outputs and gradients of its
    last pass (their shapes size the static buffers)."""
    cached: Dict[int, List[torch.Tensor]] = {}
    stream = torch.cuda.Stream() if graphs else None
    if graphs:
        torch.cuda.synchronize()
        stream.wait_stream(torch.cuda.current_stream())
    ctx = torch.cuda.stream(stream) if graphs else contextlib.nullcontext()
    with ctx:
        for i, e in enumerate(entries):
            runner = e["runners"][0]
            for _ in range(max(iters, 1)):
                inputs = [x.detach().requires_grad_(rg) for x, rg in zip(runner.sample, runner.requires_grad)]
                recorder = Recorder(runner.device(), runner.flag)
                with torch.enable_grad():
                    outputs = runner._record(inputs, recorder)
                flat = _flatten_outputs(outputs)[0]
                grads = runner._grads(flat, inputs, [torch.ones_like(o) if o.requires_grad else None for o in flat])
                cached[i] = _unique(recorder.cached_weights)
            e["warm_outputs"] = [o.detach().requires_grad_(o.requires_grad) for o in flat]
            e["warm_grads"] = [g.detach() if g is not None else None for g in grads]
    if graphs:
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
    return cached


def _capture(entries: list, order: List[int], layers: int, microbatches: int, pool) -> None:
    """Forward and backward graphs in `order`, all into `pool`, with shared static buffers."""
    slot_of, _ = _lifetime_slots(order, microbatches)
    slot_buffers: Dict[Tuple[int, int], _SlotBuffers] = {}
    grad_buffers: Dict[int, _GradBuffers] = {}
    for i, e in enumerate(entries):
        outs = e.pop("warm_outputs")
        grads = e.pop("warm_grads")
        grad_buffers[i] = _GradBuffers(
            [torch.empty_like(o) if o.requires_grad else None for o in outs],
            [torch.empty_like(g) if g is not None else None for g in grads])
        chunk = i // layers
        for (c, mb), slot in slot_of.items():
            if c == chunk and (i, slot) not in slot_buffers:
                runner = e["runners"][mb]
                slot_buffers[(i, slot)] = _SlotBuffers(
                    [x.detach().clone().requires_grad_(rg) for x, rg in zip(runner.sample, runner.requires_grad)],
                    [torch.empty_like(o) for o in outs])
    torch.cuda.synchronize()
    fwd_next: Dict[int, int] = {}
    bwd_next: Dict[int, int] = {}
    for step in order:
        chunk = abs(step) - 1
        ids = range(chunk * layers, (chunk + 1) * layers)
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
                entries[i]["runners"][mb].capture_backward(grad_buffers[i], pool)
    torch.cuda.synchronize()


def _graph_safe_rng_generators() -> List[torch.Generator]:
    """RNG states that graphs must register besides torch's default generator: megatron's RNG tracker keeps
    its states as graph-safe generators when built with `use_cudagraphable_rng` (without it, code that forks
    the tracker cannot be captured)."""
    random = sys.modules.get("megatron.core.tensor_parallel.random")
    if random is None:
        return []
    tracker = random.get_cuda_rng_tracker()
    if not getattr(tracker, "use_cudagraphable_rng", False):
        return []
    return [s for s in tracker.get_states().values() if isinstance(s, torch.Generator)]


def _unique(tensors: List[torch.Tensor]) -> List[torch.Tensor]:
    seen, out = set(), []
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out
