"""TransformerEngine's deferred initialization for the TransformerEngine-style modules.

Built with `device="meta"`, a module allocates nothing: its parameters and FP8 state are meta tensors.
`reset_parameters()` then puts them on the default device (the current CUDA device when there is one, else the
CPU) and initializes them as the constructor does, so FSDP's and TransformerEngine's flow (build on meta,
`reset_parameters()` per module) works. On a module whose parameters are already on a device it initializes
them again in place (the same distributions), as TransformerEngine's does; FP8 state on a device is left as it is.

Each constructor records how it initializes each parameter it owns (`record_init`: module-level functions and
`functools.partial`s of them, so a module still pickles and a deep copy does not reach the original); a module
made of others
(`MultiheadAttention`, `TransformerLayer`) owns none and needs no method of its own: call `reset_parameters()` on
every module that has it, e.g. `for m in model.modules(): getattr(m, "reset_parameters", lambda: None)()`.
"""
from __future__ import annotations

import functools
from typing import Callable, Dict, Iterator, Optional

import torch

Init = Callable[[torch.Tensor], object]


def record_init(module: torch.nn.Module, name: str, init: Init) -> None:
    """Record that `module`'s parameter `name` is initialized by `init(param)` (in place, under no_grad)."""
    module.__dict__.setdefault("_parameter_inits", {})[name] = init


def recorded_inits(module: torch.nn.Module) -> Dict[str, Init]:
    """The initializers `record_init` recorded for `module` (name -> init)."""
    return module.__dict__.get("_parameter_inits", {})


def zero_init(param: torch.Tensor) -> None:
    """A bias's initialization: zeros."""
    param.zero_()


def no_init(param: torch.Tensor) -> None:
    """An initializer that leaves the parameter alone (another one fills it)."""


def _fill(param: torch.Tensor, value: float) -> None:
    param.fill_(value)


def record_norm_inits(module: torch.nn.Module, weight: str, bias: str, zero_centered_gamma: bool) -> None:
    """Record a norm's gain `weight` (1, or 0 when zero-centered) and `bias` (0; a None bias is skipped)
    initializers."""
    record_init(module, weight, functools.partial(_fill, value=0.0 if zero_centered_gamma else 1.0))
    record_init(module, bias, zero_init)


def check_materialized(owner: str, tensor: torch.Tensor) -> None:
    """A clear error for a forward before `reset_parameters()` of a module built on "meta" (`tensor`: one of
    its parameters or FP8 state buffers)."""
    if tensor.is_meta:
        raise RuntimeError(f"{owner}: its parameters are on device 'meta' (built for deferred initialization); "
                           f"call reset_parameters() to put them on a device and initialize them before running it")


def default_device() -> torch.device:
    """Where `reset_parameters()` puts meta tensors: the current CUDA device when available, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _materialized(param: torch.nn.Parameter, device: torch.device) -> torch.nn.Parameter:
    """An uninitialized parameter like `param` on `device`, with its attributes (megatron's tensor-parallel
    marks, `sequence_parallel`, `skip_backward_post_hook`, ...)."""
    new = torch.nn.Parameter(torch.empty_like(param, device=device), requires_grad=param.requires_grad)
    new.__dict__.update(param.__dict__)
    return new


def _owned_fp8_states(module: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """The FP8 states in `module`'s subtree that no other `ResetParameters` module below it owns."""
    from ._core import FP8State

    for child in module.children():
        if isinstance(child, FP8State):
            yield child
        elif not isinstance(child, ResetParameters):
            yield from _owned_fp8_states(child)


class ResetParameters:
    """Mixin: TransformerEngine's `reset_parameters(defer_init=False)` from the initializers the constructor
    recorded with `record_init`."""

    def reset_parameters(self, defer_init: Optional[bool] = False) -> None:
        """Initialize this module's parameters (TransformerEngine's method): meta ones are first put on the
        default device, with fresh FP8 state; `defer_init=True` does nothing."""
        if defer_init:
            return
        device = default_device()
        inits = recorded_inits(self)
        for name in inits:
            param = self._parameters.get(name)
            if param is not None and param.is_meta:
                self._parameters[name] = _materialized(param, device)
        with torch.no_grad():
            for name, init in inits.items():
                param = self._parameters.get(name)
                if param is not None:
                    init(param)
        for state in _owned_fp8_states(self):
            if state.fwd.scale.is_meta:
                state.reset(device)
