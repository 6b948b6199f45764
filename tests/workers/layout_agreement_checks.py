"""A layout change on one rank raises `AmaxLayoutMismatch` on every rank of the group, quickly, from the same
collective, and leaves the group in step (gloo on CPU, NCCL on GPUs; every rank asserts).

Usage (under torchrun, 2 or more ranks): layout_agreement_checks.py
"""
from __future__ import annotations

import contextlib
import os
import time
from typing import Callable, ContextManager, Optional

import torch
import torch.distributed as dist

import fp8_parallel as fp
from fp8_parallel.modules import Linear
from rank_checks import run_checks, test_seed, exit_now

CUDA = torch.cuda.is_available()
if CUDA:
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
dist.init_process_group("nccl" if CUDA else "gloo")
RANK = dist.get_rank()
DEVICE = torch.device("cuda") if CUDA else torch.device("cpu")
DTYPE = torch.bfloat16 if CUDA else torch.float32
H = 32
RAISE_WITHIN_S = 10.0  # a hang shows as the launcher's timeout; a slow raise (a collective timing out) here
RECIPE = fp.DelayedScaling(amax_history_len=4)


def _out(y):
    return y[0] if isinstance(y, tuple) else y


def _layers(n: int, seed: int) -> torch.nn.ModuleList:
    torch.manual_seed(seed)  # same weights on every rank
    return torch.nn.ModuleList([Linear(H, H, params_dtype=DTYPE, device=DEVICE) for _ in range(n)])


def _input(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(test_seed() + 1000 * step + RANK)
    return (torch.randn(16, H, generator=g) * (1 + RANK)).to(DEVICE, DTYPE).requires_grad_()


def _step(layers, step: int, order=(0, 1, 2), frozen_last: bool = False, recipe=RECIPE,
          inner: Optional[Callable[[], ContextManager]] = None) -> None:
    """One iteration over `order`; `frozen_last`: the last layer runs frozen on a detached input (its call
    expects no backward, so the backward layout has one module fewer than the forward one). `inner`: a
    context the layers run in, inside the scope (a nested disabled scope, `torch.no_grad()`)."""
    with fp.autocast(recipe=recipe, group=dist.group.WORLD):
        with inner() if inner is not None else contextlib.nullcontext():
            h, loss = _input(step), 0.0
            for n, i in enumerate(order):
                last = n == len(order) - 1
                if last and frozen_last:
                    layers[i].requires_grad_(False)
                    h = h.detach()
                h = torch.tanh(_out(layers[i](h)))
                loss = loss + h.float().sum()
    try:
        loss.backward()
    finally:
        layers.requires_grad_(True)


def _assert_raises_here(fn, direction: str, words: str = "") -> None:
    t0 = time.monotonic()
    try:
        fn()
    except fp.AmaxLayoutMismatch as e:
        elapsed = time.monotonic() - t0
        assert elapsed < RAISE_WITHIN_S, f"rank {RANK} raised only after {elapsed:.1f}s"
        assert "fp8 autocast scope" in str(e) and direction in str(e) and words in str(e), str(e)
    else:
        raise AssertionError(f"rank {RANK}: no AmaxLayoutMismatch")


def _assert_in_step(layers) -> None:
    """The agreed layout keeps working after the mismatch, and every rank holds the same FP8 state."""
    for step in (10, 11):
        _step(layers, step)
    for buf in layers.buffers():
        if buf.is_floating_point():
            gathered = [torch.empty_like(buf) for _ in range(dist.get_world_size())]
            dist.all_gather(gathered, buf.contiguous())
            assert all(torch.equal(g, buf) for g in gathered), "FP8 state differs across ranks"


def check_extra_module_on_one_rank():
    """Iteration 3: rank 1 runs one extra FP8 Linear (forward layout changes on that rank only)."""
    layers = _layers(3, 1)
    for step in range(3):
        _step(layers, step, order=(0, 1))
    order = (0, 1, 2) if RANK == 1 else (0, 1)
    _assert_raises_here(lambda: _step(layers, 3, order=order), "forward")
    for step in (10, 11):
        _step(layers, step, order=(0, 1))


def check_missing_module_on_one_rank():
    """Iteration 3: rank 1 skips one FP8 Linear."""
    layers = _layers(3, 2)
    for step in range(3):
        _step(layers, step)
    order = (0, 1) if RANK == 1 else (0, 1, 2)
    _assert_raises_here(lambda: _step(layers, 3, order=order), "forward")
    _assert_in_step(layers)


def check_backward_layout_change_on_one_rank():
    """Iteration 3: rank 1's last layer runs frozen on a detached input; the forward layouts agree, the
    backward ones differ, and both ranks raise from the backward reduction."""
    layers = _layers(3, 3)
    for step in range(3):
        _step(layers, step)
    _assert_raises_here(lambda: _step(layers, 3, frozen_last=RANK == 1), "backward")
    _assert_in_step(layers)


def check_no_fp8_module_on_one_rank():
    """Iteration 3: rank 1 opens the scope but runs no FP8 module (its tables are empty). It joins the
    forward reduction with the empty layout, and every rank raises from that collective."""
    layers = _layers(3, 4)
    for step in range(3):
        _step(layers, step)
    order = () if RANK == 1 else (0, 1, 2)
    empty = "no FP8 tensors" if RANK == 1 else "slot counts range 0..6"
    _assert_raises_here(lambda: _step(layers, 3, order=order), "forward", empty)
    _assert_in_step(layers)


def check_fp8_disabled_on_one_rank():
    """Iteration 3: rank 1 runs its layers inside a nested `autocast(enabled=False)` (high precision): the
    enabled scope's tables are empty on that rank, which joins with the empty layout; every rank raises."""
    layers = _layers(3, 5)
    for step in range(3):
        _step(layers, step)
    inner = (lambda: fp.autocast(enabled=False)) if RANK == 1 else None
    _assert_raises_here(lambda: _step(layers, 3, inner=inner), "forward", "slot counts range 0..6")
    _assert_in_step(layers)


def check_empty_on_one_rank_from_the_first_iteration():
    """A new scope key (a recipe not used before: no layout agreed yet) whose first iteration is empty on
    rank 1: its empty check collective pairs with the other ranks' first check; every rank raises."""
    layers = _layers(3, 6)
    recipe = fp.DelayedScaling(amax_history_len=3)
    order = () if RANK == 1 else (0, 1, 2)
    _assert_raises_here(lambda: _step(layers, 0, order=order, recipe=recipe), "forward", "slot counts range 0..6")
    for step in (1, 2):  # the key then works as usual
        _step(layers, step, recipe=recipe)


def check_no_backward_on_one_rank():
    """Iteration 3: on rank 1 every FP8 call of the scope runs under `torch.no_grad()` (no backward follows),
    while rank 0 trains. The forward layouts agree, but rank 0 would wait in a backward reduction that rank 1
    never starts: both raise at the forward reduction instead, naming the backward."""
    layers = _layers(3, 7)
    for step in range(3):
        _step(layers, step)
    inner = torch.no_grad if RANK == 1 else None
    _assert_raises_here(lambda: _step(layers, 3, inner=inner), "forward", "whether a backward follows")
    _assert_in_step(layers)


print(f"layout agreement checks, seed {test_seed()}, backend {dist.get_backend()}", flush=True)
run_checks([
    ("extra_module_on_one_rank", check_extra_module_on_one_rank),
    ("missing_module_on_one_rank", check_missing_module_on_one_rank),
    ("backward_layout_change_on_one_rank", check_backward_layout_change_on_one_rank),
    ("no_fp8_module_on_one_rank", check_no_fp8_module_on_one_rank),
    ("fp8_disabled_on_one_rank", check_fp8_disabled_on_one_rank),
    ("empty_on_one_rank_from_the_first_iteration", check_empty_on_one_rank_from_the_first_iteration),
    ("no_backward_on_one_rank", check_no_backward_on_one_rank),
])
dist.destroy_process_group()
exit_now()  # skip finalization: see exit_now
