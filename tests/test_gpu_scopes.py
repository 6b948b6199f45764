"""GPU checks of the reduction engine: the update is capturable and equals the eager update."""
import pytest
import torch

import fp8_parallel as fp
from fp8_parallel.amax_table import AmaxTable
from fp8_parallel.meta import FP8Meta

pytestmark = pytest.mark.gpu


def test_reduce_and_update_graph_equals_eager():
    recipe = fp.DelayedScaling(amax_history_len=16)
    metas = [FP8Meta(2, f"t{i}", history_len=16, device="cuda") for i in range(50)]
    twins = [FP8Meta(2, f"t{i}", history_len=16, device="cuda") for i in range(50)]
    table, twin_table = AmaxTable("forward", torch.device("cuda")), AmaxTable("forward", torch.device("cuda"))
    for m, t in zip(metas, twins):
        table.slots(m), twin_table.slots(t)
    slots = [table.slots(m) for m in metas]  # current views, after the buffer grew
    twin_slots = [twin_table.slots(m) for m in twins]
    twin_table.force_torch_update = True  # the graph holds the fused kernel; the twin runs batched torch ops
    table._addresses()  # the device address table is built eagerly, before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        table.reduce_and_update(recipe, None, 448.0, "test")
    for step in range(5):
        vals = torch.rand(50, 2, device="cuda") * 10
        vals[step, 0] = 0.0  # did not run: no roll
        vals[step + 1, 1] = float("inf")  # non-finite: counted, no roll
        for s, ts, v in zip(slots, twin_slots, vals):
            s.copy_(v)
            ts.copy_(v)
        graph.replay()
        twin_table.reduce_and_update(recipe, None, 448.0, "test")
    for m, t in zip(metas, twins):
        assert torch.equal(m.amax_history, t.amax_history) and torch.equal(m.nonfinite_count, t.nonfinite_count)
        torch.testing.assert_close(m.scale, t.scale, rtol=1e-6, atol=0)
    assert (metas[10].amax_history[:, :5] > 0).all() and metas[2].nonfinite_count[1].item() == 1


def test_linear_on_gpu_matches_reference():
    torch.manual_seed(0)
    lin = fp.Linear(256, 512, params_dtype=torch.bfloat16, device="cuda")
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    for _ in range(3):
        with fp.autocast(recipe=fp.DelayedScaling(amax_history_len=4)):
            y = lin(x)
        y.float().pow(2).sum().backward()
    ref = x.detach().float() @ lin.weight.detach().float().t() + lin.bias.float()
    assert ((y.float() - ref).norm() / ref.norm()) < 0.06
