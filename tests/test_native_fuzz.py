"""Wrong arguments to every entry point of the compiled host path (`fp8_parallel/csrc`) get a Python exception
naming the argument, never a crash: each case starts from a valid call of random sizes (which must run), breaks
one argument (a shape, a dtype, a layout, a list length, a split sum, an index) and expects the extension's own
`RuntimeError`. Run it under the sanitizer build too (docs/testing.md, "The compiled path under
AddressSanitizer"), where an access out of bounds before a check is reported even when it does not crash.
"""
from __future__ import annotations

import random
from typing import Callable, Dict, List, Tuple

import pytest
import torch
from native_build import cpu_extension
from seeds import session_seed

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
FLOATS = (torch.float32, torch.bfloat16, torch.float16)
CODES = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}
HUGE = 2**62
TRIALS = 16  # random valid calls broken per mutation


def fuzz_seed() -> int:
    """A fixed seed (`FP8P_TEST_SEED` overrides it), printed so a failure can be reproduced."""
    seed = session_seed()
    print(f"test_native_fuzz: seed {seed} (FP8P_TEST_SEED={seed} reproduces)")
    return seed


@pytest.fixture(scope="module")
def ext():
    return cpu_extension()


def rand_fp8(*shape: int, dtype: torch.dtype = torch.float8_e4m3fn) -> torch.Tensor:
    return (torch.randn(shape) * 4).to(dtype)


def noncontiguous(t: torch.Tensor) -> torch.Tensor:
    """`t`'s values in a tensor of its shape and dtype that is not contiguous."""
    if t.dim() == 0:
        return t
    wide = torch.empty((*t.shape[:-1], 2 * t.shape[-1]), dtype=t.dtype)
    view = wide[..., ::2]
    view.view(torch.uint8).copy_(t.view(torch.uint8)) if t.element_size() == 1 else view.copy_(t)
    return view


Args = Dict[str, object]
Mutation = Callable[[Args, random.Random], None]

# ---------------------------------------------------------------------------------------------------- cast_into
CAST_ORDER = ("x", "scale_buf", "scale_index", "data", "t", "scale_inv", "amax_buf", "amax_index", "noop")


def cast_call(rng: random.Random) -> Args:
    m, k = rng.choice((1, 7, 16, 33)), rng.choice((8, 16, 40))  # (a [1, 1] view is contiguous at any stride)
    shape = (m, k) if rng.random() < 0.7 else (2, m, k)
    rows = shape[0] * shape[1] if len(shape) == 3 else m
    fp8 = rng.choice(FP8)
    which = rng.choice(("data", "t", "both"))
    slots = rng.randint(1, 4)
    return {"x": torch.randn(shape).to(rng.choice(FLOATS)) * 10, "scale_buf": torch.rand(slots) + 0.5,
            "scale_index": rng.randrange(slots),
            "data": torch.empty(shape, dtype=fp8) if which != "t" else None,
            "t": torch.empty(k, rows, dtype=fp8) if which != "data" else None,
            "scale_inv": torch.empty(()), "amax_buf": torch.zeros(slots) if rng.random() < 0.7 else None,
            "amax_index": rng.randrange(slots),
            "noop": torch.tensor([0], dtype=torch.int32) if rng.random() < 0.3 else None}


def _set_output(a: Args, value: Callable[[torch.Tensor], torch.Tensor]) -> None:
    key = "data" if a["data"] is not None else "t"
    a[key] = value(a[key])


CAST_MUTATIONS: Dict[str, Mutation] = {
    "x dtype": lambda a, r: a.update(x=a["x"].to(r.choice((torch.float64, torch.int32)))),
    "x 0-d": lambda a, _: a.update(x=torch.tensor(1.5)),
    "x FP8": lambda a, _: a.update(x=a["x"].float().to(torch.float8_e4m3fn)),
    "scale dtype": lambda a, _: a.update(scale_buf=a["scale_buf"].double()),
    "scale strided": lambda a, _r: a.update(scale_buf=noncontiguous(torch.rand(a["scale_buf"].numel() + 1) + 0.5)),
    "scale index": lambda a, r: a.update(scale_index=r.choice((-1, a["scale_buf"].numel(), HUGE, -HUGE))),
    "no output": lambda a, _: a.update(data=None, t=None),
    "output dtype": lambda a, r: _set_output(a, lambda o: torch.empty(o.shape, dtype=r.choice(FLOATS))),
    "output size": lambda a, r: _set_output(a, lambda o: torch.empty(o.shape[0] + r.randint(1, 3), *o.shape[1:],
                                                                      dtype=o.dtype)),
    "output strided": lambda a, _: _set_output(a, lambda o: noncontiguous(o) if o.numel() > 1 else o[None]),
    "transpose 3-d": lambda a, _: a.update(t=torch.empty(1, *a["x"].reshape(-1, a["x"].shape[-1]).t().shape,
                                                         dtype=torch.float8_e4m3fn)),
    "data / transpose formats": lambda a, _: a.update(
        data=torch.empty(a["x"].shape, dtype=FP8[0]), t=torch.empty(a["x"].reshape(-1, a["x"].shape[-1]).t().shape,
                                                                     dtype=FP8[1])),
    "scale_inv size": lambda a, r: a.update(scale_inv=torch.empty(r.choice((0, 2, 5)))),
    "scale_inv dtype": lambda a, _: a.update(scale_inv=torch.empty((), dtype=torch.float64)),
    "amax index": lambda a, r: a.update(amax_buf=torch.zeros(2), amax_index=r.choice((-1, 2, HUGE))),
    "amax dtype": lambda a, _: a.update(amax_buf=torch.zeros(4, dtype=torch.float16), amax_index=0),
    "amax strided": lambda a, _: a.update(amax_buf=noncontiguous(torch.zeros(4)), amax_index=0),
    "noop size": lambda a, r: a.update(noop=torch.zeros(r.choice((0, 2)), dtype=torch.int32)),
}


# --------------------------------------------------------------------------------------------------- linear_fwd
FWD_ORDER = ("x", "scale_buf", "amax_buf", "amax_index", "keep_t", "keep_scales", "w_data", "w_sinv", "w_hp", "bias")


def fwd_call(rng: random.Random) -> Args:
    m, k, n = rng.choice((16, 32)), rng.choice((16, 32, 48)), rng.choice((16, 32))
    dtype = rng.choice(FLOATS)
    shape = (m, k) if rng.random() < 0.7 else (2, m // 2, k)
    cached = rng.random() < 0.5
    return {"x": torch.randn(shape).to(dtype), "scale_buf": torch.rand(2) + 0.5,
            "amax_buf": torch.zeros(4) if rng.random() < 0.8 else None, "amax_index": rng.randrange(3),
            "keep_t": rng.random() < 0.5, "keep_scales": rng.random() < 0.5,
            "w_data": rand_fp8(n, k) if cached else None, "w_sinv": torch.rand(()) + 0.1 if cached else None,
            "w_hp": None if cached else torch.randn(n, k).to(dtype),
            "bias": torch.randn(n).to(dtype) if rng.random() < 0.5 else None}


def _weight(a: Args) -> torch.Tensor:
    return a["w_data"] if a["w_data"] is not None else a["w_hp"]


def _set_weight(a: Args, value: torch.Tensor) -> None:
    a["w_data" if a["w_data"] is not None else "w_hp"] = value


FWD_MUTATIONS: Dict[str, Mutation] = {
    "x dtype": lambda a, r: a.update(x=a["x"].to(r.choice((torch.float64, torch.int64)))),
    "x 0-d": lambda a, _: a.update(x=torch.tensor(2.0)),
    "x features": lambda a, r: a.update(x=torch.randn(*a["x"].shape[:-1], a["x"].shape[-1] + r.choice((-1, 1, 16)))),
    "scale short": lambda a, _: a.update(scale_buf=torch.rand(1) + 0.5, keep_scales=True),
    "scale dtype": lambda a, _: a.update(scale_buf=a["scale_buf"].half()),
    "scale strided": lambda a, _: a.update(scale_buf=noncontiguous(a["scale_buf"])),
    "amax index": lambda a, r: a.update(amax_buf=torch.zeros(4), amax_index=r.choice((-1, 4, HUGE, -HUGE))),
    "weight amax index": lambda a, _: a.update(amax_buf=torch.zeros(4), amax_index=3, w_data=None, w_sinv=None,
                                               w_hp=torch.randn(_weight(a).shape)),
    "amax dtype": lambda a, _: a.update(amax_buf=torch.zeros(4, dtype=torch.float64)),
    "both weights": lambda a, _: a.update(w_data=rand_fp8(*_weight(a).shape), w_sinv=torch.ones(()),
                                          w_hp=torch.randn(_weight(a).shape)),
    "no weight": lambda a, _: a.update(w_data=None, w_sinv=None, w_hp=None),
    "FP8 weight without scale_inv": lambda a, _: a.update(w_data=rand_fp8(*_weight(a).shape), w_sinv=None,
                                                          w_hp=None),
    "weight features": lambda a, r: _set_weight(a, _weight(a)[:, : -r.choice((1, 8))].contiguous()),
    "weight 1-d": lambda a, _: _set_weight(a, _weight(a).reshape(-1)),
    "FP8 weight dtype": lambda a, _: a.update(w_data=torch.randn(_weight(a).shape), w_sinv=torch.ones(()),
                                              w_hp=None),
    "FP8 weight strided": lambda a, _: a.update(w_data=noncontiguous(rand_fp8(*_weight(a).shape)),
                                                w_sinv=torch.ones(()), w_hp=None),
    "weight dtype": lambda a, _: a.update(w_data=None, w_sinv=None,
                                          w_hp=torch.randn(_weight(a).shape, dtype=torch.float64)),
    "weight scale_inv": lambda a, r: a.update(w_data=rand_fp8(*_weight(a).shape), w_hp=None,
                                              w_sinv=r.choice((torch.ones(2), torch.ones((), dtype=torch.float64)))),
    "bias size": lambda a, r: a.update(bias=torch.randn(_weight(a).shape[0] + r.choice((-1, 1, 16)))),
    "bias 2-d": lambda a, _: a.update(bias=torch.randn(1, _weight(a).shape[0])),
    "bias dtype": lambda a, _: a.update(bias=torch.zeros(_weight(a).shape[0], dtype=torch.int32)),
}

# --------------------------------------------------------------------------------------------------- linear_bwd
BWD_ORDER = ("g", "g_scale_buf", "g_amax_buf", "g_amax_index", "g_e5m2", "w_t", "w_ref", "w_sinv", "x_t", "x_ref",
             "saved_scales", "x_sinv", "need_dgrad", "need_wgrad", "need_bgrad", "x_dtype", "w_dtype", "main_grad")


def bwd_call(rng: random.Random) -> Args:
    m, k, n = rng.choice((16, 32)), rng.choice((16, 32, 48)), rng.choice((16, 32))
    dtype = rng.choice(FLOATS)
    w_cached, x_cached = rng.random() < 0.5, rng.random() < 0.5
    return {"g": torch.randn(m, n).to(dtype), "g_scale_buf": torch.rand(1) + 0.5,
            "g_amax_buf": torch.zeros(2) if rng.random() < 0.8 else None, "g_amax_index": rng.randrange(2),
            "g_e5m2": rng.random() < 0.5, "w_t": rand_fp8(k, n) if w_cached else None,
            "w_ref": None if w_cached else torch.randn(n, k).to(dtype), "w_sinv": torch.rand(()) + 0.1,
            "x_t": rand_fp8(k, m) if x_cached else None, "x_ref": None if x_cached else torch.randn(m, k).to(dtype),
            "saved_scales": torch.rand(2) + 0.5, "x_sinv": torch.rand(()) + 0.1, "need_dgrad": True,
            "need_wgrad": True, "need_bgrad": rng.random() < 0.5, "x_dtype": CODES[dtype], "w_dtype": CODES[dtype],
            "main_grad": torch.randn(n, k) if rng.random() < 0.3 else None}


def _k(a: Args) -> int:
    return a["w_t"].shape[0] if a["w_t"] is not None else a["w_ref"].shape[1]


BWD_MUTATIONS: Dict[str, Mutation] = {
    "g dtype": lambda a, _: a.update(g=a["g"].to(torch.float64)),
    "g 0-d": lambda a, _: a.update(g=torch.tensor(1.0)),
    "g scale index": lambda a, _: a.update(g_scale_buf=torch.ones(0)),
    "g scale strided": lambda a, _: a.update(g_scale_buf=noncontiguous(torch.ones(2))),
    "g amax index": lambda a, r: a.update(g_amax_buf=torch.zeros(2), g_amax_index=r.choice((2, -1, HUGE))),
    "x dtype code": lambda a, r: a.update(x_dtype=r.choice((-1, 3, 99))),
    "w dtype code": lambda a, r: a.update(w_dtype=r.choice((-1, 3, 99))),
    "dgrad without weight": lambda a, _: a.update(w_t=None, w_ref=None),
    "dgrad without scale_inv": lambda a, _: a.update(w_sinv=None),
    "weight scale_inv size": lambda a, _: a.update(w_sinv=torch.ones(3)),
    "weight transpose width": lambda a, r: a.update(w_t=rand_fp8(_k(a), a["g"].shape[1] + r.choice((-8, 1, 16))),
                                                    w_ref=None),
    "weight transpose dtype": lambda a, _: a.update(w_t=torch.randn(_k(a), a["g"].shape[1]), w_ref=None),
    "weight transpose strided": lambda a, _: a.update(w_t=noncontiguous(rand_fp8(_k(a), a["g"].shape[1])),
                                                      w_ref=None),
    "weight rows": lambda a, r: a.update(w_t=None, w_ref=torch.randn(a["g"].shape[1] + r.choice((-1, 1)), _k(a))),
    "re-cast without scales": lambda a, _: a.update(w_t=None, w_ref=torch.randn(a["g"].shape[1], _k(a)),
                                                    saved_scales=None),
    "re-cast scales short": lambda a, _: a.update(x_t=None, x_ref=torch.randn(a["g"].shape[0], _k(a)),
                                                  saved_scales=torch.ones(0)),
    "wgrad without input": lambda a, _: a.update(x_t=None, x_ref=None),
    "wgrad without scale_inv": lambda a, _: a.update(x_sinv=None),
    "input transpose rows": lambda a, r: a.update(x_t=rand_fp8(_k(a), a["g"].shape[0] + r.choice((-8, 1, 16))),
                                                  x_ref=None),
    "input rows": lambda a, r: a.update(x_t=None, x_ref=torch.randn(a["g"].shape[0] + r.choice((-1, 3)), _k(a))),
    "input / weight features": lambda a, _: a.update(x_t=rand_fp8(_k(a) + 16, a["g"].shape[0]), x_ref=None),
    "main_grad size": lambda a, r: a.update(main_grad=torch.zeros(a["g"].shape[1], _k(a) + r.choice((-1, 1)))),
    "main_grad dtype": lambda a, _: a.update(main_grad=torch.zeros(a["g"].shape[1], _k(a), dtype=torch.int32)),
}

# -------------------------------------------------------------------------------------------------- experts_bwd
EXP_ORDER = ("n", "k", "g_rows", "g_sinv", "splits", "w_t", "w_sinv", "x_dtype", "g_t", "x_t", "x_sinv",
             "padded_starts", "padded_rows", "need_w", "w_dtypes", "main_grads")


def experts_call(rng: random.Random) -> Args:
    experts, n, k = rng.randint(1, 4), rng.choice((16, 32)), rng.choice((16, 32))
    splits = [rng.choice((0, 16, 32)) for _ in range(experts)]
    splits[0] = splits[0] or 16  # some rows: a strided transpose buffer is then not contiguous
    padded = [(s + 15) // 16 * 16 for s in splits]
    starts = [sum(padded[:e]) for e in range(experts)]
    total = sum(padded)
    return {"n": n, "k": k, "g_rows": rand_fp8(sum(splits), n, dtype=torch.float8_e5m2),
            "g_sinv": (torch.rand(4 * experts) + 0.1)[::4], "splits": splits,
            "w_t": [rand_fp8(k, n) for _ in range(experts)], "w_sinv": [torch.rand(()) + 0.1 for _ in range(experts)],
            "x_dtype": rng.choice(list(CODES.values())), "g_t": rand_fp8(n * total, dtype=torch.float8_e5m2),
            "x_t": rand_fp8(k * total), "x_sinv": (torch.rand(4 * experts) + 0.1)[::4], "padded_starts": starts,
            "padded_rows": padded, "need_w": [rng.random() < 0.8 for _ in range(experts)],
            "w_dtypes": [rng.choice(list(CODES.values())) for _ in range(experts)],
            "main_grads": [torch.randn(n, k) if rng.random() < 0.3 else None for _ in range(experts)]}


def _some(a: Args, r: random.Random, key: str) -> int:
    """An expert index (one that needs its weight gradient, for the wgrad lists) after making sure it exists."""
    e = r.randrange(len(a["splits"]))
    if key == "wgrad":
        a["need_w"][e] = True
    return e


def _split_off(a: Args, r: random.Random) -> None:
    a["splits"][r.randrange(len(a["splits"]))] += r.choice((1, -1)) if sum(a["splits"]) else 1


def _put(a: Args, key: str, e: int, value) -> None:
    a[key] = list(a[key])
    a[key][e] = value


EXP_MUTATIONS: Dict[str, Mutation] = {
    "n / k": lambda a, r: a.update(**{r.choice(("n", "k")): r.choice((0, -16))}),
    "scale_invs count": lambda a, r: a.update(g_sinv=torch.ones(len(a["splits"]) + r.choice((1, 2)))),
    "scale_invs dtype": lambda a, _: a.update(g_sinv=torch.ones(len(a["splits"]), dtype=torch.float64)),
    "scale_invs 2-d": lambda a, _: a.update(g_sinv=torch.ones(len(a["splits"]), 1)),
    "split sum": _split_off,
    "negative split": lambda a, _: a.update(splits=[*a["splits"][:-1], -16]),
    "huge splits": lambda a, _: a.update(splits=[HUGE] * len(a["splits"])),
    "grad_output cast width": lambda a, _: a.update(g_rows=rand_fp8(a["g_rows"].shape[0], a["n"] + 16)),
    "grad_output cast dtype": lambda a, _: a.update(g_rows=torch.randn(a["g_rows"].shape)),
    "grad_output cast strided": lambda a, _: a.update(g_rows=noncontiguous(a["g_rows"])),
    "weight transposes count": lambda a, _: a.update(w_t=a["w_t"][:-1]),
    "weight scale_invs count": lambda a, _: a.update(w_sinv=[*a["w_sinv"], torch.ones(())]),
    "weight transpose shape": lambda a, r: _put(a, "w_t", _some(a, r, "dgrad"), rand_fp8(a["n"], a["k"] + 16)),
    "weight transpose dtype": lambda a, r: _put(a, "w_t", _some(a, r, "dgrad"), torch.randn(a["k"], a["n"])),
    "weight transpose strided": lambda a, r: _put(a, "w_t", _some(a, r, "dgrad"),
                                                  noncontiguous(rand_fp8(a["k"], a["n"]))),
    "weight scale_inv size": lambda a, r: _put(a, "w_sinv", _some(a, r, "dgrad"), torch.ones(2)),
    "x dtype code": lambda a, r: a.update(x_dtype=r.choice((-1, 3))),
    "input scale_invs": lambda a, r: a.update(x_sinv=r.choice((None, torch.ones(len(a["splits"]) + 1)))),
    "padded list lengths": lambda a, r: a.update(**{r.choice(("padded_starts", "padded_rows", "need_w", "w_dtypes",
                                                             "main_grads")): []}),
    "padded start": lambda a, r: _put(a, "padded_starts", _some(a, r, "wgrad"), r.choice((-16, HUGE, 10**6))),
    "padded rows": lambda a, r: _put(a, "padded_rows", _some(a, r, "wgrad"), r.choice((-16, HUGE, 10**6))),
    "weight gradient dtype code": lambda a, r: _put(a, "w_dtypes", _some(a, r, "wgrad"), 5),
    "main_grad shape": lambda a, r: _put(a, "main_grads", _some(a, r, "wgrad"), torch.zeros(a["n"], a["k"] + 1)),
    "main_grad dtype": lambda a, r: _put(a, "main_grads", _some(a, r, "wgrad"),
                                         torch.zeros(a["n"], a["k"], dtype=torch.int32)),
    "transposes dtype": lambda a, r: a.update(**{r.choice(("g_t", "x_t")): torch.zeros(64 * 64)}),
    "transposes strided": lambda a, _: a.update(g_t=noncontiguous(a["g_t"].view(a["n"], -1))),
}

ENTRY_POINTS: Dict[str, Tuple[Tuple[str, ...], Callable[[random.Random], Args], Dict[str, Mutation]]] = {
    "cast_into": (CAST_ORDER, cast_call, CAST_MUTATIONS),
    "linear_fwd": (FWD_ORDER, fwd_call, FWD_MUTATIONS),
    "linear_bwd": (BWD_ORDER, bwd_call, BWD_MUTATIONS),
    "experts_bwd": (EXP_ORDER, experts_call, EXP_MUTATIONS),
}


def _call(ext, name: str, order: Tuple[str, ...], args: Args):
    return getattr(ext, name)(*(args[key] for key in order))


@pytest.mark.parametrize("name", list(ENTRY_POINTS))
def test_native_entry_point_rejects_wrong_arguments(ext, name):
    """Every mutation of every random valid call raises the extension's error (the valid call runs first)."""
    order, make, mutations = ENTRY_POINTS[name]
    rng = random.Random(f"{fuzz_seed()}/{name}")
    torch.manual_seed(rng.randrange(2**31))
    missed: List[str] = []
    for label, mutate in mutations.items():
        for trial in range(TRIALS):
            args = make(rng)
            _call(ext, name, order, args)  # the unbroken call is valid
            mutate(args, rng)
            try:
                _call(ext, name, order, args)
            except RuntimeError as err:
                assert "fp8_parallel native" in str(err), (label, trial, str(err))
                continue
            missed.append(f"{label} (trial {trial})")
    assert not missed, f"{name} accepted wrong arguments: {missed}"
