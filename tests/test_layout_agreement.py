"""A layout change on one rank of an amax group raises `AmaxLayoutMismatch` on every rank, within seconds (the
launch has a timeout: a hang fails the test). Includes a rank whose scope reduces nothing."""
import pytest
import torch

from launcher import launch

CHECKS = ["extra_module_on_one_rank", "missing_module_on_one_rank", "backward_layout_change_on_one_rank",
          # one rank whose scope reduces nothing (no FP8 module, FP8 disabled inside the scope, no backward)
          "no_fp8_module_on_one_rank", "fp8_disabled_on_one_rank", "empty_on_one_rank_from_the_first_iteration",
          "no_backward_on_one_rank"]


def test_layout_change_on_one_rank_raises_everywhere_gloo():
    launch("layout_agreement_checks.py", 2, expect_checks=CHECKS, timeout=300)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_layout_change_on_one_rank_raises_everywhere_nccl():
    launch("layout_agreement_checks.py", 2, expect_checks=CHECKS, timeout=300, gpus=True)
