"""`fp8_parallel.TransformerLayer`, TransformerEngine 2.8's `TransformerLayer` (CPU).

Each configuration runs against a float64 reference built here from explicit torch ops and the layer's own
parameters (the attention reference of tests/test_te_mha.py, norms, fc1 / activation / fc2, the residual
wiring of TransformerEngine's forward): output, input gradients and every parameter gradient. Tolerances
(relative Frobenius): high precision float32 2e-5 (bfloat16 parameters 0.02); FP8 forward 0.16, backward 0.24,
tests/test_te_surface.py's 0.08 / 0.12 doubled once: each residual branch chains two FP8 GEMMs (QKV -> proj,
fc1 -> fc2), and the branches are added, not chained. Dropout is 0 in the comparisons. Each test prints its
seed; FP8P_TEST_SEED=<seed> reproduces one.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import pytest

import fp8_parallel as te
from test_te_mha import (RECIPES, CpuTracker, _pad, _rel, _scope, _seed, _tolerances, randomize, ref_mha,
                         ref_norm, rope_freqs)

HIDDEN, FFN, HEADS = 64, 96, 8


def ref_mlp(P, cfg, h):
    pre = "layernorm_mlp."
    ln = ref_norm(h, P[pre + "layer_norm_weight"], P.get(pre + "layer_norm_bias"), cfg.get("normalization", "LayerNorm"),
                  1e-5, cfg.get("zero_centered_gamma", False))
    z = ln @ P[pre + "fc1_weight"].T
    if pre + "fc1_bias" in P:
        z = z + P[pre + "fc1_bias"]
    act = cfg.get("activation", "gelu")
    if act == "gelu":
        a = F.gelu(z, approximate="tanh")
    elif act == "swiglu":
        gate, up = z.chunk(2, dim=-1)
        a = gate * torch.sigmoid(gate) * up
    else:
        raise AssertionError(act)
    out = a @ P[pre + "fc2_weight"].T
    bias = P.get(pre + "fc2_bias")
    return out, bias, ln


def ref_layer(P, cfg, x, enc=None, self_mask="causal", q_pad=None, cross_pads=None, theta=None, break_it=False):
    """TransformerEngine's TransformerLayer forward in float64 (`x` sbhd)."""
    post, out_ln, parallel = (cfg.get("apply_residual_connection_post_layernorm", False),
                              cfg.get("output_layernorm", False), cfg.get("parallel_attention_mlp", False))
    attn_cfg = dict(num_attention_heads=HEADS, num_gqa_groups=cfg.get("num_gqa_groups"),
                    input_layernorm=not out_ln, fuse_qkv_params=cfg.get("fuse_qkv_params", False),
                    qkv_weight_interleaved=cfg.get("qkv_weight_interleaved", True),
                    normalization=cfg.get("normalization", "LayerNorm"),
                    zero_centered_gamma=cfg.get("zero_centered_gamma", False))

    def badd(out, bias, residual):
        return residual + (out + bias if bias is not None else out)

    a, a_bias, a_ln = ref_mha(P, attn_cfg, x, None, self_mask, q_pad, q_pad, theta, prefix="self_attention.")
    # ref_mha adds proj's bias (return_bias off in its cfg): a_bias is only informational here
    h = x
    if post and not out_ln:
        h = a_ln + a
    elif not parallel:
        h = x + a
    if cfg.get("layer_type") == "decoder":
        cross_cfg = dict(attn_cfg, attention_type="cross", input_layernorm=True)
        kv_pad = cross_pads[1] if cross_pads else None
        qp = cross_pads[0] if cross_pads else None
        c, _, c_ln = ref_mha(P, cross_cfg, h, enc, cfg.get("enc_dec_attn_mask_type", "no_mask"), qp, kv_pad, None,
                             prefix="inter_attention.")
        h = (c_ln if post else h) + c
    m, m_bias, m_ln = ref_mlp(P, cfg, h)
    if break_it:
        m = m * 1.05
    if post:
        out = badd(m, m_bias, m_ln)
    elif parallel:
        out = x + a + (m + m_bias if m_bias is not None else m)
    else:
        out = badd(m, m_bias, h)
    if out_ln:
        out = ref_norm(out, P["layernorm.weight"], P.get("layernorm.bias"), cfg.get("normalization", "LayerNorm"),
                       1e-5, cfg.get("zero_centered_gamma", False))
    return out


CONFIGS = {
    "encoder": dict(),
    "encoder/rmsnorm/swiglu/gqa/fused/zc": dict(normalization="RMSNorm", activation="swiglu", num_gqa_groups=2,
                                                fuse_qkv_params=True, zero_centered_gamma=True),
    "encoder/padding/bshd/nobias": dict(self_attn_mask_type="padding", attn_input_format="bshd", bias=False),
    "decoder/cross-padding": dict(layer_type="decoder", enc_dec_attn_mask_type="padding", num_gqa_groups=4),
    "post-ln-residual/decoder": dict(apply_residual_connection_post_layernorm=True, layer_type="decoder"),
    "output-layernorm": dict(output_layernorm=True),
    "output-layernorm/post-ln": dict(output_layernorm=True, apply_residual_connection_post_layernorm=True,
                                     normalization="RMSNorm"),
    "parallel-attention-mlp/rotary": dict(parallel_attention_mlp=True, rope=8, num_gqa_groups=2),
}


def run_layer_case(name, cfg, rname, dtype, seed, break_it=False, device="cpu"):
    """Layer (on `device`) vs float64 CPU reference; fails on tolerance."""
    cfg = dict(cfg)
    rope = cfg.pop("rope", None)
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    layer = te.TransformerLayer(HIDDEN, FFN, HEADS, hidden_dropout=0.0, attention_dropout=0.0, params_dtype=dtype,
                                device=device, **cfg)
    randomize(layer, gen)
    fmt = cfg.get("attn_input_format", "sbhd")
    decoder = cfg.get("layer_type") == "decoder"
    s, sk, b = 10, 7, 3
    x = torch.randn(s, b, HIDDEN, generator=gen, dtype=torch.float64)
    enc = torch.randn(sk, b, HIDDEN, generator=gen, dtype=torch.float64) if decoder else None
    self_mask = cfg.get("self_attn_mask_type", "causal")
    q_pad = _pad(gen, b, s) if "padding" in self_mask else None
    cross_pads = None
    if decoder and "padding" in cfg.get("enc_dec_attn_mask_type", "no_mask"):
        cross_pads = (torch.zeros(b, s, dtype=torch.bool), _pad(gen, b, sk))
    freqs = theta = None
    if rope:
        freqs, theta = rope_freqs(s, rope, False)

    def to_fmt(t):
        return t.transpose(0, 1).contiguous() if fmt == "bshd" else t

    xm = to_fmt(x).to(device=device, dtype=dtype).requires_grad_()
    em = to_fmt(enc).to(device=device, dtype=dtype).requires_grad_() if decoder else None
    with _scope(rname):
        out = layer(xm, attention_mask=None if q_pad is None else q_pad[:, None, None, :].to(device),
                    encoder_output=em,
                    enc_dec_attn_mask=None if cross_pads is None else tuple(p[:, None, None, :].to(device)
                                                                           for p in cross_pads),
                    rotary_pos_emb=None if freqs is None else freqs.to(device))
    g = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    out.backward(g.to(device=device, dtype=dtype))
    out = out.cpu()

    P = {n: p.detach().cpu().double().requires_grad_() for n, p in layer.named_parameters()}
    xr = x.clone().requires_grad_()
    er = enc.clone().requires_grad_() if decoder else None
    ref = to_fmt(ref_layer(P, cfg, xr, er, self_mask, q_pad, cross_pads, theta, break_it))
    ref.backward(g)

    fwd_tol, bwd_tol = _tolerances(rname, dtype)
    errors = {"out": (_rel(out, ref), fwd_tol), "dx": (_rel(xm.grad.cpu(), to_fmt(xr.grad)), bwd_tol)}
    if decoder:
        errors["denc"] = (_rel(em.grad.cpu(), to_fmt(er.grad)), bwd_tol)
    for n, p in layer.named_parameters():
        assert p.grad is not None, n
        grad = p.grad.cpu()
        if n.endswith("key_bias"):  # exact gradient 0 (softmax shift invariance): against the value bias's
            scale = P[n.replace("key_bias", "value_bias")].grad.norm()
            errors[f"d{n}"] = (((grad.double() - P[n].grad).norm() / scale).item(), bwd_tol)
            continue
        errors[f"d{n}"] = (_rel(grad, P[n].grad), bwd_tol)
    bad = {k: v for k, v in errors.items() if not v[0] < v[1]}
    assert not bad, f"{name}/{rname}/{dtype}: over tolerance {bad}"


@pytest.mark.parametrize("rname", list(RECIPES))
@pytest.mark.parametrize("name", list(CONFIGS))
def test_layer_matches_float64_reference(name, rname):
    seed = _seed(f"layer/{name}/{rname}")
    run_layer_case(name, CONFIGS[name], rname, torch.float32, seed)


@pytest.mark.parametrize("rname", list(RECIPES))
def test_layer_bfloat16_parameters(rname):
    name = "encoder/rmsnorm/swiglu/gqa/fused/zc"
    seed = _seed(f"layer/bf16/{rname}")
    run_layer_case(name, CONFIGS[name], rname, torch.bfloat16, seed)


def test_reference_comparison_can_fail():
    seed = _seed("layer/broken")
    with pytest.raises(AssertionError, match="over tolerance"):
        run_layer_case("encoder", CONFIGS["encoder"], "hp", torch.float32, seed, break_it=True)


def test_state_dict_keys_are_transformer_engines():
    def names(**kw):
        layer = te.TransformerLayer(HIDDEN, FFN, HEADS, device="cpu", **kw)
        return [n for n, _ in layer.named_parameters()]

    assert names() == [
        "self_attention.layernorm_qkv.layer_norm_weight", "self_attention.layernorm_qkv.layer_norm_bias",
        "self_attention.layernorm_qkv.query_weight", "self_attention.layernorm_qkv.query_bias",
        "self_attention.layernorm_qkv.key_weight", "self_attention.layernorm_qkv.key_bias",
        "self_attention.layernorm_qkv.value_weight", "self_attention.layernorm_qkv.value_bias",
        "self_attention.proj.weight", "self_attention.proj.bias", "layernorm_mlp.layer_norm_weight",
        "layernorm_mlp.layer_norm_bias", "layernorm_mlp.fc1_weight", "layernorm_mlp.fc1_bias",
        "layernorm_mlp.fc2_weight", "layernorm_mlp.fc2_bias"]
    assert names(fuse_qkv_params=True, normalization="RMSNorm", bias=False, output_layernorm=True) == [
        "self_attention.qkv.weight", "self_attention.proj.weight", "layernorm_mlp.layer_norm_weight",
        "layernorm_mlp.fc1_weight", "layernorm_mlp.fc2_weight", "layernorm.weight"]
    decoder = names(layer_type="decoder", fuse_qkv_params=True)
    assert [n for n in decoder if n.startswith("inter_attention")] == [
        "inter_attention.layernorm_query.layer_norm_weight", "inter_attention.layernorm_query.layer_norm_bias",
        "inter_attention.layernorm_query.weight", "inter_attention.layernorm_query.bias",
        "inter_attention.key_value.weight", "inter_attention.key_value.bias", "inter_attention.proj.weight",
        "inter_attention.proj.bias"]


def test_refused_and_invalid_options_name_themselves():
    def build(**kw):
        return te.TransformerLayer(HIDDEN, FFN, HEADS, device="cpu", **kw)

    with pytest.raises(NotImplementedError, match="ub_tp_comm_overlap"):
        build(ub_tp_comm_overlap=True)
    build(ub_overlap_ag=True, ub_bulk_wgrad=True, seq_length=16, micro_batch_size=2)  # gated off / hints
    build(fuse_wgrad_accumulation=True)  # implemented (tests/test_te_main_grad.py)
    with pytest.raises(ValueError, match="parallel_attention_mlp"):
        build(parallel_attention_mlp=True, layer_type="decoder")
    with pytest.raises(ValueError, match="layer_type"):
        build(layer_type="encoder-decoder")
    with pytest.raises(NotImplementedError, match="softmax_type"):
        build(softmax_type="learnable")
    with pytest.raises(NotImplementedError, match="inference_params"):
        build()(torch.randn(4, 2, HIDDEN), inference_params=object())


def test_dropout_deterministic_under_seed_and_off_in_eval():
    """Hidden dropout and drop path draw from torch's generator, attention dropout from the tracker's fork: the
    same seeds give the same output, another global seed another one; eval() equals a dropout-free copy."""
    seed = _seed("layer/dropout")
    torch.manual_seed(seed)
    tracker = CpuTracker(seed)
    layer = te.TransformerLayer(HIDDEN, FFN, HEADS, hidden_dropout=0.2, attention_dropout=0.2, drop_path_rate=0.3,
                                device="cpu", get_rng_state_tracker=lambda: tracker)
    plain = te.TransformerLayer(HIDDEN, FFN, HEADS, hidden_dropout=0.0, attention_dropout=0.0, device="cpu")
    randomize(layer, torch.Generator().manual_seed(seed))
    plain.load_state_dict(layer.state_dict())
    x = torch.randn(8, 4, HIDDEN)

    def run(global_seed, tracker_seed=1):
        tracker.states_ = CpuTracker(tracker_seed).states_
        torch.manual_seed(global_seed)
        return layer(x)

    a, b, c, d = run(2), run(2), run(3), run(2, tracker_seed=5)
    assert torch.equal(a, b) and not torch.allclose(a, c) and not torch.allclose(a, d)
    layer.eval()
    torch.testing.assert_close(layer(x), plain(x), rtol=0, atol=0)


@pytest.mark.parametrize("fp8", [False, True])
def test_drop_path_rate_one_drops_both_branches(fp8):
    """`drop_path_rate=1.0` (TE's sanity tests build it): in training both branches contribute zeros, so the
    layer passes its input through, with finite zero gradients for the branches' parameters (TE's formula
    divides by 1 - rate and gives NaN); in eval the branches run."""
    seed = _seed(f"layer/drop_path_one/{fp8}")
    layer = te.TransformerLayer(HIDDEN, FFN, HEADS, hidden_dropout=0.0, attention_dropout=0.0, drop_path_rate=1.0,
                                device="cpu")
    randomize(layer, torch.Generator().manual_seed(seed))
    x = torch.randn(8, 4, HIDDEN, generator=torch.Generator().manual_seed(seed + 1), requires_grad=True)
    with te.autocast(enabled=fp8, recipe=te.DelayedScaling()):
        out = layer(x)
    assert torch.equal(out, x)
    out.square().sum().backward()
    assert torch.equal(x.grad, 2 * x.detach())
    assert all(p.grad is None or (torch.isfinite(p.grad).all() and not p.grad.any()) for p in layer.parameters())
    layer.eval()
    assert not torch.allclose(layer(x), x)


@pytest.mark.parametrize("fp8", [False, True])
def test_amp_runs_the_layer_in_the_autocast_dtype(fp8):
    """Inside `torch.autocast` the layer casts `hidden_states` to the autocast dtype first, as TE's does (TE's
    test_sanity AMP checks): the output has that dtype; the input and parameter gradients stay float32."""
    seed = _seed(f"layer/amp/{fp8}")
    layer = te.TransformerLayer(HIDDEN, FFN, HEADS, hidden_dropout=0.0, attention_dropout=0.0, device="cpu")
    randomize(layer, torch.Generator().manual_seed(seed))
    x = torch.randn(8, 4, HIDDEN, generator=torch.Generator().manual_seed(seed + 1), requires_grad=True)
    reference = layer(x).detach()
    with torch.autocast(device_type="cpu", dtype=torch.bfloat16), te.autocast(enabled=fp8, recipe=te.DelayedScaling()):
        out = layer(x)
    assert out.dtype == torch.bfloat16
    out.float().square().sum().backward()
    assert x.grad.dtype == torch.float32
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in layer.parameters())
    assert _rel(out.float(), reference) < (0.1 if fp8 else 0.03)


@pytest.mark.parametrize("rname", ["hp", "delayed"])
def test_checkpoint_around_the_layer_is_bitwise(rname):
    """`fp8_parallel.checkpoint` around a TransformerLayer (dropout on, with the RNG tracker): output and every
    gradient bitwise those without it."""
    seed = _seed(f"layer/checkpoint/{rname}")
    runs = []
    for ckpt in (False, True):
        torch.manual_seed(seed)
        tracker = CpuTracker(seed)
        layer = te.TransformerLayer(HIDDEN, FFN, HEADS, hidden_dropout=0.1, attention_dropout=0.1, device="cpu",
                                    num_gqa_groups=2, get_rng_state_tracker=lambda: tracker)
        x = torch.randn(8, 2, HIDDEN, requires_grad=True)
        with _scope(rname):
            out = (te.checkpoint(layer, x, get_rng_state_tracker=tracker, use_reentrant=True) if ckpt else layer(x))
        out.backward(torch.ones_like(out))
        runs.append([out.detach(), x.grad] + [p.grad for p in layer.parameters()])
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rname", list(RECIPES))
@pytest.mark.parametrize("name", ["encoder", "encoder/rmsnorm/swiglu/gqa/fused/zc"])
def test_gpu_layer_matches_float64_reference(name, rname, dtype):
    """On the GPU, every parameter dtype, against the float64 CPU reference (the CPU test's tolerances)."""
    seed = _seed(f"gpu/layer/{name}/{rname}/{dtype}")
    run_layer_case(name, CONFIGS[name], rname, dtype, seed, device="cuda")
