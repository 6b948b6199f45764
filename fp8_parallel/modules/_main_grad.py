"""TransformerEngine's `fuse_wgrad_accumulation`: a weight's gradient is added into its `main_grad` buffer
(megatron's DistributedDataParallel protocol) instead of being returned to autograd as `.grad`."""
from __future__ import annotations

import torch


class _AccumulateIntoMainGrad(torch.autograd.Function):
    """Identity on a weight whose backward adds the incoming gradient into `weight.main_grad`."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor) -> torch.Tensor:
        ctx.weight = weight
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        weight = ctx.weight
        weight.main_grad.add_(grad)
        if not hasattr(weight, "grad_added_to_main_grad"):
            return None  # `.grad` stays None, as TransformerEngine leaves it
        # megatron's protocol: the flag tells its DDP hook not to add `.grad` again; TE hands autograd an
        # unused buffer (zeros when the parameter asks for them with `zero_out_wgrad`)
        return placeholder_grad(weight)


def placeholder_grad(weight: torch.Tensor) -> torch.Tensor:
    """What autograd gets for a weight whose gradient is already in `main_grad` under megatron's protocol:
    `grad_added_to_main_grad` set (its DDP hook then adds nothing) and an unused buffer, zeros when the
    parameter asks for them with `zero_out_wgrad` (TransformerEngine's convention)."""
    weight.grad_added_to_main_grad = True
    if getattr(weight, "zero_out_wgrad", False):
        return torch.zeros_like(weight)
    return torch.empty_like(weight)


def weight_for_gemm(weight: torch.Tensor, fuse_wgrad_accumulation: bool, owner: str, name: str) -> torch.Tensor:
    """`weight` as the module's GEMM should see it: itself, or (with `fuse_wgrad_accumulation` and a gradient
    to compute) a view whose gradient goes into `weight.main_grad`.

    Raises:
        RuntimeError: fused accumulation without a `main_grad` of the weight's shape on the weight.
    """
    if not fuse_wgrad_accumulation or not (torch.is_grad_enabled() and weight.requires_grad):
        return weight
    main_grad = getattr(weight, "main_grad", None)
    if not isinstance(main_grad, torch.Tensor) or main_grad.shape != weight.shape:
        found = "none" if main_grad is None else f"shape {tuple(getattr(main_grad, 'shape', ()))}"
        raise RuntimeError(
            f"{owner}(fuse_wgrad_accumulation=True): parameter {name!r} needs a `main_grad` tensor of its shape "
            f"{tuple(weight.shape)} (megatron's DistributedDataParallel allocates it; otherwise set "
            f"`param.main_grad = torch.zeros_like(param, dtype=torch.float32)`), found {found}")
    return _AccumulateIntoMainGrad.apply(weight)
