"""Shared pieces of the TransformerEngine-surface tests: a reproducible seed, the relative error, and an RNG
states tracker over the CPU generator."""
from __future__ import annotations

import contextlib

import torch
from seeds import session_seed


def seed_for(name: str) -> int:
    """The run's seed (`seeds.session_seed`), printed with the test's name so a failure can be reproduced."""
    seed = session_seed() % 100_000
    print(f"{name}: seed {seed} (FP8P_TEST_SEED={seed} reproduces)")
    return seed


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative Frobenius error of `a` against the reference `b`, in float64."""
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


class CpuTracker:
    """megatron's / TransformerEngine's RNG states tracker interface over the CPU generator: `fork()` swaps its
    own state in and out of the default generator, so torch's checkpoint (which restores the default
    generator) does not restore it."""

    def __init__(self, seed: int) -> None:
        self.states_ = {"model-parallel-rng": torch.Generator().manual_seed(seed).get_state()}

    def get_states(self):
        return dict(self.states_)

    def set_states(self, states) -> None:
        self.states_ = states

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng"):
        outside = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outside)
