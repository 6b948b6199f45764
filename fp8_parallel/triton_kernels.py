"""Triton kernels (CUDA only): fused quantize (+amax, +transpose), fused amax-history update."""
from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import torch

from .recipe import fp8_max

try:
    import triton
    import triton.language as tl

    AVAILABLE = torch.cuda.is_available()
except ImportError:  # CPU-only installs
    AVAILABLE = False

FAST_LAUNCH = True  # launch cached compiled kernels directly (False: always through Triton's JIT entry point)


def _specialization(arg: Any) -> Any:
    """What Triton specializes a compiled kernel on, for one scalar argument: an integer's width, being 1 and
    divisibility by 16 (floats and None are not specialized; tensors are keyed by `_Launcher._key`)."""
    if isinstance(arg, bool) or not isinstance(arg, int):
        return type(arg)
    return -(2**31) <= arg < 2**31, arg == 1, arg % 16 == 0


def _hooked(hook: Any) -> bool:
    """Whether a Triton launch hook is set (a hook chain with calls, or a plain callable)."""
    return bool(getattr(hook, "calls", hook))


class _Launcher:
    """Launches one Triton kernel. The first launch of a specialization goes through Triton's JIT entry point
    (which compiles and binds); later ones call the compiled kernel directly. Measured on H200 with Triton 3.6,
    the entry point's per-call argument binding and launch-metadata work cost tens of microseconds of host
    time, several times the launch itself (docs/benchmarks.md). Launch hooks (profilers) take the JIT path.

    `tensors`: how many leading arguments are tensors (the kernels' pointers); the rest are scalars. The key
    of a launch is built from those two runs of arguments directly, without a call per argument."""

    def __init__(self, kernel: Any, tensors: int) -> None:
        self.kernel = kernel
        self.tensors = tensors
        self._compiled: Dict[Tuple, Any] = {}
        self._runtime: Any = None  # (current device, current stream, Triton's runtime knobs), bound on first use

    def _bind_runtime(self) -> Tuple[Any, Any, Any]:
        from triton import knobs
        from triton.runtime import driver

        active = driver.active
        self._runtime = (active.get_current_device, active.get_current_stream, knobs.runtime)
        return self._runtime

    def _key(self, args: Tuple) -> Tuple:
        n = self.tensors
        return (tuple((a.dtype, a.data_ptr() % 16 == 0) for a in args[:n]),
                tuple(_specialization(a) for a in args[n:]))

    def __call__(self, grid: Tuple[int, ...], args: Tuple, constexprs: Tuple, num_warps: int) -> None:
        current_device, current_stream, runtime = self._runtime or self._bind_runtime()
        device = current_device()
        key = (device, num_warps, constexprs, self._key(args))
        compiled = self._compiled.get(key) if FAST_LAUNCH else None
        if compiled is None or _hooked(runtime.launch_enter_hook) or _hooked(runtime.launch_exit_hook):
            compiled = self.kernel[grid](*args, *constexprs, num_warps=num_warps)
            if all(hasattr(compiled, a) for a in ("run", "function", "packed_metadata")):
                self._compiled[key] = compiled
            return
        grid = (*grid, 1, 1)
        compiled.run(grid[0], grid[1], grid[2], current_stream(device), compiled.function, compiled.packed_metadata,
                     None, None, None, *args, *constexprs)

if AVAILABLE or __import__("os").environ.get("TRITON_INTERPRET") == "1":
    import triton
    import triton.language as tl

    @triton.jit
    def _quantize_kernel(
        x_ptr, data_ptr, t_ptr, scale_ptr, scale_inv_ptr, amax_ptr, noop_ptr,
        M, N, stride_xm, fp8_max,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        WITH_T: tl.constexpr, WITH_AMAX: tl.constexpr, WITH_NOOP: tl.constexpr,
        WITH_DATA: tl.constexpr = True,
    ):
        if WITH_NOOP:
            if tl.load(noop_ptr) != 0:
                return
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
        scale = tl.load(scale_ptr)
        y = tl.clamp(x * scale, -fp8_max, fp8_max, propagate_nan=tl.PropagateNan.ALL)
        y8 = y.to(t_ptr.dtype.element_ty)
        if WITH_DATA:
            tl.store(data_ptr + offs_m[:, None] * N + offs_n[None, :], y8, mask=mask)
        if WITH_T:  # store the transposed tile with M contiguous, so the writes coalesce
            tl.store(t_ptr + offs_n[:, None] * M + offs_m[None, :], tl.trans(y8), mask=tl.trans(mask))
        if WITH_AMAX:
            ax = tl.abs(x)
            ax = tl.where(ax != ax, float("inf"), ax)  # NaN -> +inf: recorded as non-finite
            tl.atomic_max(amax_ptr, tl.max(tl.max(ax, axis=1), axis=0))
        if (pid_m == 0) & (pid_n == 0):
            # IEEE division (Triton's `/` rounds approximately): scale_inv equals torch's `1 / scale` bit for bit
            tl.store(scale_inv_ptr, tl.math.div_rn(1.0, scale))


def quantize_2d(
    x: torch.Tensor,
    scale: torch.Tensor,
    data: Optional[torch.Tensor],
    scale_inv: torch.Tensor,
    transpose: Optional[torch.Tensor],
    amax_out: Optional[torch.Tensor],
    noop_flag: Optional[torch.Tensor],
) -> None:
    """Fused cast of `x` (viewed as `[M, N]`) into the FP8 tensors `data` (`[M, N]`) and `transpose`
    (`[N, M]`), `1 / scale` into `scale_inv`, amax into `amax_out`. `data=None` writes the transpose only.

    32-bit inputs: the kernel writes the row-major data (and amax) only, and the transpose is a copy of those
    FP8 bytes. Measured on H200 (Triton 3.6): the kernel's transposed store from a float32 tile wrote about a
    quarter of the transpose wrong whenever the sizes were multiples of 16 (so the store was vectorized); the
    E5M2 grad_output transpose then held NaN bytes and every float32 weight gradient came out NaN. The
    row-major store is exact for every input dtype, and 16-bit inputs are exact with the fused transpose.
    """
    x2 = x.detach().reshape(-1, x.shape[-1]) if x.dim() != 2 else x.detach()
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M, N = x2.shape
    if transpose is not None and x2.element_size() > 2:
        _quantize_then_transpose(x2, scale, data, scale_inv, transpose, amax_out, noop_flag)
        return
    # tiles measured on H200 (docs/benchmarks.md): 64x128 beat 64x64 by 4-7% with the transpose at every
    # shape tried; without it 32x256
    block_m, block_n = (64, 128) if transpose is not None else (32, 256)
    grid = (-(-M // block_m), -(-N // block_n))  # plain ints: triton.cdiv is a slow constexpr function call
    with_data = data is not None
    fp8 = data if with_data else transpose
    _QUANTIZE(
        grid,
        (x2, fp8, transpose if transpose is not None else fp8, scale, scale_inv,
         amax_out if amax_out is not None else scale_inv, noop_flag if noop_flag is not None else scale_inv,
         M, N, x2.stride(0), fp8_max(fp8.dtype)),
        (block_m, block_n, transpose is not None, amax_out is not None, noop_flag is not None, with_data),
        num_warps=4 if transpose is not None else 8,
    )


def _quantize_then_transpose(x2, scale, data, scale_inv, transpose, amax_out, noop_flag) -> None:
    """The fused cast without its transposed store, then the transpose as a copy of the FP8 bytes (the
    32-bit-input path of `quantize_2d`). A set `noop_flag` leaves the data, and so the transpose, unchanged."""
    from .tensor import _fill_transpose

    rows = data.view(x2.shape) if data is not None else torch.empty(x2.shape, dtype=transpose.dtype, device=x2.device)
    quantize_2d(x2, scale, rows, scale_inv, None, amax_out, noop_flag)
    _fill_transpose(transpose, rows, noop_flag)


if AVAILABLE or __import__("os").environ.get("TRITON_INTERPRET") == "1":

    @triton.jit
    def _quantize_blocks_kernel(
        x_ptr, data_ptr, t_ptr, table_ptr, sinv_ptr, row_sinv_ptr,
        N, stride_xm, fp8_max, padded_total,
        E: tl.constexpr, SINV_STRIDE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        WITH_T: tl.constexpr, ONE_MATRIX: tl.constexpr,
    ):
        """The fused cast of consecutive row blocks of x, block e with its own scale and amax slot.

        `table_ptr`: int64 `[6, E]`: the blocks' scale addresses, amax slot addresses, row ends, padded starts,
        padded rows and first tiles. A program casts one tile of BLOCK_M rows of one block (block e owns tiles
        `first_e ...`), so its scale and amax slot are one each, and the rows of its transposed tile are
        contiguous in the transpose (coalesced stores). Block e's transpose is stored in the first rows_e
        columns of `[N, padded_rows_e]` at `t_ptr + N * padded_start_e`, or (ONE_MATRIX) in columns
        `padded_start_e ...` of one `[N, padded_total]` matrix; its padding columns are written with zeros
        (an empty block's, which no tile covers, stay as allocated).
        `row_sinv[r]` gets 1 / scale of r's block; `sinv[SINV_STRIDE * e]` 1 / scale_e (16-byte aligned, see
        `quantize.RowBlocks`)."""
        pid_t = tl.program_id(0)
        pid_n = tl.program_id(1)
        block = 0
        for j in tl.static_range(1, E):
            block += (tl.load(table_ptr + 5 * E + j) <= pid_t).to(tl.int32)
        end = tl.load(table_ptr + 2 * E + block)
        start = tl.where(block > 0, tl.load(table_ptr + 2 * E + tl.maximum(block - 1, 0)), 0)
        local = (pid_t - tl.load(table_ptr + 5 * E + block)) * BLOCK_M + tl.arange(0, BLOCK_M)  # rows in the block
        offs_m = start + local
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = offs_m < end
        scale = tl.load(tl.load(table_ptr + block).to(tl.pointer_type(tl.float32)))
        mask = row_ok[:, None] & (offs_n[None, :] < N)
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
        y = tl.clamp(x * scale, -fp8_max, fp8_max, propagate_nan=tl.PropagateNan.ALL)
        y8 = y.to(data_ptr.dtype.element_ty)
        tl.store(data_ptr + offs_m[:, None] * N + offs_n[None, :], y8, mask=mask)
        if WITH_T:  # the transposed tile, its rows contiguous (the block's rows): the writes coalesce
            padded_start = tl.multiple_of(tl.load(table_ptr + 3 * E + block), 16)
            padded_rows = tl.multiple_of(tl.load(table_ptr + 4 * E + block), 16)
            if ONE_MATRIX:  # one [N, padded_total] matrix, block e in columns padded_start_e ...
                t_off = offs_n[:, None].to(tl.int64) * padded_total + (padded_start + local)[None, :]
            else:  # block e's own [N, padded_rows_e] matrix from element N * padded_start_e
                t_off = padded_start * N + offs_n[:, None].to(tl.int64) * padded_rows + local[None, :]
            # the block's padding rows too (zeros: masked out of the load), so the mask is constant over 16
            # rows and the stores vectorize (a mask at the block's end, not a multiple of 16, would split them
            # into single bytes: measured 5x slower)
            t_mask = (offs_n[:, None] < N) & (local[None, :] < padded_rows)
            tl.store(t_ptr + t_off, tl.trans(y8), mask=t_mask)
        ax = tl.abs(x)
        ax = tl.where(ax != ax, float("inf"), ax)  # NaN -> +inf: recorded as non-finite
        amax_ptr = tl.load(table_ptr + E + block).to(tl.pointer_type(tl.float32))
        tl.atomic_max(amax_ptr, tl.max(tl.max(ax, axis=1), axis=0))  # one atomic per tile
        if pid_n == 0:  # IEEE division, as `quantize`
            tl.store(row_sinv_ptr + offs_m, tl.zeros([BLOCK_M], tl.float32) + tl.math.div_rn(1.0, scale), mask=row_ok)
        if (pid_t == 0) & (pid_n == 0):
            for j in tl.static_range(E):
                scale_j = tl.load(tl.load(table_ptr + j).to(tl.pointer_type(tl.float32)))
                tl.store(sinv_ptr + SINV_STRIDE * j, tl.math.div_rn(1.0, scale_j))

    @triton.jit
    def _amax_update_kernel(
        amax_ptr, hist_addr_ptr, scale_addr_ptr, count_addr_ptr,
        L, fp8_max, margin_div, float32_max,
        BLOCK_L: tl.constexpr, MOST_RECENT: tl.constexpr,
    ):
        """One program per FP8 tensor: roll its history in place, recompute its scale, count non-finite."""
        i = tl.program_id(0)
        a = tl.load(amax_ptr + i)
        hist_ptr = tl.load(hist_addr_ptr + i).to(tl.pointer_type(tl.float32))
        scale_ptr = tl.load(scale_addr_ptr + i).to(tl.pointer_type(tl.float32))
        count_ptr = tl.load(count_addr_ptr + i).to(tl.pointer_type(tl.int64))
        nonfinite = (a != a) | (a == float("inf"))
        rolls = (a > 0) & (~nonfinite)
        offs = tl.arange(0, BLOCK_L)
        prev = tl.load(hist_ptr + offs - 1, mask=(offs > 0) & (offs < L), other=0.0)
        new_hist = tl.where(offs == 0, a, prev)
        if MOST_RECENT:
            amax = a
        else:
            amax = tl.max(tl.where(offs < L, new_hist, 0.0), axis=0)
        old_scale = tl.load(scale_ptr)
        sf = tl.math.div_rn(tl.math.div_rn(fp8_max, amax), margin_div)  # IEEE division, as torch
        sf = tl.where((amax > 0) & (amax == amax) & (amax != float("inf")), sf, old_scale)
        sf = tl.where(sf == float("inf"), float32_max, sf)
        tl.store(hist_ptr + offs, new_hist, mask=(offs < L) & rolls)
        tl.store(scale_ptr, sf, mask=rolls)
        tl.store(count_ptr, tl.load(count_ptr) + nonfinite.to(tl.int64))


BLOCKS_TILE_M = 64  # rows per program of `_quantize_blocks_kernel` (a block's tiles: ceil(rows / this))


def quantize_blocks_2d(x2: torch.Tensor, table: torch.Tensor, data: torch.Tensor, transposes: Optional[torch.Tensor],
                       sinv: torch.Tensor, row_sinv: torch.Tensor, padded_total: int, tiles: int,
                       one_matrix: bool) -> None:
    """`_quantize_blocks_kernel` over `x2: [M, N]` (16-bit, last dimension contiguous); `table` as the kernel
    says, on the device, `tiles` the blocks' tiles of `BLOCKS_TILE_M` rows in all; `transposes`: a flat buffer of
    `padded_total * N` elements (zeroed where an empty block's padding is), or None."""
    from .gemm import SINV_STRIDE

    N = x2.shape[1]
    E = table.shape[-1]
    block_n = 128
    _QUANTIZE_BLOCKS(
        (tiles, -(-N // block_n)),
        (x2, data, transposes if transposes is not None else data, table, sinv, row_sinv, N, x2.stride(0),
         fp8_max(data.dtype), padded_total),
        (E, SINV_STRIDE, BLOCKS_TILE_M, block_n, transposes is not None, one_matrix),
        num_warps=4,
    )


def amax_update(amax: torch.Tensor, addresses: torch.Tensor, history_len: int, fp8_max: float, margin: int,
                most_recent: bool) -> None:
    """Fused delayed-scaling update. `addresses` is `[3, n]` int64: history row, scale and counter addresses."""
    n = amax.numel()
    _AMAX_UPDATE(
        (n,),
        (amax, addresses[0], addresses[1], addresses[2], history_len, fp8_max, float(2.0**margin),
         torch.finfo(torch.float32).max),
        (1 << max(history_len - 1, 0).bit_length(), most_recent),
        num_warps=4,
    )


if AVAILABLE:
    _QUANTIZE = _Launcher(_quantize_kernel, tensors=7)
    _AMAX_UPDATE = _Launcher(_amax_update_kernel, tensors=4)
    _QUANTIZE_BLOCKS = _Launcher(_quantize_blocks_kernel, tensors=6)
