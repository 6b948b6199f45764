"""parallel_state under NCCL: the same multi-rank checks as on CPU, one rank per GPU."""
import pytest
import torch

from launcher import launch
from test_parallel_state import CHECKS


@pytest.mark.gpu
@pytest.mark.parametrize("vpp", [0, 2], ids=["pp2", "pp2-vpp2"])
def test_parallel_state_nccl(vpp):
    n = torch.cuda.device_count()
    if n < 2:
        pytest.skip("needs 2 GPUs")
    launch("parallel_state_checks.py", 2, ["1", "2", str(vpp), "1"], expect_checks=CHECKS, gpus=True, timeout=300)
