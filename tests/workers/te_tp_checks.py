"""Tensor parallelism of the TransformerEngine-style modules (2 gloo ranks), the way a TransformerEngine user
builds them: `Linear(parallel_mode="column"/"row")`, `LayerNormLinear(parallel_mode="column")`,
`LayerNormMLP(set_parallel_mode=True)`, with and without `sequence_parallel`, `tp_group` given or set later.

Each TP2 module gets the shards of a TP1 module's parameters (same seed on both ranks). After a few FP8 steps
its output, input gradient and parameter gradients (shards gathered, sequence-parallel partial gradients
summed as megatron's DDP sums them) are compared with (a) a float64 reference of the whole computation
(FP8 tolerances, as in tests/test_te_compat.py) and (b) for delayed scaling, the TP1 module run in FP8 on
the same data (the same scales: the amax group is the TP group; differences only from summation order and
the FP8 roundings they move; current scaling is not compared so: each weight shard has its own scale). The
high-precision path must match float64 to 1e-5. FP8 states must agree
over the TP group. `autocast(amax_reduction_group=...)` is checked to reduce over exactly that group.

Usage (under torchrun, 2 ranks): te_tp_checks.py [layers]  (`layers`: MultiheadAttention / TransformerLayer,
see the section below)
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from rank_checks import run_checks, test_seed, exit_now

import fp8_parallel as te
from fp8_parallel import recipe

FWD_TOL, BWD_TOL, HP_TOL = 0.08, 0.12, 1e-5
TP1_TOL = 1e-5  # TP2 vs TP1 in FP8, delayed scaling: measured below 5e-7 (summation order only)
RECIPES = {
    "delayed": recipe.DelayedScaling(amax_history_len=8, amax_compute_algo="max"),
    "current": recipe.Float8CurrentScaling(),
}
SEQ, BATCH, HIDDEN, FFN = 32, 2, 64, 96


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _gated_rows(t: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    """A gated fc1's shard: this rank's slice of the gate half and of the linear half (rows)."""
    gate, up = t.chunk(2, dim=0)
    return torch.cat([gate.chunk(tp, 0)[rank], up.chunk(tp, 0)[rank]])


def _shard(name: str, full: torch.Tensor, part: torch.nn.Parameter, gated: bool) -> torch.Tensor:
    rank, tp = dist.get_rank(), dist.get_world_size()
    if not getattr(part, "tensor_model_parallel", False):
        return full
    if gated and name.startswith("fc1_"):
        return _gated_rows(full, rank, tp)
    return full.chunk(tp, dim=part.partition_dim)[rank]


def _unshard(name: str, grad: torch.Tensor, part: torch.nn.Parameter, gated: bool) -> torch.Tensor:
    """The full gradient from this rank's: shards gathered, sequence-parallel partial gradients summed."""
    tp = dist.get_world_size()
    if getattr(part, "tensor_model_parallel", False):
        pieces = [torch.empty_like(grad) for _ in range(tp)]
        dist.all_gather(pieces, grad.contiguous())
        if gated and name.startswith("fc1_"):
            halves = [p.chunk(2, dim=0) for p in pieces]
            return torch.cat([torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])])
        return torch.cat(pieces, dim=part.partition_dim)
    if getattr(part, "sequence_parallel", False):
        grad = grad.clone()
        dist.all_reduce(grad)
    return grad


def _gather(t: torch.Tensor, dim: int) -> torch.Tensor:
    pieces = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(pieces, t.contiguous())
    return torch.cat(pieces, dim=dim)


def _norm(x, w, b, eps=1e-5):
    mu = x.mean(-1, keepdim=True)
    return (x - mu) * torch.rsqrt((x - mu).pow(2).mean(-1, keepdim=True) + eps) * w + b


def _silu(t):
    return t * torch.sigmoid(t)


# kind -> (build(**tp_kwargs), float64 function of (x, *params in named_parameters order), gated, out dim)
def _cases():
    return {
        "Linear-column": (lambda **kw: te.Linear(HIDDEN, FFN, parallel_mode="column", device="cpu", **kw),
                          lambda x, w, b: x @ w.t() + b, False, "column"),
        "Linear-row": (lambda **kw: te.Linear(FFN, HIDDEN, parallel_mode="row", device="cpu", **kw),
                       lambda x, w, b: x @ w.t() + b, False, "row"),
        "LayerNormLinear": (lambda **kw: te.LayerNormLinear(HIDDEN, FFN, parallel_mode="column", device="cpu",
                                                            return_layernorm_output_gathered=True, **kw),
                            lambda x, lw, lb, w, b: _norm(x, lw, lb) @ w.t() + b, False, "column"),
        "LayerNormMLP-swiglu": (
            lambda **kw: te.LayerNormMLP(HIDDEN, FFN, set_parallel_mode=True, activation="swiglu", device="cpu",
                                         init_method=lambda w: torch.nn.init.normal_(w, std=0.1),
                                         output_layer_init_method=lambda w: torch.nn.init.normal_(w, std=0.1), **kw),
            lambda x, lw, lb, w1, b1, w2, b2: (
                lambda h: _silu(h[..., : h.shape[-1] // 2]) * h[..., h.shape[-1] // 2:])(
                _norm(x, lw, lb) @ w1.t() + b1) @ w2.t() + b2,
            True, "row"),
    }


def _run(module, x, g, rec, steps=3):
    """`steps` FP8 steps on the same data (delayed scaling needs one to get scales); returns the last
    output (first element of a tuple), the whole output and the input's gradient."""
    for _ in range(steps):
        module.zero_grad(set_to_none=True)
        xi = x.detach().clone().requires_grad_()
        with te.autocast(enabled=True, recipe=rec):
            out = module(xi)
        y = out[0] if isinstance(out, tuple) else out
        y.backward(g)
    return y, out, xi.grad


def _check_case(kind: str, sp: bool, rname: str, late_group: bool):  # noqa: C901
    build, fn, gated, out_kind = _cases()[kind]
    rank, tp = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    seed = test_seed() % 100_000
    torch.manual_seed(seed)
    full = build()
    with torch.no_grad():  # non-trivial biases and norm parameters
        for name, p in full.named_parameters():
            if "bias" in name:
                p.normal_(std=0.5)
            elif name == "layer_norm_weight":
                p.add_(torch.rand_like(p) * 0.5)
    part = build(tp_size=tp, sequence_parallel=sp) if late_group else build(tp_group=group, sequence_parallel=sp)
    if late_group:
        try:
            part(torch.randn(2, HIDDEN))
        except RuntimeError as e:
            assert "set_tensor_parallel_group" in str(e), e
        else:
            raise AssertionError("a module built with tp_size only ran without a group")
        part.set_tensor_parallel_group(group)
    names = [n for n, _ in full.named_parameters()]
    assert names == [n for n, _ in part.named_parameters()], (names, [n for n, _ in part.named_parameters()])
    with torch.no_grad():
        for (name, pf), pp in zip(full.named_parameters(), part.parameters()):
            pp.copy_(_shard(name, pf, pp, gated))
    in_features = FFN if kind == "Linear-row" else HIDDEN
    gen = torch.Generator().manual_seed(seed)
    x_full = torch.randn(SEQ, BATCH, in_features, generator=gen) * 2 + 0.5
    out_features = FFN if out_kind == "column" else HIDDEN
    g_full = torch.randn(SEQ, BATCH, out_features, generator=gen)
    # what this rank gets: its sequence shard (sequence parallel: column input, row output), its feature
    # slice of a row layer's input, its slice of a column layer's output gradient
    x = x_full
    if kind == "Linear-row":
        x = x_full.chunk(tp, dim=-1)[rank]
    if sp and kind != "Linear-row":  # a sequence-parallel input is sharded along the sequence
        x = x.chunk(tp, dim=0)[rank]
    g = g_full
    if out_kind == "column":
        g = g.chunk(tp, dim=-1)[rank]
    elif sp:
        g = g.chunk(tp, dim=0)[rank]
    rec = RECIPES[rname]
    y, out, dx = _run(part, x, g, rec)
    # reassemble the whole output and input gradient
    y_all = _gather(y, -1) if out_kind == "column" else (_gather(y, 0) if sp else y)
    dx_all = dx
    if kind == "Linear-row":
        dx_all = _gather(dx, -1)
    elif sp:
        dx_all = _gather(dx, 0)
    grads = [_unshard(n, p.grad, p, gated) for n, p in part.named_parameters()]
    # (a) float64 reference of the whole computation
    xd = x_full.double().requires_grad_()
    pd = [p.detach().double().requires_grad_() for p in full.parameters()]
    yd = fn(xd, *pd)
    yd.backward(g_full.double())
    scale = 2 if kind.startswith("LayerNormMLP") else 1  # two FP8 GEMMs in a row
    errs = {"out": _rel(y_all, yd), "dx": _rel(dx_all, xd.grad)}
    errs.update({f"d{n}": _rel(gr, p.grad) for n, gr, p in zip(names, grads, pd)})
    label = f"{kind} sp={sp} {rname} late_group={late_group}"
    print(f"rank {rank} {label} vs float64 {({k: round(v, 4) for k, v in errs.items()})}", flush=True)
    assert errs["out"] < scale * FWD_TOL and all(v < scale * BWD_TOL for v in errs.values()), (label, errs)
    # the FP8 state agrees over the TP group (the amax domain)
    for name, buf in part.named_buffers():
        assert torch.equal(_gather(buf.unsqueeze(0), 0)[0], _gather(buf.unsqueeze(0), 0)[1]), (label, name)
    if isinstance(out, tuple):  # LayerNormLinear: the gathered norm output
        ln_ref = _norm(x_full.double(), pd[0].detach(), pd[1].detach())
        assert out[1].shape == x_full.shape and _rel(out[1], ln_ref) < HP_TOL, label
    # (b) the TP1 module in FP8 on the same data, same recipe: delayed scales agree with TP2's
    if rname == "delayed":
        y1, _, dx1 = _run(full, x_full, g_full, rec)
        rel = {"out": _rel(y_all, y1), "dx": _rel(dx_all, dx1)}
        rel.update({f"d{n}": _rel(gr, p.grad) for n, gr, p in zip(names, grads, full.parameters())})
        print(f"rank {rank} {label} vs TP1 {({k: f'{v:.1e}' for k, v in rel.items()})}", flush=True)
        assert all(v < TP1_TOL for v in rel.values()), (label, rel)
    # the high-precision path of the same module
    with te.autocast(enabled=False):
        out_hp = part(x)
    y_hp = out_hp[0] if isinstance(out_hp, tuple) else out_hp
    y_hp = _gather(y_hp, -1) if out_kind == "column" else (_gather(y_hp, 0) if sp else y_hp)
    assert _rel(y_hp, fn(x_full.double(), *[p.detach() for p in pd])) < HP_TOL, label
    assert not torch.equal(y_hp, y_all), f"{label}: the FP8 scope ran in high precision"


def check_modules_tp2():
    for kind in _cases():
        for sp in (False, True):
            for rname in RECIPES:
                _check_case(kind, sp, rname, late_group=False)
    _check_case("Linear-column", True, "delayed", late_group=True)
    _check_case("LayerNormMLP-swiglu", False, "delayed", late_group=True)


def check_tp_parameter_attributes():
    """megatron's attributes: split weights carry tensor_model_parallel / partition_dim; a row layer's bias and
    the norms' parameters carry sequence_parallel (their gradients are partial per rank then)."""
    tp = dist.get_world_size()
    col = te.Linear(HIDDEN, FFN, parallel_mode="column", tp_group=dist.group.WORLD, sequence_parallel=True,
                    device="cpu")
    assert col.weight.shape == (FFN // tp, HIDDEN) and col.weight.partition_dim == 0 and col.bias.partition_dim == 0
    row = te.Linear(FFN, HIDDEN, parallel_mode="row", tp_group=dist.group.WORLD, sequence_parallel=True, device="cpu")
    assert row.weight.shape == (HIDDEN, FFN // tp) and row.weight.partition_dim == 1
    assert row.bias.shape == (HIDDEN,) and row.bias.sequence_parallel and not hasattr(row.bias, "partition_dim")
    mlp = te.LayerNormMLP(HIDDEN, FFN, tp_group=dist.group.WORLD, set_parallel_mode=True, sequence_parallel=True,
                          activation="swiglu", device="cpu")
    assert mlp.fc1_weight.shape == (2 * FFN // tp, HIDDEN) and mlp.fc2_weight.shape == (HIDDEN, FFN // tp)
    assert mlp.layer_norm_weight.sequence_parallel and mlp.fc2_bias.sequence_parallel
    # without set_parallel_mode the weights are still split and nothing is communicated (TransformerEngine)
    local = te.LayerNormMLP(HIDDEN, FFN, tp_group=dist.group.WORLD, device="cpu")
    x = torch.randn(4, HIDDEN)
    with te.autocast(enabled=False):
        y = local(x)
    h = torch.nn.functional.layer_norm(x, (HIDDEN,), local.layer_norm_weight, local.layer_norm_bias, 1e-5)
    expect = torch.nn.functional.gelu(h @ local.fc1_weight.t() + local.fc1_bias, approximate="tanh") @ \
        local.fc2_weight.t() + local.fc2_bias
    torch.testing.assert_close(y, expect)


def check_autocast_amax_reduction_group():
    """TransformerEngine 2.x's `autocast(amax_reduction_group=g)`: amaxes are reduced over `g` exactly. Each rank
    its own data: with the world group the scales agree; with a group of this rank alone they differ."""
    rank = dist.get_rank()
    alone = [dist.new_group([r]) for r in range(dist.get_world_size())][rank]
    rec = RECIPES["delayed"]
    scales = {}
    for label, group in (("world", dist.group.WORLD), ("alone", alone)):
        torch.manual_seed(test_seed() % 1000)
        lin = te.Linear(HIDDEN, HIDDEN, device="cpu")
        gen = torch.Generator().manual_seed(test_seed() + rank)
        for _ in range(2):
            x = torch.randn(8, HIDDEN, generator=gen) * (1 + 3 * rank)
            with te.autocast(True, False, rec, group):  # TransformerEngine 2.x's positional order
                y = lin(x)
            y.sum().backward()
        scales[label] = _gather(lin.fp8.fwd.scale.unsqueeze(0), 0)
    assert torch.equal(scales["world"][0], scales["world"][1]), scales["world"]
    assert not torch.equal(scales["alone"][0][0], scales["alone"][1][0]), scales["alone"]



def check_current_scaling_quantizer_amax_reduction():
    """`Float8CurrentScalingQuantizer(with_amax_reduction=True, amax_reduction_group=g)`: every rank of `g`
    casts with the scale of the group's largest amax (each rank its own data, rank 1's four times larger);
    without reduction each rank scales from its own amax."""
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(test_seed() + rank)
    x = torch.randn(16, 32, generator=gen) * (1 + 3 * rank)
    amaxes = _gather(x.abs().max().reshape(1, 1), 0).flatten()
    reduced = te.Float8CurrentScalingQuantizer(torch.float8_e4m3fn, with_amax_reduction=True,
                                              amax_reduction_group=dist.group.WORLD)(x)
    local = te.Float8CurrentScalingQuantizer(torch.float8_e4m3fn)(x)
    want_reduced = torch.tensor(448.0 / float(amaxes.max().double()), dtype=torch.float64).float()
    want_local = torch.tensor(448.0 / float(x.abs().max().double()), dtype=torch.float64).float()
    assert torch.equal(reduced._scale_inv.reshape(()), want_reduced.reciprocal()), (rank, reduced._scale_inv)
    assert torch.equal(local._scale_inv.reshape(()), want_local.reciprocal()), (rank, local._scale_inv)
    sinvs = _gather(reduced._scale_inv.reshape(1, 1), 0).flatten()
    assert torch.equal(sinvs[0], sinvs[1]) and not torch.equal(amaxes[0], amaxes[1]), (sinvs, amaxes)

def check_calibration_reduces_amaxes_over_the_group():
    """`fp8_autocast(enabled=False, calibrating=True, fp8_group=world)` under no_grad: each rank's outputs are its
    own high-precision ones, and after exit every rank holds the scales of the group's largest amaxes (rank 1's
    inputs four times larger, the weights identical); with no group given (world size 2 here: the world
    group by default as well) the same."""
    rank = dist.get_rank()
    torch.manual_seed(test_seed())  # the same weights on both ranks
    lin = te.Linear(32, 16, params_dtype=torch.float32, device="cpu")
    gen = torch.Generator().manual_seed(test_seed() + 17 * rank)
    x = torch.randn(8, 32, generator=gen) * (1e-3 * (1 + 3 * rank))
    with torch.no_grad(), te.fp8_autocast(enabled=False, calibrating=True, fp8_group=dist.group.WORLD):
        y = lin(x)
    assert torch.equal(y, torch.nn.functional.linear(x, lin.weight, lin.bias)), rank
    amax_x = _gather(x.abs().max().reshape(1, 1), 0).flatten()
    assert not torch.equal(amax_x[0], amax_x[1]), amax_x
    want = torch.stack([448.0 / amax_x.max(), 448.0 / lin.weight.detach().abs().max()])
    torch.testing.assert_close(lin.fp8.fwd.scale[:2], want, rtol=1e-6, atol=0, msg=f"rank {rank}")
    scales = _gather(lin.fp8.fwd.scale[:2].reshape(1, 2), 0)
    assert torch.equal(scales[0], scales[1]), (rank, scales)


def check_distributed_gather_along_first_dim():
    """`fp8_parallel.distributed.gather_along_first_dim` (TE's signature): the ranks' tensors stacked along the
    first dimension in rank order, synchronously and with `async_op` (its handle waited on)."""
    from fp8_parallel import distributed

    rank, world = dist.get_rank(), dist.get_world_size()
    mine = torch.arange(6, dtype=torch.float32).reshape(2, 3) + 10 * rank
    want = torch.cat([torch.arange(6, dtype=torch.float32).reshape(2, 3) + 10 * r for r in range(world)])
    out, handle = distributed.gather_along_first_dim(mine, None)
    assert handle is None and torch.equal(out, want), (rank, out)
    out, handle = distributed.gather_along_first_dim(mine.t(), dist.group.WORLD, async_op=True)  # non-contiguous
    handle.wait()
    assert torch.equal(out, torch.cat([want[2 * r: 2 * r + 2].t() for r in range(world)])), (rank, out)
    assert distributed.get_distributed_world_size() == world


# ---- MultiheadAttention / TransformerLayer at TP2 (`te_tp_checks.py layers`, tests/test_te_tp_layers.py) ----
# Each TP2 module (set_parallel_mode=True) gets the shards of a TP1 module's float32 parameters; both run on the
# same data. High precision: output, input gradient and every parameter gradient (this rank's shard of the TP1
# gradient; a replicated parameter under sequence parallelism carries `sequence_parallel` and its gradient is
# partial per rank: summed over the TP group here, as megatron's DDP / finalize_model_grads sums it) within 1e-5
# relative. FP8 (delayed scaling, amax group = the TP group): against the TP1 module in high precision within
# test_te_surface.py's tolerances for FP8 GEMMs in a row (forward 2 * 0.08, backward 2 * 0.12), and against the
# TP1 module in FP8 (same recipe, same steps, so nearly the same scales) within FP8_TP1_TOL. A key bias's gradient is
# zero in exact arithmetic (and the key bias unobservable): only its size is checked.

LAYER_HEADS, LAYER_TOL, ZERO_GRAD_TOL = 4, 1e-5, 1e-4
CHAINED_FWD_TOL, CHAINED_BWD_TOL = 2 * FWD_TOL, 2 * BWD_TOL
# TP2 vs TP1, both FP8 with delayed scaling: usually below 1e-6 (summation order only). But the row-parallel sum
# of another order can move an amax by an ulp, so a scale by 1-2 ulp (seen: FP8P_TEST_SEED=74903, fc1/fc2 input
# scales of the TransformerLayer); a few FP8 values then round the other way and a small layer's gradients move by
# up to 5e-3 (its output by 2e-4). Scales that really differ (e.g. a shard's own amax) re-round every value:
# errors of the FP8 noise's size (~4e-2, the "out" error against high precision above).
FP8_TP1_TOL = 1e-2


def _layer_init(w: torch.Tensor) -> torch.Tensor:
    return torch.nn.init.normal_(w, std=0.1)


def _mha(fused: bool, groups=None, interleaved: bool = True):
    return lambda **kw: te.MultiheadAttention(
        HIDDEN, LAYER_HEADS, attention_dropout=0.0, input_layernorm=True, fuse_qkv_params=fused,
        num_gqa_groups=groups, qkv_weight_interleaved=interleaved, init_method=_layer_init,
        output_layer_init_method=_layer_init, device="cpu", **kw)


def _layer(**extra):
    return lambda **kw: te.TransformerLayer(
        HIDDEN, FFN, LAYER_HEADS, hidden_dropout=0.0, attention_dropout=0.0, init_method=_layer_init,
        output_layer_init_method=_layer_init, device="cpu", **extra, **kw)


# kind -> (build(**tp_kwargs), spec): spec["gated"]: fc1 is [gate; linear] (each half split separately);
# spec["qkv_parts"]: row sizes of a fused, non-interleaved QKV weight ([queries; keys; values], each part split
# separately); an interleaved fused QKV weight is grouped per key/value head, so a plain row chunk is its split
_KV = HIDDEN // LAYER_HEADS
LAYER_CASES = {
    "MHA-fused": (_mha(True), {}),
    "MHA-split": (_mha(False), {}),
    "MHA-gqa2-fused": (_mha(True, 2), {}),
    "MHA-gqa2-split": (_mha(False, 2), {}),
    "MHA-gqa2-fused-concat": (_mha(True, 2, interleaved=False), {"qkv_parts": (HIDDEN, 2 * _KV, 2 * _KV)}),
    "TransformerLayer": (_layer(), {}),
    "TransformerLayer-rmsnorm-swiglu": (_layer(normalization="RMSNorm", activation="swiglu"), {"gated": True}),
}


def _is_fused_qkv(name: str) -> bool:
    owner, leaf = name.rsplit(".", 1) if "." in name else ("", name)
    return leaf in ("weight", "bias") and owner.split(".")[-1] in ("qkv", "layernorm_qkv")


def _layer_shard(name: str, full: torch.Tensor, part: torch.nn.Parameter, spec: dict) -> torch.Tensor:
    """This rank's piece of a TP1 parameter (or of its gradient) for the TP module's parameter `part`."""
    rank, tp = dist.get_rank(), dist.get_world_size()
    if not getattr(part, "tensor_model_parallel", False):
        return full
    leaf = name.rsplit(".", 1)[-1]
    if spec.get("gated") and leaf.startswith("fc1_"):
        return _gated_rows(full, rank, tp)
    if spec.get("qkv_parts") and _is_fused_qkv(name):
        return torch.cat([p.chunk(tp, 0)[rank] for p in full.split(spec["qkv_parts"], dim=0)])
    return full.chunk(tp, dim=part.partition_dim)[rank]


def _layer_pair(kind: str, sp: bool):
    """(TP1 module, TP2 module holding its shards) for `kind`; same seed on every rank."""
    build, spec = LAYER_CASES[kind]
    torch.manual_seed(test_seed() % 100_000)
    full = build()
    with torch.no_grad():  # non-trivial biases and norm gains
        for name, p in full.named_parameters():
            if "bias" in name:
                p.normal_(std=0.5)
            elif "layer_norm_weight" in name:
                p.add_(torch.rand_like(p) * 0.5)
    part = build(tp_group=dist.group.WORLD, set_parallel_mode=True, sequence_parallel=sp)
    full_params, part_params = dict(full.named_parameters()), dict(part.named_parameters())
    assert list(full_params) == list(part_params), (kind, list(full_params), list(part_params))
    with torch.no_grad():
        for name, pp in part_params.items():
            piece = _layer_shard(name, full_params[name], pp, spec)
            assert piece.shape == pp.shape, (kind, name, piece.shape, pp.shape)
            pp.copy_(piece)
    return full, part, spec


def _reduced_grad(p: torch.nn.Parameter, sp: bool) -> torch.Tensor:
    """`p`'s gradient as the caller uses it: a replicated parameter's partial sequence-parallel gradient summed
    over the TP group (what megatron's DDP / finalize_model_grads does for `sequence_parallel` parameters)."""
    if sp and not getattr(p, "tensor_model_parallel", False) and getattr(p, "sequence_parallel", False):
        grad = p.grad.clone()
        dist.all_reduce(grad, group=dist.group.WORLD)
        return grad
    return p.grad


def _fwd_bwd(module, x, g, fp8: bool, steps: int = 1):
    for _ in range(steps):
        module.zero_grad(set_to_none=True)
        xi = x.detach().clone().requires_grad_()
        with te.autocast(enabled=fp8, recipe=RECIPES["delayed"] if fp8 else None,
                         amax_reduction_group=dist.group.WORLD if fp8 else None):
            y = module(xi)
        y.backward(g)
    return y.detach(), xi.grad


def _check_layer_case(kind: str, sp: bool, fp8: bool):
    rank, tp = dist.get_rank(), dist.get_world_size()
    full, part, spec = _layer_pair(kind, sp)
    gen = torch.Generator().manual_seed(test_seed() % 100_000 + 1)
    x_full = torch.randn(SEQ, BATCH, HIDDEN, generator=gen)
    g_full = torch.randn(SEQ, BATCH, HIDDEN, generator=gen)
    x, g = (x_full.chunk(tp, 0)[rank], g_full.chunk(tp, 0)[rank]) if sp else (x_full, g_full)
    label = f"{kind} tp={tp} sp={sp} fp8={fp8} seed={test_seed()}"
    # the TP1 module in high precision is the reference of both paths
    y_ref, dx_ref = _fwd_bwd(full, x_full, g_full, fp8=False)
    # delayed scaling needs a step to get scales: the last of 3 steps on the same data is compared
    y, dx = _fwd_bwd(part, x, g, fp8=fp8, steps=3 if fp8 else 1)
    # this rank's outputs against this rank's piece of the reference (sequence parallel: its sequence shard;
    # otherwise the whole output and input gradient on every rank)
    y_exp, dx_exp = (y_ref.chunk(tp, 0)[rank], dx_ref.chunk(tp, 0)[rank]) if sp else (y_ref, dx_ref)
    assert y.shape == y_exp.shape and dx.shape == dx_exp.shape, (label, y.shape, y_exp.shape, dx.shape)
    errs = {"out": _rel(y, y_exp), "dx": _rel(dx, dx_exp)}
    full_params, zeros = dict(full.named_parameters()), {}
    for name, p in part.named_parameters():
        assert p.grad is not None, (label, name, "no gradient")
        grad = p.grad
        if not getattr(p, "tensor_model_parallel", False):
            # replicated: under sequence parallelism its gradient is partial per rank (the caller sums it over
            # the TP group, megatron's convention), so it must say so; without, every rank has the whole one
            assert bool(getattr(p, "sequence_parallel", False)) == sp, (label, name, "sequence_parallel attribute")
            grad = _reduced_grad(p, sp)
        if name.endswith("key_bias"):
            # zero in exact arithmetic (softmax ignores a shift shared by all keys): round-off on both sides, so
            # its size against the query bias's gradient is checked instead of a relative difference
            ref = full_params[name.replace("key_bias", "query_bias")].grad.norm()
            zeros[name] = max(grad.norm().item(), full_params[name].grad.norm().item()) / ref.item()
            continue
        errs[f"d:{name}"] = _rel(grad, _layer_shard(name, full_params[name].grad, p, spec))
    worst = max(errs, key=errs.get)
    print(f"rank {rank} {label} out {errs['out']:.1e} dx {errs['dx']:.1e} worst {worst} {errs[worst]:.1e}",
          flush=True)
    if zeros:
        print(f"rank {rank} {label} zero gradients (relative to the query bias's) {zeros}", flush=True)
        assert all(v < ZERO_GRAD_TOL for v in zeros.values()), (label, zeros)
    if not fp8:
        bad = {k: v for k, v in errs.items() if not v < LAYER_TOL}
        assert not bad, (label, bad)
    else:
        bad = {k: v for k, v in errs.items() if not v < (CHAINED_FWD_TOL if k == "out" else CHAINED_BWD_TOL)}
        assert not bad, (label, bad)
        assert errs["out"] > 0, f"{label}: the FP8 scope ran in high precision"
        # the FP8 state agrees over the TP group (the amax domain)
        for name, buf in part.named_buffers():
            pieces = _gather(buf.unsqueeze(0), 0)
            assert all(torch.equal(pieces[0], q) for q in pieces[1:]), (label, name)
        # the TP1 module in FP8, same recipe and steps: with the TP group as amax group the scales are TP1's
        y1, dx1 = _fwd_bwd(full, x_full, g_full, fp8=True, steps=3)
        y1, dx1 = (y1.chunk(tp, 0)[rank], dx1.chunk(tp, 0)[rank]) if sp else (y1, dx1)
        rel = {"out": _rel(y, y1), "dx": _rel(dx, dx1)}
        for name, p in part.named_parameters():
            if not name.endswith("key_bias"):
                grad = _reduced_grad(p, sp)
                rel[f"d:{name}"] = _rel(grad, _layer_shard(name, full_params[name].grad, p, spec))
        worst = max(rel, key=rel.get)
        print(f"rank {rank} {label} vs TP1 in FP8 out {rel['out']:.1e} dx {rel['dx']:.1e} worst {worst} "
              f"{rel[worst]:.1e}", flush=True)
        assert all(v < FP8_TP1_TOL for v in rel.values()), (label, "vs TP1 in FP8", rel)


def _layer_check(kind: str):
    def check():
        for sp in (False, True):
            for fp8 in (False, True):
                _check_layer_case(kind, sp, fp8)
    return check


LAYER_CHECKS = [(f"layers_tp2:{kind}", _layer_check(kind)) for kind in LAYER_CASES]


if __name__ == "__main__":
    import sys

    dist.init_process_group("gloo")
    print(f"seed {test_seed()}", flush=True)
    if sys.argv[1:] == ["layers"]:
        run_checks(LAYER_CHECKS)
    else:
        run_checks([
            ("tp_parameter_attributes", check_tp_parameter_attributes),
            ("autocast_amax_reduction_group", check_autocast_amax_reduction_group),
            ("current_scaling_quantizer_amax_reduction", check_current_scaling_quantizer_amax_reduction),
            ("calibration_reduces_amaxes_over_the_group", check_calibration_reduces_amaxes_over_the_group),
            ("distributed_gather_along_first_dim", check_distributed_gather_along_first_dim),
            ("modules_tp2", check_modules_tp2),
        ])
    dist.destroy_process_group()
    exit_now()  # skip finalization: see exit_now
