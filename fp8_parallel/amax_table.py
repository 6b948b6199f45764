"""The amax slots of one (autocast scope key, direction): one contiguous buffer, one collective, one update."""
from __future__ import annotations

import datetime
import zlib
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .group_state import PerGroup
from .meta import FP8Meta
from .recipe import DelayedScaling
from .scaling import update_history_and_scale

_FINGERPRINT_MOD = 1 << 23  # exactly representable in float32
HEADER = 4  # [fingerprint, -fingerprint, count, -count] (see `count_code`), reduced with MAX before the amaxes
LAYOUT_CHECK_TIMEOUT = datetime.timedelta(seconds=30)


def count_code(used: int, backward_follows: bool) -> int:
    """The header's count: `2 * slots + backward_follows`. The low bit says whether this rank will reduce the
    key's backward amaxes too, so ranks that disagree on it fail at the forward reduction, before any of them
    waits in a backward collective the others never start."""
    return 2 * used + int(backward_follows)


class _LayoutInfo:
    """What a reduction needs to know about one exact list of FP8 state tensors, computed once: the layout
    fingerprint, the device header, the history lengths, and (lazily) the device address table."""

    __slots__ = ("fingerprint", "used", "history_lens", "_headers", "_device", "addresses")

    def __init__(self, metas: List[FP8Meta], device: torch.device):
        crc = 0
        for meta in metas:
            crc = zlib.crc32(meta.tag_hash.to_bytes(4, "little"), crc)
        self.fingerprint = crc % _FINGERPRINT_MOD
        self.used = sum(m.num_tensors for m in metas)
        self.history_lens = {m.amax_history.shape[1] for m in metas}
        self._device = device
        self._headers: Dict[bool, torch.Tensor] = {}
        self.addresses: Optional[torch.Tensor] = None

    def header(self, backward_follows: bool) -> torch.Tensor:
        """The device header `[fp, -fp, code, -code]` (made once per flag: no host-to-device copy per step)."""
        h = self._headers.get(backward_follows)
        if h is None:
            fp, code = self.fingerprint, count_code(self.used, backward_follows)
            h = self._headers[backward_follows] = torch.tensor([fp, -fp, code, -code], dtype=torch.float32,
                                                               device=self._device)
        return h


# Layout facts per exact list of FP8 state tensors (keyed by their storage ids): a cache, no training state.
_LAYOUTS: Dict[tuple, _LayoutInfo] = {}
_LAYOUTS_MAX = 256

# The last layout (fingerprint, slot count) that all ranks of a group were seen to agree on, per group,
# recipe and direction. Every rank holds the same entry (each entry is set only after a successful cross-rank
# check), which is what lets a rank with a new layout size its check collective like the reduction of a
# rank without one. A cache for safety checks; it holds no training state, and it lives with the group.
_AGREED_LAYOUTS: PerGroup[Tuple[int, int]] = PerGroup()


class AmaxLayoutMismatch(RuntimeError):
    """Ranks of one amax group registered different FP8 tensors (number or order)."""


class AmaxTable:
    """Slots for the amaxes of one direction of one scope key, in registration order.

    A module asks for its slots once per scope (a second call returns the same slots, so a module run twice
    takes the max of both runs). Slots are views into one zero-initialised buffer that grows by doubling;
    growth copies the slots written so far. A slot view is current until the next registration grows the
    buffer (modules write their slots right after taking them; others call `slots()` again).

    An empty table (this rank ran no FP8 module in the scope, or ran them with FP8 disabled) still joins its
    group's reductions, with the empty layout: ranks that did register tensors then fail the layout check
    together with it instead of waiting for it.
    """

    def __init__(self, direction: str, device: torch.device, capacity: int = 64):
        self.direction = direction
        self.device = device
        self._capacity = capacity
        self._buffer: Optional[torch.Tensor] = None  # allocated on the first registration
        self._used = 0
        self._entries: Dict[int, Tuple[FP8Meta, int]] = {}
        self._order: List[FP8Meta] = []
        self.force_torch_update = False  # use the batched torch ops even where the fused kernel runs

    def __len__(self) -> int:
        return len(self._order)

    @property
    def metas(self) -> List[FP8Meta]:
        return list(self._order)

    def slots(self, meta: FP8Meta) -> torch.Tensor:
        """The `[meta.num_tensors]` amax slots of `meta` in this table."""
        offset = self._offset(meta)
        return self._buffer[HEADER + offset : HEADER + offset + meta.num_tensors]

    def slot_address(self, meta: FP8Meta) -> Tuple[torch.Tensor, int]:
        """`(buffer, index)`: `meta`'s first slot as an index into the table's buffer, without making a view (the
        compiled path writes through it). The buffer is current until the next registration grows it."""
        offset = self._offset(meta)
        return self._buffer, HEADER + offset

    def slots_of(self, metas: Sequence[FP8Meta]) -> List[torch.Tensor]:
        """`slots(meta)` for each of `metas` (registered in that order when new), made as one view split into
        rows when their slots are contiguous, as they are when the metas are registered together."""
        if not metas:
            return []
        offsets = [self._offset(m) for m in metas]
        n = metas[0].num_tensors
        if all(m.num_tensors == n for m in metas) and all(b - a == n for a, b in zip(offsets, offsets[1:])):
            start = HEADER + offsets[0]
            return list(self._buffer[start : start + n * len(metas)].view(len(metas), n).unbind(0))
        return [self.slots(m) for m in metas]

    def amaxes(self) -> torch.Tensor:
        """All slots, in registration order (a view; current until the next registration)."""
        return self._buffer[HEADER : HEADER + self._used] if self._buffer is not None else torch.zeros(0, device=self.device)

    def fold(self, metas: List[FP8Meta], amax: torch.Tensor) -> None:
        """Max the amaxes `amax` of `metas` (concatenated, as another table's `amaxes()`) into their slots here,
        registering the metas that are new: one kernel when their slots are contiguous, as they are when the
        metas are registered together."""
        if not metas:
            return
        offsets = [self._offset(m) for m in metas]
        total = sum(m.num_tensors for m in metas)
        if all(b - a == m.num_tensors for a, b, m in zip(offsets, offsets[1:], metas)):
            block = self._buffer[HEADER + offsets[0] : HEADER + offsets[0] + total]
            torch.maximum(block, amax, out=block)
            return
        start = 0
        for meta, offset in zip(metas, offsets):
            block = self._buffer[HEADER + offset : HEADER + offset + meta.num_tensors]
            torch.maximum(block, amax[start : start + meta.num_tensors], out=block)
            start += meta.num_tensors

    def _offset(self, meta: FP8Meta) -> int:
        """The offset of `meta`'s slots, registering it (and growing the buffer) when it is new."""
        entry = self._entries.get(id(meta))
        if entry is not None:
            return entry[1]
        self._adopt_device(meta)
        n = meta.num_tensors
        self._allocate(n)
        if HEADER + self._used + n > self._buffer.numel():
            grown = torch.zeros(HEADER + max(2 * (self._buffer.numel() - HEADER), self._used + n), device=self.device)
            grown[: HEADER + self._used].copy_(self._buffer[: HEADER + self._used])
            self._buffer = grown
        self._entries[id(meta)] = (meta, self._used)
        self._order.append(meta)
        self._used += n
        return self._used - n

    def _adopt_device(self, meta: FP8Meta) -> None:
        """The table lives where its modules' FP8 state lives: the first registration decides (a scope opened on a
        machine with a GPU defaults to it, but CPU modules are fine); a meta on another device is refused, since
        the fused update writes every registered history through one device's addresses."""
        device = meta.amax_history.device
        if not self._order:
            if self._buffer is not None and self._buffer.device != device:
                self._buffer = None  # holds no slots yet
            self.device = device
        elif device != self.device:
            raise RuntimeError(
                f"FP8 state of {meta.tag} is on {device}, but this scope's other FP8 modules ({self._order[0].tag}, "
                f"...) keep theirs on {self.device}: run the modules of one autocast scope on one device"
            )

    def _allocate(self, n: int = 0) -> None:
        if self._buffer is None:
            self._buffer = torch.zeros(HEADER + max(self._capacity, n), device=self.device)

    def _layout(self) -> _LayoutInfo:
        key = tuple([m.storage_id for m in self._order])
        info = _LAYOUTS.get(key)
        if info is None:
            if len(_LAYOUTS) >= _LAYOUTS_MAX:
                _LAYOUTS.clear()
            info = _LAYOUTS[key] = _LayoutInfo(self._order, self.device)
        return info

    def reduce_and_update(
        self, recipe: DelayedScaling, group: Optional[dist.ProcessGroup], fp8_max: float, scope: str,
        backward_follows: bool = False,
    ) -> None:
        """One all-reduce(MAX) over `group` (if it has several ranks), then one batched history/scale update.

        `backward_follows` (forward tables): this rank will reduce the key's backward amaxes as well (some FP8
        call of the scope expects a backward, or one already ran). It is part of the layout the ranks must
        agree on, so a rank whose FP8 calls all ran without a backward (under `no_grad`, frozen on detached
        inputs) fails the forward reduction together with the others, none of them waiting in a backward
        reduction that rank never starts. An empty table joins the reduction too (see the class docstring).

        Layout safety. Every reduction carries the layout fingerprint, slot count and `backward_follows` in a
        4-element header (`[fp, -fp, c, -c]` with `c = count_code(slots, backward_follows)`: after the MAX
        every rank sees a disagreement as `h[0] != -h[1]` or `h[2] != -h[3]`). When this rank's layout
        differs from the last one the group agreed on, it first runs a check collective of exactly the size
        the agreed layout's reduction has, so it pairs with a rank that reduces the old layout as well as with
        ranks that check. Every rank of that one collective
        reads its reduced header on the host and raises `AmaxLayoutMismatch` naming the scope, so all of
        them stop at the same collective and none is left waiting in a later one (on NCCL as on gloo).

        Cost of the host read: one 16-byte device-to-host copy per (scope, direction) and iteration, which
        waits for the all-reduce. It adds no collective; the GPU idles only while the host issues its next
        kernel after the wait (one launch, about 10 us on H200) and in a host-bound eager step the queue is
        short anyway. While a CUDA graph is captured nothing is read on the host: a mismatch there skips
        the update on the device and shows in the tensors' `nonfinite_count` (layout changes are refused
        before capture, see `_check_layout_if_new`).
        """
        reduces = recipe.reduce_amax and group is not None and dist.get_world_size(group) > 1
        if not self._order and not reduces:
            return
        self._allocate()
        buf = self._buffer[: HEADER + self._used]
        amax = buf[HEADER:]
        on_cpu = self.device.type == "cpu"
        layout = self._layout()
        if reduces:
            self._check_layout_if_new(group, (recipe, self.direction), layout.fingerprint, scope,
                                      backward_follows)
            buf[:HEADER].copy_(layout.header(backward_follows))
            if on_cpu:  # the one collective of this table (gloo: bounded wait, never a hang)
                self._all_reduce_checked(buf, group, scope, "reduction")
            else:
                dist.all_reduce(buf, op=dist.ReduceOp.MAX, group=group)  # the one collective of this table
            if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                mismatch = (buf[0] != -buf[1]) | (buf[2] != -buf[3])
                amax = torch.where(mismatch, torch.full_like(amax, float("nan")), amax)
            else:  # every rank of the collective learns of a mismatch from it
                self._check_header(buf[:HEADER], scope, backward_follows)
        metas = self._order
        if not metas:  # the group agreed on an empty layout: nothing to update
            return
        if not on_cpu and not self.force_torch_update and self._fused_update(amax, recipe, fp8_max, layout):
            return
        sizes = [m.num_tensors for m in metas]
        history = torch.cat([m.amax_history for m in metas])
        scale = torch.cat([m.scale for m in metas])
        new_history, new_scale, nonfinite = update_history_and_scale(
            history, scale, amax, fp8_max, recipe.margin, recipe.amax_compute_algo,
            recipe.scaling_factor_compute_algo, recipe,
        )
        torch._foreach_copy_([m.amax_history for m in metas], list(new_history.split(sizes)))
        torch._foreach_copy_([m.scale for m in metas], list(new_scale.split(sizes)))
        torch._foreach_add_([m.nonfinite_count for m in metas], list(nonfinite.long().split(sizes)))

    def _fused_update(self, amax: torch.Tensor, recipe: DelayedScaling, fp8_max: float, layout: _LayoutInfo) -> bool:
        """One Triton kernel for all tensors (CUDA, "max"/"most_recent", the default scale rule, one history
        length)."""
        from . import triton_kernels

        algo = recipe.amax_compute_algo
        if not triton_kernels.AVAILABLE or amax.device.type != "cuda" or algo not in ("max", "most_recent"):
            return False
        if recipe.scaling_factor_compute_algo is not None:  # the user's rule runs as torch ops
            return False
        if layout.history_lens != {recipe.amax_history_len}:
            return False
        triton_kernels.amax_update(
            amax, self._addresses(), recipe.amax_history_len, fp8_max, recipe.margin, algo == "most_recent"
        )
        return True

    def _addresses(self) -> torch.Tensor:
        """`[3, slots]` int64 device addresses of each slot's history row, scale and counter.

        Cached per layout, whose key is the metas' `storage_id`s: every path that replaces an FP8 buffer
        (`load_state_dict(assign=True)`, `.to()`/`_apply`, a history resize, any assignment of a buffer
        attribute) gives its meta a new `storage_id`, so a table built from old storage is never used again."""
        layout = self._layout()
        if layout.addresses is None:
            rows = [[], [], []]
            for m in self._order:
                h, s, c = m.amax_history, m.scale, m.nonfinite_count
                for r in range(m.num_tensors):
                    rows[0].append(h.data_ptr() + r * h.stride(0) * h.element_size())
                    rows[1].append(s.data_ptr() + r * s.element_size())
                    rows[2].append(c.data_ptr() + r * c.element_size())
            layout.addresses = torch.tensor(rows, dtype=torch.int64, device=self.device)
        return layout.addresses

    def _check_layout_if_new(self, group: dist.ProcessGroup, cache_key: tuple, fp: int, scope: str,
                             backward_follows: bool) -> None:
        agreed = _AGREED_LAYOUTS.get(group, cache_key)
        if agreed == (fp, self._used):
            return
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise AmaxLayoutMismatch(
                f"{scope} {self.direction}: a new amax layout ({self._describe()}) cannot be verified while a "
                f"CUDA graph is being captured; run one eager step first"
            )
        probe = torch.zeros(HEADER + (agreed[1] if agreed else 0), device=self.device)
        code = count_code(self._used, backward_follows)
        probe[:HEADER] = torch.tensor([fp, -fp, code, -code], dtype=torch.float32)
        self._all_reduce_checked(probe, group, scope, "layout check")
        self._check_header(probe[:HEADER], scope, backward_follows)
        _AGREED_LAYOUTS.set(group, cache_key, (fp, self._used))

    def _all_reduce_checked(self, buf: torch.Tensor, group: dist.ProcessGroup, scope: str, what: str) -> None:
        """all-reduce(MAX) that fails with a clear error instead of hanging when ranks disagree."""
        try:
            dist.all_reduce(buf, op=dist.ReduceOp.MAX, group=group, async_op=True).wait(timeout=LAYOUT_CHECK_TIMEOUT)
        except Exception as e:  # another rank issued a collective of another size
            raise AmaxLayoutMismatch(
                f"{scope} {self.direction}: amax {what} failed; this rank registered {self._used} FP8 tensors "
                f"({self._describe()}); other ranks of the group registered a different layout ({e})"
            ) from e

    def _check_header(self, header: torch.Tensor, scope: str, backward_follows: bool = False) -> None:
        h = header.tolist()
        if h[0] == -h[1] and h[2] == -h[3]:
            return
        low, high = int(-h[3]), int(h[2])  # the smallest and largest count code over the ranks
        if h[0] == -h[1] and low // 2 == high // 2:  # the same tensors; only `backward_follows` differs
            raise AmaxLayoutMismatch(
                f"{scope} {self.direction}: ranks disagree on whether a backward follows: on some ranks FP8 "
                f"calls of this scope expect a backward, on others none does (all ran under no_grad, or frozen "
                f"on inputs that need no grad); this rank {'expects one' if backward_follows else 'expects none'} "
                f"({self._describe()})"
            )
        differ = "layout fingerprints differ" if h[0] != -h[1] else "layout fingerprints agree"
        raise AmaxLayoutMismatch(
            f"{scope} {self.direction}: ranks registered different FP8 tensor layouts: slot counts range "
            f"{low // 2}..{high // 2}, {differ}; this rank has {self._used} slots ({self._describe()})"
        )

    def _describe(self, limit: int = 6) -> str:
        if not self._order:
            return "no FP8 tensors: it ran no FP8 module in this scope, or ran them with FP8 disabled"
        tags = [f"{m.tag}[{m.num_tensors}]" for m in self._order[:limit]]
        more = f", ... {len(self._order) - limit} more" if len(self._order) > limit else ""
        return ", ".join(tags) + more
