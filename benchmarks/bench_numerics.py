"""Fused quantize (+amax, +transpose) vs copy bandwidth and eager torch; FP8 GEMM wrapper vs raw _scaled_mm."""
from __future__ import annotations


import torch

from common import cli, bench_ms, copy_bandwidth_gbs, dump, graph_ms, record
from fp8_parallel.gemm import fp8_gemm
from fp8_parallel.quantize import quantize, quantize_row_blocks


def bench_quantize() -> None:
    copy_gbs = copy_bandwidth_gbs()
    record("quantize", "device copy", "GB/s", copy_gbs)
    m, n = 16384, 4096
    x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    scale, slot = torch.full((1,), 40.0, device="cuda"), torch.zeros(1, device="cuda")
    out = quantize(x, scale, torch.float8_e4m3fn, with_transpose=True)
    for name, with_t, force_torch in [
        ("fused +amax +transpose", True, False), ("fused +amax", False, False),
        ("eager torch +amax +transpose", True, True), ("eager torch +amax", False, True),
    ]:
        call = lambda: quantize(x, scale, torch.float8_e4m3fn, amax_out=slot, with_transpose=with_t, out=out,
                                force_torch=force_torch)
        nbytes = x.numel() * (2 + 1 + (1 if with_t else 0))
        for how, ms in (("graph", graph_ms(call)), ("eager", bench_ms(call, inner=10))):
            gbs = nbytes / (ms * 1e-3) / 1e9
            record("quantize", f"16384x4096 {name} ({how})", "GB/s", gbs, "copy bandwidth", gbs / copy_gbs)


def bench_native_cast() -> None:
    """The compiled extension's cast kernels against the Triton kernels (the same bytes), bf16 -> E4M3 with
    amax, with and without the transpose, device time of graph replays; skipped without the extension."""
    from fp8_parallel import native

    ext = native.module()
    if ext is None or not ext.with_cuda:
        print("native cast: extension not built, skipped")
        return
    copy_gbs = copy_bandwidth_gbs()
    for m, n in ((16384, 4096), (16384, 14336), (4096, 14336), (8192, 8192)):
        x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        scale, slot = torch.full((1,), 40.0, device="cuda"), torch.zeros(1, device="cuda")
        out = quantize(x, scale, torch.float8_e4m3fn, with_transpose=True)
        for with_t in (True, False):
            call = lambda: quantize(x, scale, torch.float8_e4m3fn, amax_out=slot, with_transpose=with_t, out=out)
            nbytes = x.numel() * (2 + 1 + (1 if with_t else 0))
            triton_ms = None
            for name in ("triton", "native"):
                previous = native.use(ext if name == "native" else None)
                try:
                    ms = graph_ms(call)
                finally:
                    native.use(previous)
                gbs = nbytes / (ms * 1e-3) / 1e9
                base, ratio = ("copy bandwidth", gbs / copy_gbs) if name == "triton" else ("triton kernel", triton_ms / ms)
                record("quantize", f"{m}x{n} {'+T' if with_t else 'no T'} {name}", "GB/s", gbs, base, ratio)
                triton_ms = ms


def bench_row_blocks() -> None:
    """The experts' cast (`quantize_row_blocks`: 8 row blocks of uneven sizes, each with its own scale and
    amax slot, one launch, outputs allocated per call as the grouped experts do) against one per-tensor fused
    cast of the same tensor, both with the transpose."""
    gen = torch.Generator().manual_seed(0)
    for m, n in ((16384, 2048), (16384, 4096)):
        splits = torch.bincount(torch.multinomial(torch.rand(8, generator=gen) + 0.5, m, True, generator=gen),
                                minlength=8).tolist()
        x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        scales = [torch.full((1,), 40.0, device="cuda") for _ in splits]
        slots = [torch.zeros(1, device="cuda") for _ in splits]
        nbytes = x.numel() * 4
        whole = bench_ms(lambda: quantize(x, scales[0], torch.float8_e4m3fn, amax_out=slots[0], with_transpose=True),
                         inner=10)
        for layout, one_matrix in (("per-block transposes", False), ("one transposed matrix", True)):
            ms = bench_ms(lambda: quantize_row_blocks(x, splits, scales, slots, torch.float8_e4m3fn, True,
                                                      one_matrix=one_matrix), inner=10)
            record("quantize", f"{m}x{n} 8 row blocks +T, {layout}", "GB/s", nbytes / (ms * 1e-3) / 1e9,
                   "one per-tensor cast +T", whole / ms)


def bench_gemm() -> None:
    for m, k, n in [(8192, 8192, 8192), (16384, 4096, 14336), (4096, 4096, 4096)]:
        a = quantize(torch.randn(m, k, device="cuda"), torch.full((1,), 64.0, device="cuda"), torch.float8_e4m3fn)
        b = quantize(torch.randn(n, k, device="cuda"), torch.full((1,), 64.0, device="cuda"), torch.float8_e4m3fn)
        sa, sb = a._scale_inv.reshape(()), b._scale_inv.reshape(())
        raw_call = lambda: torch._scaled_mm(a._data, b._data.t(), scale_a=sa, scale_b=sb,
                                            out_dtype=torch.bfloat16, use_fast_accum=True)
        ours_call = lambda: fp8_gemm(a, b, torch.bfloat16, use_fast_accum=True)
        raw, ours = [], []
        for _ in range(3):  # interleaved repeats: clocks and order effects hit both equally
            raw.append(bench_ms(raw_call, inner=10, iters=20))
            ours.append(bench_ms(ours_call, inner=10, iters=20))
        raw, ours = sorted(raw)[1], sorted(ours)[1]
        tflops = 2 * m * n * k / (ours * 1e-3) / 1e12
        record("gemm", f"{m}x{k}x{n} wrapper (eager)", "TFLOP/s", tflops, "raw _scaled_mm time", raw / ours)
        raw_g, ours_g = graph_ms(raw_call), graph_ms(ours_call)  # device time only
        record("gemm", f"{m}x{k}x{n} wrapper (graph)", "TFLOP/s", 2 * m * n * k / (ours_g * 1e-3) / 1e12,
               "raw _scaled_mm time", raw_g / ours_g)
        hp_a, hp_b = torch.randn(m, k, device="cuda", dtype=torch.bfloat16), torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        bf16 = bench_ms(lambda: hp_a @ hp_b.t(), inner=10, iters=20)
        record("gemm", f"{m}x{k}x{n} fp8 vs bf16", "speedup", bf16 / ours, "bf16 matmul time", bf16 / ours)


if __name__ == "__main__":
    out = cli(__doc__).results
    bench_quantize()
    bench_native_cast()
    bench_row_blocks()
    bench_gemm()
    dump(out)
