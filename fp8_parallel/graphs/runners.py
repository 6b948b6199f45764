"""One callable for one microbatch: captured forward/backward CUDA graphs or eager execution, with the same
recording; their shared static buffers; the autograd function that replays them."""
from __future__ import annotations

import contextlib
import dataclasses
import warnings
import weakref
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch
from torch.autograd.graph import increment_version

from ..modules._main_grad import placeholder_grad
from ..recipe import Recipe
from ..scopes import Recorder, recording_scope
from .arguments import _flatten_outputs, _Signature
from .recording import _register_backward


@dataclasses.dataclass(frozen=True)
class RunOptions:
    """How one callable is recorded, replayed and differentiated (shared by its microbatches' runners)."""

    fp8_enabled: bool
    recipe: Optional[Recipe]
    flag: Optional[torch.Tensor]  # weight-caching device flag (None: no caching)
    allow_unused_input: bool = False
    retain_graph: bool = False  # keep the autograd graph after the backward (TE's retain_graph_in_backward)
    generators: Tuple[torch.Generator, ...] = ()  # RNG states the graphs register besides torch's default one
    accumulate_into_main_grad: bool = False  # megatron DDP's parameters: gradients added into main_grad in-graph
    clone_param_grads: bool = True  # a replay returns copies of its parameter gradients (TE's default)
    check_held_outputs: bool = False  # debug: refuse a replay into outputs the caller still holds


LEGACY_STREAM_HINT = (
    "capturing the backward graph failed: a parameter's gradient accumulator belongs to the default (legacy) "
    "CUDA stream, which cannot wait on a capturing stream. Its accumulator node was created on the default stream, "
    "typically by a data-parallel wrapper that registers gradient hooks at construction (megatron's or torch's "
    "DistributedDataParallel). Construct the wrapper on a side stream: `with torch.cuda.stream(torch.cuda.Stream()): "
    "model = DistributedDataParallel(...)`."
)

def follows_main_grad_protocol(param: torch.Tensor) -> bool:
    """Whether `param` takes part in megatron's DistributedDataParallel gradient protocol: a `main_grad` buffer
    of its shape and the `grad_added_to_main_grad` flag (megatron's DDP sets both; TransformerEngine's fused
    weight-gradient accumulation writes through them)."""
    main_grad = getattr(param, "main_grad", None)
    return (isinstance(main_grad, torch.Tensor) and main_grad.shape == param.shape
            and hasattr(param, "grad_added_to_main_grad"))


def protocol_positions(runner: "_Runner") -> Dict[int, torch.nn.Parameter]:
    """The runner's trainable parameters under megatron's DDP protocol, by position in the gradient list
    (inputs first, then parameters)."""
    first = len(runner.requires_grad)
    return {first + j: p for j, p in enumerate(runner.params) if p.requires_grad and follows_main_grad_protocol(p)}


def main_grad_positions(runner: "_Runner") -> Dict[int, torch.nn.Parameter]:
    """The runner's parameters whose gradients its backward graph adds into `main_grad` (for a module that does
    not add them itself), by position in the gradient list: with `accumulate_into_main_grad`, all of
    `protocol_positions`; none otherwise."""
    return protocol_positions(runner) if runner.options.accumulate_into_main_grad else {}


def buffer_address(t: Optional[torch.Tensor]) -> Optional[tuple]:
    """Where a graph reads or writes `t`: (address, dtype, shape, strides), or None for no tensor. Taken as
    numbers, so a buffer freed and allocated again under the same tensor object (megatron's
    `offload_grad_buffers` / `restore_grad_buffers`) is told apart."""
    if not isinstance(t, torch.Tensor):
        return None
    return t.data_ptr(), t.dtype, tuple(t.shape), t.stride()


_FLAG_BEFORE = "_fp8p_flag_before_backward"  # a parameter's `grad_added_to_main_grad` before the running backward


def _restore_flags(params: List[torch.Tensor]) -> Callable[[], None]:
    def restore() -> None:
        for param in params:
            param.grad_added_to_main_grad = param.__dict__.pop(_FLAG_BEFORE)
    return restore


def _end_generator_captures(generators: Tuple[torch.Generator, ...]) -> None:
    """Take the RNG states a failed capture registered out of capture mode.

    torch ends a generator's capture mode only when a capture ends cleanly; after a failed one every later
    random op on the device (weight init, dropout) raises "Offset increment outside graph capture". An empty
    capture over the same generators ends the mode; their eager seed and offset are left as they were."""
    graph = torch.cuda.CUDAGraph()
    for gen in generators:
        graph.register_generator_state(gen)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "the CUDA graph is empty"
        with torch.cuda.graph(graph):
            pass
    graph.reset()


@contextlib.contextmanager
def _capturing(graph: "torch.cuda.CUDAGraph", pool, generators: Tuple[torch.Generator, ...]) -> Iterator[None]:
    """`torch.cuda.graph` over `graph` with `generators` registered; a failed capture leaves no RNG state in
    capture mode."""
    for gen in generators:
        graph.register_generator_state(gen)
    try:
        with torch.enable_grad(), torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            yield
    except BaseException:
        _end_generator_captures(generators)
        raise


@contextlib.contextmanager
def _tensor_hooks_held_back(params: Tuple[torch.nn.Parameter, ...]) -> Iterator[None]:
    """Gradient hooks on `params` (`param.register_hook`) do not run inside: `torch.autograd.grad` runs a leaf's
    hooks, and the gradient it computes here reaches the parameter again when autograd accumulates what the
    callable returns. So a parameter's hooks run once per call, on the returned gradient, as with replays."""
    held = []
    for p in params:
        hooks = getattr(p, "_backward_hooks", None)
        if hooks:
            held.append((hooks, dict(hooks)))
            hooks.clear()
    try:
        yield
    finally:
        for hooks, saved in held:
            hooks.update(saved)


class _Runner:
    """Forward and backward of one callable for one microbatch (the common part of graph and eager)."""

    def __init__(self, func: Callable, params: Tuple[torch.nn.Parameter, ...], signature: _Signature,
                 requires_grad: List[bool], options: RunOptions):
        self.func, self.params, self.signature = func, params, signature
        self.requires_grad = requires_grad
        self.options = options
        self.fp8_enabled, self.recipe, self.flag = options.fp8_enabled, options.recipe, options.flag
        self.released = False

    def _record(self, inputs: List[torch.Tensor], recorder: Recorder):
        args, kwargs = self.signature.rebuild(inputs)
        with recording_scope(recorder, self.fp8_enabled, self.recipe):
            return self.func(*args, **kwargs)

    def _grads(self, outputs: List[torch.Tensor], inputs: List[torch.Tensor], grad_outputs: List[Optional[torch.Tensor]]):
        outs = [(o, g) for o, g in zip(outputs, grad_outputs) if o.requires_grad and g is not None]
        wrt = [i for i, rg in zip(inputs, self.requires_grad) if rg] + list(self.params)
        with _tensor_hooks_held_back(self.params):
            grads = torch.autograd.grad([o for o, _ in outs], wrt, [g for _, g in outs], only_inputs=True,
                                        retain_graph=self.options.retain_graph or None,
                                        allow_unused=self.options.allow_unused_input) if outs and wrt else [None] * len(wrt)
        it = iter(grads)
        by_input = [next(it) if rg else None for rg in self.requires_grad]
        return by_input + [next(it) for _ in self.params]

    def release(self) -> None:
        """Give up what replays need (graphs, static buffers); later calls run eagerly."""
        self.released = True

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

    The graphs copy their results into static buffers (`buffer_plan` says which microbatches share them);
    temporaries stay in the shared pool, where later captures reuse them. By default every microbatch has
    its own inputs, outputs and input gradients, so what a caller holds from one microbatch is not
    overwritten by another's replay (the same microbatch's next replay, one step later, writes it again), and
    the parameter gradients a backward returns are copies (`RunOptions.clone_param_grads`). Each replay bumps
    the version counter of the buffers it writes, so an autograd graph that saved an earlier value of one
    raises in its backward instead of silently using the new value.

    Parameters under megatron's DistributedDataParallel protocol (`follows_main_grad_protocol`) have no
    gradient buffer: the backward graph adds their gradient into the `main_grad` it captured, the addition
    megatron's gradient hook would make, and each replay hands autograd an unused tensor with
    `grad_added_to_main_grad` set (TransformerEngine's fused accumulation protocol), so the hook still runs
    its bookkeeping but adds nothing; the flag is put back when that backward ends. That saves two copies of
    every weight gradient per microbatch (`RunOptions.accumulate_into_main_grad`). A module that adds into
    `main_grad` itself (`fuse_wgrad_accumulation`) does so inside the graph; its parameter is flagged the same
    way on every replay, with or without that option, which its own backward, run only at capture, cannot do.
    """

    def capture_forward(self, static: "_SlotBuffers", pool) -> None:
        self.static_inputs, self.static_outputs = static.inputs, static.outputs
        self.recorder = Recorder(self.device(), self.flag)
        self.fwd_graph = torch.cuda.CUDAGraph()
        with _capturing(self.fwd_graph, pool, self.options.generators):
            outputs = self._record(self.static_inputs, self.recorder)
            flat, spec, leaves, positions = _flatten_outputs(outputs)
            with torch.no_grad():
                for buf, o in zip(self.static_outputs, flat):
                    buf.copy_(o.detach())
        self._outputs_with_graph = flat
        self.out_structure = (spec, leaves, positions)
        self.held = static.held

    def capture_backward(self, shared: "_GradBuffers", pool) -> None:
        outs = self._outputs_with_graph
        self.static_grad_outputs, self.static_grads = shared.grad_outputs, shared.grads
        protocol = protocol_positions(self)
        in_graph = main_grad_positions(self)  # the graph adds their gradients into main_grad
        flags = {k: p.grad_added_to_main_grad for k, p in protocol.items()}
        self.bwd_graph = torch.cuda.CUDAGraph()
        cause: List[BaseException] = []  # the capture's own error; ending the failed capture raises another
        try:
            with _capturing(self.bwd_graph, pool, self.options.generators):
                for p in protocol.values():
                    p.grad_added_to_main_grad = False
                try:
                    grads = self._grads(outs, self.static_inputs, self.static_grad_outputs)
                except RuntimeError as err:
                    cause.append(err)
                    raise
                # a module that adds into main_grad itself (TE's fuse_wgrad_accumulation) set the flag while
                # its backward was captured: its addition is in the graph and its returned gradient is unused.
                # Replays must set the flag for it, with or without `accumulate_into_main_grad`: its Python
                # backward, which sets it eagerly, runs only at capture
                added_by_module = {k for k, p in protocol.items() if p.grad_added_to_main_grad}
                # position in the gradient list -> (parameter, the main_grad the graph adds into); a parameter
                # without a gradient (allowed unused) is returned as None, as eagerly
                self.main_grads = {k: (p, p.main_grad) for k, p in protocol.items()
                                   if k in added_by_module or (k in in_graph and grads[k] is not None)}
                lost = [k for k, (buf, g) in enumerate(zip(self.static_grads, grads))
                        if g is not None and buf is None and k not in self.main_grads]
                if lost:  # the warm-up saw no gradient (or a module's own main_grad addition) there
                    raise RuntimeError(
                        f"graphed backward: gradient positions {lost} (inputs first, then parameters) have a "
                        f"gradient at capture but had none in the warm-up; the callable must differentiate "
                        f"the same way on every call")
                with torch.no_grad():
                    for k, (buf, g) in enumerate(zip(self.static_grads, grads)):
                        if g is None or k in added_by_module:
                            continue
                        if k in self.main_grads:
                            self.main_grads[k][1].add_(g)
                        elif buf is not None:
                            buf.copy_(g)
                del grads
        except RuntimeError as err:
            first = cause[0] if cause else err
            if "legacy stream" in str(first):
                raise RuntimeError(LEGACY_STREAM_HINT) from first
            raise
        finally:
            for k, value in flags.items():
                protocol[k].grad_added_to_main_grad = value
        self.main_grad_addresses = {k: buffer_address(mg) for k, (_, mg) in self.main_grads.items()}
        del self._outputs_with_graph  # releases the captured autograd graph (its memory returns to the pool)

    def release(self) -> None:
        super().release()
        for graph in (getattr(self, "fwd_graph", None), getattr(self, "bwd_graph", None)):
            if graph is not None:
                graph.reset()
        for name in ("fwd_graph", "bwd_graph", "static_inputs", "static_outputs", "static_grad_outputs",
                     "static_grads", "recorder", "main_grads", "main_grad_addresses"):
            self.__dict__.pop(name, None)

    def forward(self, inputs: List[torch.Tensor]):
        if self.options.check_held_outputs:
            self.held.check(self.static_outputs)
        for dst, src in zip(self.static_inputs, inputs):
            if dst.data_ptr() != src.data_ptr():
                dst.copy_(src)
        self.fwd_graph.replay()
        _bump_versions(self.static_outputs)
        return self.static_outputs, self.out_structure, self.recorder, None

    def backward(self, state, grad_outputs):  # noqa: ARG002
        for dst, src in zip(self.static_grad_outputs, grad_outputs):
            if dst is not None:
                dst.copy_(src) if src is not None else dst.zero_()
        if not self.main_grads:
            self.bwd_graph.replay()
            return self._returned_grads(list(self.static_grads))
        for k, (param, _) in self.main_grads.items():
            if buffer_address(getattr(param, "main_grad", None)) != self.main_grad_addresses[k]:
                raise RuntimeError(
                    f"graphed backward: parameter {k - len(self.requires_grad)} (shape {tuple(param.shape)}): its "
                    f"`main_grad` is not the memory it was at capture, which the backward graph adds into. Keep "
                    f"megatron's gradient buffers in place (its `zero_grad_buffer()` does; offloaded buffers "
                    f"come back elsewhere), or capture again")
        self.bwd_graph.replay()
        grads = self._returned_grads(list(self.static_grads))
        first_in_backward = []
        for k, (param, _) in self.main_grads.items():
            if _FLAG_BEFORE not in param.__dict__:  # another replay of this backward may have set it already
                param.__dict__[_FLAG_BEFORE] = param.grad_added_to_main_grad
                first_in_backward.append(param)
            grads[k] = placeholder_grad(param)  # fresh each replay, so autograd takes it without a copy
        # the flag tells megatron's hook, which runs in this backward, that the gradient is in main_grad; put
        # back as it was before this backward when it ends, so a later eager gradient is added again
        if first_in_backward:
            torch.autograd.Variable._execution_engine.queue_callback(_restore_flags(first_in_backward))
        return grads

    def _returned_grads(self, grads: List[Optional[torch.Tensor]]) -> List[Optional[torch.Tensor]]:
        """What the backward hands autograd: the static gradient buffers (autograd copies them into `.grad`
        rather than stealing them, since they are held here), with the parameters' cloned unless
        `clone_param_grads` is off, so a hook that keeps a parameter's gradient keeps its own tensor. Buffers
        get a version bump: an autograd graph that saved an earlier value raises instead of reading this one."""
        _bump_versions(grads)
        if self.options.clone_param_grads:
            for k in range(len(self.requires_grad), len(grads)):
                if grads[k] is not None:
                    grads[k] = grads[k].clone()
        return grads


def _bump_versions(tensors: List[Optional[torch.Tensor]]) -> None:
    """Mark buffers a graph replay has written (a replay writes memory without autograd seeing it)."""
    for t in tensors:
        if t is not None:
            increment_version(t)


class HeldOutputs:
    """The outputs a replay handed to its caller, as weak references: `check` refuses a replay into buffers
    whose earlier outputs the caller still holds (`make_graphed_callables(check_held_outputs=True)`)."""

    def __init__(self, name: str = "graphed callable"):
        self.name = name
        self._refs: List[weakref.ref] = []

    def remember(self, outputs) -> None:
        self._refs = [weakref.ref(o) for o in outputs if isinstance(o, torch.Tensor)]

    def check(self, buffers: List[torch.Tensor]) -> None:
        """Raise if a tensor handed out earlier is alive and still reads one of `buffers`' memory."""
        addresses = {b.untyped_storage().data_ptr() for b in buffers if b.numel()}
        for k, ref in enumerate(self._refs):
            held = ref()
            if held is not None and held.numel() and held.untyped_storage().data_ptr() in addresses:
                raise RuntimeError(
                    f"{self.name}: this replay would overwrite output {k} (shape {tuple(held.shape)}) of an "
                    f"earlier replay that is still referenced. Drop it first (`del`), copy it (`.clone()`) if "
                    f"you keep it, or capture without `_reuse_graph_input_output_buffers` so that microbatches "
                    f"do not share outputs")


@dataclasses.dataclass
class _SlotBuffers:
    inputs: List[torch.Tensor]
    outputs: List[torch.Tensor]
    held: HeldOutputs = dataclasses.field(default_factory=HeldOutputs)


@dataclasses.dataclass
class _GradBuffers:
    grad_outputs: List[Optional[torch.Tensor]]
    grads: List[Optional[torch.Tensor]]


def buffer_plan(order: List[int], microbatches: int, reuse: bool) -> Dict[Tuple[int, int], int]:
    """The static-buffer slot of each (chunk, microbatch): its own (slot = microbatch) by default, or with
    `reuse` (TransformerEngine's `_reuse_graph_input_output_buffers`) the lifetime slots of `_lifetime_slots`,
    shared by microbatches that are never in flight together."""
    if reuse:
        return _lifetime_slots(order, microbatches)[0]
    return {(abs(step) - 1, mb): mb for step in order if step > 0 for mb in range(microbatches)}


def _lifetime_slots(order: List[int], microbatches: int) -> Tuple[Dict[Tuple[int, int], int], Dict[int, int]]:  # noqa: ARG001
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
