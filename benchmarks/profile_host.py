"""Where the host time of a tiny FP8 Linear step goes, to guide host-overhead work.

Prints (1) the host cost of single building blocks (one Triton cast launch, one `_scaled_mm`, one
Float8Tensor construction, one empty autograd Function, a scope entry), (2) the host time of a tiny FP8 Linear
forward+backward against BF16's, and (3) a cProfile table of the FP8 step by own time.
    python benchmarks/profile_host.py [rows]
"""
import cProfile
import pstats
import sys
import time

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


def main(rows: int = 40) -> None:
    print(torch.__version__, torch.cuda.get_device_name(0))
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
