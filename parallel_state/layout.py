"""Validated parallel sizes: the one place that says whether a layout fits a world size."""
from __future__ import annotations

import dataclasses
from typing import Optional


class ParallelLayoutError(ValueError):
    """Raised for parallel sizes that cannot form a layout; raised before any collective."""


@dataclasses.dataclass(frozen=True)
class ParallelSizes:
    """Sizes of each parallel dimension, as megatron-core's `initialize_model_parallel` takes them.

    `dp` and `edp` are derived from the world size; `etp=None` means "same as tp", as in megatron.
    """

    world: int
    tp: int = 1
    pp: int = 1
    vpp: Optional[int] = None
    cp: int = 1
    ep: int = 1
    etp: Optional[int] = None

    def __post_init__(self) -> None:
        described = self.describe()
        for name in ("world", "tp", "pp", "cp", "ep"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ParallelLayoutError(f"{name}={value!r} must be a positive integer ({described})")
        if self.etp is not None and (not isinstance(self.etp, int) or self.etp < 1):
            raise ParallelLayoutError(f"etp={self.etp!r} must be a positive integer or None ({described})")
        if self.vpp is not None:
            if not isinstance(self.vpp, int) or self.vpp < 1:
                raise ParallelLayoutError(f"vpp={self.vpp!r} must be a positive integer or None ({described})")
            if self.pp < 2:
                raise ParallelLayoutError(
                    f"vpp={self.vpp} needs pipeline parallelism, but pp={self.pp} ({described})"
                )
        model = self.tp * self.pp * self.cp
        if self.world % model:
            raise ParallelLayoutError(
                f"world size {self.world} is not divisible by tp*pp*cp = {self.tp}*{self.pp}*{self.cp} = {model} "
                f"({described})"
            )
        expert_model = self.expert_tp * self.ep * self.pp
        if self.world % expert_model:
            raise ParallelLayoutError(
                f"expert layout does not fit: world size {self.world} is not divisible by "
                f"etp*ep*pp = {self.expert_tp}*{self.ep}*{self.pp} = {expert_model} ({described})"
            )

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    @property
    def dp(self) -> int:
        return self.world // (self.tp * self.pp * self.cp)

    @property
    def expert_dp(self) -> int:
        return self.world // (self.expert_tp * self.ep * self.pp)

    def describe(self) -> str:
        return (
            f"world={self.world}, tp={self.tp}, pp={self.pp}, vpp={self.vpp}, cp={self.cp}, "
            f"ep={self.ep}, etp={self.etp}"
        )
