"""The amax cost model of docs/scale.md: its arithmetic, and its count against a real training step."""
import sys
from pathlib import Path

import pytest

from launcher import launch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import amax_cost_model as cost  # noqa: E402

HEAVY = pytest.mark.xdist_group("heavy")  # 4+ torchrun ranks: one at a time (--dist loadgroup)


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


def test_table_is_the_one_docs_scale_md_shows_and_its_cells_are_the_model_s():
    lines = cost.table().splitlines()
    assert len(lines) == len(cost.LAYOUTS) + 2 and all(line.count("|") == 13 for line in lines)
    doc = (Path(__file__).resolve().parents[1] / "docs" / "scale.md").read_text().splitlines()
    start = doc.index(lines[0])
    assert doc[start:start + len(lines)] == lines, "docs/scale.md shows another table: rerun amax_cost_model.py"
    for lay, line in zip(cost.LAYOUTS, lines[2:]):
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[0] == lay.name and int(cells[1]) == lay.gpus and int(cells[3]) == lay.dp
        assert lay.gpus == lay.dp * lay.tp * lay.pp * lay.cp, lay.name
        assert int(cells[4]) == lay.microbatches == lay.global_batch // (lay.micro_batch * lay.dp)
        assert int(cells[7]) == cost.collectives_per_step(lay) and int(cells[8]) == cost.per_module_collectives_per_step(lay)
        # one collective per (scope, direction) per microbatch and model chunk: never more than the loop's
        assert cost.collectives_per_step(lay) < cost.per_module_collectives_per_step(lay)
    dense_8b = next(lay for lay in cost.LAYOUTS if lay.name == "8B dense, 1 node")
    assert (dense_8b.dp, dense_8b.microbatches) == (4, 16) and cost.collectives_per_step(dense_8b) == 16 * 2


@HEAVY
def test_real_step_issues_the_modelled_collectives():
    launch("amax_count_checks.py", 4, expect_checks=["amax_collectives_dense_match_model", "amax_collectives_moe_match_model"],
           timeout=600)
