"""Call structure of graphed callables: tensor leaves of (args, kwargs) and of outputs, via torch's pytree."""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Sequence, Tuple

import torch
from torch.utils import _pytree as pytree


def _drop_none(kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """Keyword arguments equal to None count as absent (megatron passes many optional ones as None)."""
    return {k: v for k, v in kwargs.items() if v is not None}


@dataclasses.dataclass
class _Signature:
    """The structure of a call: pytree spec of (args, kwargs), tensor leaf positions, the other leaves."""

    spec: Any
    tensor_positions: List[int]
    other_leaves: List[Any]
    shapes: List[Tuple[torch.Size, torch.dtype]]

    @staticmethod
    def of(args: tuple, kwargs: Dict[str, Any]) -> Tuple["_Signature", List[torch.Tensor]]:
        leaves, spec = pytree.tree_flatten((tuple(args), _drop_none(kwargs)))
        positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        tensors = [leaves[i] for i in positions]
        others = [leaf for leaf in leaves if not isinstance(leaf, torch.Tensor)]
        return _Signature(spec, positions, others, [(t.shape, t.dtype) for t in tensors]), tensors

    def tensors_of(self, args: tuple, kwargs: Dict[str, Any], name: str) -> List[torch.Tensor]:
        """The tensor leaves of a call with this structure (a clear error for another structure)."""
        sig, tensors = _Signature.of(args, kwargs)
        if sig.spec != self.spec or sig.other_leaves != self.other_leaves:
            raise ValueError(f"{name}: called with arguments of another structure than the sample arguments "
                             f"(captured {self.spec} with {self.other_leaves}, got {sig.spec} with {sig.other_leaves})")
        if sig.shapes != self.shapes:
            raise ValueError(f"{name}: tensor arguments (shape, dtype) {sig.shapes} differ from the sample "
                             f"arguments' {self.shapes}")
        return tensors

    def rebuild(self, tensors: Sequence[torch.Tensor]) -> Tuple[tuple, Dict[str, Any]]:
        leaves: List[Any] = []
        t, o = iter(tensors), iter(self.other_leaves)
        positions = set(self.tensor_positions)
        for i in range(len(self.tensor_positions) + len(self.other_leaves)):
            leaves.append(next(t) if i in positions else next(o))
        args, kwargs = pytree.tree_unflatten(leaves, self.spec)
        return args, kwargs


def _flatten_outputs(outputs: Any) -> Tuple[List[torch.Tensor], Any, List[Any], List[int]]:
    leaves, spec = pytree.tree_flatten(outputs)
    positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    return [leaves[i] for i in positions], spec, leaves, positions


def _unflatten_outputs(tensors: Sequence[torch.Tensor], spec: Any, leaves: List[Any], positions: List[int]) -> Any:
    leaves = list(leaves)
    for i, t in zip(positions, tensors):
        leaves[i] = t
    return pytree.tree_unflatten(leaves, spec)
