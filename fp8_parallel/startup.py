"""Faster process start-up: import megatron-core without importing torch's compiler.

megatron-core decorates its fused functions with `torch.compile` when its modules are imported, and building
those wrappers imports TorchDynamo and Inductor: about 2 s of CPU in every process, every torchrun rank
included, even one that never calls them. `torch.compile` compiles nothing before the first call anyway, so
`deferred_compile()` only moves that import to the first call of a decorated function: calls compile and run
as they would have.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
from typing import Any, Callable, Iterator, Optional

import torch

__all__ = ["deferred_compile", "import_megatron_core"]


def _deferred(real: Callable, fn: Callable, options: dict) -> Callable:
    compiled: Optional[Callable] = None

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        nonlocal compiled
        if compiled is None:
            compiled = real(fn, **options)
        return compiled(*args, **kwargs)

    return call


@contextlib.contextmanager
def deferred_compile() -> Iterator[None]:
    """While active, `torch.compile(fn, ...)` on a plain function (also as `@torch.compile(...)`) returns a
    wrapper that calls the real `torch.compile(fn, ...)` at its first call. Modules are compiled as usual."""
    real = torch.compile

    def compile_later(model: Optional[Callable] = None, **options: Any) -> Any:
        if model is None:  # @torch.compile(mode=...): a decorator
            return lambda fn: compile_later(fn, **options)
        if isinstance(model, torch.nn.Module) or not callable(model):
            return real(model, **options)
        return _deferred(real, model, options)

    torch.compile = compile_later
    try:
        yield
    finally:
        torch.compile = real


def import_megatron_core(*modules: str) -> None:
    """Import `megatron.core` (and the given submodules, e.g. "megatron.core.models.gpt") under
    `deferred_compile()`. A no-op for modules already imported."""
    with deferred_compile():
        for name in ("megatron.core", *modules):
            importlib.import_module(name)
