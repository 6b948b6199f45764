"""Captured CUDA graphs vs eager execution: FP8 megatron layers, in pipeline order, and under megatron's
schedule on two GPUs. Equality is bitwise: replays run the same kernels as eager calls."""
import pytest
import torch

from launcher import launch

pytestmark = pytest.mark.gpu


def test_graphed_layer_stack_in_pipeline_order_equals_eager():
    """2 chunks x 2 FP8 layers, 4 microbatches in PP2/VPP2 rank-0 order, 3 iterations, caching on and off."""
    launch("graph_checks.py", 1, ["stack"], timeout=400, gpus=True, expect_checks=[
        "graphed_stack_matches_eager", "graphed_stack_cached_weights_matches_eager"])


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("vpp", ["0", "2"])
def test_pp2_schedule_replays_graphs_on_both_ranks(vpp):
    launch("graph_checks.py", 2, ["1", "2", vpp], timeout=400, gpus=True, expect_checks=[
        f"graphed_layers_match_plain_tp1_pp2_vpp{vpp}", f"graphed_layers_cached_weights_match_plain_tp1_pp2_vpp{vpp}"])
