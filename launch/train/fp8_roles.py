"""Which FP8 tensor an entry of a module's FP8 state is: its role (input, weight or grad) and a short name.

An FP8 module holds two metas (`fp8_parallel.modules`' FP8State): `fwd` with the input's and the weight's
amax and scale (rows 0 and 1), and `bwd` with the output gradient's (row 0). The job's per-layer records
(`fp8_layers`) are named by those metas (`layer01/mlp.linear_fc1.fp8.fwd`), so the role follows from the
name's last part and the row. Plain Python: the standalone plot script uses it without torch.
"""
from __future__ import annotations

from typing import Optional

ROLES = ("input", "weight", "grad")
_ROWS = {"fwd": ("input", "weight"), "bwd": ("grad",)}


def role_of(meta_name: str, row: int) -> Optional[str]:
    """The role of row `row` of the FP8 meta named `meta_name` (ending in `fwd` / `bwd`); None if unknown."""
    roles = _ROWS.get(meta_name.rsplit(".", 1)[-1], ())
    return roles[row] if 0 <= row < len(roles) else None


def tensor_name(meta_name: str) -> str:
    """The name of the layer a meta belongs to: `layer01/mlp.linear_fc1.fp8.fwd` -> `layer01/mlp.linear_fc1`."""
    parts = meta_name.split(".")
    if parts[-1] in _ROWS:
        parts = parts[:-1]
    if len(parts) > 1 and parts[-1] == "fp8":
        parts = parts[:-1]
    return ".".join(parts)
