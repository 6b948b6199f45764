"""One-pass FP8 quantization: saturating cast, amax into a slot, optional transpose. No host sync.

On CUDA (with Triton) a fused kernel reads the input once and writes the data, the transpose and the amax;
elsewhere, and for outputs stored in zero-padded buffers (`padded_fp8`), plain torch ops compute the same
values. The amax of a tensor holding NaN is recorded as +inf
(non-finite), on both paths.
"""
from __future__ import annotations

import dataclasses
from typing import List, Optional, Sequence

import torch

from . import native
from .device_tables import device_table
from .gemm import SINV_STRIDE, zero_padded
from .tensor import Float8Tensor, cast_to_fp8

_INF = float("inf")


_TRITON: Optional[bool] = None  # whether the fused kernels run (CUDA with Triton); decided on first use


def _use_triton(x: torch.Tensor) -> bool:
    global _TRITON
    if not x.is_cuda:
        return False
    if _TRITON is None:
        from . import triton_kernels

        _TRITON = triton_kernels.AVAILABLE
    return _TRITON


def _native_cast(x: torch.Tensor, scale: torch.Tensor, data: Optional[torch.Tensor], scale_inv: torch.Tensor,
                 transpose: Optional[torch.Tensor], amax_out: Optional[torch.Tensor],
                 noop_flag: Optional[torch.Tensor]) -> bool:
    """The fused cast through the compiled extension (CUDA tensors, float32 scale and slot; see `native`);
    False where it does not apply (then the Triton kernel or the torch formulas run)."""
    if not x.is_cuda or scale.dtype != torch.float32 or (amax_out is not None and amax_out.dtype != torch.float32):
        return False
    ext = native.for_device(x.device)
    if ext is None:
        return False
    ext.cast_into(x, scale, 0, data, transpose, scale_inv, amax_out, 0, noop_flag)
    return True


def padded_fp8(rows: int, cols: int, fp8_dtype: torch.dtype, dtype: torch.dtype, device: torch.device,
               with_transpose: bool = False) -> Float8Tensor:
    """An empty `[rows, cols]` Float8Tensor (standing for `dtype`) whose data, and transpose buffer when asked
    for, are stored in zero-padded buffers aligned for the FP8 GEMM (`gemm.zero_padded`): an `out` for
    `quantize` that `fp8_gemm(..., pad=True)` then multiplies without padding it again."""
    out = Float8Tensor(zero_padded(rows, cols, fp8_dtype, device), torch.empty((), dtype=torch.float32, device=device),
                       dtype)
    if with_transpose:
        out._transpose_cache.buffer = zero_padded(cols, rows, fp8_dtype, device)
    return out


def quantize(
    x: torch.Tensor,
    scale: torch.Tensor,
    fp8_dtype: torch.dtype,
    amax_out: Optional[torch.Tensor] = None,
    with_transpose: bool = False,
    out: Optional[Float8Tensor] = None,
    noop_flag: Optional[torch.Tensor] = None,
    force_torch: bool = False,
) -> Float8Tensor:
    """Quantize `x` to FP8 with `scale` in one pass.

    Args:
        x: high-precision input (any shape; the transpose is of `x` viewed as `[-1, x.shape[-1]]`).
        scale: float32 tensor with one element (e.g. a view into a module's scale buffer).
        fp8_dtype: torch.float8_e4m3fn or torch.float8_e5m2. Values beyond the format's range saturate.
        amax_out: float32 one-element slot; receives `max(amax_out, amax(|x|))` (a slot may be written by
            several casts, e.g. a module called twice).
        with_transpose: also fill the persistent transpose of the result.
        out: write into this Float8Tensor in place (same data, scale_inv and transpose addresses).
        noop_flag: device tensor; where non-zero, nothing is written (a captured cast that replays as a no-op).
        force_torch: use the torch path even on CUDA (for tests).

    Returns:
        The Float8Tensor (`out` if given) with `scale_inv = 1 / scale`.
    """
    if scale.numel() != 1:
        raise ValueError(f"quantize: scale must have one element, got shape {tuple(scale.shape)}")
    if out is None:
        data = torch.empty(x.shape, dtype=fp8_dtype, device=x.device)
        out = Float8Tensor(data, torch.empty((), dtype=torch.float32, device=x.device), x.dtype)
    elif out._data.shape != x.shape or out._data.dtype != fp8_dtype:
        raise ValueError(
            f"quantize: out has shape {tuple(out._data.shape)} / {out._data.dtype}, "
            f"input needs {tuple(x.shape)} / {fp8_dtype}"
        )
    transpose = out._transpose_buffer() if with_transpose else None
    # the fused kernel writes contiguous outputs; views into padded buffers take the torch path
    dense = out._data.is_contiguous() and (transpose is None or transpose.is_contiguous())
    if not force_torch and dense and x.numel() > 0 and _native_cast(x, scale, out._data, out._scale_inv, transpose,
                                                                  amax_out, noop_flag):
        pass
    elif not force_torch and dense and _use_triton(x) and x.numel() > 0:
        from .triton_kernels import quantize_2d

        quantize_2d(x, scale, out._data, out._scale_inv, transpose, amax_out, noop_flag)
    else:
        _quantize_torch(x, scale, out, transpose, amax_out, noop_flag)
    out._transpose_cache.writes += 1
    if transpose is not None:
        out._transpose_cache.version = out._data_version()
    return out


def _keep_where(flag: Optional[torch.Tensor], old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    if flag is None:
        return new
    if old.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return torch.where(flag.reshape(()).bool(), old.view(torch.uint8), new.view(torch.uint8)).view(old.dtype)
    return torch.where(flag.reshape(()).bool(), old, new)


def _quantize_torch(
    x: torch.Tensor,
    scale: torch.Tensor,
    out: Float8Tensor,
    transpose: Optional[torch.Tensor],
    amax_out: Optional[torch.Tensor],
    noop_flag: Optional[torch.Tensor],
) -> None:
    x = x.detach()
    scale = scale.reshape(()).float()
    data = _keep_where(noop_flag, out._data, cast_to_fp8(x, scale, out._data.dtype))
    out._data.copy_(data)
    out._scale_inv.copy_(_keep_where(noop_flag, out._scale_inv, scale.reciprocal()))
    if transpose is not None:
        flat = data.reshape(-1, data.shape[-1]) if data.dim() != 2 else data
        transpose.copy_(flat.t())
    if amax_out is not None:
        amax = x.abs().amax().float() if x.numel() else torch.zeros((), device=x.device)
        amax = torch.nan_to_num(amax, nan=_INF, posinf=_INF)
        new = torch.maximum(amax_out.reshape(()), amax)
        amax_out.copy_(_keep_where(noop_flag, amax_out.reshape(()), new).reshape(amax_out.shape))


def quantize_transposed(x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype, force_torch: bool = False,
                        padded: bool = False) -> Float8Tensor:
    """The FP8 cast of `x.T` (`x` viewed as `[M, K]`, result `[K, M]`), in one pass that writes only the
    transpose (e.g. a weight's dgrad operand, re-cast in backward instead of held since forward). `padded`:
    store the result in a zero-padded buffer (`padded_fp8`; torch path)."""
    if scale.numel() != 1:
        raise ValueError(f"quantize_transposed: scale must have one element, got shape {tuple(scale.shape)}")
    x2 = x.reshape(-1, x.shape[-1])
    if padded:
        t = padded_fp8(x2.shape[1], x2.shape[0], fp8_dtype, x.dtype, x.device)
    else:
        t = Float8Tensor(torch.empty((x2.shape[1], x2.shape[0]), dtype=fp8_dtype, device=x.device),
                         torch.empty((), dtype=torch.float32, device=x.device), x.dtype)
    if not force_torch and not padded and x.numel() > 0 and _native_cast(x2, scale, None, t._scale_inv, t._data, None,
                                                                       None):
        pass
    elif not force_torch and not padded and _use_triton(x) and x.numel() > 0:
        from .triton_kernels import quantize_2d

        quantize_2d(x2, scale, None, t._scale_inv, t._data, None, None)  # the transpose only
    else:
        t._data.copy_(cast_to_fp8(x2.detach(), scale.reshape(()).float(), fp8_dtype).t())
        t._scale_inv.copy_(scale.reshape(()).float().reciprocal())
    return t




@dataclasses.dataclass
class RowBlocks:
    """FP8 casts of consecutive row blocks of one `[M, N]` tensor, block `e` with its own scale (see
    `quantize_row_blocks`).

    `data [M, N]`; the blocks' transposes in one zero-filled buffer, each block's rows padded with zeros to a
    multiple of 16 (`padded_e`), so a GEMM that contracts over the rows (a weight gradient) needs no padding
    copy and stays exact: block e's own `[N, padded_e]` matrix from element `N * padded_start_e`, or, with
    `one_matrix`, columns `padded_start_e ...` of one `[N, padded_total]` matrix (a grouped GEMM's operand
    with its groups along the columns; there an empty block gets 16 zero columns); `sinv [E * SINV_STRIDE]`
    (1 / scale of block e at `e * SINV_STRIDE`: every scale_inv 16-byte aligned, as cuBLAS's FP8 GEMM requires
    of its scale pointers); `row_sinv [M]` (each row's block's); and the device table `[6, E]` (scale
    addresses, amax slot addresses, row ends, padded starts, padded rows, first kernel tiles) the fused kernel
    reads."""

    data: torch.Tensor
    transposes: Optional[torch.Tensor]
    sinv: torch.Tensor
    row_sinv: torch.Tensor
    table: torch.Tensor
    starts: List[int]
    rows: List[int]
    padded_starts: List[int]
    padded_rows: List[int]
    dtype: torch.dtype
    one_matrix: bool = False

    def block(self, e: int) -> Float8Tensor:
        """Block `e` as a Float8Tensor (a view of `data`, its scale_inv a view of `sinv`)."""
        s, m = self.starts[e], self.rows[e]
        return Float8Tensor(self.data[s : s + m], self.sinv[e * SINV_STRIDE], self.dtype)

    def block_transposed(self, e: int) -> Float8Tensor:
        """Block `e`'s zero-padded transpose `[N, padded_e]` (a view of `transposes`; strided with
        `one_matrix`)."""
        n = self.data.shape[1]
        s, m = self.padded_starts[e], self.padded_rows[e]
        if self.one_matrix:
            return Float8Tensor(self.transposed_matrix()[:, s : s + m], self.sinv[e * SINV_STRIDE], self.dtype)
        return Float8Tensor(self.transposes[n * s : n * (s + m)].view(n, m), self.sinv[e * SINV_STRIDE], self.dtype)

    def transposed_matrix(self) -> torch.Tensor:
        """The `[N, padded_total]` matrix of all blocks' transposes (`one_matrix` layout)."""
        return self.transposes.view(self.data.shape[1], -1)


def quantize_row_blocks(x: torch.Tensor, splits: Sequence[int], scales: Sequence[torch.Tensor],
                        amax_slots: Sequence[torch.Tensor], fp8_dtype: torch.dtype, with_transpose: bool,
                        one_matrix: bool = False, force_torch: bool = False) -> RowBlocks:
    """Cast the row blocks of `x: [M, N]` (`splits` rows each, in order) to FP8, block `e` with the first
    element of `scales[e]` into the first element of `amax_slots[e]` (so a module's scale and slot buffers
    serve as they are, no view per block), in one pass: on CUDA one fused kernel for all blocks (16-bit inputs),
    elsewhere `quantize` per block; the same bytes either way (see `RowBlocks` for the layout)."""
    from .gemm import ALIGN
    from .triton_kernels import BLOCKS_TILE_M

    x2 = x.detach()
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M, N = x2.shape
    device = x2.device
    starts, padded_starts, padded_rows, first_tiles, total, padded_total, tiles = [], [], [], [], 0, 0, 0
    for m in splits:
        starts.append(total)
        padded_starts.append(padded_total)
        padded_rows.append(max(-(-m // ALIGN) * ALIGN, ALIGN if one_matrix else 0))
        first_tiles.append(tiles)
        total += m
        padded_total += padded_rows[-1]
        tiles += -(-m // BLOCKS_TILE_M)
    fused = not force_torch and x2.element_size() == 2 and M > 0 and _use_triton(x2)
    data = torch.empty((M, N), dtype=fp8_dtype, device=device)
    transposes = None
    if with_transpose:  # the fused kernel writes every padding but an empty block's; the torch path none
        written = fused and not (one_matrix and 0 in splits)
        transposes = (torch.empty if written else torch.zeros)(padded_total * N, dtype=fp8_dtype, device=device)
    sinv = torch.empty(len(splits) * SINV_STRIDE, dtype=torch.float32, device=device)
    row_sinv = torch.empty(M, dtype=torch.float32, device=device)
    table = device_table([[s.data_ptr() for s in scales], [a.data_ptr() for a in amax_slots],
                          [s + m for s, m in zip(starts, splits)], padded_starts, padded_rows, first_tiles],
                         torch.int64, device)
    blocks = RowBlocks(data, transposes, sinv, row_sinv, table, starts, list(splits), padded_starts, padded_rows,
                       x.dtype, one_matrix)
    if fused:
        from .triton_kernels import quantize_blocks_2d

        quantize_blocks_2d(x2, table, data, transposes, sinv, row_sinv, padded_total, tiles, one_matrix)
        return blocks
    for e, (start, m) in enumerate(zip(starts, splits)):
        out = blocks.block(e)
        if with_transpose:  # the block's rows of its padded transpose (a strided view: the torch path)
            out._transpose_cache.buffer = blocks.block_transposed(e)._data[:, :m]
        quantize(x2[start : start + m], scales[e][:1], fp8_dtype, amax_out=amax_slots[e][:1], out=out,
                 with_transpose=with_transpose, force_torch=True)
        row_sinv[start : start + m] = out._scale_inv
    return blocks
