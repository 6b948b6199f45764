"""The amax cost model of docs/scale.md: its arithmetic, and its count against a real training step."""
import sys
from pathlib import Path

import pytest

from launcher import launch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import amax_cost_model as cost  # noqa: E402


def test_dense_layout_counts():
    lay = cost.Layout("t", gpus=64, layers=8, tp=2, pp=2, vpp=2, global_batch=64, micro_batch=1)
    (red,) = cost.reductions_per_pass(lay)
    assert red.ranks == 32  # TP x CP x DP of a stage
    assert red.fwd_values == cost.HEADER + 2 * 4 * 2  # 2 layers per chunk, 4 linears, input + weight
    assert red.bwd_values == cost.HEADER + 1 * 4 * 2
    assert lay.microbatches == 4 and cost.collectives_per_step(lay) == 4 * 2 * 2


def test_moe_layout_counts():
    lay = cost.Layout("t", gpus=16, layers=4, pp=2, ep=4, experts=8, global_batch=16, micro_batch=1)
    dense, expert = cost.reductions_per_pass(lay)
    assert (dense.ranks, expert.ranks) == (8, 2)
    assert expert.fwd_values == cost.HEADER + 2 * 2 * (8 // 4) * 2


def test_bad_layout_names_the_sizes():
    with pytest.raises(ValueError, match="TP\\*PP\\*CP=12"):
        cost.Layout("bad", gpus=16, layers=4, tp=4, pp=3)


def test_table_renders():
    assert cost.table().count("\n") == len(cost.LAYOUTS) + 1


def test_real_step_issues_the_modelled_collectives():
    launch("amax_count_checks.py", 4, expect_checks=["amax_collectives_dense_match_model", "amax_collectives_moe_match_model"],
           timeout=600)
