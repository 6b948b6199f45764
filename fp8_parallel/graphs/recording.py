"""FP8 state around the recording of graphed callables, and the registration of recorded amaxes with the
caller's autocast scopes on replay."""
from __future__ import annotations

from typing import Any, List, Tuple

import torch

from ..scopes import KeyState, Recorder, RecordingKey, autocast, current_scope


def _fp8_states(module: Any) -> List[torch.nn.Module]:
    from ..meta import FP8Meta

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
