"""Multi-rank checks of parallel_state: getters, amax domains, bad sizes, megatron's schedule on CPU.

Usage (under torchrun): parallel_state_checks.py TP PP VPP EP [CP]   (VPP 0 = none; CP default 1)
"""
from __future__ import annotations

import sys

import torch
import torch.distributed as dist

import parallel_state as ps
from parallel_state import ParallelLayoutError
from rank_checks import run_checks, test_seed, exit_now
import toy_pipeline as toy

TP, PP, VPP, EP = (int(a) for a in sys.argv[1:5])
CP = int(sys.argv[5]) if len(sys.argv) > 5 else 1
VPP = VPP or None
WORLD = int(__import__("os").environ["WORLD_SIZE"])


# --- bad sizes first, while torch.distributed is not initialized: they must fail before any collective ---
def _expect_layout_error(kwargs, must_mention):
    try:
        ps.initialize(**kwargs)
    except ParallelLayoutError as e:
        msg = str(e)
        missing = [m for m in must_mention if m not in msg]
        return None if not missing else f"{kwargs}: message {msg!r} lacks {missing}"
    return f"{kwargs}: no error"


BAD = [
    (dict(tp=3), ["world size 8" if WORLD == 8 else f"world size {WORLD}", "tp*pp*cp", "tp=3"]),
    (dict(tp=1, pp=1, vpp=2), ["vpp=2", "pp=1"]),
    (dict(tp=2, ep=3), ["etp*ep*pp", "ep=3"]),
    (dict(tp=0), ["tp=0"]),
]
bad_results = [_expect_layout_error(kw, m) for kw, m in BAD]
bad_left_dist_uninitialized = not dist.is_initialized()

sizes = ps.initialize(tp=TP, pp=PP, vpp=VPP, ep=EP, cp=CP)
DEVICE = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
from megatron.core import parallel_state as mpu  # noqa: E402

RANK = dist.get_rank()
DP = WORLD // (TP * PP * CP)
ETP, EDP = TP, WORLD // (TP * EP * PP)


def _coords(rank, dims):
    """Decompose `rank` along `dims` [(name, size), ...], first dim fastest (megatron's order tp-cp-ep-dp-pp)."""
    out = {}
    for name, size in dims:
        out[name] = rank % size
        rank //= size
    return out


def _group_of(rank, dims, vary):
    mine = _coords(rank, dims)
    return sorted(r for r in range(WORLD) if all(_coords(r, dims)[n] == mine[n] for n, _ in dims if n not in vary))


DENSE = [("tp", TP), ("cp", CP), ("dp", DP), ("pp", PP)]
EXPERT = [("tp", ETP), ("ep", EP), ("dp", EDP), ("pp", PP)]
EXPECTED = {
    "tp": _group_of(RANK, DENSE, {"tp"}),
    "pp": _group_of(RANK, DENSE, {"pp"}),
    "dp": _group_of(RANK, DENSE, {"dp"}),
    "dp_cp": _group_of(RANK, DENSE, {"dp", "cp"}),
    "cp": _group_of(RANK, DENSE, {"cp"}),
    "ep": _group_of(RANK, EXPERT, {"ep"}),
    "etp": _group_of(RANK, EXPERT, {"tp"}),
    "edp": _group_of(RANK, EXPERT, {"dp"}),
}
EXPECTED_DENSE_AMAX = _group_of(RANK, DENSE, {"tp", "cp", "dp"})
EXPECTED_DENSE_AMAX_TP_ONLY = _group_of(RANK, DENSE, {"tp", "cp"})
EXPECTED_EXPERT_AMAX = _group_of(RANK, EXPERT, {"tp", "dp"})
MEGATRON = {
    "tp": mpu.get_tensor_model_parallel_group(),
    "pp": mpu.get_pipeline_model_parallel_group(),
    "dp": mpu.get_data_parallel_group(),
    "dp_cp": mpu.get_data_parallel_group(with_context_parallel=True),
    "cp": mpu.get_context_parallel_group(),
    "ep": mpu.get_expert_model_parallel_group(),
    "etp": mpu.get_expert_tensor_parallel_group(),
    "edp": mpu.get_expert_data_parallel_group(),
}


def check_bad_sizes():
    errors = [r for r in bad_results if r]
    assert not errors, errors
    assert bad_left_dist_uninitialized, "a bad layout initialized torch.distributed"


def check_sizes():
    assert (sizes.tp, sizes.pp, sizes.vpp, sizes.ep, sizes.dp, sizes.expert_dp) == (TP, PP, VPP, EP, DP, EDP)


def check_getters():
    for dim in ps.DIMENSIONS:
        ranks = ps.get_ranks(dim)
        assert sorted(ranks) == EXPECTED[dim], (dim, ranks, EXPECTED[dim])
        assert ranks == dist.get_process_group_ranks(MEGATRON[dim]), dim
        assert ps.get_size(dim) == len(EXPECTED[dim]), dim
        assert ps.get_rank(dim) == sorted(ranks).index(RANK), dim
    assert ps.get_rank("tp") == mpu.get_tensor_model_parallel_rank()
    assert ps.get_rank("pp") == mpu.get_pipeline_model_parallel_rank()
    assert ps.get_rank("ep") == mpu.get_expert_model_parallel_rank()


def check_amax_domains():
    dense = sorted(dist.get_process_group_ranks(ps.dense_amax_group()))
    dense_tp = sorted(dist.get_process_group_ranks(ps.dense_amax_group(tp_only=True)))
    expert = sorted(dist.get_process_group_ranks(ps.expert_amax_group()))
    assert dense == EXPECTED_DENSE_AMAX, (dense, EXPECTED_DENSE_AMAX)
    assert dense_tp == EXPECTED_DENSE_AMAX_TP_ONLY, (dense_tp, EXPECTED_DENSE_AMAX_TP_ONLY)
    assert expert == EXPECTED_EXPERT_AMAX, (expert, EXPECTED_EXPERT_AMAX)
    # the same experts live on exactly these ranks: nobody with another EP rank or stage is in the domain
    assert all(_coords(r, EXPERT)["ep"] == _coords(RANK, EXPERT)["ep"] for r in expert)
    assert all(_coords(r, EXPERT)["pp"] == _coords(RANK, EXPERT)["pp"] for r in expert)


def _value(rank: int) -> torch.Tensor:
    return torch.rand(3, generator=torch.Generator().manual_seed(test_seed() + 7919 * rank)) * 100


def check_max_all_reduce():
    domains = {
        "dense": (ps.dense_amax_group(), EXPECTED_DENSE_AMAX),
        "dense_tp_only": (ps.dense_amax_group(tp_only=True), EXPECTED_DENSE_AMAX_TP_ONLY),
        "expert": (ps.expert_amax_group(), EXPECTED_EXPERT_AMAX),
    }
    for name, (group, members) in domains.items():
        t = _value(RANK).to(DEVICE)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        t = t.cpu()
        expected = torch.stack([_value(r) for r in members]).amax(0)
        assert torch.equal(t, expected), (name, t, expected)
        others = [r for r in range(WORLD) if r not in members]
        if others:  # the result must differ from the world max where another rank holds the maximum
            world_max = torch.stack([_value(r) for r in range(WORLD)]).amax(0)
            if not torch.equal(expected, world_max):
                assert not torch.equal(t, world_max), name


def check_schedule_matches_single_process():
    from megatron.core.pipeline_parallel import get_forward_backward_func

    seed = test_seed() % 10_000
    config = toy.make_config(PP, VPP, TP)
    n_vchunks = VPP or 1
    n_micro = 4 if VPP is None else 2 * PP
    batches = [(x.to(DEVICE), y.to(DEVICE)) for x, y in toy.make_batches(seed + 1, n_micro)]
    pp_rank = mpu.get_pipeline_model_parallel_rank()
    chunk_ids = [v * PP + pp_rank for v in range(n_vchunks)]  # megatron's interleaved layer assignment
    model = [toy.ToyChunk(config, seed, c).to(DEVICE) for c in chunk_ids]
    with ps.cpu_compat():
        losses = get_forward_backward_func()(
            forward_step_func=toy.forward_step,
            data_iterator=[iter(batches) for _ in model] if VPP else iter(batches),
            model=model if VPP else model[0],
            num_microbatches=n_micro,
            seq_length=toy.SEQ,
            micro_batch_size=toy.MICRO_BATCH,
        )
    ref_grads, ref_losses = toy.reference_grads(config, seed, batches, PP * n_vchunks, DEVICE)
    for local, c in zip(model, chunk_ids):
        for p, g in zip(local.parameters(), ref_grads[c]):
            assert p.grad is not None, f"chunk {c} got no grad"
            torch.testing.assert_close(p.grad, g, rtol=1e-6, atol=1e-7)
    if mpu.is_pipeline_last_stage():
        got = [d["loss"].item() for d in losses]
        assert len(got) == n_micro
        torch.testing.assert_close(torch.tensor(got), torch.tensor(ref_losses), rtol=1e-6, atol=1e-7)


run_checks(
    [
        ("bad_sizes", check_bad_sizes),
        ("sizes", check_sizes),
        ("getters", check_getters),
        ("amax_domains", check_amax_domains),
        ("max_all_reduce", check_max_all_reduce),
        # the toy pipeline model does not shard the sequence, which megatron's p2p shapes assume under CP
        *([("schedule_matches_single_process", check_schedule_matches_single_process)] if CP == 1 else []),
    ]
)
ps.destroy()
exit_now()  # skip finalization: see exit_now
