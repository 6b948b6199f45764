"""Small host tables of integers (expert row ends, kernel tables) as device tensors, cached by content.

A grouped expert GEMM needs its row ends, and the fused block cast its table, on the device. Copying them
from pageable host memory at every call is refused inside CUDA graph capture, and costs a copy per call
outside it. `device_table` returns one read-only device tensor per (device, dtype, content): drop-and-pad MoE
(the same splits every step) copies each table once, and a graph captured over it reads a tensor that stays
alive and unchanged. Entries a capture used are kept for the life of the process (a graph may replay them at
any time); the others are evicted oldest first beyond `EAGER_ENTRIES`.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Dict, Sequence, Tuple, Union

import torch

EAGER_ENTRIES = 256

Key = Tuple[str, torch.dtype, tuple]
_EAGER: "OrderedDict[Key, torch.Tensor]" = OrderedDict()
_CAPTURED: Dict[Key, torch.Tensor] = {}


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def device_table(rows: Union[Sequence[int], Sequence[Sequence[int]]], dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
    """`torch.tensor(rows, dtype=dtype)` on `device`, shared by every call with the same content: never write
    into it. Works inside CUDA graph capture (a table first seen there is copied from pinned host memory)."""
    device = torch.device(device)
    content = tuple(tuple(int(v) for v in r) for r in rows) if rows and not isinstance(rows[0], int) else \
        tuple(int(v) for v in rows)
    key = (str(device), dtype, content)
    hit = _CAPTURED.get(key)
    if hit is not None:
        return hit
    capturing = _capturing(device)
    hit = _EAGER.pop(key, None)
    if hit is None:
        host = torch.tensor(content, dtype=dtype, pin_memory=capturing)
        hit = host if device.type == "cpu" else host.to(device, non_blocking=True)
        if capturing:  # the graph's copy reads `host` at every replay: keep it alive with the result
            hit._fp8p_pinned_source = host
    if capturing:
        _CAPTURED[key] = hit
    else:
        _EAGER[key] = hit
        while len(_EAGER) > EAGER_ENTRIES:
            _EAGER.popitem(last=False)
    return hit
