"""torch's foreach kernels for megatron's multi-tensor fallbacks.

Without TransformerEngine or apex, megatron's optimizer and gradient clipping use `megatron.core.utils`'
local stand-ins for apex's multi-tensor kernels: the L2 norm reads each gradient's norm back to the host (one
device synchronisation per parameter, every step), and the scale / copy runs two kernels per parameter. The
replacements here do the same arithmetic with torch's foreach kernels, on the device, with no host read-back:
the step's single read of the norm is megatron's own. Where TE or apex serve megatron, nothing is replaced.
"""
from __future__ import annotations

import importlib
from typing import List, Optional, Sequence, Tuple

import torch

# the megatron modules that bind the fallbacks at import, and the names they bind them to
_BINDINGS = {
    "megatron.core.optimizer.optimizer": {"multi_tensor_scale_impl": "local_multi_tensor_scale"},
    "megatron.core.optimizer.clip_grads": {"multi_tensor_scale_impl": "local_multi_tensor_scale",
                                           "l2_norm_impl": "local_multi_tensor_l2_norm"},
}


def foreach_l2_norm(chunk_size: int, noop_flag: torch.Tensor, tensor_lists: Sequence[Sequence[torch.Tensor]],  # noqa: ARG001
                    per_tensor: bool, *args) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """apex's `multi_tensor_l2norm` contract: `([1]` float32 norm of all tensors, per-tensor norms or None), on
    the tensors' device, computed without reading anything back to the host."""
    tensors = [t for ts in tensor_lists for t in ts]
    if not tensors:
        return torch.zeros(1, dtype=torch.float32, device=noop_flag.device), None
    norms = torch._foreach_norm(tensors)  # each in its tensor's dtype, as megatron's fallback's torch.norm
    same = all(n.dtype == norms[0].dtype for n in norms)
    per = (torch.stack(norms) if same else torch.stack([n.float() for n in norms])).float()
    total = torch.linalg.vector_norm(per).reshape(1)
    return total, (per if per_tensor else None)


def foreach_scale(chunk_size: int, noop_flag: torch.Tensor, tensor_lists: Sequence[List[torch.Tensor]],  # noqa: ARG001
                  scale: float) -> None:
    """apex's `multi_tensor_scale` contract: `dst = src * scale` per pair (`tensor_lists = [srcs, dsts]`), in
    place when they are the same tensors; the product in the source's dtype, then cast, as megatron's fallback."""
    srcs, dsts = tensor_lists[0], tensor_lists[1]
    if not srcs:
        return
    if all(s is d for s, d in zip(srcs, dsts)):
        if scale != 1.0:
            torch._foreach_mul_(list(dsts), scale)
        return
    torch._foreach_copy_(list(dsts), torch._foreach_mul(list(srcs), scale) if scale != 1.0 else list(srcs))


def use_foreach_multi_tensor_ops() -> List[str]:
    """Bind the foreach versions wherever megatron bound its local fallbacks (idempotent). Returns the
    `module.name` bindings replaced (empty where TE or apex serve megatron, or on a second call)."""
    from megatron.core import utils as mutils

    replacements = {"local_multi_tensor_scale": foreach_scale, "local_multi_tensor_l2_norm": foreach_l2_norm}
    replaced = []
    for module_name, names in _BINDINGS.items():
        module = importlib.import_module(module_name)
        for name, fallback in names.items():
            if getattr(module, name, None) is getattr(mutils, fallback):
                setattr(module, name, replacements[fallback])
                replaced.append(f"{module_name}.{name}")
    return replaced
