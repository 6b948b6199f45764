"""Per-module FP8 state: amax histories and scales of one direction, as fixed-shape buffers."""
from __future__ import annotations

import itertools
import zlib
from typing import Optional

import torch


_ALLOCATIONS = itertools.count()


class FP8Meta(torch.nn.Module):
    """Amax history `[n, L]` (newest in column 0), scale `[n]`, and a non-finite-amax counter `[n]`.

    A module owns one per direction: forward (its input and weight) and backward (its grad_output). They are
    buffers, so they travel in the state dict as plain tensors; `L` follows the recipe on first use.

    Args:
        num_tensors: FP8 tensors of this direction (2 forward: input, weight; 1 backward: grad_output).
        tag: a description of the owner that is equal on every rank holding the same tensors (used in the
            cross-rank layout fingerprint, so it must not contain rank-specific values).
    """

    def __init__(self, num_tensors: int, tag: str, history_len: int = 1, device: Optional[torch.device] = None):
        super().__init__()
        self.num_tensors = num_tensors
        self.tag = tag
        self.tag_hash = zlib.crc32(f"{tag}/{num_tensors}".encode())
        self.register_buffer("amax_history", torch.zeros(num_tensors, history_len, device=device))
        self.register_buffer("scale", torch.ones(num_tensors, device=device))
        self.register_buffer("nonfinite_count", torch.zeros(num_tensors, dtype=torch.int64, device=device))
        # changes whenever a buffer is replaced (`_apply`/`.to()`, a resize, an assignment): the key of cached
        # device addresses
        self.storage_id = next(_ALLOCATIONS)

    def scale_of(self, index: int) -> torch.Tensor:
        """`scale[index : index + 1]`, a view made once per scale buffer (made again when the buffer or its
        storage is replaced: an assignment, `.to()`, `scale.data = ...`)."""
        views = self.__dict__.get("_scale_views")
        scale = self._buffers["scale"]
        if views is None or views[0] is not scale or views[1][0].data_ptr() != scale.data_ptr():
            views = (scale, [scale[i : i + 1] for i in range(self.num_tensors)])
            self.__dict__["_scale_views"] = views
        return views[1][index]

    def __setattr__(self, name: str, value) -> None:
        # any replacement of a buffer (load_state_dict(assign=True), a direct assignment) is a new storage:
        # device address tables built from the old buffers must not be used again
        super().__setattr__(name, value)
        if name in ("amax_history", "scale", "nonfinite_count"):
            super().__setattr__("storage_id", next(_ALLOCATIONS))

    def _apply(self, fn, recurse=True):
        before = dict(self._buffers)
        out = super()._apply(fn, recurse)
        for name, buf in self._buffers.items():  # a dtype cast of the model (e.g. megatron's Float16Module
            if buf is not None and buf.dtype != before[name].dtype:  # calling .bfloat16()) keeps FP8 state exact
                self._buffers[name] = before[name].to(buf.device)
        self.storage_id = next(_ALLOCATIONS)
        return out

    def ensure_history_len(self, length: int) -> None:
        """Resize the history to `length`, keeping the newest entries (a recipe with another length)."""
        current = self.amax_history.shape[1]
        if current == length:
            return
        hist = torch.zeros(self.num_tensors, length, device=self.amax_history.device)
        keep = min(current, length)
        hist[:, :keep] = self.amax_history[:, :keep]
        self.amax_history = hist
        self.storage_id = next(_ALLOCATIONS)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        key = prefix + "amax_history"
        if key in state_dict:  # follow the saved history length
            self.ensure_history_len(state_dict[key].shape[1])
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
