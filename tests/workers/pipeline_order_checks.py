"""capture_order equals the forward/backward sequence megatron's real schedules execute (CPU, gloo, 4 ranks)."""
from __future__ import annotations

import torch
import torch.distributed as dist

import parallel_state as ps
from fp8_parallel.pipeline import capture_order
from rank_checks import run_checks, exit_now
import toy_pipeline as toy


class _RecordBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, log, chunk):
        ctx.log, ctx.chunk = log, chunk
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.log.append(-ctx.chunk)
        return grad, None, None


def _recorded_order(pp: int, vpp, m: int, group) -> list:
    from megatron.core.pipeline_parallel import get_forward_backward_func

    config = toy.make_config(pp, vpp)
    if group is not None:
        config.microbatch_group_size_per_vp_stage = group
    from megatron.core import parallel_state as mpu

    rank = mpu.get_pipeline_model_parallel_rank()
    n = vpp or 1
    model = [toy.ToyChunk(config, 0, v * pp + rank) for v in range(n)]
    log: list = []

    def forward_step(data_iterator, chunk_model):
        c = model.index(chunk_model) + 1
        log.append(c)
        out, loss_fn = toy.forward_step(data_iterator, chunk_model)
        return _RecordBackward.apply(out, log, c), loss_fn

    batches = toy.make_batches(1, m)
    with ps.cpu_compat():
        get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=[iter(batches) for _ in model] if vpp else iter(batches),
            model=model if vpp else model[0], num_microbatches=m,
            seq_length=toy.SEQ, micro_batch_size=toy.MICRO_BATCH,
        )
    return log


CASES = [  # (pp, vpp, microbatches, group size)
    (2, None, 1), (2, None, 5), (4, None, 3), (4, None, 8),
    (2, 2, 4), (2, 2, 6), (2, 3, 4), (4, 2, 4), (4, 2, 8), (4, 3, 8),
]
GROUPED = [(2, 2, 5, 3), (4, 2, 9, 5), (2, 3, 6, 3)]


def check_orders_match_megatron_schedule():
    """Every case on every rank; the mismatches are raised after the last one, so a rank whose order is wrong
    still runs the schedules (and their point-to-point exchanges) its peers run, and none waits for it."""
    mismatches = []
    for pp in (2, 4):
        ps.initialize(pp=pp, vpp=None)
        for case in [c for c in CASES if c[0] == pp and c[1] is None]:
            mismatches += _compare(*case, None)
        ps.destroy(destroy_process_group=False)
        for vpp in (2, 3):
            ps.initialize(pp=pp, vpp=vpp)
            for case in [c for c in CASES if c[0] == pp and c[1] == vpp]:
                mismatches += _compare(*case, None)
            for g in [c for c in GROUPED if c[0] == pp and c[1] == vpp]:
                mismatches += _compare(*g)
            ps.destroy(destroy_process_group=False)
    assert not mismatches, f"rank {dist.get_rank()}: (pp, vpp, microbatches, group, megatron's, ours): {mismatches}"


def _compare(pp, vpp, m, group) -> list:
    from megatron.core import parallel_state as mpu

    got = _recorded_order(pp, vpp, m, group)
    expected = capture_order(m, pp, mpu.get_pipeline_model_parallel_rank(), vpp, group)
    return [] if got == expected else [(pp, vpp, m, group, got, expected)]


if __name__ == "__main__":
    dist.init_process_group("gloo")
    run_checks([("capture_order_matches_megatron_schedule", check_orders_match_megatron_schedule)])
    dist.destroy_process_group()
    exit_now()  # skip finalization: see exit_now
