"""Where the host time of a tiny FP8 Linear step goes, to guide host-overhead work.

Prints (0) the host time per linear of a chain of linears, BF16 against FP8, (1) the host cost of single
building blocks (one Triton cast launch, one `_scaled_mm`, one
Float8Tensor construction, one empty autograd Function, a scope entry), (2) the host time of a tiny FP8 Linear
forward+backward against BF16's, and (3) a cProfile table of the FP8 step by own time.
    python benchmarks/profile_host.py [rows]
"""
import cProfile
import pstats
import sys
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


def chain_host_us(fp8: bool, tokens: int, width: int, layers: int = 8) -> Tuple[float, float]:
    """Host time per linear of a chain of `layers` `[width, width]` linears (cached FP8 weights in one scope,
    or `torch.nn.Linear`), forward and forward + backward: the fastest of 5 loops of 10 steps. The input is not
    a leaf, as inside a model."""
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

    out = []
    for f in (fwd, step):
        for _ in range(5):
            f()
        torch.cuda.synchronize()
        best = float("inf")
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(10):
                f()
            best = min(best, (time.perf_counter() - start) / 10 / layers * 1e6)
            torch.cuda.synchronize()
        out.append(best)
    return out[0], out[1]


def chains() -> None:
    """Host time per linear in a chain, BF16 against FP8, tiny and real sizes (pin the process to one core,
    e.g. `taskset -c 2`, for figures that repeat: unpinned they moved by up to 1.7x between processes)."""
    print("host us per linear of an 8-linear chain (fwd, fwd+bwd):")
    for tokens, width in ((32, 64), (4096, 2048)):
        bf16, ours = chain_host_us(False, tokens, width), chain_host_us(True, tokens, width)
        print(f"  {tokens}x{width}: bf16 {bf16[0]:6.1f} {bf16[1]:6.1f} | fp8 {ours[0]:6.1f} {ours[1]:6.1f} "
              f"({ours[1] / bf16[1]:.2f}x fwd+bwd)")


def main(rows: int = 40) -> None:
    print(torch.__version__, torch.cuda.get_device_name(0))
    chains()
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


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 40)
