"""The autocast scope of MoE experts: the enclosing scope's recipe, reduced over the expert amax domain.

Its own small module so that the expert layers (`modules.grouped`) and the megatron integration
(`fp8_parallel.megatron`, which re-exports it) both import it without importing each other.
"""
from __future__ import annotations

import contextlib
from typing import ContextManager, Optional

import torch.distributed as dist


def expert_amax_group() -> Optional[dist.ProcessGroup]:
    """The expert amax domain (the ranks holding the same experts) when `parallel_state` is initialized."""
    import parallel_state

    return parallel_state.expert_amax_group() if parallel_state.is_initialized() else None


def expert_scope() -> ContextManager:
    """A scope for MoE experts: the enclosing scope's recipe over the expert amax domain (a no-op outside an
    enabled scope)."""
    from .scopes import autocast, current_scope

    scope = current_scope()
    if scope is None or not scope.enabled:
        return contextlib.nullcontext()
    return autocast(recipe=scope.recipe, group=expert_amax_group())
