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

Usage (under torchrun, 2 ranks): te_tp_checks.py
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from rank_checks import run_checks, test_seed

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


def _check_case(kind: str, sp: bool, rname: str, late_group: bool):
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


if __name__ == "__main__":
    dist.init_process_group("gloo")
    print(f"seed {test_seed()}", flush=True)
    run_checks([
        ("tp_parameter_attributes", check_tp_parameter_attributes),
        ("autocast_amax_reduction_group", check_autocast_amax_reduction_group),
        ("modules_tp2", check_modules_tp2),
    ])
    dist.destroy_process_group()
