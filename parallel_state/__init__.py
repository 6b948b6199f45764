"""Process groups for fp8_parallel, on top of megatron-core's `parallel_state`.

`initialize(tp, pp, vpp, cp, ep, etp)` starts torch.distributed from torchrun's environment and megatron's
groups; the getters read megatron's groups back; `dense_amax_group` / `expert_amax_group` give the FP8 amax
reduction domains. `cpu_compat()` lets megatron's CUDA-only code run on CPU with gloo.
"""
from .device_compat import cpu_compat, needs_cpu_compat
from .groups import (
    DIMENSIONS,
    build_expert_amax_group,
    default_backend,
    dense_amax_group,
    destroy,
    expert_amax_group,
    get_group,
    get_rank,
    get_ranks,
    get_size,
    initialize,
    is_initialized,
    sizes,
)
from .layout import ParallelLayoutError, ParallelSizes

__all__ = [
    "DIMENSIONS",
    "ParallelLayoutError",
    "ParallelSizes",
    "build_expert_amax_group",
    "cpu_compat",
    "default_backend",
    "dense_amax_group",
    "destroy",
    "expert_amax_group",
    "get_group",
    "get_rank",
    "get_ranks",
    "get_size",
    "initialize",
    "is_initialized",
    "needs_cpu_compat",
    "sizes",
]
