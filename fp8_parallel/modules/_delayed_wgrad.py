"""TransformerEngine's `delay_wgrad_compute`: backward computes the input gradient only; the weight gradient
is computed later, when the module's `backward_dw()` runs it (e.g. to fill pipeline bubbles)."""
from __future__ import annotations

import collections
from typing import Callable, Deque, Optional, Tuple

import torch
import torch.nn.functional as F

from ._main_grad import add_weight_gradient


class WgradStore:
    """The weight-gradient computations one weight's backward passes left, oldest first."""

    def __init__(self) -> None:
        self._pending: Deque[Tuple[Callable[[], torch.Tensor], str]] = collections.deque()

    def put(self, compute: Callable[[], torch.Tensor], device_type: str) -> None:
        self._pending.append((compute, device_type))

    def pop(self) -> torch.Tensor:
        """Run the oldest pending computation (outside any autocast region the caller is in: the dtypes were
        fixed by the forward) and return its weight gradient."""
        if not self._pending:
            raise RuntimeError("backward_dw: no delayed weight gradient is pending (run backward first)")
        compute, device_type = self._pending.popleft()
        with torch.autocast(device_type, enabled=False):
            return compute()

    def __len__(self) -> int:
        return len(self._pending)


class _HighPrecisionLinear(torch.autograd.Function):
    """`F.linear` whose weight gradient goes to a `WgradStore` (the path outside an FP8 scope). Inside an
    autocast region it computes in the autocast dtype, as torch's autocast runs `F.linear`; its backward (and
    the delayed weight gradient) use the dtypes of that forward, wherever they run. With `owner` (fused
    accumulation) the delayed computation adds the gradient into `owner.main_grad` itself, as the undelayed
    fused path does (`_main_grad.add_weight_gradient`: float32 accumulation, one rounding), and returns None."""

    @staticmethod
    def forward(ctx, x, weight, bias, store: WgradStore, owner=None):
        device_type = x.device.type
        dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else x.dtype
        with torch.autocast(device_type, enabled=False):
            xc, wc = x.to(dtype), weight.to(dtype)
            out = F.linear(xc, wc, None if bias is None else bias.to(dtype))
        ctx.save_for_backward(xc, wc)
        ctx.store, ctx.has_bias, ctx.owner = store, bias is not None, owner
        ctx.x_dtype, ctx.w_dtype = x.dtype, weight.dtype
        ctx.b_dtype = None if bias is None else bias.dtype
        return out

    @staticmethod
    def backward(ctx, grad):
        xc, wc = ctx.saved_tensors
        device_type = grad.device.type
        with torch.autocast(device_type, enabled=False):
            g = grad.to(wc.dtype)
            g2, x2 = g.reshape(-1, g.shape[-1]), xc.reshape(-1, xc.shape[-1])
            grad_x = (g @ wc).to(ctx.x_dtype) if ctx.needs_input_grad[0] else None
            if ctx.needs_input_grad[1]:
                w_dtype, owner = ctx.w_dtype, ctx.owner
                if owner is not None:
                    ctx.store.put(lambda: add_weight_gradient(owner.main_grad, g2, x2), device_type)
                else:
                    ctx.store.put(lambda: (g2.t() @ x2).to(w_dtype), device_type)
            grad_b = g2.sum(0).to(ctx.b_dtype) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, None, grad_b, None, None


def high_precision_linear(x, weight, bias, store: WgradStore, owner: Optional[torch.Tensor] = None) -> torch.Tensor:
    """`F.linear` with its weight gradient left in `store`; with `owner`, that computation adds it into
    `owner.main_grad` (see `_HighPrecisionLinear`)."""
    return _HighPrecisionLinear.apply(x, weight, bias, store, owner)


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
        `.grad` (or is added into `main_grad` with fused accumulation: the computation left a float32 gradient,
        or None when it added it itself); then the registered hooks run."""
        if not any(len(store) for store in self.stores.values()):
            return
        for name, store in self.stores.items():
            if not len(store):  # a frozen weight: no gradient was left for it
                continue
            weight = getattr(module, name)
            grad = store.pop()
            if fuse_wgrad_accumulation:
                if grad is not None:
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
