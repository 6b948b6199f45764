"""Drive model chunks through a pipeline capture order, as a schedule would (shared by graph tests)."""
from __future__ import annotations

from typing import Callable, Dict, List, Sequence, Tuple

import torch

from fp8_parallel.meta import FP8Meta


def run_in_order(
    order: Sequence[int],
    num_chunks: int,
    forward: Callable[[int, int], Tuple[torch.Tensor, torch.Tensor]],
    grad_of: Callable[[int, int], torch.Tensor],
) -> List[torch.Tensor]:
    """Per `+c` call `forward(c, mb)` (chunk index from 0, its next microbatch) -> (input leaf, output); per
    `-c` run the backward of chunk c's oldest pending microbatch with `grad_of(c, mb)`. Returns every output
    and every input gradient, in order."""
    fwd, bwd = [0] * num_chunks, [0] * num_chunks
    pending: Dict[Tuple[int, int], Tuple[torch.Tensor, torch.Tensor]] = {}
    seen = []
    for step in order:
        c = abs(step) - 1
        if step > 0:
            mb = fwd[c]
            fwd[c] += 1
            x, h = forward(c, mb)
            pending[(c, mb)] = (x, h)
            seen.append(h.detach().clone())
        else:
            mb = bwd[c]
            bwd[c] += 1
            x, h = pending.pop((c, mb))
            h.backward(grad_of(c, mb))
            seen.append(x.grad.clone())
    return seen


def fp8_state(modules) -> List[torch.Tensor]:
    """Copies of every amax history and scale under `modules`."""
    return [t.clone() for module in modules for m in module.modules() if isinstance(m, FP8Meta)
            for t in (m.amax_history, m.scale)]
