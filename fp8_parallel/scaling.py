"""Scale arithmetic and the batched amax-history/scale update (no host synchronization anywhere)."""
from __future__ import annotations

from typing import Any, Callable, Optional, Tuple, Union

import torch

from .recipe import AmaxComputeAlgo

FLOAT32_MAX = torch.finfo(torch.float32).max


def scale_from_amax(
    amax: torch.Tensor, prev_scale: torch.Tensor, fp8_max: Union[float, torch.Tensor], margin: int = 0
) -> torch.Tensor:
    """TransformerEngine's rule, elementwise: `fp8_max / amax / 2**margin`.

    amax <= 0, inf or NaN keeps `prev_scale`; a scale that overflows to inf becomes float32 max.
    """
    amax = amax.float()
    # a true division (a Python number over a tensor is its reciprocal times the number: two roundings), so the
    # result equals TransformerEngine's and the fused update's IEEE float32 division bit for bit
    limit = fp8_max if isinstance(fp8_max, torch.Tensor) else torch.full_like(amax, fp8_max)
    scale = torch.div(limit, amax) / (2.0**margin)
    usable = (amax > 0) & torch.isfinite(amax)
    scale = torch.where(usable, scale, prev_scale)
    return torch.where(torch.isinf(scale), torch.full_like(scale, FLOAT32_MAX), scale)


def current_scale(amax: torch.Tensor, fp8_max: float, eps: float) -> torch.Tensor:
    """Current (tensorwise) scaling: `fp8_max / max(amax, eps)`, computed in float64, returned as float32
    (float64 keeps eager and compiled numerics equal, as torchao.float8 does)."""
    return (fp8_max / torch.clamp(amax.to(torch.float64), min=eps)).float()


def current_scale_te(amax: torch.Tensor, fp8_max_value: float, epsilon: float, force_pow_2: bool,
                     value_for_inf: float) -> torch.Tensor:
    """TransformerEngine's current-scaling rule, elementwise in float32: `fp8_max / max(amax, epsilon)`, 1 for
    a zero or non-finite amax, `value_for_inf` where the quotient overflows, rounded down to a power of 2
    with `force_pow_2`. (For a finite amax >= epsilon > 0 it equals `scaling.current_scale` bit for bit: a
    float64 quotient of float32 values rounds to the float32 quotient.)"""
    amax = amax.float()
    amax = torch.where(amax < epsilon, torch.full_like(amax, epsilon), amax)
    scale = torch.div(torch.full_like(amax, fp8_max_value), amax)
    scale = torch.where(torch.isinf(scale), torch.full_like(scale, value_for_inf), scale)
    scale = torch.where((amax == 0) | ~torch.isfinite(amax), torch.ones_like(scale), scale)
    if force_pow_2:  # keep sign and exponent: the largest power of 2 not above the scale
        scale = (scale.view(torch.int32) & -8388608).view(torch.float32)
    return scale


def amax_from_history(history: torch.Tensor, algo: AmaxComputeAlgo) -> torch.Tensor:
    """Reduce a `[n, history_len]` history (newest in column 0) to `[n]` amaxes. A callable `algo` gets the
    history in TransformerEngine's layout, `[history_len, n]` with the newest amaxes in row 0, and returns `[n]`.

    Raises:
        ValueError: a callable returned another shape.
    """
    if algo == "max":
        return history.amax(dim=1)
    if algo == "most_recent":
        return history[:, 0].clone()
    amax = algo(history.t())
    if not isinstance(amax, torch.Tensor) or tuple(amax.shape) != (history.shape[0],):
        got = tuple(amax.shape) if isinstance(amax, torch.Tensor) else type(amax).__name__
        raise ValueError(
            f"amax_compute_algo {getattr(algo, '__name__', algo)!r}: given the amax history as "
            f"[history_len, num_tensors] = {list(history.t().shape)} (TransformerEngine's layout, newest amaxes "
            f"in row 0), it must return one amax per tensor, shape [{history.shape[0]}]; got {got}")
    return amax


def update_history_and_scale(
    history: torch.Tensor,
    scale: torch.Tensor,
    new_amax: torch.Tensor,
    fp8_max: torch.Tensor,
    margin: int,
    algo: AmaxComputeAlgo,
    scale_rule: Optional[Callable[..., torch.Tensor]] = None,
    recipe: Any = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One delayed-scaling step for `n` tensors at once, as a fixed handful of batched ops.

    Args:
        history: `[n, L]`, newest amax in column 0.
        scale: `[n]` current scales.
        new_amax: `[n]` (already reduced) amaxes of this iteration.
        fp8_max: `[n]` format maximum of each tensor, or one float for all.
        scale_rule: a recipe's `scaling_factor_compute_algo`, called as TransformerEngine calls it,
            `scale_rule(amax, scale, fp8_max, recipe)` -> `[n]` scales, instead of `scale_from_amax`.

    Returns:
        (new_history, new_scale, nonfinite): a tensor whose amax is 0 (it did not run anywhere in the group)
        or not finite keeps its history unrolled and its scale unchanged; `nonfinite` flags the latter.
    """
    nonfinite = ~torch.isfinite(new_amax)
    rolls = (new_amax > 0) & ~nonfinite
    # the newest amax enters column 0, the oldest drops off the end
    rolled = torch.cat([new_amax.float().unsqueeze(1), history[:, :-1]], dim=1)
    new_history = torch.where(rolls.unsqueeze(1), rolled, history)
    amax = amax_from_history(new_history, algo)
    if scale_rule is None:
        computed = scale_from_amax(amax, scale, fp8_max, margin)
    else:
        computed = custom_scale(scale_rule, amax, scale, fp8_max, recipe)
    new_scale = torch.where(rolls, computed, scale)
    return new_history, new_scale, nonfinite


def custom_scale(rule: Callable[..., torch.Tensor], amax: torch.Tensor, scale: torch.Tensor,
                 fp8_max: Union[float, torch.Tensor], recipe: Any) -> torch.Tensor:
    """`rule(amax, scale, fp8_max, recipe)` (a recipe's `scaling_factor_compute_algo`) as float32 `[n]`.

    Raises:
        ValueError: the rule returned something else than one scale per tensor (naming the rule and shape).
    """
    out = rule(amax, scale.clone(), fp8_max, recipe)  # a clone: a rule that writes into `scale` changes nothing
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != tuple(scale.shape):
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(f"scaling_factor_compute_algo {getattr(rule, '__name__', rule)!r}: given amax and scale of "
                         f"shape {list(scale.shape)}, it must return one scale per tensor, shape {list(scale.shape)}; "
                         f"got {got}")
    return out.to(device=scale.device, dtype=torch.float32)
