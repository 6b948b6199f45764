"""Parallel FP8 modules and the megatron-core integration."""
import pytest
import torch

import fp8_parallel as fp
from launcher import launch
from seeds import session_seed

HEAVY = pytest.mark.xdist_group("heavy")  # 4+ torchrun ranks: one at a time (--dist loadgroup)


def test_tp2_modules_match_single_rank_cache_and_state_dict():
    launch("module_checks.py", 2, ["mlp"], timeout=300, expect_checks=[
        "tp2_matches_single_rank", "tp2_sp_matches_single_rank", "sp_fp8_gather_equals_bf16_gather",
        "weight_caching", "state_dict_tp2_to_tp1", "fused_wgrad_accumulation_under_ddp"])


@HEAVY
def test_megatron_gpt_dense_and_moe_fp8_under_megatron_schedule():
    launch("module_checks.py", 8, ["gpt"], timeout=500, expect_checks=[
        "gpt_dense_tp2_pp2_fp8", "gpt_moe_tp2_pp2_ep2_fp8", "gpt_moe_grouped_tp2_pp2_ep2_fp8"])


@HEAVY
def test_ep2_moe_matches_unsharded_experts():
    launch("module_checks.py", 4, ["ep"], timeout=300, expect_checks=[
        "ep2_moe_sequential_matches_unsharded", "ep2_moe_grouped_matches_unsharded",
        "ep2_drop_and_pad_sequential_matches_megatron", "ep2_drop_and_pad_grouped_matches_megatron"])


def _config(**kw):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(num_layers=6, hidden_size=32, num_attention_heads=4, **kw)


def test_recipe_from_megatron_config():
    from fp8_parallel.megatron import fp8_context, is_bf16_layer, recipe_from_config

    assert recipe_from_config(_config()) is None
    r = recipe_from_config(_config(fp8="e4m3", fp8_recipe="delayed", fp8_margin=1, fp8_amax_history_len=7,
                                   fp8_amax_compute_algo="max"))
    assert r == fp.DelayedScaling(margin=1, fp8_format=fp.Format.E4M3, amax_history_len=7, amax_compute_algo="max")
    assert recipe_from_config(_config(fp8="hybrid", fp8_recipe="tensorwise")) == fp.CurrentScaling()
    with pytest.raises(ValueError, match="fp8_recipe='mxfp8'"):
        recipe_from_config(_config(fp8="hybrid", fp8_recipe="mxfp8"))
    # megatron refuses first/last-bf16 layers with delayed scaling (its TE path cannot do it); ours can
    cfg = _config(fp8="hybrid", fp8_recipe="tensorwise", first_last_layers_bf16=True,
                  num_layers_at_start_in_bf16=1, num_layers_at_end_in_bf16=2)
    assert [is_bf16_layer(cfg, i) for i in range(6)] == [True, False, False, False, True, True]
    assert not fp8_context(cfg, 0).enabled and fp8_context(cfg, 2).enabled


def test_fp8_wgrad_false_computes_wgrad_in_high_precision():
    from fp8_parallel.modules import FP8State, fp8_linear

    torch.manual_seed(0)
    w = torch.randn(48, 32, requires_grad=True)
    x = torch.randn(16, 32, requires_grad=True)
    state = FP8State("t")
    with fp.autocast(recipe=fp.DelayedScaling()):
        y = fp8_linear(x, w, None, state, wgrad_in_fp8=False)
    g = torch.randn_like(y)
    y.backward(g)
    # wgrad = g^T x exactly, in high precision
    torch.testing.assert_close(w.grad, g.t() @ x, rtol=1e-5, atol=1e-5)


def test_gpt_layer_spec_options():
    from fp8_parallel.megatron import get_gpt_layer_spec

    from fp8_parallel.modules.grouped import FP8GroupedMLP

    assert get_gpt_layer_spec(num_experts=4, moe_grouped_gemm=True).submodules.mlp.submodules.experts.module is FP8GroupedMLP
    with pytest.raises(ValueError, match="normalization='BatchNorm'"):
        get_gpt_layer_spec(normalization="BatchNorm")


def test_fp8_state_stays_exact_float32_when_the_model_is_cast():
    """megatron's Float16Module calls `.bfloat16()` on the model; the FP8 histories and scales must not be
    rounded to bf16."""
    torch.manual_seed(2)
    lin = fp.Linear(32, 32, device="cpu")
    with fp.autocast(recipe=fp.DelayedScaling(amax_history_len=4)):
        lin(torch.randn(8, 32) * 3.3)
    with fp.autocast(recipe=fp.DelayedScaling(amax_history_len=4)):
        lin(torch.randn(8, 32) * 3.3)
    before = {k: v.clone() for k, v in lin.fp8.state_dict().items()}
    assert before["fwd.scale"].ne(1).any()
    lin.bfloat16()
    assert lin.weight.dtype == torch.bfloat16
    after = lin.fp8.state_dict()
    for k, v in before.items():
        assert after[k].dtype == v.dtype and torch.equal(after[k], v), k


@pytest.mark.parametrize("recipe", [fp.DelayedScaling(amax_history_len=4), fp.CurrentScaling()])
def test_leaf_input_is_kept_by_reference_and_recast_in_backward(recipe):
    """A leaf input (held by the caller anyway) is not copied to FP8 for backward; the transpose is re-cast
    there with the forward's scale, so results are bitwise those of the saved-FP8-copy path."""
    torch.manual_seed(5)
    fp8_types = (torch.float8_e4m3fn, torch.float8_e5m2)

    def run(leaf: bool):
        lin = fp.Linear(64, 48, device="cpu")
        lin.load_state_dict(ref_state)
        base = torch.randn(32, 64, generator=torch.Generator().manual_seed(1)) * 2.5
        x = base.clone().requires_grad_() if leaf else (base.clone().requires_grad_() * 1.0)
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: (saved.append(t), t)[1], lambda t: t):
            with fp.autocast(recipe=recipe):
                y = lin(x)
        y.backward(torch.randn(32, 48, generator=torch.Generator().manual_seed(2)))
        fp8_input_copies = [t for t in saved if t.dtype in fp8_types and t.numel() == x.numel()]
        return y, lin.weight.grad, lin.fp8.state_dict(), fp8_input_copies, any(t is x or t.data_ptr() == x.data_ptr() for t in saved)

    ref_state = fp.Linear(64, 48, device="cpu").state_dict()
    y1, g1, s1, copies1, ref1 = run(leaf=True)
    y2, g2, s2, copies2, ref2 = run(leaf=False)
    assert not copies1 and ref1  # leaf: a reference, no FP8 copy
    assert copies2 and not ref2  # non-leaf: the 1-byte FP8 transpose only
    assert torch.equal(y1, y2) and torch.equal(g1, g2)
    for k in s1:
        assert torch.equal(s1[k], s2[k]), k


def test_moe_spec_lets_megatrons_router_run_without_transformer_engine(monkeypatch):
    """megatron-core 0.16's router GEMM names `te_general_gemm`, undefined without TransformerEngine (NameError
    on every MoE forward on a GPU; on CPU `cpu_compat` defines it). Building an MoE spec defines it as None,
    which selects megatron's torch GEMM: the router logits then equal float64's `x @ W.T`."""

    from megatron.core.transformer.moe import moe_utils

    from fp8_parallel.megatron import get_gpt_layer_spec

    if getattr(moe_utils, "te_general_gemm", None) is not None:
        pytest.skip("TransformerEngine is installed: megatron uses its GEMM")
    monkeypatch.setattr(moe_utils, "te_general_gemm", None, raising=False)
    monkeypatch.delattr(moe_utils, "te_general_gemm")  # restored as it was after the test
    seed = session_seed() % 100_000
    print(f"seed {seed} (FP8P_TEST_SEED={seed} reproduces)")
    gen = torch.Generator().manual_seed(seed)
    x, w = torch.randn(6, 16, generator=gen), torch.randn(4, 16, generator=gen)
    with pytest.raises(NameError, match="te_general_gemm"):
        moe_utils.router_gating_linear(x, w, None, torch.float32)
    get_gpt_layer_spec(num_experts=4)
    logits = moe_utils.router_gating_linear(x, w, None, torch.float32)
    torch.testing.assert_close(logits.double(), x.double() @ w.double().t(), rtol=1e-5, atol=1e-5)
