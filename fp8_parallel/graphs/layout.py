"""Which callable belongs to which chunk, how many microbatches a capture order runs, and where each
(chunk, microbatch, layer) finds its sample arguments."""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Sequence, Union

import torch
from torch.utils import _pytree as pytree


@dataclasses.dataclass(frozen=True)
class Layout:
    """Callables split into pipeline chunks (consecutive, `layers[c]` callables in chunk c) and the order in
    which their forwards (`+c`, 1-indexed) and backwards (`-c`) run, one per microbatch."""

    layers: List[int]
    microbatches: int
    order: List[int]

    @property
    def chunks(self) -> int:
        return len(self.layers)

    @property
    def num_callables(self) -> int:
        return sum(self.layers)

    def first(self, chunk: int) -> int:
        """Index of chunk `chunk`'s first callable."""
        return sum(self.layers[:chunk])

    def callables_of(self, chunk: int) -> range:
        return range(self.first(chunk), self.first(chunk) + self.layers[chunk])

    def chunk_of(self, i: int) -> int:
        for c in range(self.chunks):
            if i < self.first(c) + self.layers[c]:
                return c
        raise IndexError(i)

    def sample_index(self, i: int, mb: int) -> int:
        """Position of callable i's microbatch `mb` in per-(chunk, microbatch, layer) samples (TE's layout:
        chunk by chunk, within a chunk microbatch by microbatch, within a microbatch layer by layer)."""
        c = self.chunk_of(i)
        return self.first(c) * self.microbatches + mb * self.layers[c] + (i - self.first(c))


def layout_of(order: Optional[List[int]], num_callables: int,
              layers_per_chunk: Optional[Union[int, Sequence[int]]] = None) -> Layout:
    """Validate `order` (None: one chunk of all callables, one microbatch) and split the callables into its
    chunks: `layers_per_chunk` callables each (an int, or one count per chunk), equal counts by default."""
    if order is None:
        if layers_per_chunk is not None:
            raise ValueError("make_graphed_callables: _num_layers_per_chunk needs an order")
        return Layout([num_callables], 1, [1, -1])
    order = list(order)
    if any(isinstance(c, float) and not float(c).is_integer() for c in order):
        raise NotImplementedError(f"make_graphed_callables: order {order} has fractional entries (separate "
                                  f"weight-gradient graphs); not supported: use whole chunk ids")
    if not order or any(int(c) != c or c == 0 for c in order):
        raise ValueError(f"make_graphed_callables: order {order} is not a list of +c/-c chunk ids (1-indexed) with "
                         f"one forward and one backward per chunk and microbatch")
    order = [int(c) for c in order]
    chunks = max(abs(c) for c in order)
    if len(order) % (2 * chunks):
        raise ValueError(f"make_graphed_callables: order {order} has {len(order)} entries for {chunks} chunks; "
                         f"expected one forward and one backward per chunk and microbatch")
    microbatches = len(order) // (2 * chunks)
    for c in range(1, chunks + 1):
        if order.count(c) != microbatches or order.count(-c) != microbatches:
            raise ValueError(f"make_graphed_callables: order {order} runs {order.count(c)} forwards and "
                             f"{order.count(-c)} backwards of chunk {c}; expected {microbatches} each")
    done: Dict[int, int] = {}
    for c in order:
        done[c] = done.get(c, 0) + 1
        if c < 0 and done[c] > done.get(-c, 0):
            raise ValueError(f"make_graphed_callables: order {order} runs a backward of chunk {-c} before its forward")
    if layers_per_chunk is None:
        if num_callables % chunks:
            raise ValueError(f"make_graphed_callables: {num_callables} callables do not split into {chunks} chunks")
        layers = [num_callables // chunks] * chunks
    elif isinstance(layers_per_chunk, int):
        layers = [layers_per_chunk] * chunks
    else:
        layers = list(layers_per_chunk)
        if len(layers) != chunks:
            raise ValueError(f"make_graphed_callables: _num_layers_per_chunk {layers} has {len(layers)} entries; "
                             f"the order has {chunks} chunks")
    if any(n < 1 for n in layers) or sum(layers) != num_callables:
        raise ValueError(f"make_graphed_callables: layers per chunk {layers} do not add up to the "
                         f"{num_callables} callables (each chunk needs at least one)")
    return Layout(layers, microbatches, order)


def expand_samples(samples: list, what: str, layout: Layout) -> list:
    """Per (chunk, microbatch, layer) samples; one per callable is reused for every microbatch (cloned)."""
    n, m = layout.num_callables, layout.microbatches
    if len(samples) == n * m:
        return samples
    if len(samples) == n:
        out: list = [None] * (n * m)
        for i in range(n):
            for mb in range(m):
                s = samples[i]
                out[layout.sample_index(i, mb)] = s if mb == 0 else pytree.tree_map(
                    lambda x: x.detach().clone().requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) else x, s)
        return out
    raise ValueError(f"make_graphed_callables: {what} has {len(samples)} entries; expected one per callable "
                     f"({n}) or one per (chunk, microbatch, layer) ({n * m})")
