"""The order in which megatron's pipeline schedules run forward and backward passes of a rank's chunks.

`capture_order` lists, for one pipeline rank, `+c` for the forward of model chunk c (1-indexed) on its next
microbatch and `-c` for the backward of chunk c, in the order megatron-core's 1F1B (vpp=None) and
interleaved 1F1B schedules execute them. Graphed callables are captured in exactly this order.

Interleaved schedule, as megatron-core runs it: microbatches are taken in groups of
`microbatch_group_size_per_vp_stage` (default: the pipeline size; the last group takes the remainder); for
each group every chunk runs its forwards in chunk order. Backwards follow the same table with the chunks
reversed. A rank runs `(pp - rank - 1) * 2 + (vpp - 1) * group` warm-up forwards (all of them if there are
not more), then alternates one forward and one backward, then drains the remaining backwards.
"""
from __future__ import annotations

from typing import List, Optional


def capture_order(
    num_microbatches: int,
    pp_size: int,
    pp_rank: int,
    vpp_size: Optional[int] = None,
    microbatch_group_size_per_vp_stage: Optional[int] = None,
) -> List[int]:
    """The forward/backward order of this rank's chunks for one training step (see the module docstring).

    Raises:
        ValueError: sizes that describe no pipeline rank (megatron's own schedule validates microbatch
            counts and group sizes when it runs).
    """
    if pp_size < 1 or not 0 <= pp_rank < pp_size or num_microbatches < 1:
        raise ValueError(f"capture_order: pp_size={pp_size}, pp_rank={pp_rank}, num_microbatches={num_microbatches}")
    chunks = vpp_size or 1
    if chunks == 1:
        warmup = min(pp_size - pp_rank - 1, num_microbatches)
        forward_chunks = [0] * num_microbatches
    else:
        group = microbatch_group_size_per_vp_stage or pp_size
        forward_chunks = []
        for start in range(0, num_microbatches, group):
            end = num_microbatches if start + group >= num_microbatches else start + group
            forward_chunks += [chunk for chunk in range(chunks) for _ in range(start, end)]
        warmup = min((pp_size - pp_rank - 1) * 2 + (chunks - 1) * group, len(forward_chunks))
    forwards = [c + 1 for c in forward_chunks]
    backwards = [-(chunks - c) for c in forward_chunks]  # backward runs the chunks in reverse
    order = forwards[:warmup]
    for i in range(warmup, len(forwards)):
        order += [forwards[i], backwards[i - warmup]]
    order += backwards[len(backwards) - warmup :] if warmup else []
    return order
