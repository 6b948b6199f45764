"""Megatron-LM's `pretrain_gpt.py --spec fp8_parallel.megatron_lm NAME`: the spec objects resolve the way
Megatron-LM resolves them, build every pipeline / virtual stage, cost one amax collective per block pass, and
run full activation recompute without TransformerEngine (multi-rank checks in workers/megatron_lm_checks.py).
"""
from __future__ import annotations

import pytest

from launcher import launch

HEAVY = pytest.mark.xdist_group("heavy")  # 4+ torchrun ranks: one at a time (--dist loadgroup)


def test_spec_names_resolve_as_megatron_lm_resolves_them():
    from megatron.core.transformer.spec_utils import ModuleSpec, import_module
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    from fp8_parallel.megatron import FP8TransformerLayer
    from fp8_parallel.megatron_lm import StageBlockSpec
    from fp8_parallel.modules.norm import Norm

    for name in ("block_spec", "block_spec_qk_norm", "moe_block_spec", "moe_grouped_block_spec"):
        spec = import_module(["fp8_parallel.megatron_lm", name])  # argparse's nargs='*' gives a list
        assert isinstance(spec, StageBlockSpec) and isinstance(spec, TransformerBlockSubmodules), name
        assert spec.layer.module is FP8TransformerLayer and spec.layer_norm is Norm, name
        assert name in repr(spec) or "StageBlockSpec" in repr(spec)
    layer = import_module(["fp8_parallel.megatron_lm", "layer_spec"])
    assert isinstance(layer, ModuleSpec) and layer.module is FP8TransformerLayer
    moe = import_module(["fp8_parallel.megatron_lm", "moe_block_spec"]).layer.submodules
    assert moe.mlp.module.__name__ == "MoELayer" and moe.pre_mlp_layernorm is Norm


def test_stage_block_spec_outside_a_block_build_says_what_to_use():
    from fp8_parallel.megatron_lm import block_spec

    with pytest.raises(RuntimeError, match="get_gpt_block_spec"):
        block_spec.layer_specs


def test_only_plain_transformer_blocks_are_adopted():
    from megatron.core.transformer.transformer_block import TransformerBlock

    from fp8_parallel.megatron_lm import adopt_block

    class Custom(TransformerBlock):
        pass

    block = Custom.__new__(Custom)
    with pytest.raises(TypeError, match="Custom"):
        adopt_block(block)


@HEAVY
def test_megatron_lm_spec_path_tp2_pp2_vpp2():
    launch("megatron_lm_checks.py", 4, timeout=900, expect_checks=[
        "spec_by_name_builds_every_stage", "one_amax_reduction_per_block_pass",
        "full_recompute_matches_no_recompute",
    ])


def test_gpt_block_spec_full_recompute_tp1_tp2():
    """GPTModel from `get_gpt_block_spec` with config.fp8 and recompute_granularity="full" (uniform, block):
    losses and gradients bitwise equal to no recompute over two steps, at TP1 and TP2 (2 gloo ranks)."""
    launch("megatron_block_checks.py", 2, args=["recompute"], timeout=600,
           expect_checks=["full_recompute_tp1", "full_recompute_tp2"])


@HEAVY
def test_megatron_lm_moe_expert_amax_domain_ep2():
    """Megatron-LM-style start-up (megatron's groups only) with EP2 on 4 gloo ranks: MoE models from our block
    specs reduce expert amaxes over the expert amax domain and dense ones over the dense group, with no set-up
    by the caller; a domain of megatron's previous groups is refused."""
    launch("megatron_block_checks.py", 4, args=["moe"], timeout=600,
           expect_checks=["moe_expert_amaxes_over_expert_domain", "stale_expert_domain_is_refused"])


def test_cpu_launcher_names_a_checkout_without_pretrain_gpt(tmp_path):
    import subprocess
    import sys

    from launcher import REPO, child_env

    proc = subprocess.run(
        [sys.executable, str(REPO / "launch" / "megatron_lm_cpu.py"), "--megatron-lm", str(tmp_path), "--",
         "--num-layers", "2"],
        capture_output=True, text=True, timeout=120, env=child_env(),
    )
    assert proc.returncode == 2 and f"--megatron-lm {tmp_path}: no pretrain_gpt.py there" in proc.stderr, proc.stderr
