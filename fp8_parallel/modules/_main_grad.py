"""TransformerEngine's `fuse_wgrad_accumulation`: a weight's gradient is added into its `main_grad` buffer
(megatron's DistributedDataParallel protocol) instead of being returned to autograd as `.grad`."""
from __future__ import annotations

from typing import List, Optional, Sequence

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
        return grad_after_main_grad(weight)


def placeholder_grad(weight: torch.Tensor, like: Optional[torch.Tensor] = None) -> torch.Tensor:
    """What autograd gets for a weight whose gradient is already in `main_grad` under megatron's protocol:
    `grad_added_to_main_grad` set (its DDP hook then adds nothing) and an unused buffer shaped as `like`
    (default the weight), zeros when the parameter asks for them with `zero_out_wgrad` (TransformerEngine's
    convention)."""
    weight.grad_added_to_main_grad = True
    like = weight if like is None else like
    if getattr(weight, "zero_out_wgrad", False):
        return torch.zeros_like(like)
    return torch.empty_like(like)


def accumulates_into_main_grad(weight: torch.Tensor, fuse_wgrad_accumulation: bool, owner: str, name: str) -> bool:
    """Whether this call's weight gradient goes into `weight.main_grad` (fused accumulation asked for and a
    gradient to compute), after checking that the buffer exists.

    Raises:
        RuntimeError: fused accumulation without a `main_grad` of the weight's shape on the weight.
    """
    if not fuse_wgrad_accumulation or not (torch.is_grad_enabled() and weight.requires_grad):
        return False
    main_grad = getattr(weight, "main_grad", None)
    if not isinstance(main_grad, torch.Tensor) or main_grad.shape != weight.shape:
        found = "none" if main_grad is None else f"shape {tuple(getattr(main_grad, 'shape', ()))}"
        raise RuntimeError(
            f"{owner}(fuse_wgrad_accumulation=True): parameter {name!r} needs a `main_grad` tensor of its shape "
            f"{tuple(weight.shape)} (megatron's DistributedDataParallel allocates it; otherwise set "
            f"`param.main_grad = torch.zeros_like(param, dtype=torch.float32)`), found {found}")
    return True


def grad_after_main_grad(weight: torch.Tensor, like: Optional[torch.Tensor] = None):
    """What autograd gets for `weight` (or for `like`, the tensor standing for it in the GEMM) once its
    gradient is in `main_grad`: None, or under megatron's protocol (the parameter has `grad_added_to_main_grad`)
    the flag set and `placeholder_grad`, as TransformerEngine."""
    if not hasattr(weight, "grad_added_to_main_grad"):
        return None  # `.grad` stays None, as TransformerEngine leaves it
    return placeholder_grad(weight, like)


def add_into_main_grads(weights: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]) -> List[Optional[torch.Tensor]]:
    """`weights[i].main_grad += grads[i]` for every i as one multi-tensor add (each sum in float32 where
    `main_grad` is, as `main_grad.add_`), for gradients computed together (a grouped GEMM's); returns what
    autograd gets for each weight (`grad_after_main_grad`)."""
    if weights:
        torch._foreach_add_([w.main_grad for w in weights], list(grads))
    return [grad_after_main_grad(w) for w in weights]


def weight_for_gemm(weight: torch.Tensor, fuse_wgrad_accumulation: bool, owner: str, name: str) -> torch.Tensor:
    """`weight` as the module's GEMM should see it: itself, or (with `fuse_wgrad_accumulation` and a gradient
    to compute) a view whose gradient goes into `weight.main_grad` (for modules whose GEMM does not take the
    buffer itself; see `fp8_linear`'s `fuse_wgrad_accumulation`).

    Raises:
        RuntimeError: fused accumulation without a `main_grad` of the weight's shape on the weight.
    """
    if not accumulates_into_main_grad(weight, fuse_wgrad_accumulation, owner, name):
        return weight
    return _AccumulateIntoMainGrad.apply(weight)


# torch's CUDA addmm takes bf16 / fp16 operands with a float32 buffer (`out_dtype`) from 2.10 on
_ADDMM_INTO_FLOAT32 = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 10)


def add_weight_gradient(main_grad: torch.Tensor, grad_out: torch.Tensor, inp: torch.Tensor) -> None:
    """`main_grad += grad_out.T @ inp` (2-d operands) with float32 accumulation and one rounding into
    `main_grad`'s dtype, as megatron's fused weight-gradient accumulation: on CUDA one GEMM that adds into the
    buffer (cuBLAS with beta 1; for bf16 / fp16 operands and a float32 buffer from torch 2.10 on)."""
    if grad_out.dtype == main_grad.dtype == inp.dtype:
        main_grad.addmm_(grad_out.t(), inp)
    elif (_ADDMM_INTO_FLOAT32 and grad_out.is_cuda and main_grad.dtype == torch.float32
          and grad_out.dtype == inp.dtype and grad_out.dtype in (torch.bfloat16, torch.float16)):
        torch.addmm(main_grad, grad_out.t(), inp, out_dtype=torch.float32, out=main_grad)
    else:
        main_grad.add_(grad_out.t().float() @ inp.float())


class _LinearIntoMainGrad(torch.autograd.Function):
    """`F.linear` in the input's dtype whose weight gradient is added into `owner.main_grad`
    (`add_weight_gradient`) instead of returned: the high-precision path of a linear with fused accumulation.
    `owner`: the parameter `weight` stands for (itself, or the FP8 parameter it was dequantized from)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias, owner: torch.Tensor):
        ctx.owner = owner
        ctx.bias_dtype = None if bias is None else bias.dtype
        ctx.save_for_backward(x, weight)
        return torch.nn.functional.linear(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        g2 = grad.reshape(-1, grad.shape[-1])
        grad_x = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = (g2 @ weight.to(g2.dtype)).reshape(x.shape)
        add_weight_gradient(ctx.owner.main_grad, g2, x.reshape(-1, x.shape[-1]))
        if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
            grad_b = g2.sum(0).to(ctx.bias_dtype)
        return grad_x, grad_after_main_grad(ctx.owner, like=weight), grad_b, None


def linear_into_main_grad(x: torch.Tensor, weight: torch.Tensor, bias, owner: Optional[torch.Tensor] = None
                          ) -> torch.Tensor:
    """`x @ weight.T + bias` in `x`'s dtype, the weight's gradient added into `owner.main_grad` (`owner`: the
    parameter `weight` stands for, default `weight` itself; see `_LinearIntoMainGrad`)."""
    return _LinearIntoMainGrad.apply(x, weight, bias, weight if owner is None else owner)
