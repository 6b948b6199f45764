"""What goes into a checkpoint: sharded state dicts of the model chunks and optimizer, FP8 state keys, RNG
states of every rank, and the parallel layout, all as plain tensors and JSON.

megatron-core gives the sharding (`sharded_state_dict()` of the model, `optimizer.sharded_state_dict(...)`
in its fully reshardable form, so TP / PP / EP may change between save and load). Our FP8 state is plain
buffers (`FP8State`: amax histories, scales, counters), equal on every rank of a tensor's amax domain, so
megatron saves it like any replicated tensor. Empty `_extra_state` objects of megatron's linears are left
out: they would be stored as pickles.
"""
from __future__ import annotations

import json
import random
from typing import Any, Dict, Iterable, List, Optional, Set, Tuple

import numpy as np
import torch
import torch.distributed as dist

# fully reshardable optimizer state, keyed like the model's tensors (no per-optimizer prefix, so MoE's dense and
# expert optimizers load by key whatever the layout)
OPTIMIZER_SHARDING = {"distrib_optim_sharding_type": "fully_reshardable", "chained_optim_avoid_prefix": True}
RNG_KEY = "rng_state.per_rank"


def unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    """The model inside megatron's DDP / Float16Module wrappers (their keys must not depend on wrapping)."""
    while hasattr(chunk, "module") and type(chunk).__name__ in (
        "DistributedDataParallel", "Float16Module", "TorchFullyShardedDataParallel", "FullyShardedDataParallel"
    ):
        chunk = chunk.module
    return chunk


def layout() -> Dict[str, Any]:
    """This run's parallel layout (saved with each checkpoint, compared on load)."""
    from megatron.core import parallel_state as mpu

    vpp = mpu.get_virtual_pipeline_model_parallel_world_size()
    return {
        "world": dist.get_world_size(),
        "tp": mpu.get_tensor_model_parallel_world_size(),
        "pp": mpu.get_pipeline_model_parallel_world_size(),
        "vpp": vpp,
        "cp": mpu.get_context_parallel_world_size(),
        "ep": mpu.get_expert_model_parallel_world_size(),
        "etp": mpu.get_expert_tensor_parallel_world_size(),
        "dp": mpu.get_data_parallel_world_size(),
    }


def describe(lay: Dict[str, Any]) -> str:
    """`TP2 x PP2 x EP2 (...)` for messages."""
    parts = [f"{k.upper()}{lay[k]}" for k in ("tp", "pp", "vpp", "cp", "ep", "etp", "dp") if lay.get(k)]
    return " x ".join(parts) + f" on {lay.get('world')} ranks"


def fp8_prefixes(model: torch.nn.Module) -> List[str]:
    """State-dict prefixes of every FP8State module of `model` (ending with '.')."""
    from fp8_parallel.modules._core import FP8State

    return [name + "." for name, m in model.named_modules() if isinstance(m, FP8State)]


def fp8_enabled(chunks: Iterable[torch.nn.Module]) -> Optional[str]:
    """The FP8 format the model runs with (`config.fp8`), or None."""
    for chunk in chunks:
        config = getattr(unwrap(chunk), "config", None)
        if config is not None:
            return getattr(config, "fp8", None) or None
    return None


def model_sharded(chunks: List[torch.nn.Module]) -> Tuple[Dict[str, Dict], Set[Tuple[str, str]]]:
    """`{"model0": sharded_sd, ...}` of the unwrapped chunks without empty extra states, and the
    (chunk, local key) pairs that are FP8 state."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    out, fp8_keys = {}, set()
    for i, chunk in enumerate(chunks):
        inner = unwrap(chunk)
        sd = inner.sharded_state_dict()
        for key in [k for k, v in sd.items() if isinstance(v, ShardedObject)]:
            if key.endswith("_extra_state") and sd[key].data is None:
                del sd[key]
            else:
                raise ValueError(f"model state {key!r} is a non-tensor object ({type(sd[key].data).__name__}); "
                                 "checkpoints hold tensors only")
        prefixes = tuple(fp8_prefixes(inner))
        fp8_keys |= {(f"model{i}", k) for k in sd if prefixes and k.startswith(prefixes)}
        out[f"model{i}"] = sd
    return out, fp8_keys


def ensure_optimizer_state(optimizer) -> None:
    """Give a fresh optimizer its state tensors, so megatron can describe (and then load) its sharded state.

    megatron's distributed optimizer reads each parameter's `step` while building its state dict; a torch
    optimizer has none before its first step. One step with zero gradients at learning rate 0 creates them;
    the parameters are put back bit for bit afterwards (decoupled weight decay would otherwise move them).
    """
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if inner is None or len(inner.state) > 0:
            continue
        params = [p for g in inner.param_groups for p in g["params"]]
        saved = [p.detach().clone() for p in params]
        lrs = [g["lr"] for g in inner.param_groups]
        for g in inner.param_groups:
            g["lr"] = 0.0
        for p in params:
            p.grad = torch.zeros_like(p)
        inner.step()
        inner.zero_grad(set_to_none=True)
        with torch.no_grad():
            for p, s in zip(params, saved):
                p.copy_(s)
        for g, lr in zip(inner.param_groups, lrs):
            g["lr"] = lr


def _saved_parts(state: Dict[str, Any]) -> List[Dict[str, Any]]:
    """The saved optimizers' common state (param groups, sharding type), however many the checkpoint had.

    dist_checkpointing returns the saved common state in the saved structure, merged with the requested
    tensors in the requested one: one optimizer is a plain dict, a chained one a dict keyed 0, 1, ..."""
    if "optimizer" in state:
        return [state]
    return [v for k, v in sorted((k, v) for k, v in state.items() if isinstance(k, int))
            if isinstance(v, dict) and "optimizer" in v]


def _group_id(group: Dict[str, Any], with_expert: bool = True) -> tuple:
    """megatron's identity of a param group (weight-decay / lr multipliers, expert-parallel, decoupled lr)."""
    keys = ("wd_mult", "lr_mult", "is_decoupled_lr") + (("is_expert_parallel",) if with_expert else ())
    return tuple(group.get(k, group.get(f"pre_{k}")) for k in keys)


def _matching_groups(opt, saved_groups: List[Dict[str, Any]], describe_saved: str) -> List[Dict[str, Any]]:
    """For each param group of `opt`, the saved group of the same identity.

    A layout change of expert parallelism moves experts between megatron's dense and expert optimizers (with
    EP1 megatron builds no separate expert optimizer): when no saved group has the same expert flag, one that
    agrees in everything else is taken, its flag set to this run's."""
    out = []
    for group in opt.optimizer.param_groups:
        exact = [g for g in saved_groups if _group_id(g) == _group_id(group)]
        loose = [g for g in saved_groups if _group_id(g, False) == _group_id(group, False)]
        if not (exact or loose):
            raise ValueError(f"no saved optimizer param group matches this run's group {_group_id(group)} "
                             f"(wd_mult, lr_mult, is_decoupled_lr, is_expert_parallel); saved: {describe_saved}")
        chosen = dict((exact or loose)[0])
        chosen["is_expert_parallel"] = group.get("is_expert_parallel", chosen.get("is_expert_parallel"))
        out.append(chosen)
    return out


def load_optimizer(optimizer, state: Dict[str, Any]) -> None:
    """Load the optimizer's state as `optimizer.sharded_state_dict(..., is_loading=True)` described it.

    The tensors (master weights, moments) are keyed like the model's and reshard with it. The common state
    (param groups with their `step`) is matched to this run's param groups by megatron's group identity, so a
    checkpoint of a chained dense + expert optimizer (EP > 1) loads into a single optimizer (EP1) and back.

    megatron-core 0.16's distributed optimizer, without TransformerEngine / apex, first puts the common
    `step` into torch Adam's per-parameter state and then expects the fully reshardable parameter state to
    carry a `step` too (it does not): the parameter state is loaded here with `step` set aside, and each
    parameter gets its own copy of the step back (torch increments it in place).

    Raises:
        ValueError: saved param groups or sharding that do not fit this run's optimizer.
    """
    chained = list(getattr(optimizer, "chained_optimizers", [optimizer]))
    saved = _saved_parts(state)
    if not saved:
        raise ValueError("checkpoint holds no optimizer param groups")
    kinds = {p.get("param_state_sharding_type") for p in saved}
    if kinds != {"fully_reshardable"}:
        raise ValueError(f"optimizer state sharded as {sorted(map(str, kinds))}; expected 'fully_reshardable'")
    saved_groups = [g for p in saved for g in p["optimizer"]["param_groups"]]
    describe_saved = f"{len(saved)} optimizer(s), groups {[_group_id(g) for g in saved_groups]}"
    requested = [state] if len(chained) == 1 else [state.get(i, {}) for i in range(len(chained))]
    for i, (opt, req) in enumerate(zip(chained, requested)):
        part: Dict[str, Any] = {"optimizer": {"param_groups": _matching_groups(opt, saved_groups, describe_saved)}}
        same = saved[i] if len(saved) == len(chained) else saved[0]
        if "grad_scaler" in same:
            part["grad_scaler"] = same["grad_scaler"]
        opt.load_state_dict(part)
        inner = opt.optimizer
        steps = {p: s.pop("step") for p, s in inner.state.items() if "step" in s}
        try:
            if req.get("param_state") is not None:
                opt.load_parameter_state_from_fully_reshardable(req["param_state"])
        finally:
            for p, step in steps.items():
                inner.state[p]["step"] = step.detach().clone()


def _to_jsonable(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return {"tensor": value.cpu().tolist(), "dtype": str(value.dtype).replace("torch.", "")}
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, (tuple, list)):
        return [_to_jsonable(v) for v in value]
    return value


def rng_blob() -> bytes:
    """This rank's RNG states (python, numpy, torch CPU, CUDA when present, megatron's tracker) as JSON."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    tracker = {}
    for name, state in get_cuda_rng_tracker().get_states().items():
        if not isinstance(state, torch.Tensor):
            state = state.get_state()
        tracker[name] = state.cpu().tolist()
    states = {
        "python": _to_jsonable(random.getstate()),
        "numpy": _to_jsonable(np.random.get_state()),
        "torch": torch.get_rng_state().tolist(),
        "cuda": torch.cuda.get_rng_state().tolist() if torch.cuda.is_available() and torch.cuda.is_initialized() else None,
        "tracker": tracker,
    }
    return json.dumps(states, separators=(",", ":")).encode()


def restore_rng(blob: bytes) -> None:
    """Set this rank's RNG states from `rng_blob()`'s bytes."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    s = json.loads(blob.decode())
    version, internal, gauss = s["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = s["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(torch.tensor(s["torch"], dtype=torch.uint8))
    if s["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.tensor(s["cuda"], dtype=torch.uint8))
    tracker = get_cuda_rng_tracker()
    current = tracker.get_states()
    states = {}
    for name, values in s["tracker"].items():
        t = torch.tensor(values, dtype=torch.uint8)
        old = current.get(name)
        if old is not None and not isinstance(old, torch.Tensor):  # a generator object (graph-safe tracker)
            old.set_state(t)  # a generator's state is a CPU byte tensor, also for a CUDA generator
            states[name] = old
        else:
            states[name] = t.to(old.device) if isinstance(old, torch.Tensor) else t
    tracker.set_states(states)


def rng_length(blob: bytes) -> int:
    """Row length for every rank's RNG blob (8-byte length header + the longest blob), agreed by all ranks."""
    n = torch.tensor([len(blob) + 8], dtype=torch.int64, device=collective_device())
    dist.all_reduce(n, op=dist.ReduceOp.MAX)
    return int(n.item())


def rng_sharded(blob: Optional[bytes], length: int):
    """This rank's row of the `[world, length]` uint8 RNG tensor (for saving `blob`, or an empty row to load)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    row = torch.zeros(1, length, dtype=torch.uint8)
    if blob is not None:
        row[0, :8] = torch.tensor(list(len(blob).to_bytes(8, "little")), dtype=torch.uint8)
        row[0, 8 : 8 + len(blob)] = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
    rank, world = dist.get_rank(), dist.get_world_size()
    return ShardedTensor.from_rank_offsets(RNG_KEY, row, (0, rank, world), replica_id=0)


def rng_row_to_blob(row: torch.Tensor) -> bytes:
    """Inverse of `rng_sharded`'s packing."""
    data = bytes(row.reshape(-1).tolist())
    n = int.from_bytes(data[:8], "little")
    return data[8 : 8 + n]


def collective_device() -> torch.device:
    """Where small control tensors live for this backend (NCCL needs the current GPU)."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
