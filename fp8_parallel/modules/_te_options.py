"""What the TransformerEngine-style standalone modules share: device and dtype defaults, weight
initialization, and the TransformerEngine constructor options they accept only at their defaults.

Tensor parallelism (`tp_group`, `tp_size`, `parallel_mode`, `sequence_parallel`) is implemented
(`_tensor_parallel.py`). A TransformerEngine option that selects behaviour these modules do not have
(userbuffers overlap, ...) is accepted at its default
value and refused, with the reason and what to use instead, at any other. Options that change no result
(JIT warm-up sizes, the userbuffers name, which copy of the input backward keeps) are accepted.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Dict, Iterable, Optional, Tuple, Union

import torch

from ._deferred_init import default_device, record_init, zero_init

# option -> (default, why another value is refused); None as the reason: any value is accepted (no effect on
# any result, or implemented by the modules that read it)
_OPTIONS: Dict[str, tuple] = {
    "ub_name": (None, None),
    "seq_length": (None, None),  # JIT warm-up hints
    "micro_batch_size": (None, None),
    # the weight-gradient operand is the input cast with the forward's scale either way (kept in FP8, or
    # re-cast in backward from the kept input), so the results are the same; only what is held differs
    "save_original_input": (False, None),
    "fuse_wgrad_accumulation": (False, None),  # implemented by the modules (`_main_grad.weight_for_gemm`)
    "parameters_split": (None, "each weight is one parameter; split the output after the module instead"),
    "delay_wgrad_compute": (False, None),  # implemented by the modules that accept it (`_delayed_wgrad`)
    "symmetric_ar_type": (None, "tensor-parallel all-reduces are torch.distributed's all_reduce (no symmetric "
                                "memory variants)"),
}
for _ub in ("ub_overlap_ag", "ub_overlap_rs", "ub_overlap_rs_dgrad", "ub_bulk_dgrad", "ub_bulk_wgrad"):
    _OPTIONS[_ub] = (False, "userbuffers communication/GEMM overlap is not implemented; the tensor-parallel "
                            "collectives run before/after the GEMMs")


def check_te_options(owner: str, allowed: Iterable[str], options: Dict[str, Any]) -> None:
    """Validate TransformerEngine constructor options of `owner` (a class name).

    Args:
        allowed: the option names `owner`'s TransformerEngine counterpart has (others are a TypeError,
            like any unexpected keyword argument).
        options: the options the caller passed.

    Raises:
        TypeError: an option `owner` does not have.
        NotImplementedError: an option at a value these modules do not implement.
    """
    allowed = set(allowed)
    for name in options:
        if name not in allowed:
            raise TypeError(f"{owner}.__init__() got an unexpected keyword argument {name!r}")
    for name, value in options.items():
        default, why = _OPTIONS[name]
        if why is not None and value != default:
            raise NotImplementedError(f"{owner}({name}={value!r}): {why}. Leave {name}={default!r}.")


def resolve_device(device: Optional[Union[str, torch.device]]) -> torch.device:
    """The parameters' device: None means CUDA when available, else the CPU; an explicit device is kept
    ("meta": deferred initialization, see `_deferred_init`)."""
    return default_device() if device is None else torch.device(device)


def resolve_dtype(owner: str, params_dtype: Optional[torch.dtype]) -> torch.dtype:
    """The parameters' dtype: None means `torch.get_default_dtype()`; float32, float16 or bfloat16 (FP8
    casts happen inside the autocast scope)."""
    dtype = torch.get_default_dtype() if params_dtype is None else params_dtype
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"{owner}(params_dtype={params_dtype!r}): expected float32, float16 or bfloat16 (or None)")
    return dtype


def default_init_method(weight: torch.Tensor) -> None:
    """TransformerEngine's default weight initialization: normal with mean 0 and std 0.023."""
    torch.nn.init.normal_(weight, mean=0.0, std=0.023)


def init_weight(
    weight: torch.Tensor,
    init_method: Optional[Callable[[torch.Tensor], Any]],
    get_rng_state_tracker: Optional[Callable[[], Any]] = None,
    rng_tracker_name: Optional[str] = None,
) -> None:
    """`init_method(weight)` (default: `default_init_method`), inside the RNG tracker's fork when a tracker
    is given (megatron's / TransformerEngine's `get_rng_state_tracker`)."""
    init = default_init_method if init_method is None else init_method
    with torch.no_grad():
        if get_rng_state_tracker is None:
            init(weight)
            return
        tracker = get_rng_state_tracker()
        with tracker.fork(rng_tracker_name) if rng_tracker_name is not None else tracker.fork():
            init(weight)


def check_input(owner: str, inp: torch.Tensor, features: int, label: str = "in_features") -> None:
    """A clear error for an input whose last dimension is not the module's input size (`label`)."""
    if not isinstance(inp, torch.Tensor):
        raise TypeError(f"{owner}: expected a tensor input, got {type(inp).__name__}")
    if inp.dim() == 0 or inp.shape[-1] != features:
        raise ValueError(f"{owner}: input of shape {tuple(inp.shape)} does not end in {label}={features}")


def in_autocast_dtype(inp: torch.Tensor) -> torch.Tensor:
    """`inp` cast to the autocast dtype inside `torch.autocast` for its device (TransformerEngine's activation
    dtype: a module's compute and output are in it), else unchanged."""
    dev = inp.device.type
    if inp.is_floating_point() and torch.is_autocast_enabled(dev):
        return inp.to(torch.get_autocast_dtype(dev))
    return inp


def check_forward_options(owner: str, fp8_output: Optional[bool], fp8_grad: Optional[bool]) -> None:
    """TransformerEngine's `fp8_output` / `fp8_grad` forward flags: only False (outputs and input
    gradients leave the module in high precision)."""
    for name, value in (("fp8_output", fp8_output), ("fp8_grad", fp8_grad)):
        if value:
            raise NotImplementedError(
                f"{owner}.forward({name}=True): outputs and gradients leave the module in high precision; "
                f"leave {name}=False"
            )


def weight_initializer(init_method: Optional[Callable[[torch.Tensor], Any]],
                       get_rng_state_tracker: Optional[Callable[[], Any]] = None,
                       rng_tracker_name: Optional[str] = None) -> Callable[[torch.Tensor], None]:
    """`init_weight` with these arguments, as one callable (run now, and again by `reset_parameters`)."""
    return functools.partial(init_weight, init_method=init_method, get_rng_state_tracker=get_rng_state_tracker,
                             rng_tracker_name=rng_tracker_name)


def add_weight(module: torch.nn.Module, name: str, shape: Tuple[int, ...], dtype: torch.dtype, device: torch.device,
               init: Callable[[torch.Tensor], None]) -> torch.nn.Parameter:
    """Register parameter `name` of `shape`, initialized by `init` (recorded for `reset_parameters`)."""
    param = torch.nn.Parameter(torch.empty(shape, dtype=dtype, device=device))
    with torch.no_grad():
        init(param)
    setattr(module, name, param)
    record_init(module, name, init)
    return param


def add_bias(module: torch.nn.Module, name: str, size: int, dtype: torch.dtype, device: torch.device,
             bias: bool = True) -> Optional[torch.nn.Parameter]:
    """Register a zero bias `name` of `size` (or None without `bias`), recorded for `reset_parameters`."""
    if not bias:
        setattr(module, name, None)
        return None
    return add_weight(module, name, (size,), dtype, device, zero_init)


def add_linear_parameters(module: torch.nn.Module, in_features: int, out_features: int, bias: bool,
                          dtype: torch.dtype, device: torch.device, init_method: Optional[Callable],
                          get_rng_state_tracker: Optional[Callable], tag: str,
                          rng_tracker_name: Optional[str] = None, bias_features: Optional[int] = None) -> None:
    """Give `module` TransformerEngine's linear parameters (`weight [out_features, in_features]`, this rank's
    shard, initialized as such; optional zero `bias` of `bias_features`, default `out_features`) and its FP8
    state (`fp8`, tagged `tag`)."""
    from ._core import FP8State

    add_weight(module, "weight", (out_features, in_features), dtype, device,
               weight_initializer(init_method, get_rng_state_tracker, rng_tracker_name))
    add_bias(module, "bias", out_features if bias_features is None else bias_features, dtype, device, bias)
    module.fp8 = FP8State(tag, device=device)
