"""`fp8_parallel.DotProductAttention`, TransformerEngine's core-attention module, used as a TransformerEngine
script uses it (CPU).

Every mask type, both padded formats and the packed one, grouped-query attention, sliding windows and the
diagonal alignment are checked forward and backward against a float64 reference written here from
TransformerEngine's documented rules (an explicit softmax over masked scores; a query with no allowed key
outputs zeros), plus the exact masks of TransformerEngine's own docstring examples. Dropout: deterministic
under a seed or a seeded RNG tracker, drawn from the tracker's fork, without effect in eval(). Context
parallel runs on 2 gloo ranks (workers/te_attention_cp_checks.py). Seeds are the run's seed (`--random-seed`
draws one) and printed; FP8P_TEST_SEED=<seed> reproduces one.
"""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import fp8_parallel as te
from fp8_parallel import recipe
from launcher import child_env, launch
from te_testing import seed_for as _seed, rel_error as _rel, CpuTracker

REPO = Path(__file__).resolve().parents[1]
HEADS, GROUPS, DIM = 4, 2, 8
TOL = 2e-5  # float32 module vs float64 reference, relative Frobenius error
CAUSAL_TYPES = ("causal", "padding_causal", "causal_bottom_right", "padding_causal_bottom_right")
MASK_TYPES = ("no_mask", "padding", "arbitrary") + CAUSAL_TYPES


# ---- the float64 reference ---------------------------------------------------------------------------------


def reference(q, k, v, mask_type, window=None, bottom_right=None, scale=None, q_len=None, kv_len=None,
              arbitrary=None):
    """TransformerEngine's attention in float64, from its documented rules. q `[b, sq, h, d]`, k / v
    `[b, sk, g, d]` (bshd); `q_len` / `kv_len`: actual lengths per batch element (padding types); `arbitrary`:
    True = masked, broadcastable to `[b, h, sq, sk]`. Returns `[b, sq, h, dv]`."""
    q, k, v = q.double(), k.double(), v.double()
    b, sq, h, d = q.shape
    sk, g = k.shape[1], k.shape[2]
    k, v = k.repeat_interleave(h // g, dim=2), v.repeat_interleave(h // g, dim=2)
    scale = d ** -0.5 if scale is None else scale
    scores = torch.einsum("bihd,bjhd->bhij", q, k) * scale
    causal = "causal" in mask_type
    padding = "padding" in mask_type
    if bottom_right is None:
        bottom_right = mask_type not in ("causal", "padding_causal")
    if mask_type in ("causal", "padding_causal"):
        bottom_right = False
    if "bottom_right" in mask_type:
        bottom_right = True
    left, right = (-1, -1) if window is None else window
    if causal:
        right = 0
    allowed = torch.ones(b, h, sq, sk, dtype=torch.bool)
    i = torch.arange(sq).view(sq, 1)
    j = torch.arange(sk).view(1, sk)
    for n in range(b):
        lq = q_len[n] if padding else sq
        lk = kv_len[n] if padding else sk
        # the diagonal: top left, or the bottom right of the (actual, for padding types) score matrix
        off = (lk - lq) if (bottom_right and padding) else (sk - sq) if bottom_right else 0
        ok = torch.ones(sq, sk, dtype=torch.bool)
        if left >= 0:
            ok &= j >= i + off - left
        if right >= 0:
            ok &= j <= i + off + right
        if padding:
            ok &= (i < lq) & (j < lk)
        allowed[n] &= ok
    if arbitrary is not None:
        allowed &= ~arbitrary.expand(b, h, sq, sk)
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a row with no allowed key: zeros
    return torch.einsum("bhij,bjhd->bihd", probs, v)


def _to(fmt, t):
    """bshd -> fmt."""
    return t.transpose(0, 1).contiguous() if fmt == "sbhd" else t.clone()


def _from_out(fmt, out, h):
    """The module's output in fmt -> `[b, s, h, d]`."""
    out = out.transpose(0, 1) if fmt == "sbhd" else out
    return out.reshape(out.shape[0], out.shape[1], h, -1)


def _inputs(gen, b, sq, sk, h=HEADS, g=GROUPS, d=DIM, dv=None):
    q = torch.randn(b, sq, h, d, generator=gen)
    k = torch.randn(b, sk, g, d, generator=gen)
    v = torch.randn(b, sk, g, d if dv is None else dv, generator=gen)
    return q, k, v


def _lengths(gen, b, s):
    """Actual lengths per batch element, at least one shorter than `s` and one of length 1."""
    lengths = torch.randint(1, s + 1, (b,), generator=gen)
    lengths[0] = max(1, s - 3)
    lengths[-1] = 1
    return lengths


def _pad_mask(lengths, s):
    return (torch.arange(s).view(1, s) >= lengths.view(-1, 1)).view(-1, 1, 1, s)


def _window(mask_type):
    return (2, 0) if "causal" in mask_type else (2, 1)


# ---- against the reference ----------------------------------------------------------------------------------


@pytest.mark.parametrize("windowed", [False, True], ids=["full", "window"])
@pytest.mark.parametrize("shape", ["self", "cross"])
@pytest.mark.parametrize("fmt", ["sbhd", "bshd"])
@pytest.mark.parametrize("mask_type", MASK_TYPES)
def test_matches_float64_reference(mask_type, fmt, shape, windowed):
    """Forward and the query/key/value gradients of every mask type, both padded formats, self- and
    cross-attention shapes (queries fewer than keys), with and without a sliding window, 4 query heads over 2
    key/value heads, against the float64 reference."""
    _check_reference(mask_type, fmt, shape, windowed, "cpu", torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("mask_type", MASK_TYPES)
def test_gpu_matches_float64_reference(mask_type, dtype):
    """The same on the GPU (torch's flash / efficient / cuDNN SDPA kernels), every input dtype, with and
    without a window; tolerance 1e-4 in float32 (GPU kernels reorder sums), 2e-2 in 16-bit."""
    for windowed in (False, True):
        _check_reference(mask_type, "sbhd", "cross", windowed, "cuda", dtype)


def _check_reference(mask_type: str, fmt: str, shape: str, windowed: bool, device: str, dtype: torch.dtype):
    tol = TOL if device == "cpu" else (1e-4 if dtype == torch.float32 else 2e-2)
    seed = _seed(f"{mask_type}/{fmt}/{shape}/{windowed}/{device}/{dtype}")
    gen = torch.Generator().manual_seed(seed)
    b, sq, sk = 3, 8, (8 if shape == "self" else 11)
    q, k, v = _inputs(gen, b, sq, sk)
    kwargs, ref_kwargs = {}, {}
    if "padding" in mask_type:
        q_len, kv_len = _lengths(gen, b, sq), _lengths(gen, b, sk)
        if shape == "self":
            kv_len = q_len
            kwargs["attention_mask"] = _pad_mask(q_len, sq)
        else:
            kwargs["attention_mask"] = (_pad_mask(q_len, sq), _pad_mask(kv_len, sk))
        ref_kwargs.update(q_len=q_len.tolist(), kv_len=kv_len.tolist())
    if mask_type == "arbitrary":
        mask = torch.rand(b, HEADS, sq, sk, generator=gen) < 0.3
        mask[0, 1, 2] = True  # one query attends to nothing: zeros
        kwargs["attention_mask"] = ref_kwargs["arbitrary"] = mask
    window = _window(mask_type) if windowed else None
    attn = te.DotProductAttention(HEADS, DIM, num_gqa_groups=GROUPS, qkv_format=fmt, attn_mask_type=mask_type,
                                  window_size=window, attention_type=shape)
    xs = [_to(fmt, t).to(device=device, dtype=dtype).requires_grad_() for t in (q, k, v)]
    mask = kwargs.get("attention_mask")
    if mask is not None:
        kwargs["attention_mask"] = tuple(m.to(device) for m in mask) if isinstance(mask, tuple) else mask.to(device)
    out = attn(*xs, **kwargs)
    assert out.shape == ((sq, b, HEADS * DIM) if fmt == "sbhd" else (b, sq, HEADS * DIM))
    grad = torch.randn(b, sq, HEADS, DIM, generator=gen)
    (_from_out(fmt, out, HEADS) * grad.to(device=device, dtype=dtype)).sum().backward()
    out = out.cpu()

    rs = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = reference(*rs, mask_type, window=window, **ref_kwargs)
    (ref * grad.double()).sum().backward()
    assert ref.abs().sum() > 0
    assert _rel(_from_out(fmt, out, HEADS), ref) < tol
    for x, r, name in zip(xs, rs, "qkv"):
        xg = x.grad.cpu()
        assert _rel(xg.transpose(0, 1) if fmt == "sbhd" else xg, r.grad) < tol, name


@pytest.mark.parametrize("bottom_right", [None, False, True])
@pytest.mark.parametrize("mask_type", ["no_mask", "padding", "arbitrary"])
def test_window_alignment_follows_bottom_right_diagonal(mask_type, bottom_right):
    """`bottom_right_diagonal` (constructor, or forward overriding it) moves a window's diagonal: None is
    bottom right for these mask types; causal types ignore it (their own alignment)."""
    seed = _seed(f"alignment/{mask_type}/{bottom_right}")
    gen = torch.Generator().manual_seed(seed)
    b, sq, sk = 2, 5, 9
    q, k, v = _inputs(gen, b, sq, sk)
    kwargs, ref_kwargs = {}, {}
    if mask_type == "padding":
        q_len, kv_len = torch.tensor([5, 3]), torch.tensor([9, 6])
        kwargs["attention_mask"] = (_pad_mask(q_len, sq), _pad_mask(kv_len, sk))
        ref_kwargs.update(q_len=q_len.tolist(), kv_len=kv_len.tolist())
    if mask_type == "arbitrary":
        kwargs["attention_mask"] = ref_kwargs["arbitrary"] = torch.rand(1, 1, sq, sk, generator=gen) < 0.2
    built = te.DotProductAttention(HEADS, DIM, num_gqa_groups=GROUPS, qkv_format="bshd", attn_mask_type=mask_type,
                                   window_size=(1, 1), bottom_right_diagonal=bottom_right)
    default = te.DotProductAttention(HEADS, DIM, num_gqa_groups=GROUPS, qkv_format="bshd", attn_mask_type=mask_type)
    ref = reference(q, k, v, mask_type, window=(1, 1), bottom_right=bottom_right, **ref_kwargs)
    assert _rel(_from_out("bshd", built(q, k, v, **kwargs), HEADS), ref) < TOL
    out = default(q, k, v, window_size=(1, 1), bottom_right_diagonal=bottom_right, **kwargs)
    assert _rel(_from_out("bshd", out, HEADS), ref) < TOL
    other = reference(q, k, v, mask_type, window=(1, 1), bottom_right=not (bottom_right in (None, True)),
                      **ref_kwargs)
    assert _rel(other, ref) > 0.05  # the alignment matters for these shapes: the check can fail


def _weights(attn, sq, sk, **kwargs):
    """The attention weights `[b, h, sq, sk]` the module applies: values are one-hot per key (head size sk),
    so each output row is its weight row."""
    gen = torch.Generator().manual_seed(0)
    b = 2
    q = torch.randn(b, sq, 1, 4, generator=gen, dtype=torch.float64)
    k = torch.randn(b, sk, 1, 4, generator=gen, dtype=torch.float64)
    v = torch.eye(sk, dtype=torch.float64).view(1, sk, 1, sk).expand(b, sk, 1, sk)
    return attn(q, k, v, **kwargs).view(b, sq, sk)


def test_masks_are_transformer_engines():
    """The allowed keys of TransformerEngine's own examples: causal (top left) and causal_bottom_right with 2
    queries over 4 keys; a cross-attention padding mask pair (the example in TransformerEngine's
    `get_full_mask` docstring); a window with the bottom-right diagonal. True = attends."""
    def attends(mask_type, sq, sk, **kwargs):
        attn = te.DotProductAttention(1, (4, sk), qkv_format="bshd", attn_mask_type=mask_type,
                                      attention_type="cross", window_size=kwargs.pop("window_size", None))
        return (_weights(attn, sq, sk, **kwargs) > 0).tolist()

    t, f = True, False
    assert attends("causal", 2, 4)[0] == [[t, f, f, f], [t, t, f, f]]
    assert attends("causal_bottom_right", 2, 4)[0] == [[t, t, t, f], [t, t, t, t]]
    q_mask = torch.tensor([[f, f, t, t], [f, f, f, f]]).view(2, 1, 1, 4)
    kv_mask = torch.tensor([[f, f, f, t], [f, t, t, t]]).view(2, 1, 1, 4)
    got = attends("padding", 4, 4, attention_mask=(q_mask, kv_mask))
    assert got == [[[t, t, t, f], [t, t, t, f], [f, f, f, f], [f, f, f, f]],
                   [[t, f, f, f], [t, f, f, f], [t, f, f, f], [t, f, f, f]]]
    # window (1, 0) on no_mask, 2 queries over 4 keys, bottom right: query i sees keys i + 2 - 1 ... i + 2
    assert attends("no_mask", 2, 4, window_size=(1, 0))[0] == [[f, t, t, f], [f, f, t, t]]


def test_padding_from_cu_seqlens_equals_mask():
    """A padding mask type takes `cu_seqlens_q` / `cu_seqlens_kv` instead of the mask (sequences padded at the
    end); forward and gradients agree bitwise."""
    seed = _seed("cu_seqlens")
    gen = torch.Generator().manual_seed(seed)
    b, s = 3, 7
    q, k, v = _inputs(gen, b, s, s)
    lengths = _lengths(gen, b, s)
    cu = torch.cat([torch.zeros(1, dtype=torch.int32), lengths.cumsum(0).int()])
    attn = te.DotProductAttention(HEADS, DIM, num_gqa_groups=GROUPS, qkv_format="bshd", attn_mask_type="padding_causal")
    results = []
    for kwargs in ({"attention_mask": _pad_mask(lengths, s)}, {"cu_seqlens_q": cu, "cu_seqlens_kv": cu}):
        xs = [t.clone().requires_grad_() for t in (q, k, v)]
        out = attn(*xs, **kwargs)
        out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)))
        results.append((out, *[x.grad for x in xs]))
    assert all(torch.equal(a, b) for a, b in zip(*results))
    ref = reference(q, k, v, "padding_causal", q_len=lengths.tolist(), kv_len=lengths.tolist())
    assert _rel(_from_out("bshd", results[0][0], HEADS), ref) < TOL


@pytest.mark.parametrize("gaps", [False, True], ids=["packed", "padded-between"])
@pytest.mark.parametrize("mask_type", ["padding", "padding_causal", "padding_causal_bottom_right"])
def test_thd_matches_per_sequence_reference(mask_type, gaps):
    """"thd": packed sequences given by `cu_seqlens_q` / `cu_seqlens_kv` (and `cu_seqlens_*_padded` when
    tokens sit between sequences) attend within their own sequence; output `[t, h * d]`. Checked per sequence
    against the float64 reference, forward and backward; tokens between sequences output zeros and get no
    gradient."""
    seed = _seed(f"thd/{mask_type}/{gaps}")
    gen = torch.Generator().manual_seed(seed)
    q_lens, kv_lens = [3, 1, 5], [4, 2, 5]
    gap = 2 if gaps else 0

    def layout(lens):
        cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)
        starts = [sum(lens[:n]) + n * gap for n in range(len(lens))]
        padded = torch.tensor(starts + [starts[-1] + lens[-1] + gap], dtype=torch.int32)
        return cu, padded, starts, int(padded[-1])

    cu_q, cu_q_pad, q_starts, tq = layout(q_lens)
    cu_kv, cu_kv_pad, kv_starts, tk = layout(kv_lens)
    q = torch.randn(tq, HEADS, DIM, generator=gen).requires_grad_()
    k = torch.randn(tk, GROUPS, DIM, generator=gen).requires_grad_()
    v = torch.randn(tk, GROUPS, DIM, generator=gen).requires_grad_()
    attn = te.DotProductAttention(HEADS, DIM, num_gqa_groups=GROUPS, qkv_format="thd", attn_mask_type=mask_type,
                                  attention_type="cross")
    extra = {"cu_seqlens_q_padded": cu_q_pad, "cu_seqlens_kv_padded": cu_kv_pad} if gaps else {}
    out = attn(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv, **extra)
    assert out.shape == (tq, HEADS * DIM)
    grad = torch.randn(out.shape, generator=gen)
    (out * grad).sum().backward()
    in_q = torch.zeros(tq, dtype=torch.bool)
    in_k = torch.zeros(tk, dtype=torch.bool)
    ref_out = torch.zeros(tq, HEADS, DIM, dtype=torch.float64)
    ref_grads = [torch.zeros(t.shape, dtype=torch.float64) for t in (q, k, v)]
    for n, (lq, lk) in enumerate(zip(q_lens, kv_lens)):
        qs, ks = slice(q_starts[n], q_starts[n] + lq), slice(kv_starts[n], kv_starts[n] + lk)
        in_q[qs], in_k[ks] = True, True
        rs = [t.detach()[sl].double().unsqueeze(0).requires_grad_() for t, sl in ((q, qs), (k, ks), (v, ks))]
        ref = reference(*rs, mask_type, q_len=[lq], kv_len=[lk])
        (ref * grad[qs].view(1, lq, HEADS, DIM).double()).sum().backward()
        ref_out[qs] = ref[0].detach()
        for full, r, sl in zip(ref_grads, rs, (qs, ks, ks)):
            full[sl] = r.grad[0]
    assert _rel(out.view(tq, HEADS, DIM), ref_out) < TOL
    for x, r, name in zip((q, k, v), ref_grads, "qkv"):
        assert _rel(x.grad, r) < TOL, name
    if gaps:
        assert (~in_q).any() and (out[~in_q] == 0).all() and (q.grad[~in_q] == 0).all()
        assert (k.grad[~in_k] == 0).all() and (v.grad[~in_k] == 0).all()


def test_value_head_size_and_softmax_scale():
    """`kv_channels=(dk, dv)` takes a value head size other than the key's (output `h * dv`); `softmax_scale`
    replaces `1 / sqrt(dk)`; one key/value head (multi-query attention)."""
    seed = _seed("kv_channels")
    gen = torch.Generator().manual_seed(seed)
    q, k, v = _inputs(gen, 2, 6, 6, g=1, dv=5)
    attn = te.DotProductAttention(HEADS, (DIM, 5), num_gqa_groups=1, qkv_format="bshd", softmax_scale=0.7)
    out = attn(q, k, v)
    assert out.shape == (2, 6, HEADS * 5)
    assert _rel(_from_out("bshd", out, HEADS), reference(q, k, v, "causal", scale=0.7)) < TOL
    assert _rel(reference(q, k, v, "causal", scale=0.7), reference(q, k, v, "causal")) > 0.01


def test_tensor_parallel_size_divides_heads():
    """`num_attention_heads` and `num_gqa_groups` are the whole layer's; `tp_size` ranks hold a share each."""
    attn = te.DotProductAttention(8, DIM, num_gqa_groups=4, tp_size=2, qkv_format="bshd")
    q, k, v = _inputs(torch.Generator().manual_seed(0), 2, 5, 5, h=4, g=2)
    assert attn(q, k, v).shape == (2, 5, 4 * DIM)
    with pytest.raises(ValueError, match="tensor-parallel size 2"):
        attn(*_inputs(torch.Generator().manual_seed(0), 2, 5, 5, h=8, g=4))
    with pytest.raises(ValueError, match="do not divide"):
        te.DotProductAttention(6, DIM, num_gqa_groups=3, tp_size=2)
    with pytest.raises(ValueError, match="not divisible"):
        te.DotProductAttention(6, DIM, num_gqa_groups=4)


# ---- dropout -----------------------------------------------------------------------------------------------


def _dropout_inputs(seed):
    gen = torch.Generator().manual_seed(seed)
    return _inputs(gen, 2, 16, 16)


def test_dropout_deterministic_under_seed_and_off_in_eval():
    """Dropout acts in training only: in eval() the output is bitwise that of `attention_dropout=0`; in training
    it differs, and the same `torch.manual_seed` gives bitwise the same output and gradients."""
    seed = _seed("dropout/seed")
    q, k, v = _dropout_inputs(seed)
    drop = te.DotProductAttention(HEADS, DIM, num_gqa_groups=GROUPS, attention_dropout=0.4, qkv_format="bshd")
    plain = te.DotProductAttention(HEADS, DIM, num_gqa_groups=GROUPS, qkv_format="bshd")
    runs = []
    for _ in range(2):
        torch.manual_seed(seed)
        xs = [t.clone().requires_grad_() for t in (q, k, v)]
        out = drop(*xs)
        out.backward(torch.ones_like(out) + out.detach())
        runs.append((out.detach(), *[x.grad for x in xs]))
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    assert not torch.allclose(runs[0][0], plain(q, k, v))
    drop.eval()
    assert torch.equal(drop(q, k, v), plain(q, k, v))


def test_dropout_draws_from_the_tracker_fork():
    """With `get_rng_state_tracker`, dropout runs inside the tracker's fork: the default generator is left as
    it was, the tracker's state advances, the same tracker seed gives the same output whatever the global
    seed, and another tracker seed another output. `sequence_parallel=True` does not fork (TransformerEngine's
    rule). Dropped weights are zero and kept ones scaled by 1 / (1 - p) (values one-hot per key)."""
    seed = _seed("dropout/tracker")
    q, k, v = _dropout_inputs(seed)

    def run(tracker_seed, global_seed, sequence_parallel=False):
        tracker = CpuTracker(tracker_seed)
        attn = te.DotProductAttention(HEADS, DIM, num_gqa_groups=GROUPS, attention_dropout=0.4, qkv_format="bshd",
                                      get_rng_state_tracker=lambda: tracker, sequence_parallel=sequence_parallel)
        torch.manual_seed(global_seed)
        before = torch.get_rng_state()
        out = attn(q, k, v)
        global_untouched = torch.equal(before, torch.get_rng_state())
        tracker_moved = not torch.equal(tracker.states_["model-parallel-rng"],
                                        torch.Generator().manual_seed(tracker_seed).get_state())
        return out, global_untouched, tracker_moved

    out_a, untouched, moved = run(seed, 1)
    assert untouched and moved
    out_b, _, _ = run(seed, 2)
    out_c, _, _ = run(seed + 1, 1)
    assert torch.equal(out_a, out_b) and not torch.allclose(out_a, out_c)
    _, untouched, moved = run(seed, 1, sequence_parallel=True)
    assert not untouched and not moved

    # the dropped attention weights, against the float64 weights
    p, sk = 0.4, 32
    attn = te.DotProductAttention(1, (4, sk), attention_dropout=p, qkv_format="bshd",
                                  attn_mask_type="no_mask", get_rng_state_tracker=lambda: CpuTracker(seed))
    weights = _weights(attn, 24, sk)
    gen = torch.Generator().manual_seed(0)
    qd = torch.randn(2, 24, 1, 4, generator=gen, dtype=torch.float64)
    kd = torch.randn(2, sk, 1, 4, generator=gen, dtype=torch.float64)
    exact = torch.softmax(torch.einsum("bid,bjd->bij", qd[:, :, 0], kd[:, :, 0]) / 2.0, dim=-1)
    kept = weights != 0
    assert torch.allclose(weights[kept], exact[kept] / (1 - p), rtol=1e-10, atol=0)
    assert abs((~kept).double().mean().item() - p) < 0.05  # 1536 weights: the dropped share is p


def test_checkpoint_core_attention_with_dropout_is_bitwise():
    """`checkpoint_core_attention=True` recomputes attention in backward with the tracker's states of the
    first pass: output and gradients bitwise those without it, dropout included; the tracker ends where it
    ends without checkpointing."""
    seed = _seed("dropout/checkpoint")
    q, k, v = _dropout_inputs(seed)
    runs = []
    for ckpt in (False, True):
        tracker = CpuTracker(seed)
        attn = te.DotProductAttention(HEADS, DIM, num_gqa_groups=GROUPS, attention_dropout=0.3, qkv_format="sbhd",
                                      get_rng_state_tracker=lambda: tracker)
        xs = [t.clone().requires_grad_() for t in (q, k, v)]
        out = attn(*xs, checkpoint_core_attention=ckpt)
        out.backward(out.detach() * 2 + 1)
        runs.append((out.detach(), *[x.grad for x in xs], tracker.states_["model-parallel-rng"]))
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_runs_in_high_precision_inside_autocast():
    """Inside an FP8 autocast the attention is the same computation (TransformerEngine without fp8_dpa)."""
    q, k, v = _inputs(torch.Generator().manual_seed(_seed("autocast")), 2, 6, 6)
    attn = te.DotProductAttention(HEADS, DIM, num_gqa_groups=GROUPS)
    with te.autocast(recipe=recipe.DelayedScaling()):
        inside = attn(q, k, v)
    assert torch.equal(inside, attn(q, k, v))


# ---- refusals and checks -----------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, name", [
    ({"core_attention_bias_type": "post_scale_bias", "core_attention_bias": torch.zeros(1, HEADS, 6, 6)},
     "core_attention_bias_type"),
    ({"core_attention_bias": torch.ones(1, HEADS, 6, 6)}, "core_attention_bias"),
    ({"core_attention_bias_type": "alibi", "alibi_slopes": torch.ones(HEADS)}, "core_attention_bias_type"),
    ({"alibi_slopes": torch.ones(HEADS)}, "alibi_slopes"),
    ({"inference_params": object()}, "inference_params"),
    ({"fp8_output": True}, "fp8_output"),
    ({"score_mod": lambda *a: a}, "score_mod"),
])
def test_unsupported_forward_arguments_raise(kwargs, name):
    q, k, v = _inputs(torch.Generator().manual_seed(0), 2, 6, 6)
    attn = te.DotProductAttention(HEADS, DIM, num_gqa_groups=GROUPS, qkv_format="bshd")
    with pytest.raises(NotImplementedError, match=name):
        attn(q, k, v, **kwargs)


@pytest.mark.parametrize("kwargs, error, name", [
    ({"softmax_type": "off-by-one"}, NotImplementedError, "softmax_type"),
    ({"return_max_logit": True}, NotImplementedError, "return_max_logit"),
    ({"cp_group": [None, None], "cp_comm_type": "a2a+p2p"}, NotImplementedError, "cp_group"),
    ({"cp_group": "group", "cp_comm_type": "a2a"}, NotImplementedError, "cp_comm_type"),
    ({"attn_mask_type": "causal", "window_size": (-1, 3)}, ValueError, "window_size"),
    ({"attn_mask_type": "no_mask", "window_size": (3, -1)}, ValueError, "window_size"),
    ({"attn_mask_type": "sliding"}, ValueError, "attn_mask_type"),
    ({"qkv_format": "sbh3d"}, ValueError, "qkv_format"),
    ({"attention_dropout": 1.0}, ValueError, "attention_dropout"),
])
def test_unsupported_or_invalid_constructor_arguments_raise(kwargs, error, name):
    with pytest.raises(error, match=name):
        te.DotProductAttention(HEADS, DIM, num_gqa_groups=GROUPS, **kwargs)


def test_input_checks():
    """Masks of the wrong kind, missing padding information and mismatched shapes raise, naming the problem;
    TransformerEngine's near-miss windows are corrected with a warning; its mask-type spellings are accepted."""
    q, k, v = _inputs(torch.Generator().manual_seed(0), 2, 6, 6)
    attn = te.DotProductAttention(HEADS, DIM, num_gqa_groups=GROUPS, qkv_format="bshd")
    with pytest.raises(ValueError, match="needs attention_mask or cu_seqlens"):
        attn(q, k, v, attn_mask_type="padding")
    with pytest.raises(TypeError, match="boolean"):
        attn(q, k, v, attn_mask_type="arbitrary", attention_mask=torch.zeros(1, 1, 6, 6))
    with pytest.raises(ValueError, match="broadcastable"):
        attn(q, k, v, attn_mask_type="arbitrary", attention_mask=torch.zeros(2, 3, 6, 6, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"\[b, 1, 1, s\]"):
        attn(q, k, v, attn_mask_type="padding", attention_mask=torch.zeros(2, 1, 6, 6, dtype=torch.bool))
    with pytest.raises(ValueError, match="heads"):
        attn(q, k[:, :, :1], v[:, :, :1])
    with pytest.raises(ValueError, match="thd"):
        attn(q[:, 0], k[:, 0], v[:, 0], qkv_format="thd", attn_mask_type="causal",
             cu_seqlens_q=torch.tensor([0, 2]), cu_seqlens_kv=torch.tensor([0, 2]))
    with pytest.warns(UserWarning, match="window_size"):
        out = attn(q, k, v, attn_mask_type="causal", window_size=(2, 2))
    assert torch.equal(out, attn(q, k, v, attn_mask_type="causal", window_size=(2, 0)))
    padded = _pad_mask(torch.tensor([4, 6]), 6)
    assert torch.equal(attn(q, k, v, attn_mask_type="causal,padding", attention_mask=padded),
                       attn(q, k, v, attn_mask_type="padding_causal", attention_mask=padded))


def test_names_exported_without_megatron():
    """`te.DotProductAttention`, `te.modules.DotProductAttention` and `te.checkpoint` exist (no longer in
    TE_NAMES_NOT_PROVIDED), and building and running the attention imports no megatron-core (fresh
    interpreter); `position_mask` still imports from its former module."""
    script = textwrap.dedent("""
        import sys, torch
        import fp8_parallel as te
        from fp8_parallel.te_compat import TE_NAMES_NOT_PROVIDED
        assert "DotProductAttention" not in TE_NAMES_NOT_PROVIDED and "checkpoint" not in TE_NAMES_NOT_PROVIDED
        assert te.modules.DotProductAttention is te.DotProductAttention and callable(te.checkpoint)
        attn = te.DotProductAttention(2, 4)
        q = torch.randn(3, 1, 2, 4, requires_grad=True)
        te.checkpoint(attn, q, q, q).sum().backward()
        assert not [m for m in sys.modules if m == "megatron" or m.startswith("megatron.")], "megatron imported"
        from fp8_parallel.modules.attention import position_mask
        from fp8_parallel.modules._attention_masks import position_mask as moved
        assert position_mask is moved
        print("NAMES-OK")
    """)
    env = child_env()
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, env=env)
    assert res.returncode == 0 and "NAMES-OK" in res.stdout, res.stdout + res.stderr


# ---- context parallel ---------------------------------------------------------------------------------------


def test_context_parallel_cp2():
    """cp_group over 2 gloo ranks, each with its two load-balanced chunks: outputs and query/key/value
    gradients equal the single-rank module on the whole sequence (no_mask and causal, sbhd and bshd, GQA, with
    checkpoint_core_attention); unsupported combinations raise naming cp_group."""
    launch("te_attention_cp_checks.py", 2, timeout=600, expect_checks=["cp2_matches_cp1", "cp_refusals"])
