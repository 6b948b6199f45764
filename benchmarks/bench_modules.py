"""FP8 MLP (fc1 -> gelu -> fc2) forward+backward: ours (eager, delayed scaling) vs bf16 eager and torchao
Float8Linear with torch.compile, with peak memory; MoE experts (grouped linears) with the grouped FP8 GEMM
against the per-expert FP8 GEMMs and BF16 (per-expert and torch's grouped GEMM); and the host overhead of a
tiny FP8 Linear."""
from __future__ import annotations

import time

import torch

import fp8_parallel as fp
from common import cli, bench_ms, dump, record


class _BF16MLP(torch.nn.Module):
    def __init__(self, d: int, f: int):
        super().__init__()
        self.fc1 = torch.nn.Linear(d, f, bias=False, dtype=torch.bfloat16, device="cuda")
        self.fc2 = torch.nn.Linear(f, d, bias=False, dtype=torch.bfloat16, device="cuda")

    def forward(self, x):
        return self.fc2(torch.nn.functional.gelu(self.fc1(x)))


class _FP8MLP(torch.nn.Module):
    def __init__(self, d: int, f: int):
        super().__init__()
        self.fc1 = fp.Linear(d, f, bias=False, params_dtype=torch.bfloat16, device="cuda")
        self.fc2 = fp.Linear(f, d, bias=False, params_dtype=torch.bfloat16, device="cuda")
        self.recipe = fp.DelayedScaling(amax_history_len=16)

    def forward(self, x):
        with fp.autocast(recipe=self.recipe):
            return self.fc2(torch.nn.functional.gelu(self.fc1(x)))


def _step(model, x, grad):
    def run():
        for p in model.parameters():
            p.grad = None
        x.grad = None
        model(x).backward(grad)
    return run


def _peak_gib(fn) -> float:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**30


def bench_mlp(d: int, f: int, tokens: int) -> None:
    x = torch.randn(tokens, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(tokens, d, device="cuda", dtype=torch.bfloat16)
    case = f"D={d} F={f} T={tokens}"
    bf16 = _BF16MLP(d, f)
    t_bf16 = bench_ms(_step(bf16, x, grad), iters=20)
    t3_bf16 = bench_ms(_step(bf16, x, grad), iters=10, inner=3)
    m_bf16 = _peak_gib(_step(bf16, x, grad))
    record("mlp", f"{case} bf16 eager", "ms", t_bf16)
    record("mlp", f"{case} bf16 eager, 3 back to back", "ms", t3_bf16)
    record("mlp", f"{case} bf16 eager", "peak GiB", m_bf16)
    ours = _FP8MLP(d, f)
    with torch.no_grad():
        ours.fc1.weight.copy_(bf16.fc1.weight)
        ours.fc2.weight.copy_(bf16.fc2.weight)
    t_ours = bench_ms(_step(ours, x, grad), iters=20)
    t3_ours = bench_ms(_step(ours, x, grad), iters=10, inner=3)
    m_ours = _peak_gib(_step(ours, x, grad))
    record("mlp", f"{case} fp8_parallel eager", "ms", t_ours, "bf16 eager time", t_bf16 / t_ours)
    record("mlp", f"{case} fp8_parallel eager, 3 back to back", "ms", t3_ours, "bf16 eager time", t3_bf16 / t3_ours)
    record("mlp", f"{case} fp8_parallel eager", "peak GiB", m_ours, "bf16 peak", m_ours / m_bf16)
    del ours
    try:
        from torchao.float8 import convert_to_float8_training
    except Exception as e:  # torchao is optional here
        print(f"torchao not available: {e}")
        return
    ao = _BF16MLP(d, f)
    ao.load_state_dict(bf16.state_dict())
    convert_to_float8_training(ao)
    ao_c = torch.compile(ao)
    t_ao = bench_ms(_step(ao_c, x, grad), warmup=3, iters=20)
    m_ao = _peak_gib(_step(ao_c, x, grad))
    record("mlp", f"{case} torchao+compile", "ms", t_ao, "bf16 eager time", t_bf16 / t_ao)
    record("mlp", f"{case} torchao+compile", "peak GiB", m_ao, "bf16 peak", m_ao / m_bf16)
    record("mlp", f"{case} fp8_parallel vs torchao", "speedup", t_ao / t_ours, "torchao+compile time", t_ao / t_ours)


class _Experts(torch.nn.Module):
    """fc1 -> gelu -> fc2 over experts' row blocks: our GroupedLinear (FP8 in a scope, or BF16 with
    `fp8=False`), or BF16 per-expert `F.linear` / torch's grouped GEMM (`bf16_impl`) on the same weights."""

    def __init__(self, e: int, d: int, f: int, fp8: bool, bf16_impl: str = "", cache_weights: bool = False,
                 fp8_format=fp.Format.HYBRID):
        super().__init__()
        self.first = True if cache_weights else None  # is_first_microbatch: True once, then False (cached casts)
        self.fc1 = fp.GroupedLinear(e, d, f, bias=False, params_dtype=torch.bfloat16, device="cuda")
        self.fc2 = fp.GroupedLinear(e, f, d, bias=False, params_dtype=torch.bfloat16, device="cuda")
        self.fc1.use_grouped_gemm = self.fc2.use_grouped_gemm = True  # GROUPED_GEMM decides per variant
        self.fp8, self.bf16_impl, self.e = fp8, bf16_impl, e
        self.recipe = fp.DelayedScaling(fp8_format=fp8_format, amax_history_len=16)

    def _weights(self, lin):
        return [getattr(lin, f"weight{i}") for i in range(self.e)]

    def _bf16(self, lin, x, splits, offs):
        if self.bf16_impl == "grouped":
            return torch._grouped_mm(x, torch.stack(self._weights(lin)).transpose(1, 2), offs=offs)
        return torch.cat([torch.nn.functional.linear(c, w) for c, w in zip(torch.split(x, splits), self._weights(lin))])

    def forward(self, x, splits, offs):
        if self.bf16_impl:
            return self._bf16(self.fc2, torch.nn.functional.gelu(self._bf16(self.fc1, x, splits, offs)), splits, offs)
        first, self.first = self.first, (False if self.first is not None else None)
        with fp.autocast(enabled=self.fp8, recipe=self.recipe):
            h = torch.nn.functional.gelu(self.fc1(x, splits, is_first_microbatch=first))
            return self.fc2(h, splits, is_first_microbatch=first)


def bench_experts(e: int, d: int, f: int, tokens: int) -> None:
    """MoE experts fc1 -> gelu -> fc2, forward+backward and forward alone, uneven routing (fixed seed)."""
    from fp8_parallel.modules import _grouped_core

    gen = torch.Generator().manual_seed(0)
    counts = torch.bincount(torch.multinomial(torch.rand(e, generator=gen) + 0.5, tokens, True, generator=gen),
                            minlength=e)
    splits = counts.tolist()
    offs = torch.cumsum(counts, 0).to(torch.int32).cuda()
    x = torch.randn(tokens, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(tokens, d, device="cuda", dtype=torch.bfloat16)
    case = f"E={e} D={d} F={f} T={tokens}"
    base = _Experts(e, d, f, fp8=False, bf16_impl="loop")
    variants = [("bf16 per-expert F.linear", base, None), ("bf16 torch._grouped_mm", None, None),
                ("fp8 per-expert", None, False), ("fp8 grouped", None, True),
                ("fp8 per-expert, cached weight casts", None, False), ("fp8 grouped, cached weight casts", None, True),
                ("fp8 grouped, cached weight casts, E4M3 gradients", None, True)]
    times = {}
    for name, model, grouped in variants:
        if model is None:
            model = _Experts(e, d, f, fp8=grouped is not None, bf16_impl="grouped" if grouped is None else "",
                             cache_weights="cached" in name,
                             fp8_format=fp.Format.E4M3 if "E4M3" in name else fp.Format.HYBRID)
            model.load_state_dict(base.state_dict(), strict=False)
        if grouped is not None:
            _grouped_core.GROUPED_GEMM = grouped

        def step(model=model):
            for p in model.parameters():
                p.grad = None
            x.grad = None
            model(x, splits, offs).backward(grad)

        def forward(model=model):
            with torch.no_grad():
                model(x, splits, offs)
        try:
            times[name] = bench_ms(step, iters=20), bench_ms(forward, iters=20)
        except Exception as err:  # torch's BF16 grouped GEMM may be missing or refuse a layout
            print(f"experts {case} {name}: {type(err).__name__}: {err}")
            continue
        ref = times.get("bf16 per-expert F.linear")
        for label, i in (("fwd+bwd", 0), ("fwd", 1)):
            ratio = ref[i] / times[name][i] if ref else float("nan")
            record("experts", f"{case} {name} {label}", "ms", times[name][i], "bf16 per-expert time", ratio)
    _grouped_core.GROUPED_GEMM = True


def _host_ms(fn, iters: int = 300) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters * 1e3


def bench_host_overhead() -> None:
    """Tiny shapes, so the host (Python + launches) is what costs."""
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

    t_ref, t_ours, t_floor = _host_ms(bf16_step), _host_ms(fp8_step), _host_ms(_bare_fp8_launches(x, ours.weight.detach()))
    record("host", "Linear 32x64x64 bf16 fwd+bwd", "ms", t_ref)
    record("host", "Linear 32x64x64 fp8 fwd+bwd+scope", "ms", t_ours, "bf16 host time", t_ours / t_ref)
    record("host", "bare FP8 launches, no autograd", "ms", t_floor, "bf16 host time", t_floor / t_ref)


def _bare_fp8_launches(x: torch.Tensor, w: torch.Tensor):
    """A floor for the FP8 step's host time: only the kernels it cannot do without (input and weight casts,
    three FP8 GEMMs, the grad_output cast with its transpose, the two transpose re-casts, the bias gradient,
    one fused amax update per direction), launched back to back with no autograd and no scope logic."""
    from fp8_parallel import triton_kernels
    from fp8_parallel.quantize import quantize, quantize_transposed

    e4, e5 = torch.float8_e4m3fn, torch.float8_e5m2
    x, g = x.detach(), torch.randn_like(x)
    scale, amax, hist = torch.ones(3, device="cuda"), torch.zeros(3, device="cuda"), torch.zeros(3, 16, device="cuda")
    counts = torch.zeros(3, dtype=torch.int64, device="cuda")
    addr = torch.tensor([[hist[i].data_ptr() for i in range(3)], [scale[i:].data_ptr() for i in range(3)],
                         [counts[i:].data_ptr() for i in range(3)]], dtype=torch.int64, device="cuda")

    def mm(a, b):
        return torch._scaled_mm(a._data, b._data.t(), a._scale_inv, b._scale_inv, out_dtype=torch.bfloat16)

    def step():
        qx = quantize(x, scale[0:1], e4, amax_out=amax[0:1])
        qw = quantize(w, scale[1:2], e4, amax_out=amax[1:2])
        mm(qx, qw)
        triton_kernels.amax_update(amax[0:2], addr[:, 0:2], 16, 448.0, 0, False)
        qg = quantize(g, scale[2:3], e5, amax_out=amax[2:3], with_transpose=True)
        mm(qg, quantize_transposed(w, scale[1:2], e4))
        mm(qg.transpose_2d(update_cache=False), quantize_transposed(x, scale[0:1], e4))
        g.sum(0)
        triton_kernels.amax_update(amax[2:3], addr[:, 2:3], 16, 57344.0, 0, False)

    return step


if __name__ == "__main__":
    out = cli(__doc__).results
    bench_host_overhead()
    bench_mlp(4096, 14336, 16384)
    bench_mlp(8192, 28672, 8192)
    bench_experts(8, 2048, 1408, 16384)
    bench_experts(8, 4096, 2048, 16384)
    dump(out)
