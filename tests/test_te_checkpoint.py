"""`fp8_parallel.checkpoint`, TransformerEngine's activation-recompute entry point (CPU).

A TransformerEngine-style block (LayerNormMLP, dropout inside an RNG tracker's fork, dropout on the default
generator, Linear) runs a few training steps with and without `checkpoint`, reentrant and not, under delayed
and current FP8 scaling and without FP8: outputs, input and parameter gradients, the FP8 state (amax
histories and scales: the recompute records nothing twice) and the tracker's final state must be bitwise
equal. Without the tracker passed, the recompute's dropout differs and so do the gradients (the check can
fail). Seeds are the run's seed (`--random-seed` draws one) and printed; FP8P_TEST_SEED=<seed> reproduces
one.
"""
from __future__ import annotations

import contextlib
import warnings

import pytest
import torch

import fp8_parallel as te
from fp8_parallel import recipe
from te_testing import seed_for as _seed, CpuTracker

RECIPES = {
    "delayed": recipe.DelayedScaling(amax_history_len=4, amax_compute_algo="max"),
    "current": recipe.Float8CurrentScaling(),
    "none": None,
}


class Block(torch.nn.Module):
    def __init__(self, tracker: CpuTracker) -> None:
        super().__init__()
        self.mlp = te.LayerNormMLP(32, 64, activation="swiglu", device="cpu")
        self.drop = torch.nn.Dropout(0.25)
        self.out = te.Linear(32, 32, device="cpu")
        self.tracker = tracker
        self.calls = 0

    def forward(self, x: torch.Tensor, scale: float = 1.0, is_first_microbatch=None) -> torch.Tensor:
        self.calls += 1
        h = self.mlp(x, is_first_microbatch=is_first_microbatch)
        with self.tracker.fork():
            h = self.drop(h)  # the tracker's generator (tensor-parallel dropout)
        h = self.drop(h)  # the default generator (torch's checkpoint restores that one)
        return self.out(h, is_first_microbatch=is_first_microbatch) * scale


def _train(seed: int, rname: str, mode: str, pass_tracker: bool = True, tracker_as: str = "callable"):
    """Three steps; mode "plain", "reentrant" or "non-reentrant". Returns everything that must agree."""
    torch.manual_seed(seed)
    tracker = CpuTracker(seed + 1)
    block = Block(tracker)
    gen = torch.Generator().manual_seed(seed + 2)
    rec = RECIPES[rname]
    results = []
    for step in range(3):
        x = (torch.randn(4, 6, 32, generator=gen) * 2).requires_grad_()
        grad = torch.randn(4, 6, 32, generator=gen)
        kwargs = {"scale": 1.5, "is_first_microbatch": step == 0 or None}
        with te.autocast(enabled=rec is not None, recipe=rec):
            if mode == "plain":
                y = block(x, **kwargs)
            else:
                get_tracker = None
                if pass_tracker:
                    get_tracker = (lambda: tracker) if tracker_as == "callable" else tracker
                y = te.checkpoint(block, x, use_reentrant=(mode == "reentrant"),
                                  get_rng_state_tracker=get_tracker, **kwargs)
        y.backward(grad)
        results.append((y.detach(), x.grad, [p.grad.clone() for p in block.parameters()]))
        block.zero_grad(set_to_none=True)
    return results, block.state_dict(), tracker.states_["model-parallel-rng"], block.calls


def _equal(a, b) -> bool:
    (steps_a, state_a, tracker_a, _), (steps_b, state_b, tracker_b, _) = a, b
    for (ya, dxa, ga), (yb, dxb, gb) in zip(steps_a, steps_b):
        if not (torch.equal(ya, yb) and torch.equal(dxa, dxb) and all(torch.equal(p, q) for p, q in zip(ga, gb))):
            return False
    return all(torch.equal(state_a[k], state_b[k]) for k in state_a) and torch.equal(tracker_a, tracker_b)


@pytest.mark.parametrize("mode", ["reentrant", "non-reentrant"])
@pytest.mark.parametrize("rname", list(RECIPES))
def test_checkpoint_is_bitwise_no_checkpoint(rname, mode):
    """Outputs, gradients, FP8 state (amax histories, scales) and the tracker's state after three steps
    (weight cache on the first) equal those without checkpointing; the block ran twice per step (forward
    and recompute)."""
    seed = _seed(f"checkpoint/{rname}/{mode}")
    plain = _train(seed, rname, "plain")
    ckpt = _train(seed, rname, mode)
    assert plain[3] == 3 and ckpt[3] == 6, (plain[3], ckpt[3])
    assert _equal(plain, ckpt)
    if rname == "delayed":  # the histories are in use (current scaling keeps none)
        state = ckpt[1]
        assert all((state[k] > 0).any() for k in state if k.endswith("amax_history")), "no amax recorded"


@pytest.mark.parametrize("mode", ["reentrant", "non-reentrant"])
def test_without_the_tracker_the_recompute_differs(mode):
    """The control: without `get_rng_state_tracker` the recompute's tracker dropout draws other masks, so
    gradients differ; a tracker passed as the object itself (not a callable) restores as well."""
    seed = _seed(f"checkpoint/no-tracker/{mode}")
    plain = _train(seed, "delayed", "plain")
    assert not _equal(plain, _train(seed, "delayed", mode, pass_tracker=False))
    assert _equal(plain, _train(seed, "delayed", mode, tracker_as="object"))


def test_te_arguments():
    """TransformerEngine's own arguments: `distribute_saved_activations=True` is refused with the reentrant
    checkpoint and warns (no effect) with the non-reentrant one; the deprecated positional form works with a
    DeprecationWarning; `debug=True` needs the non-reentrant one; keyword tensors reach the function."""
    lin = te.Linear(8, 8, device="cpu")
    x = torch.randn(3, 8, requires_grad=True)
    with pytest.raises(NotImplementedError, match="distribute_saved_activations"):
        te.checkpoint(lin, x, distribute_saved_activations=True)
    with pytest.warns(UserWarning, match="distribute_saved_activations"):
        te.checkpoint(lin, x, distribute_saved_activations=True, use_reentrant=False).sum().backward()
    tracker = CpuTracker(0)
    with pytest.warns(DeprecationWarning, match="positional"):
        y = te.checkpoint(lambda a, b: lin(a) * b, False, lambda: tracker, None, x, torch.tensor(2.0))
    assert torch.equal(y, lin(x) * 2)
    with pytest.raises(ValueError, match="debug"):
        te.checkpoint(lin, x, debug=True)
    with pytest.raises(TypeError, match="get_rng_state_tracker"):
        te.checkpoint(lin, x, get_rng_state_tracker=3)
    bias = torch.randn(8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for reentrant in (True, False):
            out = te.checkpoint(lambda a, bias=None: lin(a) + bias, x, bias=bias, use_reentrant=reentrant)
            assert torch.equal(out, lin(x) + bias)


def test_context_fn_in_both_modes():
    """torch's `context_fn` (forward context, recompute context) is entered around the first pass and the
    recompute in both modes (torch's reentrant checkpoint itself refuses it; TransformerEngine's takes it)."""
    for reentrant in (True, False):
        seen = []

        @contextlib.contextmanager
        def mark(name):
            seen.append(name)
            yield

        lin = te.Linear(8, 8, device="cpu")
        x = torch.randn(3, 8, requires_grad=True)
        te.checkpoint(lin, x, use_reentrant=reentrant,
                      context_fn=lambda: (mark("forward"), mark("recompute"))).sum().backward()
        assert seen == ["forward", "recompute"], (reentrant, seen)
