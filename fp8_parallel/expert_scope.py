"""The autocast scope of MoE experts: the enclosing scope's recipe, reduced over the expert amax domain.

The expert amax domain is the set of ranks that hold the same experts (same pipeline rank, same
expert-parallel rank: expert-TP x expert-DP of one stage). `parallel_state.initialize` builds it. A run whose
groups megatron's `initialize_model_parallel` built alone (Megatron-LM's start-up) gets it from megatron's
groups when its first MoE block is built from our specs (`ensure_megatron_expert_domain`, collective), so
experts never reduce over the world group, which would mix unrelated experts' amaxes.

Its own small module so that the expert layers (`modules.grouped`) and the megatron integration
(`fp8_parallel.megatron`, which re-exports it) both import it without importing each other.
"""
from __future__ import annotations

import contextlib
import sys
from typing import ContextManager, Optional, Tuple

import torch.distributed as dist

# (megatron's EP group, megatron's PP group, the expert amax domain built from them), or None
_MEGATRON_DOMAIN: Optional[Tuple[object, object, dist.ProcessGroup]] = None


def _megatron_groups() -> Optional[Tuple[object, object]]:
    """megatron's (expert-parallel, pipeline) groups when its model-parallel state is initialized."""
    mpu = sys.modules.get("megatron.core.parallel_state")
    if mpu is None or not mpu.model_parallel_is_initialized():
        return None
    return mpu.get_expert_model_parallel_group(), mpu.get_pipeline_model_parallel_group()


def _domain(build: bool) -> Optional[dist.ProcessGroup]:
    """The expert amax domain (see `expert_amax_group`); `build`: make it from megatron's current groups when it
    was not (collective), else refuse."""
    global _MEGATRON_DOMAIN
    import parallel_state

    if parallel_state.is_initialized():
        return parallel_state.expert_amax_group()
    groups = _megatron_groups()
    if groups is None:
        return None
    if _MEGATRON_DOMAIN is None or _MEGATRON_DOMAIN[:2] != groups:
        if build:
            _MEGATRON_DOMAIN = (*groups, parallel_state.build_expert_amax_group())
        else:
            raise RuntimeError(
                "FP8 experts need the expert amax domain (the ranks holding the same experts), which was not built "
                "for megatron's current groups: build the model from fp8_parallel's block specs "
                "(fp8_parallel.megatron.get_gpt_block_spec or fp8_parallel.megatron_lm.moe_block_spec), or call "
                "fp8_parallel.expert_scope.ensure_megatron_expert_domain() on every rank after "
                "initialize_model_parallel"
            )
    return _MEGATRON_DOMAIN[2]


def ensure_megatron_expert_domain() -> Optional[dist.ProcessGroup]:
    """Build the expert amax domain from megatron's groups, once per megatron set-up, when megatron's groups
    exist and `parallel_state.initialize` did not run (it has its own). Returns the domain, or None when
    there is nothing to build from.

    Collective on the first call after megatron's groups are (re)built: every rank must call it, in the same
    order with the same other collectives. The block specs call it while each rank builds its blocks (every
    rank builds one per model chunk); call it yourself after `initialize_model_parallel` when you build
    expert layers without our block specs.
    """
    return _domain(build=True)


def expert_amax_group() -> Optional[dist.ProcessGroup]:
    """The expert amax domain: `parallel_state`'s when it is initialized, else the one built from megatron's
    groups (`ensure_megatron_expert_domain`), else None (no megatron groups: the scope's default group).

    Raises:
        RuntimeError: megatron's groups exist but the domain was not built from them (building it here, in
            a forward, could deadlock: pipeline stages reach their first forward at different times).
    """
    return _domain(build=False)


def experts_reduce_over_dense_dp(config) -> bool:
    """The `allreduce` mark of MoE expert parameters under `config` (a megatron TransformerConfig).

    As megatron marks its experts: True (reduced with the dense parameters) with EP1, False (reduced over
    expert data parallelism, by megatron's expert optimizer) with EP > 1. One case differs: with EP1 and an
    expert TP other than the dense TP, each TP rank's copy of an expert sees only its share of the tokens,
    so the copies need the expert data-parallel reduction (which holds those TP ranks); megatron's mark would
    let them drift apart.
    """
    tp = config.tensor_model_parallel_size
    etp = config.expert_tensor_parallel_size or tp
    return config.expert_model_parallel_size == 1 and etp == tp


def expert_scope() -> ContextManager:
    """A scope for MoE experts: the enclosing scope's recipe over the expert amax domain (a no-op outside an
    enabled scope)."""
    from .scopes import autocast, current_scope

    scope = current_scope()
    if scope is None or not scope.enabled:
        return contextlib.nullcontext()
    return autocast(recipe=scope.recipe, group=expert_amax_group())
