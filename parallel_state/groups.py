"""Process groups for FP8 training, built by megatron-core and read back from it.

megatron-core's `parallel_state` is the source of truth for every group. This module only
(1) validates sizes before anything collective happens, (2) starts torch.distributed from torchrun's
environment, (3) calls megatron's `initialize_model_parallel`, and (4) adds the one group megatron does not
build: the expert amax domain.

Amax reduction domains (why each is right):

* Dense modules: every rank that holds a replica or a shard of the same dense weights must use the same
  FP8 scale, or TP shards would quantize one logical tensor with different scales and DP replicas would
  drift apart. Those ranks are TP x DP (x CP, since CP ranks hold the same weights and see different
  tokens) of one pipeline stage: megatron's `get_amax_reduction_group(with_context_parallel=True)`.
  Ranks of other pipeline stages hold other layers and must not take part. `tp_only=True` restricts the
  domain to TP x CP (megatron's `tp_only_amax_red`), trading replica consistency for a cheaper collective.
* Expert modules: ranks with different expert-parallel ranks hold *different* experts, so reducing over
  EP would mix unrelated tensors (and, when some experts get no tokens, poison histories). The ranks that
  hold the same experts are expert-TP x expert-DP within one stage: same pipeline rank, same EP rank.
"""
from __future__ import annotations

import dataclasses
import datetime
import os
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from .layout import ParallelSizes

_DEFAULT_TIMEOUT = datetime.timedelta(minutes=10)


@dataclasses.dataclass
class _Extras:
    sizes: ParallelSizes
    expert_amax_group: dist.ProcessGroup
    owns_process_group: bool


_EXTRAS: Optional[_Extras] = None


def _mpu():
    from megatron.core import parallel_state as mpu

    return mpu


def _world_size_from_env() -> int:
    if dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def _refuse_helper_process() -> None:
    """Refuse to start in a multiprocessing child of a torchrun rank: that is a helper process (megatron's
    checkpoint writer starts one with the spawn method) re-running the main script, whose code is not under
    `if __name__ == "__main__":`. Joining the rank's rendezvous from there would hang both.

    Such a helper is caught while it bootstraps (multiprocessing's `_inheriting` flag, the one multiprocessing
    itself checks before it starts a process); a rank that torchrun forked (`--start-method fork`) is not one."""
    import multiprocessing

    if not getattr(multiprocessing.current_process(), "_inheriting", False) or "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    raise RuntimeError(
        f"parallel_state.initialize called in process {multiprocessing.current_process().name!r}, a child "
        f"of torchrun rank {os.environ.get('RANK', '?')} (a helper process such as megatron's checkpoint "
        "writer re-imported the main script). Put the script's code in a function called under "
        "`if __name__ == \"__main__\":`"
    )


def default_backend() -> str:
    """NCCL when CUDA is available, gloo otherwise."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def initialize(
    tp: int = 1,
    pp: int = 1,
    vpp: Optional[int] = None,
    cp: int = 1,
    ep: int = 1,
    etp: Optional[int] = None,
    backend: Optional[str] = None,
    timeout: datetime.timedelta = _DEFAULT_TIMEOUT,
) -> ParallelSizes:
    """Start torch.distributed (if needed) and megatron's model-parallel groups.

    Args:
        tp, pp, vpp, cp, ep, etp: parallel sizes, as megatron's `initialize_model_parallel` takes them.
        backend: process-group backend; default NCCL with CUDA, gloo without.
        timeout: collective timeout for the groups, so a hang becomes an error.

    Returns:
        The validated sizes, with `dp` and `expert_dp` derived.

    Raises:
        ParallelLayoutError: sizes that do not fit the world size, before any collective is issued.
        RuntimeError: called in a multiprocessing child of a torchrun rank (the main script re-imported by a
            helper process: its code needs an `if __name__ == "__main__":` guard).
    """
    global _EXTRAS
    if _EXTRAS is not None:
        raise RuntimeError(f"parallel_state is already initialized with {_EXTRAS.sizes.describe()}")
    _refuse_helper_process()
    sizes = ParallelSizes(world=_world_size_from_env(), tp=tp, pp=pp, vpp=vpp, cp=cp, ep=ep, etp=etp)
    owns = False
    if not dist.is_initialized():
        backend = backend or default_backend()
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        if "MASTER_ADDR" not in os.environ:  # a plain single-process run
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
            os.environ.setdefault("RANK", "0")
            os.environ.setdefault("WORLD_SIZE", "1")
        dist.init_process_group(backend=backend, timeout=timeout)
        owns = True
    mpu = _mpu()
    mpu.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        context_parallel_size=cp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
        distributed_timeout_minutes=max(1, int(timeout.total_seconds() // 60)),
    )
    _EXTRAS = _Extras(sizes=sizes, expert_amax_group=build_expert_amax_group(timeout), owns_process_group=owns)
    return sizes


def build_expert_amax_group(timeout: Optional[datetime.timedelta] = None) -> dist.ProcessGroup:
    """Group the ranks that hold the same experts: equal (pipeline rank, expert-parallel rank).

    Reads megatron's groups only, so it also serves runs whose groups megatron's `initialize_model_parallel`
    built without `initialize` (Megatron-LM's start-up). Collective: every rank of the world calls it, in the
    same order. The key of every rank is read from megatron's groups and gathered, so no rank arithmetic is
    repeated here. Every rank creates every group in the same order, as `new_group` requires.
    """
    mpu = _mpu()
    key = torch.tensor(
        [mpu.get_pipeline_model_parallel_rank(), mpu.get_expert_model_parallel_rank()], dtype=torch.int64
    )
    if dist.get_backend() == "nccl":
        key = key.cuda()
    keys = [torch.empty_like(key) for _ in range(dist.get_world_size())]
    dist.all_gather(keys, key)
    members: Dict[tuple, List[int]] = {}
    for rank, k in enumerate(keys):
        members.setdefault(tuple(k.tolist()), []).append(rank)
    mine = None
    for k in sorted(members):
        group = dist.new_group(members[k], timeout=timeout) if timeout is not None else dist.new_group(members[k])
        if dist.get_rank() in members[k]:
            mine = group
    assert mine is not None
    return mine


def is_initialized() -> bool:
    """Whether `initialize()` has run (and `destroy()` has not) in this process."""
    return _EXTRAS is not None


def sizes() -> ParallelSizes:
    """The sizes `initialize` was called with."""
    return _require().sizes


def destroy(destroy_process_group: Optional[bool] = None) -> None:
    """Tear down megatron's groups (and torch.distributed if `initialize` started it)."""
    global _EXTRAS
    extras = _EXTRAS
    _EXTRAS = None
    _mpu().destroy_model_parallel()
    if destroy_process_group is None:
        destroy_process_group = extras is not None and extras.owns_process_group
    if destroy_process_group and dist.is_initialized():
        dist.destroy_process_group()


def _require() -> _Extras:
    if _EXTRAS is None:
        raise RuntimeError("parallel_state is not initialized: call parallel_state.initialize(...) first")
    return _EXTRAS


# Each parallel dimension -> megatron's getter of its group.
_GROUP_GETTERS: Dict[str, Callable[[], dist.ProcessGroup]] = {
    "tp": lambda: _mpu().get_tensor_model_parallel_group(),
    "pp": lambda: _mpu().get_pipeline_model_parallel_group(),
    "dp": lambda: _mpu().get_data_parallel_group(with_context_parallel=False),
    "dp_cp": lambda: _mpu().get_data_parallel_group(with_context_parallel=True),
    "cp": lambda: _mpu().get_context_parallel_group(),
    "ep": lambda: _mpu().get_expert_model_parallel_group(),
    "etp": lambda: _mpu().get_expert_tensor_parallel_group(),
    "edp": lambda: _mpu().get_expert_data_parallel_group(),
}

DIMENSIONS = tuple(_GROUP_GETTERS)


def get_group(dim: str) -> dist.ProcessGroup:
    """The process group of this rank along `dim` (one of `DIMENSIONS`)."""
    _require()
    try:
        getter = _GROUP_GETTERS[dim]
    except KeyError:
        raise ValueError(f"unknown parallel dimension {dim!r}; expected one of {DIMENSIONS}") from None
    return getter()


def get_rank(dim: str) -> int:
    """This rank's index inside its `dim` group."""
    return dist.get_rank(get_group(dim))


def get_size(dim: str) -> int:
    """The size of this rank's `dim` group."""
    return dist.get_world_size(get_group(dim))


def get_ranks(dim: str) -> List[int]:
    """Global ranks of this rank's `dim` group, in group order."""
    return dist.get_process_group_ranks(get_group(dim))


def dense_amax_group(tp_only: bool = False) -> dist.ProcessGroup:
    """Amax domain of dense (non-expert) FP8 tensors: TP x DP x CP of this stage, or TP x CP when `tp_only`."""
    _require()
    return _mpu().get_amax_reduction_group(with_context_parallel=True, tp_only_amax_red=tp_only)


def expert_amax_group(etp_only: bool = False) -> dist.ProcessGroup:
    """Amax domain of expert FP8 tensors: expert-TP x expert-DP of this stage, or expert-TP when `etp_only`."""
    extras = _require()
    return get_group("etp") if etp_only else extras.expert_amax_group

