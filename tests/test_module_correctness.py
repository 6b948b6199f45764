"""Correctness of the FP8 linears where results used to be silently wrong: unaligned tensor-parallel sizes
(and their weight padded once, when cast), experts without tokens, replaced FP8 buffers and the address table
of the fused amax update."""
import pytest
import torch

import fp8_parallel as fp
from launcher import child_env, launch
from seeds import session_seed


def test_tp2_unaligned_sizes_match_references():
    """TP2 column -> gelu -> row, 30 -> 50 -> 30 (25 features per rank), against float64 and single-rank FP8.
    The run's seed (`--seed N` or FP8P_TEST_SEED=N reproduces one) (e.g. 3146414574: its preset step-0 scales used
    to saturate the gelu output, 13% off; the check now presets scales that cannot saturate)."""
    launch("correctness_checks.py", 2, ["tp2"], timeout=400,
           expect_checks=["tp2_unaligned_delayed", "tp2_unaligned_current"])


def test_experts_without_tokens_keep_the_amax_layout():
    launch("correctness_checks.py", 2, ["ep"], timeout=400,
           expect_checks=["empty_experts_delayed", "empty_experts_current", "grouped_weight_caching"])


@pytest.mark.parametrize("recipe", [fp.DelayedScaling(amax_history_len=4), fp.CurrentScaling()],
                         ids=["delayed", "current"])
@pytest.mark.parametrize("first", [None, True], ids=["uncached", "cached"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_unaligned_weight_is_padded_once_when_cast(recipe, first, device, monkeypatch):
    """A layer with unaligned features (25 x 30) casts its FP8 weight into zero-padded aligned storage (and the
    cached transpose, or the one re-cast in backward): its GEMMs copy only the per-call operands. Outputs and
    gradients are bitwise those of a dense weight cast padded by every GEMM (zero padding is exact; on CUDA the
    padded cast takes the torch path and the dense one the fused kernel, which must agree bit for bit)."""

    from fp8_parallel import testing
    from fp8_parallel.modules import FP8State, fp8_linear

    seed = session_seed()
    print(f"seed {seed} (FP8P_TEST_SEED={seed} reproduces)")
    gen = torch.Generator().manual_seed(seed)
    w, b = (torch.randn(25, 30, generator=gen) / 30**0.5).to(device), torch.randn(25, generator=gen).to(device)
    batches = [((torch.randn(21, 30, generator=gen) * 2).to(device), torch.randn(21, 25, generator=gen).to(device))
               for _ in range(3)]
    copied = testing.record_operand_padding(monkeypatch)  # operand shapes padded by copy

    def run():
        st, wp, bp = FP8State("t", device=device), w.clone().requires_grad_(), b.clone().requires_grad_()
        outs = []
        for i, (x, dy) in enumerate(batches):
            xr = x.clone().requires_grad_()
            with fp.autocast(recipe=recipe, group=None):
                y = fp8_linear(xr, wp, bp, st, is_first_microbatch=first if first is None or i == 0 else False)
            y.backward(dy)
            outs += [y.detach(), xr.grad]
        return outs + [wp.grad, bp.grad], st

    padded, st = run()
    if first is not None:  # the cache: data and transpose in zero-padded storage, padding still zero
        for view in (st.weight_fp8._data, st.weight_fp8.transpose_2d()._data):
            base = testing.padded_storage(view)
            assert base.shape == (32, 32) and view.shape in ((25, 30), (30, 25))
            rest = base.view(torch.uint8).clone()
            rest[: view.shape[0], : view.shape[1]] = 0
            assert not rest.any(), "padding of the stored FP8 weight is not zero"
    # per step: input (21 x 30) in fprop, grad_output (21 x 25) in dgrad, both transposes in wgrad; no weight
    assert copied == [(21, 30), (21, 25), (25, 21), (30, 21)] * 3, copied
    copied.clear()
    # the dense reference: every weight cast (and backward re-cast of its transpose) into ordinary storage
    testing.dense_weight_casts(monkeypatch)
    dense, _ = run()
    assert (25, 30) in copied and (30, 25) in copied, copied  # the dense weight was padded by the GEMMs
    for i, (p, d) in enumerate(zip(padded, dense)):
        assert torch.equal(p, d), f"result {i} differs from padding a dense weight cast"


def _expected_addresses(metas):
    rows = [[], [], []]
    for m in metas:
        h, s, c = m.amax_history, m.scale, m.nonfinite_count
        for r in range(m.num_tensors):
            rows[0].append(h.data_ptr() + r * h.stride(0) * h.element_size())
            rows[1].append(s.data_ptr() + r * s.element_size())
            rows[2].append(c.data_ptr() + r * c.element_size())
    return torch.tensor(rows, dtype=torch.int64)


def test_address_table_follows_replaced_buffers():
    """The fused update's device-address table is rebuilt whenever an FP8 buffer is replaced: by
    `load_state_dict(assign=True)`, `.to()`/`_apply`, a history resize, or a direct assignment."""
    from fp8_parallel.amax_table import AmaxTable
    from fp8_parallel.modules import FP8State

    states = [FP8State(f"t{i}") for i in range(3)]
    table = AmaxTable("forward", torch.device("cpu"))
    for st in states:
        table.slots(st.fwd)
    metas = [st.fwd for st in states]
    assert torch.equal(table._addresses(), _expected_addresses(metas))
    cached = table._addresses()
    assert table._addresses() is cached  # unchanged buffers: the cached table, no rebuild

    fresh = {k: v.clone() + 1 for k, v in states[1].state_dict().items()}
    states[1].load_state_dict(fresh, assign=True)
    assert states[1].fwd.amax_history.data_ptr() == fresh["fwd.amax_history"].data_ptr()
    assert torch.equal(table._addresses(), _expected_addresses(metas))

    states[0].to(torch.float64)  # a model dtype cast: FP8 state stays float32, in new tensors
    assert states[0].fwd.scale.dtype == torch.float32
    assert torch.equal(table._addresses(), _expected_addresses(metas))

    states[2].fwd.ensure_history_len(7)
    assert torch.equal(table._addresses(), _expected_addresses(metas))

    states[2].fwd.scale = torch.full((2,), 3.0)
    assert torch.equal(table._addresses(), _expected_addresses(metas))


def test_import_grouped_does_not_import_the_megatron_integration():
    import subprocess
    import sys

    code = ("import sys; import fp8_parallel.modules.grouped; "
            "assert 'fp8_parallel.megatron' not in sys.modules, 'grouped imported fp8_parallel.megatron'; "
            "import fp8_parallel.megatron as m, fp8_parallel.expert_scope as e; assert m.expert_scope is e.expert_scope")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300, env=child_env())


def test_grouped_linear_follows_megatron_first_microbatch_protocol():
    """megatron's schedule sets `is_first_microbatch = True` on every module that has it: the experts' weights
    are cast once and the casts reused for the step's later microbatches."""
    from megatron.core.transformer.transformer_config import TransformerConfig
    from fp8_parallel.modules.grouped import GroupedLinear

    seed = session_seed()
    print(f"seed {seed}")
    gen = torch.Generator().manual_seed(seed)
    cfg = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=2, use_cpu_initialization=True,
                            perform_initialization=False)
    lin = GroupedLinear(2, 32, 16, partition="row", config=cfg, init_method=None)
    with torch.no_grad():
        for p in lin.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    x = torch.randn(10, 32, generator=gen)
    with fp.autocast(recipe=fp.DelayedScaling()):
        lin(x, [4, 6])
    assert all(st.weight_fp8 is None for st in lin.fp8)  # attribute unset: no caching
    lin.is_first_microbatch = True
    with fp.autocast(recipe=fp.DelayedScaling()):
        y1 = lin(x, [4, 6])
    cached = [st.weight_fp8 for st in lin.fp8]
    assert all(c is not None for c in cached) and lin.is_first_microbatch is False
    with fp.autocast(recipe=fp.DelayedScaling()):
        y2 = lin(x, [4, 6])
    assert all(st.weight_fp8 is c for st, c in zip(lin.fp8, cached))
    assert torch.equal(y1, y2)


def test_expert_allreduce_mark_follows_megatron():
    """Expert parameters carry megatron's `allreduce` mark (EP1: True, one optimizer with the dense ones; EP > 1:
    False), except with EP1 and an expert TP other than the dense TP (False: the TP copies need expert-DP)."""
    from types import SimpleNamespace

    from megatron.core.transformer.transformer_config import TransformerConfig
    from fp8_parallel.expert_scope import experts_reduce_over_dense_dp
    from fp8_parallel.modules.grouped import GroupedLinear

    def cfg(tp, ep, etp):
        return SimpleNamespace(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                               expert_tensor_parallel_size=etp)

    assert experts_reduce_over_dense_dp(cfg(1, 1, None)) is True
    assert experts_reduce_over_dense_dp(cfg(2, 1, None)) is True  # expert TP defaults to the dense TP
    assert experts_reduce_over_dense_dp(cfg(2, 1, 2)) is True
    assert experts_reduce_over_dense_dp(cfg(2, 1, 1)) is False
    assert experts_reduce_over_dense_dp(cfg(1, 2, 1)) is False
    for ep, want in ((1, True), (2, False)):
        config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=2, use_cpu_initialization=True,
                                   perform_initialization=False, num_moe_experts=4, expert_model_parallel_size=ep)
        lin = GroupedLinear(2, 32, 16, partition="column", config=config, init_method=None, bias=True)
        marks = {p.allreduce for p in lin.parameters()}
        assert marks == {want}, f"EP{ep}: marks {marks}, expected {want}"
