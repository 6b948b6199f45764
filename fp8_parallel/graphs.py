"""Graphed FP8 callables: one forward and one backward CUDA graph per (callable, microbatch), FP8 state kept right.

`make_graphed_callables` captures each callable's forward and backward (torch's and TransformerEngine's
conventions; see its docstring). What FP8 needs on top of plain CUDA graphs:

* Amaxes. While recorded (warm-up, capture) a callable runs under a recording scope: its FP8 modules write
  their amaxes into the recording's own tables, and nothing is reduced. On replay the recorded amaxes are
  maxed into the caller's autocast scope (one kernel per scope key), so the scope's reduce-and-update runs
  when that scope ends, exactly as in eager mode; scopes opened inside the callable (an FP8 layer's own
  scope, an expert scope) are re-opened around the registration so they share or own keys as they would
  eagerly. The backward replay does the same for the grad amaxes and counts as the backward of those calls.
* Scales are read by the graphs from the modules' scale buffers, which updates write in place: an update
  between replays takes effect.
* Weight caching: captured weight casts write a persistent cache unless a device flag says "skip"; each
  replay sets the flag from `is_first_microbatch` (a weight changed in place since its last cast is cast
  again whatever the flag would say, so a cached FP8 weight is never used stale).
* Warm-up and capture leave amax histories and scales as they were (saved before, restored after).

Without CUDA the same objects run the callables eagerly per call (same recording and registration path,
one warning), so CPU tests exercise the code that graphs use.
"""
from __future__ import annotations

import dataclasses
import sys
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

from .recipe import DelayedScaling, Recipe
from .scopes import KeyState, Recorder, RecordingKey, autocast, current_scope, recording_scope


def _uses_cuda_graphs() -> bool:
    return torch.cuda.is_available()


# -- inputs and outputs ------------------------------------------------------------------------------------

def _drop_none(kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """Keyword arguments equal to None count as absent (megatron passes many optional ones as None)."""
    return {k: v for k, v in kwargs.items() if v is not None}


@dataclasses.dataclass
class _Signature:
    """The structure of a call: pytree spec of (args, kwargs), tensor leaf positions, the other leaves."""

    spec: Any
    tensor_positions: List[int]
    other_leaves: List[Any]
    shapes: List[Tuple[torch.Size, torch.dtype]]

    @staticmethod
    def of(args: tuple, kwargs: Dict[str, Any]) -> Tuple["_Signature", List[torch.Tensor]]:
        leaves, spec = pytree.tree_flatten((tuple(args), _drop_none(kwargs)))
        positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        tensors = [leaves[i] for i in positions]
        others = [leaf for leaf in leaves if not isinstance(leaf, torch.Tensor)]
        return _Signature(spec, positions, others, [(t.shape, t.dtype) for t in tensors]), tensors

    def tensors_of(self, args: tuple, kwargs: Dict[str, Any], name: str) -> List[torch.Tensor]:
        """The tensor leaves of a call with this structure (a clear error for another structure)."""
        sig, tensors = _Signature.of(args, kwargs)
        if sig.spec != self.spec or sig.other_leaves != self.other_leaves:
            raise ValueError(f"{name}: called with arguments of another structure than the sample arguments "
                             f"(captured {self.spec} with {self.other_leaves}, got {sig.spec} with {sig.other_leaves})")
        if sig.shapes != self.shapes:
            raise ValueError(f"{name}: tensor arguments (shape, dtype) {sig.shapes} differ from the sample "
                             f"arguments' {self.shapes}")
        return tensors

    def rebuild(self, tensors: Sequence[torch.Tensor]) -> Tuple[tuple, Dict[str, Any]]:
        leaves: List[Any] = []
        t, o = iter(tensors), iter(self.other_leaves)
        positions = set(self.tensor_positions)
        for i in range(len(self.tensor_positions) + len(self.other_leaves)):
            leaves.append(next(t) if i in positions else next(o))
        args, kwargs = pytree.tree_unflatten(leaves, self.spec)
        return args, kwargs


def _flatten_outputs(outputs: Any) -> Tuple[List[torch.Tensor], Any, List[Any], List[int]]:
    leaves, spec = pytree.tree_flatten(outputs)
    positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    return [leaves[i] for i in positions], spec, leaves, positions


def _unflatten_outputs(tensors: Sequence[torch.Tensor], spec: Any, leaves: List[Any], positions: List[int]) -> Any:
    leaves = list(leaves)
    for i, t in zip(positions, tensors):
        leaves[i] = t
    return pytree.tree_unflatten(leaves, spec)


# -- FP8 state around recording ----------------------------------------------------------------------------

def _fp8_states(module: Any) -> List[torch.nn.Module]:
    from .meta import FP8Meta

    return [m for m in module.modules() if isinstance(m, FP8Meta)] if isinstance(module, torch.nn.Module) else []


def _save_fp8_state(metas: List[torch.nn.Module]) -> List[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    return [(m.amax_history.clone(), m.scale.clone(), m.nonfinite_count.clone()) for m in metas]


def _restore_fp8_state(metas: List[torch.nn.Module], saved) -> None:
    """In place, so the addresses that graphs read stay the same."""
    for m, (history, scale, count) in zip(metas, saved):
        if m.amax_history.shape != history.shape:  # warm-up resized it for the recipe: keep the newest entries
            keep = min(history.shape[1], m.amax_history.shape[1])
            m.amax_history.zero_()
            m.amax_history[:, :keep].copy_(history[:, :keep])
        else:
            m.amax_history.copy_(history)
        m.scale.copy_(scale)
        m.nonfinite_count.copy_(count)


# -- registration of recorded amaxes with the caller's scopes ----------------------------------------------

def _register_forward(recorder: Recorder) -> List[Tuple[KeyState, RecordingKey]]:
    """Max the recorded forward amaxes into the caller's key states; each key that expects a backward gets one
    pending backward. Scopes opened inside the recorded callable are re-opened here (sharing the caller's key
    when eager execution would, owning and reducing their own otherwise)."""
    pairs = []
    for rkey in recorder.keys:
        if rkey.caller:
            target = current_scope().state
            _fold_forward(target, rkey)
        else:
            with autocast(recipe=rkey.recipe, group=rkey.group) as inner:
                target = inner._scope.state
                _fold_forward(target, rkey)
        pairs.append((target, rkey))
    return pairs


def _fold_forward(target: KeyState, rkey: RecordingKey) -> None:
    target.forward.fold(rkey.forward.metas, rkey.forward.amaxes())
    if rkey.expected_backward:
        target.expect_backward()


def _register_backward(pairs: List[Tuple[KeyState, RecordingKey]]) -> None:
    for target, rkey in pairs:
        target.backward.fold(rkey.backward.metas, rkey.backward.amaxes())
        if rkey.expected_backward:
            target.backward_ran()


# -- one microbatch of one callable: captured graphs, or eager execution -----------------------------------

class _Runner:
    """Forward and backward of one callable for one microbatch (the common part of graph and eager)."""

    def __init__(self, func: Callable, params: Tuple[torch.nn.Parameter, ...], signature: _Signature,
                 requires_grad: List[bool], fp8_enabled: bool, recipe: Optional[Recipe],
                 flag: Optional[torch.Tensor], allow_unused_input: bool):
        self.func, self.params, self.signature = func, params, signature
        self.requires_grad = requires_grad
        self.fp8_enabled, self.recipe, self.flag = fp8_enabled, recipe, flag
        self.allow_unused_input = allow_unused_input

    def _record(self, inputs: List[torch.Tensor], recorder: Recorder):
        args, kwargs = self.signature.rebuild(inputs)
        with recording_scope(recorder, self.fp8_enabled, self.recipe):
            return self.func(*args, **kwargs)

    def _grads(self, outputs: List[torch.Tensor], inputs: List[torch.Tensor], grad_outputs: List[Optional[torch.Tensor]]):
        outs = [(o, g) for o, g in zip(outputs, grad_outputs) if o.requires_grad and g is not None]
        wrt = [i for i, rg in zip(inputs, self.requires_grad) if rg] + list(self.params)
        grads = torch.autograd.grad([o for o, _ in outs], wrt, [g for _, g in outs], only_inputs=True,
                                    allow_unused=self.allow_unused_input) if outs and wrt else [None] * len(wrt)
        it = iter(grads)
        by_input = [next(it) if rg else None for rg in self.requires_grad]
        return by_input + [next(it) for _ in self.params]

    def device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


class _EagerRunner(_Runner):
    """Runs the callable eagerly on every call (no CUDA), with the same recording and registration."""

    def forward(self, inputs: List[torch.Tensor]):
        detached = [x.detach().requires_grad_(rg) for x, rg in zip(inputs, self.requires_grad)]
        recorder = Recorder(self.device(), self.flag)
        with torch.enable_grad():
            outputs = self._record(detached, recorder)
        flat, spec, leaves, positions = _flatten_outputs(outputs)
        state = (flat, detached)
        return flat, (spec, leaves, positions), recorder, state

    def backward(self, state, grad_outputs):
        flat, detached = state
        with torch.enable_grad():
            return self._grads(flat, detached, grad_outputs)


class _GraphRunner(_Runner):
    """Captured forward and backward CUDA graphs of one microbatch.

    Static buffers are shared so that graphs per microbatch do not multiply memory: inputs and outputs per
    lifetime slot (microbatches of a callable that are never in flight together share one), gradient
    buffers per callable (a backward's gradients are consumed before the callable's next backward). The
    graphs copy their results into them; temporaries stay in the shared pool, where later captures reuse
    them.
    """

    def capture_forward(self, static: "_SlotBuffers", pool) -> None:
        self.static_inputs, self.static_outputs = static.inputs, static.outputs
        self.recorder = Recorder(self.device(), self.flag)
        self.fwd_graph = torch.cuda.CUDAGraph()
        for gen in self.generators:
            self.fwd_graph.register_generator_state(gen)
        with torch.enable_grad(), torch.cuda.graph(self.fwd_graph, pool=pool, capture_error_mode="thread_local"):
            outputs = self._record(self.static_inputs, self.recorder)
            flat, spec, leaves, positions = _flatten_outputs(outputs)
            with torch.no_grad():
                for buf, o in zip(self.static_outputs, flat):
                    buf.copy_(o.detach())
        self._outputs_with_graph = flat
        self.out_structure = (spec, leaves, positions)

    def capture_backward(self, shared: "_GradBuffers", pool) -> None:
        outs = self._outputs_with_graph
        self.static_grad_outputs, self.static_grads = shared.grad_outputs, shared.grads
        self.bwd_graph = torch.cuda.CUDAGraph()
        for gen in self.generators:
            self.bwd_graph.register_generator_state(gen)
        with torch.enable_grad(), torch.cuda.graph(self.bwd_graph, pool=pool, capture_error_mode="thread_local"):
            grads = self._grads(outs, self.static_inputs, self.static_grad_outputs)
            with torch.no_grad():
                for buf, g in zip(self.static_grads, grads):
                    if buf is not None and g is not None:
                        buf.copy_(g)
            del grads
        del self._outputs_with_graph  # releases the captured autograd graph (its memory returns to the pool)

    def forward(self, inputs: List[torch.Tensor]):
        for dst, src in zip(self.static_inputs, inputs):
            if dst.data_ptr() != src.data_ptr():
                dst.copy_(src)
        self.fwd_graph.replay()
        return self.static_outputs, self.out_structure, self.recorder, None

    def backward(self, state, grad_outputs):
        for dst, src in zip(self.static_grad_outputs, grad_outputs):
            if dst is not None:
                dst.copy_(src) if src is not None else dst.zero_()
        self.bwd_graph.replay()
        return self.static_grads  # the held tensors themselves: autograd copies them instead of stealing


@dataclasses.dataclass
class _SlotBuffers:
    inputs: List[torch.Tensor]
    outputs: List[torch.Tensor]


@dataclasses.dataclass
class _GradBuffers:
    grad_outputs: List[Optional[torch.Tensor]]
    grads: List[Optional[torch.Tensor]]


def _lifetime_slots(order: List[int], microbatches: int) -> Tuple[Dict[Tuple[int, int], int], Dict[int, int]]:
    """Per (chunk, microbatch) a buffer slot such that microbatches in flight together (forward run, backward
    not yet) have different slots; and the number of slots per chunk."""
    slot_of: Dict[Tuple[int, int], int] = {}
    free: Dict[int, List[int]] = {}
    count: Dict[int, int] = {}
    fwd: Dict[int, int] = {}
    bwd: Dict[int, int] = {}
    for step in order:
        c = abs(step) - 1
        if step > 0:
            mb = fwd.get(c, 0)
            fwd[c] = mb + 1
            slots = free.setdefault(c, [])
            if slots:
                slots.sort()
                slot = slots.pop(0)
            else:
                slot = count.get(c, 0)
                count[c] = slot + 1
            slot_of[(c, mb)] = slot
        else:
            mb = bwd.get(c, 0)
            bwd[c] = mb + 1
            free.setdefault(c, []).append(slot_of[(c, mb)])
    return slot_of, count


class _Flight:
    """What one call hands from forward to backward."""

    __slots__ = ("runner", "state", "pairs", "num_inputs")


class _Replay(torch.autograd.Function):
    @staticmethod
    def forward(ctx, flight: _Flight, *inputs_and_params):
        ctx.flight = flight
        outputs, structure, recorder, state = flight.runner.forward(list(inputs_and_params[: flight.num_inputs]))
        flight.state = (structure, recorder, state)
        return tuple(o.detach() for o in outputs)

    @staticmethod
    def backward(ctx, *grad_outputs):
        flight = ctx.flight
        _, _, state = flight.state
        grads = flight.runner.backward(state, list(grad_outputs))
        _register_backward(flight.pairs)
        flight.state = None
        return (None, *grads)


# -- the graphed callable ----------------------------------------------------------------------------------

class GraphedCallable:
    """A callable whose calls replay its next microbatch's captured forward (and, through autograd, backward).

    It replays when the call matches the capture (training mode, grad enabled, the caller's FP8 scope enabled
    with the captured recipe exactly when `fp8_enabled`); otherwise it runs the original callable eagerly,
    so a graphed module can still run with or without FP8. `is_first_microbatch` (keyword) drives the
    captured weight casts when `fp8_weight_caching`; without it, microbatch 0 of a step casts.

    Attributes:
        num_microbatches: graphs per direction.
        next_microbatch: the microbatch whose graphs the next call replays (cycles; settable).
        replayed: calls that replayed (the others ran eagerly).
    """

    def __init__(self, name: str, original: Callable, module: Optional[torch.nn.Module], runners: List[_Runner],
                 signatures: List[_Signature], params: Tuple[torch.nn.Parameter, ...], training: bool,
                 fp8_enabled: bool, recipe: Optional[Recipe], group: Optional[dist.ProcessGroup],
                 flag: Optional[torch.Tensor], cached_weights: List[torch.Tensor]):
        self.name = name
        self.original = original
        self.module = module
        self.runners = runners
        self.signatures = signatures
        self.params = params
        self.training = training
        self.fp8_enabled, self.recipe, self.group = fp8_enabled, recipe, group
        self.flag = flag
        self._flag_value = 0
        self.cached_weights = cached_weights
        self._cast_versions: Optional[List[int]] = None
        self.num_microbatches = len(runners)
        self.next_microbatch = 0
        self.replayed = 0

    def replays(self) -> bool:
        """Whether a call now replays the graphs (see the class docstring)."""
        if self.module is not None and self.module.training != self.training:
            return False
        if not torch.is_grad_enabled():
            return False
        scope = current_scope()
        fp8_on = scope is not None and scope.enabled
        if fp8_on != self.fp8_enabled:
            return False
        if fp8_on and (scope.recipe != self.recipe or (self.group is not None and scope.group is not self.group)):
            return False
        return True

    def __call__(self, *args, **kwargs):
        if not self.replays():
            return self.original(*args, **kwargs)
        is_first = kwargs.pop("is_first_microbatch", None)
        mb = self.next_microbatch
        runner, signature = self.runners[mb], self.signatures[mb]
        inputs = signature.tensors_of(args, kwargs, self.name)
        if self.flag is not None:
            self._set_weight_flag(mb == 0 if is_first is None else bool(is_first))
        flight = _Flight()
        flight.runner, flight.num_inputs, flight.pairs = runner, len(inputs), []
        outputs = _Replay.apply(flight, *inputs, *self.params)
        _, recorder, _ = flight.state
        flight.pairs = _register_forward(recorder)
        self.next_microbatch = (mb + 1) % self.num_microbatches
        self.replayed += 1
        return _unflatten_outputs(outputs, *flight.state[0])

    def _set_weight_flag(self, first: bool) -> None:
        versions = [w._version for w in self.cached_weights]
        cast = first or versions != self._cast_versions  # a weight written since its last cast: cast again
        value = 0 if cast else 1
        if value != self._flag_value:
            self.flag.fill_(value)
            self._flag_value = value
        if cast:
            self._cast_versions = versions

    def reset(self) -> None:
        """Start the next call at microbatch 0 (e.g. after an interrupted step)."""
        self.next_microbatch = 0


# -- capture -----------------------------------------------------------------------------------------------

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
    args_list = _expand_samples([sample_args] if single else list(sample_args), "sample_args", len(funcs), microbatches, layers, ())
    if sample_kwargs is None:
        kwargs_list = [{}] * (len(funcs) * microbatches)
    else:
        kwargs_list = _expand_samples([sample_kwargs] if single else list(sample_kwargs), "sample_kwargs", len(funcs), microbatches, layers, {})
    if fp8_enabled and fp8_recipe is None:
        fp8_recipe = DelayedScaling()
    graphs = _uses_cuda_graphs()
    if not graphs:
        warnings.warn("fp8_parallel.make_graphed_callables: CUDA is not available; the callables run eagerly "
                      "(same FP8 semantics, no graphs)", stacklevel=2)

    generators = _graph_safe_rng_generators() if graphs else []

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
        runners, signatures = [], []
        for mb in range(microbatches):
            k = index(chunk, mb, layer)
            signature, tensors = _Signature.of(args_list[k], kwargs_list[k])
            requires = [t.requires_grad for t in tensors]
            cls = _GraphRunner if graphs else _EagerRunner
            runner = cls(original, params, signature, requires, fp8_enabled, fp8_recipe, flag, allow_unused_input)
            runner.sample = tensors
            runner.generators = generators
            runners.append(runner)
            signatures.append(signature)
        entries.append(dict(func=func, module=module, original=original, params=params, flag=flag,
                            runners=runners, signatures=signatures))

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
        graphed = GraphedCallable(name, e["original"], e["module"], e["runners"], e["signatures"], e["params"],
                                  training, fp8_enabled, fp8_recipe, fp8_group, e["flag"], cached_weights.get(i, []))
        if e["module"] is not None:
            e["module"].forward = graphed
            results.append(e["module"])
        else:
            results.append(graphed)
    return results[0] if single else tuple(results)


def _expand_samples(samples: list, what: str, num_funcs: int, microbatches: int, layers: int, empty) -> list:
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
    ctx = torch.cuda.stream(stream) if graphs else _nullcontext()
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


class _nullcontext:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False
