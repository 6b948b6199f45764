"""`module.fp8_meta`: TransformerEngine's FP8 metadata dictionary, as a read view of the module's FP8 state.

TransformerEngine keeps per module `fp8_meta["scaling_fwd"]` / `["scaling_bwd"]` (an `FP8TensorMeta` with
`scale` `[n]` and `amax_history` `[history, n]`) and a few entries about the recipe. Between steps TE's history
reads as after its update: row 0 zeros (the next step's amaxes go there), the last row the latest amaxes, the
rows before it older ones. This history keeps the latest amax first (`FP8Meta.amax_history [n, history]`,
column 0); the view places its columns as TE's rows (the oldest one, which TE's layout has no row for, left
out).
Its forward holds three tensors per GEMM (input, weight, output), its backward two (grad_output, grad_input);
a GroupedLinear orders them by kind (every GEMM's input, then every weight, then every output). Here each GEMM
records its input and weight forward and its grad_output backward; the output and grad_input entries, which
TE fills only for FP8 outputs, read as scale 1 and zero amaxes. Every access builds the view from the current
state: writing into it changes nothing (set scales through a checkpoint or `FP8State` instead).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Sequence

import torch

from ..recipe import DelayedScaling, Recipe
from ._core import FP8State


@dataclasses.dataclass
class FP8TensorMetaView:
    """TransformerEngine's `FP8TensorMeta` fields (copies): `scale [n]`, `scale_inv [n]` (1 / scale, as TE 1.x
    kept it) and `amax_history [history, n]`."""

    scale: torch.Tensor
    scale_inv: torch.Tensor
    amax_history: torch.Tensor


def _direction(states: Sequence[FP8State], fwd: bool, by_kind: bool) -> FP8TensorMetaView:
    per_gemm = 3 if fwd else 2  # TE's tensors per GEMM in this direction
    recorded = 2 if fwd else 1  # ours: input, weight / grad_output
    metas = [s.fwd if fwd else s.bwd for s in states]
    history = max(m.amax_history.shape[1] for m in metas)
    n = per_gemm * len(metas)
    device = metas[0].scale.device
    scale = torch.ones(n, device=device)
    amax = torch.zeros(history, n, device=device)
    for g, meta in enumerate(metas):
        for kind in range(recorded):
            index = kind * len(metas) + g if by_kind else g * per_gemm + kind
            scale[index] = meta.scale[kind]
            kept = meta.amax_history[kind, : meta.amax_history.shape[1] - 1]  # latest first
            amax[history - kept.numel():, index] = kept.flip(0)  # TE: the latest last, row 0 pending
    return FP8TensorMetaView(scale, scale.reciprocal(), amax)


def fp8_meta_view(states: Sequence[FP8State], by_kind: bool = False) -> Dict[str, Any]:
    """TE's `fp8_meta` keys for a module whose GEMMs have `states` (in TE's GEMM order)."""
    recipe: Optional[Recipe] = next((s._prepared_for for s in states if s._prepared_for is not None), None)
    shown = recipe if recipe is not None else DelayedScaling()
    fmt = getattr(shown, "fp8_format", None)
    return {
        "recipe": shown,
        "num_gemms": len(states),
        "fp8_checkpoint": True,  # the FP8 state is always in the state dict (TE: `_extra_state` when FP8 ran)
        "scaling_fwd": _direction(states, True, by_kind),
        "scaling_bwd": _direction(states, False, by_kind),
        "fp8_max_fwd": torch.finfo(fmt.forward_dtype).max if fmt is not None else 448.0,
        "fp8_max_bwd": torch.finfo(fmt.backward_dtype).max if fmt is not None else 57344.0,
    }


class TEFP8Meta:
    """Mixin: `fp8_meta`, TransformerEngine's FP8 metadata dictionary as a read view (see the module doc)."""

    def _fp8_gemm_states(self) -> List[FP8State]:
        return [self.fp8]

    _fp8_meta_by_kind = False

    @property
    def fp8_meta(self) -> Dict[str, Any]:
        """TransformerEngine's `fp8_meta` keys (`recipe`, `num_gemms`, `scaling_fwd`, `scaling_bwd`, ...), built
        from the current FP8 state on each access (a copy: writing into it changes nothing)."""
        return fp8_meta_view(self._fp8_gemm_states(), self._fp8_meta_by_kind)
