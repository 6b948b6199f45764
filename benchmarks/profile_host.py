"""Where the host time of a tiny FP8 Linear step goes, to guide host-overhead work.

Prints (0) the host time per linear of a chain of linears, BF16 against FP8, and per grouped expert linear
(8 experts, BF16 against FP8 with HYBRID and E4M3 gradients), (1) the host cost of single
building blocks (one Triton cast launch, one `_scaled_mm`, one
Float8Tensor construction, one empty autograd Function, a scope entry), (2) the host time of a tiny FP8 Linear
forward+backward against BF16's, and (3) a cProfile table of the FP8 step by own time.
    python benchmarks/profile_host.py [rows]
"""
import cProfile
import pstats
import time
from typing import Tuple

import torch

import fp8_parallel as fp
from fp8_parallel import triton_kernels
from fp8_parallel.quantize import quantize
from fp8_parallel.tensor import Float8Tensor


def host_us(fn, iters: int = 2000) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters * 1e6


class _Identity(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g


def _jit_entry(fn, *args, **kwargs):
    """`fn` with every Triton launch going through Triton's JIT entry point."""
    triton_kernels.FAST_LAUNCH = False
    try:
        return fn(*args, **kwargs)
    finally:
        triton_kernels.FAST_LAUNCH = True


def blocks() -> None:
    x = torch.randn(32, 64, device="cuda", dtype=torch.bfloat16)
    scale, amax = torch.ones(1, device="cuda"), torch.zeros(1, device="cuda")
    q = quantize(x, scale, torch.float8_e4m3fn)
    xr = x.clone().requires_grad_()
    recipe = fp.DelayedScaling()
    rows = {
        "torch.empty": lambda: torch.empty(32, 64, device="cuda"),
        "torch elementwise (x * 2)": lambda: x * 2,
        "Float8Tensor(data, scale_inv)": lambda: Float8Tensor(q._data, q._scale_inv, torch.bfloat16),
        "Triton cast (+amax), JIT entry point": lambda: _jit_entry(quantize, x, scale, torch.float8_e4m3fn, amax_out=amax),
        "Triton cast (+amax)": lambda: quantize(x, scale, torch.float8_e4m3fn, amax_out=amax),
        "Triton cast (+amax, +transpose)": lambda: quantize(x, scale, torch.float8_e4m3fn, amax_out=amax,
                                                             with_transpose=True),
        "torch._scaled_mm": lambda: torch._scaled_mm(q._data, q._data.t(), scale.reshape(()), scale.reshape(()),
                                                     out_dtype=torch.bfloat16),
        "F.linear bf16": lambda: torch.nn.functional.linear(x, x),
        "autograd.Function apply (identity)": lambda: _Identity.apply(xr),
        "autocast scope enter+exit (no module)": lambda: fp.autocast(recipe=recipe).__enter__() and None,
    }
    for name, fn in rows.items():
        if name.startswith("autocast"):
            def fn(recipe=recipe):
                with fp.autocast(recipe=recipe):
                    pass
        print(f"  {name:42s} {host_us(fn):8.1f} us")


def fastest_us(fn, per: int, iters: int, wait: bool) -> float:
    """The fastest of 5 loops of `iters` calls of `fn` (after `iters` warm-up calls), in us per call and per
    `per` (e.g. the layers a call runs). `wait`: a loop's time includes the device finishing its work; else it
    is the host's time to issue the calls."""
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        if wait:
            torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - start) / iters / per * 1e6)
        torch.cuda.synchronize()
    return best


def chain_host_us(fp8: bool, tokens: int, width: int, layers: int = 8) -> Tuple[float, float]:
    """Host time per linear of a chain of `layers` `[width, width]` linears (cached FP8 weights in one scope,
    or `torch.nn.Linear`), forward and forward + backward: the fastest of 5 loops of 10 steps, host time. The
    input is not a leaf, as inside a model."""
    if fp8:
        mods = torch.nn.Sequential(*[fp.Linear(width, width, bias=False, params_dtype=torch.bfloat16, device="cuda")
                                     for _ in range(layers)])
    else:
        mods = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False, dtype=torch.bfloat16, device="cuda")
                                     for _ in range(layers)])
    x0 = torch.randn(tokens, width, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    recipe = fp.DelayedScaling(amax_history_len=16)

    def fwd():
        y = x0 * 1.0
        if not fp8:
            return mods(y)
        with fp.autocast(recipe=recipe):
            for m in mods:
                y = m(y, is_first_microbatch=False)
        return y

    def step():
        fwd().sum().backward()

    return fastest_us(fwd, layers, 10, wait=False), fastest_us(step, layers, 10, wait=False)


def chains() -> None:
    """Host time per linear in a chain, BF16 against FP8, tiny and real sizes (pin the process to one core,
    e.g. `taskset -c 2`, for figures that repeat: unpinned they moved by up to 1.7x between processes)."""
    print("host us per linear of an 8-linear chain (fwd, fwd+bwd):")
    for tokens, width in ((32, 64), (4096, 2048)):
        bf16, ours = chain_host_us(False, tokens, width), chain_host_us(True, tokens, width)
        print(f"  {tokens}x{width}: bf16 {bf16[0]:6.1f} {bf16[1]:6.1f} | fp8 {ours[0]:6.1f} {ours[1]:6.1f} "
              f"({ours[1] / bf16[1]:.2f}x fwd+bwd)")


def grouped_us(fmt: str, fp8: bool, experts: int, width: int, splits, layers: int = 4, routed: bool = False) -> float:
    """Time per grouped expert linear (`[width, width]` per expert, `use_grouped_gemm`) of a chain of `layers`,
    forward + backward, weights cached as megatron's schedule does (a first microbatch every 4 steps): the
    fastest of 5 loops of 8 steps. `routed`: every step routes its rows anew (random splits of the same total,
    from a fixed seed, as a router's token counts change every microbatch), else `splits` every step."""
    lins = [fp.GroupedLinear(experts, width, width, bias=False, params_dtype=torch.bfloat16, device="cuda")
            for _ in range(layers)]
    for lin in lins:
        lin.use_grouped_gemm = True
    x = torch.randn(sum(splits), width, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(sum(splits), width, device="cuda", dtype=torch.bfloat16)
    recipe = fp.DelayedScaling(fp8_format=fp.Format[fmt], amax_history_len=16)
    calls = [0]
    gen = torch.Generator().manual_seed(1)
    routings = [torch.bincount(torch.multinomial(torch.ones(experts), sum(splits), True, generator=gen),
                               minlength=experts).tolist() for _ in range(48)] if routed else [splits]

    def step():  # the routings are drawn before timing: 48 steps, each with its own
        counts = routings[calls[0] % len(routings)]
        first = calls[0] % 4 == 0
        calls[0] += 1
        with fp.autocast(enabled=fp8, recipe=recipe):
            y = x * 1.0
            for lin in lins:
                y = lin(y, counts, is_first_microbatch=first)
        y.backward(dy)

    return fastest_us(step, layers, 8, wait=True)


def grouped() -> None:
    """Time per grouped expert linear, BF16 (`torch._grouped_mm`) against FP8: tiny (host time) and real sizes."""
    gen = torch.Generator().manual_seed(0)
    routed = torch.bincount(torch.multinomial(torch.rand(8, generator=gen) + 0.5, 16384, True, generator=gen),
                            minlength=8).tolist()
    print("us per grouped expert linear (8 experts), fwd+bwd; 'routed': new token counts every step:")
    for width, splits, anew in ((128, [16, 32, 0, 16, 48, 16, 16, 32], False), (2048, routed, False),
                                (2048, routed, True)):
        bf16 = grouped_us("HYBRID", False, 8, width, splits, routed=anew)
        hybrid = grouped_us("HYBRID", True, 8, width, splits, routed=anew)
        e4m3 = grouped_us("E4M3", True, 8, width, splits, routed=anew)
        print(f"  {sum(splits)} rows x {width}{' routed' if anew else ''}: bf16 {bf16:7.0f} | fp8 HYBRID {hybrid:7.0f} "
              f"({hybrid / bf16:.2f}x) | fp8 E4M3 {e4m3:7.0f} ({e4m3 / bf16:.2f}x)")


def main(rows: int = 40) -> None:
    print(torch.__version__, torch.cuda.get_device_name(0))
    chains()
    grouped()
    print("host cost of building blocks (tiny tensors, so launches are not waiting on the device):")
    blocks()
    x = torch.randn(32, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    ref = torch.nn.Linear(64, 64, dtype=torch.bfloat16, device="cuda")
    ours = fp.Linear(64, 64, params_dtype=torch.bfloat16, device="cuda")
    recipe = fp.DelayedScaling(amax_history_len=16)

    def bf16_step():
        ref(x).sum().backward()

    def fp8_step():
        with fp.autocast(recipe=recipe):
            y = ours(x)
        y.sum().backward()

    t_bf16, t_fp8 = host_us(bf16_step, 500), host_us(fp8_step, 500)
    t_jit = host_us(lambda: _jit_entry(fp8_step), 500)
    print(f"Linear 32x64x64 fwd+bwd host: bf16 {t_bf16:.1f} us, fp8 {t_fp8:.1f} us ({t_fp8 / t_bf16:.2f}x); "
          f"fp8 with Triton's JIT entry point {t_jit:.1f} us ({t_jit / t_bf16:.2f}x)")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(300):
        fp8_step()
    torch.cuda.synchronize()
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(rows)
    pstats.Stats(prof).sort_stats("cumulative").print_stats(rows)


def native_parts(iters: int = 2000) -> None:
    """Host time of the compiled path's calls and of what they are made of (tiny tensors, so launches do not
    wait on the device): where one FP8 linear's forward and backward spend it."""
    from fp8_parallel import native

    ext = native.module()
    if ext is None or not ext.with_cuda:
        print("native parts: extension not built")
        return
    e4m3 = torch.float8_e4m3fn
    x = torch.randn(32, 64, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
    scale, slot, sinv = torch.ones(2, device="cuda"), torch.zeros(4, device="cuda"), torch.ones((), device="cuda")
    qw = quantize(w, scale[:1], e4m3, with_transpose=True)
    qx = quantize(x, scale[:1], e4m3)
    qx_t = quantize(x.t().contiguous(), scale[:1], e4m3)._data
    data, t = torch.empty(32, 64, dtype=e4m3, device="cuda"), torch.empty(64, 32, dtype=e4m3, device="cuda")
    g = torch.randn(32, 64, device="cuda", dtype=torch.bfloat16)
    bw = torch.nn.Linear(64, 64, bias=False, dtype=torch.bfloat16, device="cuda")
    xg = x.clone().requires_grad_()
    mm = lambda a, b: torch._scaled_mm(a, b.t(), sinv, sinv, out_dtype=torch.bfloat16)
    rows = {
        "torch.empty (fp8)": lambda: torch.empty(32, 64, dtype=e4m3, device="cuda"),
        "cast_into, rows": lambda: ext.cast_into(x, scale, 0, data, None, sinv, slot, 0, None),
        "cast_into, rows + transpose": lambda: ext.cast_into(x, scale, 0, data, t, sinv, slot, 0, None),
        "_scaled_mm, one shape": lambda: mm(qx._data, qw._data),
        "_scaled_mm, three shapes in turn (per GEMM)": lambda: (mm(qx._data, qw._data), mm(qw._data, qw._data),
                                                                mm(qx_t, qx_t)),
        "linear_fwd (no transpose kept)": lambda: ext.linear_fwd(x, scale, slot, 0, False, False, qw._data,
                                                                 qw._scale_inv, None, None),
        "linear_fwd (transpose kept)": lambda: ext.linear_fwd(x, scale, slot, 0, True, False, qw._data,
                                                              qw._scale_inv, None, None),
        "linear_fwd (weight cast too)": lambda: ext.linear_fwd(x, scale, slot, 0, True, True, None, None, w, None),
        "linear_bwd (dgrad + wgrad)": lambda: ext.linear_bwd(g, scale, slot, 2, True, qw._transpose_cache.buffer,
                                                             None, qw._scale_inv, qx_t, None, None, sinv, True, True,
                                                             False, 0, 0, None),
        "F.linear bf16": lambda: torch.nn.functional.linear(x, w),
        "bf16 nn.Linear fwd + bwd": lambda: bw(xg).backward(g),
    }
    print("host us per call, compiled path and its parts:")
    for name, fn in rows.items():
        us = host_us(fn, iters)
        if name.startswith("_scaled_mm, three"):
            us /= 3
        print(f"  {name:50s} {us:7.1f}")


def chain_profile(rows: int = 30, tokens: int = 4096, width: int = 2048) -> None:
    """cProfile of the 8-linear FP8 chain's forward + backward (tottime order): where its host time goes."""
    import cProfile
    import pstats

    mods = torch.nn.Sequential(*[fp.Linear(width, width, bias=False, params_dtype=torch.bfloat16, device="cuda")
                                 for _ in range(8)])
    x0 = torch.randn(tokens, width, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    recipe = fp.DelayedScaling(amax_history_len=16)

    def step(first: bool) -> None:
        y = x0 * 1.0
        with fp.autocast(recipe=recipe):
            for m in mods:
                y = m(y, is_first_microbatch=first)
        y.sum().backward()

    step(True)
    for _ in range(20):
        step(False)
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(100):
        step(False)
    prof.disable()
    torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(rows)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", nargs="?", default="40",
                        help="'chain-profile', 'native-parts', or the number of profile rows to print (default 40)")
    mode = parser.parse_args().mode
    if mode == "chain-profile":
        chain_profile()
    elif mode == "native-parts":
        native_parts()
    elif mode.isdigit():
        main(int(mode))
    else:
        parser.error(f"mode {mode!r}: expected 'chain-profile', 'native-parts' or a number of rows")
