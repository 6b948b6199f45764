"""Run megatron-core's CUDA-only code paths on CPU (gloo), for tests and CPU runs.

megatron-core hard-codes CUDA in places that have nothing to do with the math:

* factory calls with `device="cuda"` or `device=torch.cuda.current_device()` (schedules' token counts, p2p
  shape buffers, attention masks, rotary embeddings, router buffers, all-gather outputs);
* `Tensor.cuda()`, `pin_memory=True`, `Tensor.record_stream(...)`;
* `torch.cuda.synchronize()` after batched p2p, `torch.cuda.Stream()` / `torch.cuda.stream(...)` in the MoE
  dispatcher and shared experts;
* the model-parallel RNG tracker, which reads and writes CUDA generator states;
* `Tensor.type()` names, which megatron's optimizers check against `torch.cuda.FloatTensor` and friends;
* the MoE all-to-all dispatcher moves its split sizes "to the host" as numpy arrays only when they are
  on a GPU; on CPU they would stay tensors, which `all_to_all_single` refuses: they become numpy here too;
* activation recompute runs inside autograd's backward, where torch function modes are not active: megatron's
  checkpoint backward re-enters the placement mode here;
* gloo's all_gather / reduce_scatter take only equal-sized tensor lists; megatron's MoE dispatcher with
  expert-TP > 1 gathers and reduce-scatters unequal token counts (NCCL allows that): here unequal lists are
  padded to the largest and trimmed again;
* (not CUDA, but on the same path) megatron-core 0.16's MoE router references `te_general_gemm`, a name
  that is left undefined when TransformerEngine is absent; it is defined as None here, which selects
  megatron's own torch fallback.

`cpu_compat()` redirects exactly those, for the duration of a `with` block, and only when no GPU is
present (on a CUDA machine it does nothing). Device placement is rewritten by one `TorchFunctionMode`;
the `torch.cuda` entry points and megatron's two RNG-state helpers are swapped and restored on exit. The
RNG tracker then forks the CPU generator, which is what CPU dropout and init draw from.
"""
from __future__ import annotations

import contextlib
import logging
from typing import Any, Iterator, List, Optional, Tuple

import torch
from torch.overrides import TorchFunctionMode


def needs_cpu_compat() -> bool:
    """True when megatron's CUDA assumptions must be redirected (no usable GPU)."""
    return not torch.cuda.is_available()


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)


class _CudaPlacementToCpu(TorchFunctionMode):
    """Rewrites CUDA placement in torch calls to the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda or func is torch.Tensor.pin_memory:
            return args[0]
        if func is torch.Tensor.record_stream:
            return None
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:  # megatron's optimizers accept only
            return func(*args).replace("torch.", "torch.cuda.", 1)  # "torch.cuda.*Tensor" type names
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs["device"] = "cpu"
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], "cpu") + tuple(args[2:])
        return func(*args, **kwargs)


class _NullStream:
    """Stands in for `torch.cuda.Stream`: CPU work is ordered already."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, other: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> "_NullEvent":  # noqa: ARG002
        return _NullEvent()

    def synchronize(self) -> None:
        pass


class _NullEvent:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


def _cpu_get_rng_state(*args: Any, **kwargs: Any) -> torch.Tensor:
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state: torch.Tensor, *args: Any, **kwargs: Any) -> None:
    torch.set_rng_state(new_state)


def _cpu_manual_seed(seed: int) -> None:
    torch.manual_seed(seed)


_MISSING = object()


def _host_splits(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:  # noqa: ARG001
    """megatron's `maybe_move_tensor_to_cpu` for tensors that are on the CPU already."""
    if as_numpy and torch.is_tensor(tensor):
        return tensor.numpy()
    return tensor


class _DropForkedCpuRngWarning(logging.Filter):
    """The tracker warns when the CPU generator changes inside `fork()`; here it is the forked generator."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "CPU RNG state changed" not in record.getMessage()


def _uneven_all_gather(original):
    def all_gather(tensor_list, tensor, group=None, async_op=False):
        sizes = {t.shape for t in tensor_list}
        if len(sizes) <= 1 and tensor.shape in sizes:
            return original(tensor_list, tensor, group=group, async_op=async_op)
        rows = max(t.shape[0] for t in tensor_list)
        padded = tensor.new_zeros((rows,) + tuple(tensor.shape[1:]))
        padded[: tensor.shape[0]] = tensor
        gathered = [torch.empty_like(padded) for _ in tensor_list]
        original(gathered, padded.contiguous(), group=group)
        for out, got in zip(tensor_list, gathered):
            out.copy_(got[: out.shape[0]])
        return None

    return all_gather


def _uneven_reduce_scatter(original):
    import torch.distributed as dist

    def reduce_scatter(output, input_list, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if len({t.shape for t in input_list}) <= 1 and dist.get_backend(group) != "gloo":
            return original(output, input_list, op=op, group=group, async_op=async_op)
        rows = max(t.shape[0] for t in input_list)
        stacked = input_list[0].new_zeros((len(input_list), rows) + tuple(input_list[0].shape[1:]))
        for i, t in enumerate(input_list):
            stacked[i, : t.shape[0]] = t
        dist.all_reduce(stacked, op=op, group=group)
        output.copy_(stacked[dist.get_rank(group), : output.shape[0]])
        return None

    return reduce_scatter


def _with_placement_mode(backward):
    def run(ctx, *grads):
        with _CudaPlacementToCpu():
            return backward(ctx, *grads)

    return staticmethod(run)


def _patches() -> List[Tuple[Any, str, Any]]:
    import torch.distributed as dist

    from megatron.core.tensor_parallel import random as mcore_random
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    patches = [
        (torch.cuda, "current_device", lambda: "cpu"),
        (torch.cuda, "synchronize", lambda *a, **k: None),
        (torch.cuda, "Stream", _NullStream),
        (torch.cuda, "Event", _NullEvent),
        (torch.cuda, "current_stream", lambda *a, **k: _NullStream()),
        (torch.cuda, "stream", lambda *a, **k: contextlib.nullcontext()),
        (torch.cuda, "get_rng_state", _cpu_get_rng_state),
        (torch.cuda, "set_rng_state", _cpu_set_rng_state),
        (torch.cuda, "manual_seed", _cpu_manual_seed),
        (torch.cuda.random, "get_rng_state", _cpu_get_rng_state),
        (mcore_random, "_get_cuda_rng_state", _cpu_get_rng_state),
        (mcore_random, "_set_cuda_rng_state", _cpu_set_rng_state),
        (token_dispatcher, "maybe_move_tensor_to_cpu", _host_splits),
        (mcore_random.CheckpointFunction, "backward", _with_placement_mode(mcore_random.CheckpointFunction.backward)),
        (dist, "all_gather", _uneven_all_gather(dist.all_gather)),
        (dist, "reduce_scatter", _uneven_reduce_scatter(dist.reduce_scatter)),
    ]
    if not hasattr(moe_utils, "te_general_gemm"):
        patches.append((moe_utils, "te_general_gemm", None))
    return patches


@contextlib.contextmanager
def cpu_compat(enabled: Optional[bool] = None) -> Iterator[bool]:
    """Let megatron-core's CUDA-only code run on CPU inside this block.

    Args:
        enabled: force on/off; by default on exactly when there is no GPU.

    Yields:
        Whether the redirection is active.
    """
    if enabled is None:
        enabled = needs_cpu_compat()
    if not enabled:
        yield False
        return
    patches = _patches()
    # class attributes are saved raw (a staticmethod stays a staticmethod when restored)
    saved = [(owner, name, vars(owner).get(name, _MISSING) if isinstance(owner, type) else getattr(owner, name, _MISSING))
             for owner, name, _ in patches]
    for owner, name, replacement in patches:
        setattr(owner, name, replacement)
    rng_logger = logging.getLogger("megatron.core.tensor_parallel.random")
    rng_filter = _DropForkedCpuRngWarning()
    rng_logger.addFilter(rng_filter)
    try:
        with _CudaPlacementToCpu():
            yield True
    finally:
        rng_logger.removeFilter(rng_filter)
        for owner, name, original in saved:
            if original is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, original)
