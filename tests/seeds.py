"""The test suite's seed: one per pytest run, the same in every process of the run.

`DEFAULT_SEED` unless `FP8P_TEST_SEED` says otherwise; the run shows it in its header and after its summary.
The conftest sets `FP8P_TEST_SEED` in the controlling pytest process (from `--seed N`, `--random-seed`, the
environment, or the default) before any xdist worker or subprocess starts, and `launcher.child_env` passes it
to every subprocess and torchrun rank, so a failure reproduces with `--seed N` (or `FP8P_TEST_SEED=N`).
"""
from __future__ import annotations

import os

DEFAULT_SEED = 20261205
ENV_VAR = "FP8P_TEST_SEED"


def session_seed() -> int:
    """The run's seed: `$FP8P_TEST_SEED` where set, else `DEFAULT_SEED`."""
    value = os.environ.get(ENV_VAR, "").strip()
    return int(value) if value else DEFAULT_SEED


def draw_seed() -> int:
    """A fresh random seed (32 bits), for `--random-seed`."""
    return int.from_bytes(os.urandom(4), "little")
