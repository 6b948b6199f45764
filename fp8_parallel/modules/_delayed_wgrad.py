"""TransformerEngine's `delay_wgrad_compute`: backward computes the input gradient only; the weight gradient
is computed later, when the module's `backward_dw()` runs it (e.g. to fill pipeline bubbles)."""
from __future__ import annotations

import collections
from typing import Callable, Deque

import torch
import torch.nn.functional as F


class WgradStore:
    """The weight-gradient computations one weight's backward passes left, oldest first."""

    def __init__(self) -> None:
        self._pending: Deque[Callable[[], torch.Tensor]] = collections.deque()

    def put(self, compute: Callable[[], torch.Tensor]) -> None:
        self._pending.append(compute)

    def pop(self) -> torch.Tensor:
        """Run the oldest pending computation and return its weight gradient."""
        if not self._pending:
            raise RuntimeError("backward_dw: no delayed weight gradient is pending (run backward first)")
        return self._pending.popleft()()

    def __len__(self) -> int:
        return len(self._pending)


class _HighPrecisionLinear(torch.autograd.Function):
    """`F.linear` whose weight gradient goes to a `WgradStore` (the path outside an FP8 scope)."""

    @staticmethod
    def forward(ctx, x, weight, bias, store: WgradStore):
        ctx.save_for_backward(x, weight)
        ctx.store, ctx.has_bias = store, bias is not None
        return F.linear(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype))

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        g2, x2 = grad.reshape(-1, grad.shape[-1]), x.reshape(-1, x.shape[-1])
        grad_x = (grad @ weight.to(grad.dtype)) if ctx.needs_input_grad[0] else None
        if ctx.needs_input_grad[1]:
            w_dtype = weight.dtype
            ctx.store.put(lambda: (g2.t() @ x2.detach()).to(w_dtype))
        grad_b = g2.sum(0).to(weight.dtype) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, None, grad_b, None


def high_precision_linear(x, weight, bias, store: WgradStore) -> torch.Tensor:
    return _HighPrecisionLinear.apply(x, weight, bias, store)


class DelayedWgrad:
    """What a module with `delay_wgrad_compute=True` keeps: one store per weight."""

    def __init__(self, module: torch.nn.Module, weight_names, bias_names) -> None:
        self.weight_names, self.bias_names = list(weight_names), list(bias_names)
        self.stores = {name: WgradStore() for name in self.weight_names}
        for name in self.weight_names + self.bias_names:
            param = getattr(module, name)
            if param is not None:  # megatron's DDP: the gradient arrives through backward_dw, not autograd
                param.skip_backward_post_hook = True

    def backward_dw(self, module: torch.nn.Module, fuse_wgrad_accumulation: bool, hooks) -> None:
        """Compute the oldest pending weight gradient of every weight; as TransformerEngine, it replaces
        `.grad` (or is added into `main_grad` with fused accumulation); then the registered hooks run."""
        if not any(len(store) for store in self.stores.values()):
            return
        for name, store in self.stores.items():
            weight = getattr(module, name)
            grad = store.pop()
            if fuse_wgrad_accumulation:
                weight.main_grad.add_(grad)
            else:
                weight.grad = grad.to(weight.dtype)
        for hook in hooks:
            hook()


class DelayedWgradMethods:
    """TransformerEngine's module methods around `delay_wgrad_compute` (mixed into the TE-style linears)."""

    delayed_wgrad: "DelayedWgrad | None"
    fuse_wgrad_accumulation: bool

    def _init_delayed_wgrad(self, delay: bool, weight_names, bias_names) -> None:
        self.delayed_wgrad = DelayedWgrad(self, weight_names, bias_names) if delay else None
        self._wgrad_hooks = []

    def _wgrad_store(self, weight_name: str) -> "WgradStore | None":
        return None if self.delayed_wgrad is None else self.delayed_wgrad.stores[weight_name]

    def need_backward_dw(self) -> bool:
        """Whether weight gradients wait for `backward_dw()` (`delay_wgrad_compute=True`)."""
        return self.delayed_wgrad is not None

    def backward_dw(self) -> None:
        """Compute the delayed weight gradients of the oldest pending backward (nothing without
        `delay_wgrad_compute`), then run the hooks registered with
        `register_wgrad_accumulation_and_reduce_hooks`."""
        if self.delayed_wgrad is not None:
            self.delayed_wgrad.backward_dw(self, self.fuse_wgrad_accumulation, self._wgrad_hooks)

    def register_wgrad_accumulation_and_reduce_hooks(self, hook) -> None:
        """A callable run after each `backward_dw()` (megatron's DDP registers its gradient reduction)."""
        self._wgrad_hooks.append(hook)
