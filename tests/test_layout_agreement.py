"""A layout change on one rank of an amax group raises `AmaxLayoutMismatch` on every rank, within seconds."""
import pytest
import torch

from launcher import launch

CHECKS = ["extra_module_on_one_rank", "missing_module_on_one_rank", "backward_layout_change_on_one_rank"]


def test_layout_change_on_one_rank_raises_everywhere_gloo():
    launch("layout_agreement_checks.py", 2, expect_checks=CHECKS, timeout=300)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_layout_change_on_one_rank_raises_everywhere_nccl():
    launch("layout_agreement_checks.py", 2, expect_checks=CHECKS, timeout=300, gpus=True)
