"""capture_order: megatron's own order conversion, and the sequence its real schedules execute."""
import pytest

from fp8_parallel.pipeline import capture_order
from launcher import launch

HEAVY = pytest.mark.xdist_group("heavy")  # 4+ torchrun ranks: one at a time (--dist loadgroup)


def test_matches_megatron_conversion_of_its_schedule_table():
    from megatron.core.pipeline_parallel.schedules import get_schedule_table
    from megatron.core.transformer.cuda_graphs import convert_schedule_table_to_order

    checked = 0
    for pp in (2, 4):
        for vpp in (2, 3):
            for m in range(pp, 13):
                for group in range(pp, m + 1):
                    for rank in range(pp):
                        warmup = min((pp - rank - 1) * 2 + (vpp - 1) * group, m * vpp)
                        expected = convert_schedule_table_to_order(warmup, vpp, get_schedule_table(m, vpp, group))
                        assert capture_order(m, pp, rank, vpp, group) == expected, (pp, vpp, m, group, rank)
                        checked += 1
    assert checked > 300


def test_known_orders():
    # PP2 / VPP2 / 4 microbatches, rank 0 (megatron's conversion gives the same)
    assert capture_order(4, 2, 0, 2) == [1, 1, 2, 2, 1, -2, 1, -2, 2, -1, 2, -1, -2, -2, -1, -1]
    assert capture_order(3, 2, 0) == [1, 1, -1, 1, -1, -1]  # 1F1B: one warm-up forward on the first stage
    assert capture_order(3, 2, 1) == [1, -1, 1, -1, 1, -1]  # the last stage alternates from the start


def test_bad_rank_is_named():
    with pytest.raises(ValueError, match="pp_rank=2"):
        capture_order(4, 2, 2)


@HEAVY
def test_matches_the_sequence_megatron_schedules_execute():
    launch("pipeline_order_checks.py", 4, timeout=300, expect_checks=["capture_order_matches_megatron_schedule"])
