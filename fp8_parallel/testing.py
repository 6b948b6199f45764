"""Helpers for this project's tests: a small, named view of internal state, and switches tests need.

Internal: not part of the public API (docs/api.md) and free to change with the modules it reaches into; it
exists so that tests name what they observe or force (`active_scopes()`, `grouped_gemm(...)`) instead of
private attributes, and a refactor of those updates one file. Nothing here changes what the package does
unless a test calls it.

The `set_*` and `record_*` functions take a `patcher`: anything with pytest's `monkeypatch.setattr(obj, name,
value)` (pytest's `monkeypatch` fixture undoes them after the test). The context managers do the same for one
block.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, List, Optional, Protocol, Tuple

import torch

from .amax_table import AmaxTable
from .modules import _core, _grouped_core
from .modules._context_parallel import _sequence_order, chunk_indices
from .modules._deferred_init import default_device
from .modules._grouped_gemm import ExpertWeightStack
from .modules._main_grad import accumulates_into_main_grad, add_weight_gradient, linear_into_main_grad
from .modules._sequence_parallel import _SCALES_SHARED, scales_shared_over
from .scopes import _SCOPE_STACK, KeyState, current_scope

__all__ = [
    "ExpertWeightStack", "accumulates_into_main_grad", "active_scopes", "add_weight_gradient",
    "allocate_table", "backward_done", "casts_wrapped", "chunk_indices", "cumulative_splits", "current_key",
    "default_device", "dense_weight_casts", "graph_runner_class", "device_has_bf16_grouped_gemm", "device_has_grouped_gemm",
    "grouped_gemm", "lifetime_slots", "linear_into_main_grad", "padded_storage", "pending_backward", "record_direct_expert_backwards", "record_operand_alignment", "record_operand_padding",
    "scale_sharing_groups", "scales_shared_over", "sequence_order", "set_grouped_gemm", "wrap_casts",
]


class Patcher(Protocol):
    def setattr(self, target: Any, name: str, value: Any) -> None: ...


class _Patches:
    """A patcher for one `with` block: `setattr`s undone in reverse order on exit."""

    def __init__(self) -> None:
        self._undo: List[Tuple[Any, str, Any]] = []

    def setattr(self, target: Any, name: str, value: Any) -> None:
        self._undo.append((target, name, getattr(target, name)))
        setattr(target, name, value)

    def undo(self) -> None:
        while self._undo:
            target, name, value = self._undo.pop()
            setattr(target, name, value)


@contextlib.contextmanager
def _patched(apply: Callable[[_Patches], Any]) -> Iterator[Any]:
    patches = _Patches()
    try:
        yield apply(patches)
    finally:
        patches.undo()


# ---- autocast scopes ----------------------------------------------------------------------------------------

def active_scopes() -> Tuple[Any, ...]:
    """The open autocast scopes, outermost first (empty outside any scope)."""
    return tuple(_SCOPE_STACK)


def current_key() -> KeyState:
    """The (recipe, group) key state of the innermost open scope: its amax tables and backward bookkeeping.

    Raises:
        RuntimeError: outside any scope, or inside a disabled one (it has no key).
    """
    scope = current_scope()
    if scope is None or scope.state is None:
        raise RuntimeError("current_key: no enabled fp8 autocast scope is open")
    return scope.state


def pending_backward(key: KeyState) -> int:
    """FP8 calls of `key`'s forward whose backward has not run yet (0 once every expected backward ran)."""
    return key.pending_backward


def backward_done(key: KeyState) -> bool:
    """Whether `key`'s backward amax reduction and scale update ran."""
    return key.backward_done


def allocate_table(table: AmaxTable) -> None:
    """Allocate `table`'s reduction buffer now, as its first reduction would."""
    table._allocate()


# ---- casts and GEMM operands --------------------------------------------------------------------------------

CastFn = Callable[..., Any]


def wrap_casts(patcher: Patcher, wrapper: Callable[..., Any]) -> None:
    """Route every FP8 cast of the modules' Python path through `wrapper(cast, x, recipe, scale, slot,
    fp8_dtype, out=None, with_transpose=False, noop_flag=None)`, where `cast` is the real one (call it to cast;
    `x` is the tensor cast: a weight parameter, an input or a gradient). The compiled host path
    (`fp8_parallel.native`, absent from CPU-only installs) casts in C++ and is not routed."""
    real = _core._cast
    patcher.setattr(_core, "_cast", lambda *args, **kwargs: wrapper(real, *args, **kwargs))


def casts_wrapped(wrapper: Callable[..., Any]) -> contextlib.AbstractContextManager:
    """`wrap_casts` for one `with` block."""
    return _patched(lambda p: wrap_casts(p, wrapper))


def dense_weight_casts(patcher: Patcher) -> None:
    """Cast every weight (and a transpose re-cast in backward) into ordinary dense storage, never into the
    zero-padded aligned buffers a layer with unaligned features uses: the GEMMs then pad it per call (the
    reference the padded storage is compared with)."""
    real_transposed = _core.quantize_transposed
    patcher.setattr(_core, "_weight_out", lambda weight, dtype, reuse, with_transpose: reuse)  # noqa: ARG005
    patcher.setattr(_core, "quantize_transposed",
                    lambda x, scale, dtype, padded=False: real_transposed(x, scale, dtype))  # noqa: ARG005


def record_operand_padding(patcher: Patcher) -> List[Tuple[int, ...]]:
    """Record the shape of every GEMM operand the FP8 GEMM pads by copying (an unaligned K or N); returns the
    list it appends to."""
    from . import gemm

    copied: List[Tuple[int, ...]] = []
    real = gemm._pad_cols
    patcher.setattr(gemm, "_pad_cols", lambda data, cols: copied.append(tuple(data.shape)) or real(data, cols))
    return copied


def padded_storage(data: torch.Tensor) -> Optional[torch.Tensor]:
    """The whole zero-padded aligned buffer that FP8 `data` (a view into it) lives in, or None for ordinary
    dense storage."""
    from . import gemm

    return getattr(data, gemm._PADDED, None)


def record_operand_alignment(patcher: Patcher) -> List[int]:
    """Record, for every operand the FP8 GEMM hands to `torch._scaled_mm`, its address modulo 16 (0: aligned
    as cuBLAS wants it, so no aligning copy was made); returns the list it appends to."""
    from . import gemm

    offsets: List[int] = []
    real = gemm._aligned
    patcher.setattr(gemm, "_aligned", lambda t: offsets.append(t.data_ptr() % 16) or real(t))
    return offsets


# ---- grouped GEMMs ------------------------------------------------------------------------------------------

def device_has_grouped_gemm(device: torch.device) -> bool:
    """Whether torch's grouped FP8 GEMM runs on `device` (as the modules decide, unless forced)."""
    return _grouped_core.device_has_grouped_gemm(device)


def device_has_bf16_grouped_gemm(device: torch.device) -> bool:
    """Whether torch's bfloat16 grouped GEMM serves the experts on `device` (as the modules decide)."""
    return _grouped_core.device_has_bf16_grouped_gemm(device)


def cumulative_splits(splits: List[int]) -> List[int]:
    """The experts' row ends: running sums of `splits`."""
    return list(_grouped_core.cumulative(splits))


def record_direct_expert_backwards(patcher: Patcher) -> List[int]:
    """Record each time the grouped path's backward takes the per-expert GEMMs directly (one entry per call);
    returns the list it appends to."""
    from .modules import _grouped_gemm

    calls: List[int] = []
    real = _grouped_gemm._direct_expert_backward
    patcher.setattr(_grouped_gemm, "_direct_expert_backward", lambda *args: calls.append(1) or real(*args))
    return calls


def set_grouped_gemm(patcher: Patcher, enabled: Optional[bool] = None, *, fp8_device: Optional[bool] = None,
                     bf16_device: Optional[bool] = None) -> None:
    """Force the experts' GEMM implementation: `enabled` False never takes the grouped FP8 GEMM (per-expert
    GEMMs), True allows it where it can serve (the default); `fp8_device` / `bf16_device` answer whether the
    device has the grouped FP8 / bfloat16 GEMM (True on a CPU makes the modules take the grouped path, with
    `torch._scaled_grouped_mm` then provided by the test). None leaves that setting as it is."""
    if enabled is not None:
        patcher.setattr(_grouped_core, "GROUPED_GEMM", bool(enabled))
    if fp8_device is not None:
        patcher.setattr(_grouped_core, "device_has_grouped_gemm", lambda device: bool(fp8_device))  # noqa: ARG005
    if bf16_device is not None:
        patcher.setattr(_grouped_core, "device_has_bf16_grouped_gemm", lambda device: bool(bf16_device))  # noqa: ARG005


def grouped_gemm(enabled: Optional[bool] = None, *, fp8_device: Optional[bool] = None,
                 bf16_device: Optional[bool] = None) -> contextlib.AbstractContextManager:
    """`set_grouped_gemm` for one `with` block."""
    return _patched(lambda p: set_grouped_gemm(p, enabled, fp8_device=fp8_device, bf16_device=bf16_device))


# ---- graphs, sequence and context parallelism --------------------------------------------------------------

def lifetime_slots(order: List[int], microbatches: int):
    """The graphs' static-buffer slots for a capture `order`: `({(chunk, microbatch): slot}, {chunk: slots})`,
    microbatches never in flight together sharing a slot."""
    from .graphs.runners import _lifetime_slots

    return _lifetime_slots(order, microbatches)


def graph_runner_class() -> type:
    """The class that captures and replays one callable's forward and backward graphs."""
    from .graphs.runners import _GraphRunner

    return _GraphRunner


def sequence_order(cp: int) -> List[int]:
    """Context parallelism's order of the `2 * cp` sequence chunks when the ranks' chunks are concatenated."""
    return _sequence_order(cp)


def scale_sharing_groups() -> int:
    """How many live process groups the sequence-parallel scale-sharing cache holds entries for."""
    return _SCALES_SHARED.groups()
