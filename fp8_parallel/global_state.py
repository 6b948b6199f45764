"""TransformerEngine's `FP8GlobalStateManager` query methods, answered from the autocast scope stack.

User code and TE's tests ask it whether FP8 is on, with which recipe and group, and whether a graph is being
captured. The state itself is the scope stack (`scopes.py`); this class only reads it (and `reset` empties
it, as TE's `reset` drops its global state).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from . import scopes
from .recipe import Recipe
from .te_compat import FP8Availability, get_default_recipe, is_fp8_available

__all__ = ["FP8GlobalStateManager"]


class FP8GlobalStateManager:
    """Class-level queries, as TransformerEngine's (`FP8GlobalStateManager.is_fp8_enabled()`, ...)."""

    @classmethod
    def is_fp8_available(cls) -> FP8Availability:
        """`is_fp8_available()`: `(available, reason)`."""
        return is_fp8_available()

    @classmethod
    def is_fp8_enabled(cls) -> bool:
        """Whether the innermost open autocast scope runs FP8 (False outside any scope)."""
        scope = scopes.current_scope()
        return scope is not None and scope.enabled

    @classmethod
    def is_fp8_calibration(cls) -> bool:
        """Whether the innermost open autocast scope calibrates (`calibrating=True`)."""
        scope = scopes.current_scope()
        return scope is not None and scope.calibrating

    @classmethod
    def with_fp8_parameters(cls) -> bool:
        """Always False: parameters stay in high precision (their FP8 casts are cached per step)."""
        return False

    @classmethod
    def with_high_precision_init_val(cls) -> bool:
        """Always False (no FP8 parameters, so no kept high-precision initial values)."""
        return False

    @classmethod
    def fp8_graph_capturing(cls) -> bool:
        """Whether a CUDA graph is being captured on the current stream."""
        return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()

    @classmethod
    def get_fp8_recipe(cls) -> Recipe:
        """The innermost enabled scope's recipe (as it was at its entry), else the default recipe."""
        for scope in reversed(scopes._SCOPE_STACK):
            if scope.enabled:
                return scope.recipe
        return get_default_recipe()

    @classmethod
    def get_fp8_group(cls) -> Optional[dist.ProcessGroup]:
        """The innermost enabled scope's amax-reduction group, else None."""
        for scope in reversed(scopes._SCOPE_STACK):
            if scope.enabled:
                return scope.group
        return None

    @classmethod
    def get_fp8_torch_dtype(cls, recipe: Recipe, fprop_tensor: bool = True) -> torch.dtype:
        """The FP8 dtype `recipe` casts forward (`fprop_tensor`) or backward tensors to."""
        fmt = recipe.fp8_format
        return fmt.forward_dtype if fprop_tensor else fmt.backward_dtype

    @classmethod
    def reset(cls) -> None:
        """Drop every open autocast scope without reducing its amaxes (TE's reset drops its global state);
        for tests that must start clean after a failure inside a scope."""
        scopes._SCOPE_STACK.clear()
