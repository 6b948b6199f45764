"""Megatron-LM's `--spec fp8_parallel.megatron_lm NAME` path, on megatron's real GPTModel and schedule.

Usage (under torchrun, 4 ranks): megatron_lm_checks.py [CHECK ...]  -> TP2 x PP2 x VPP2, sequence parallel,
FP8 hybrid; all checks, or the named ones

The spec is resolved the way Megatron-LM resolves `--spec` (megatron's `import_module` on the two argparse
words, the attribute used as it is, never called) and each model chunk is built the way Megatron-LM's
`get_model` builds it (one GPTModel per virtual stage, `config.fp8` set, no scope opened by the caller).
"""
from __future__ import annotations

import copy
import sys

import torch
import torch.distributed as dist

import parallel_state as ps
from rank_checks import run_checks, test_seed, exit_now

ps.initialize(tp=2, pp=2, vpp=2)

from megatron.core import parallel_state as mpu  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: E402
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed  # noqa: E402
from megatron.core.transformer.spec_utils import import_module  # noqa: E402
from megatron.core.transformer.transformer_block import (  # noqa: E402
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

from fp8_parallel.megatron import FP8TransformerLayer, fp8_context, get_gpt_block_spec  # noqa: E402
from fp8_parallel.megatron_lm import FP8TransformerBlock  # noqa: E402
from fp8_parallel.modules.norm import Norm  # noqa: E402

VOCAB, SEQ, MBS, M = 64, 16, 2, 2
VPP, LAYERS_PER_CHUNK = 2, 2


def _spec(name: str):
    """What Megatron-LM does with `--spec fp8_parallel.megatron_lm NAME` (argparse nargs='*' gives a list)."""
    return import_module(["fp8_parallel.megatron_lm", name])


def _config(**extra) -> TransformerConfig:
    return TransformerConfig(
        num_layers=2 * VPP * LAYERS_PER_CHUNK, hidden_size=64, num_attention_heads=4, use_cpu_initialization=True,
        tensor_model_parallel_size=2, sequence_parallel=True, pipeline_model_parallel_size=2,
        virtual_pipeline_model_parallel_size=VPP, pipeline_dtype=torch.float32, hidden_dropout=0.0,
        attention_dropout=0.0, overlap_p2p_comm=True, batch_p2p_comm=False,
        fp8="hybrid", fp8_amax_history_len=4, fp8_amax_compute_algo="max", **extra,
    )


def _build(cfg, spec_for_stage):
    model_parallel_cuda_manual_seed(test_seed() % 1000)
    torch.manual_seed(test_seed() % 1000)
    return [
        GPTModel(
            config=cfg, transformer_layer_spec=spec_for_stage(v), vocab_size=VOCAB, max_sequence_length=SEQ,
            pre_process=mpu.is_pipeline_first_stage(ignore_virtual=False, vp_stage=v),
            post_process=mpu.is_pipeline_last_stage(ignore_virtual=False, vp_stage=v), vp_stage=v,
        )
        for v in range(VPP)
    ]


class _CountAmaxReductions:
    """Counts all-reduce(MAX) calls over the dense amax group while active (the FP8 amax collectives)."""

    def __init__(self):
        self.count = 0
        self._group = ps.dense_amax_group()

    def __enter__(self):
        self._original = dist.all_reduce

        def counting(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
            if op == dist.ReduceOp.MAX and group is self._group:
                self.count += 1
            return self._original(tensor, op=op, group=group, async_op=async_op)

        dist.all_reduce = counting
        return self

    def __exit__(self, *exc):
        dist.all_reduce = self._original
        return False


def _step(chunks, cfg, user_scope: bool, counter=None):
    """One iteration of megatron's interleaved schedule; returns (losses, grads) and steps with SGD."""
    gen = torch.Generator().manual_seed(test_seed())
    batches = [torch.randint(0, VOCAB, (MBS, SEQ), generator=gen) for _ in range(M)]

    def loss_func(out):
        loss = out.float().mean()
        return loss, {"loss": loss.detach().clone()}

    def forward_step(it, chunk):
        t = next(it)
        args = (t, torch.arange(SEQ).expand(MBS, SEQ), None)
        if user_scope:  # the documented way for our own training loops: one scope around the model pass
            with fp8_context(cfg):
                return chunk(*args, labels=torch.roll(t, -1, 1)), loss_func
        return chunk(*args, labels=torch.roll(t, -1, 1)), loss_func

    params = [p for c in chunks for p in c.parameters()]
    for p in params:
        p.grad = None
    with counter if counter is not None else _Null():
        out = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=[iter(batches) for _ in chunks], model=chunks,
            num_microbatches=M, seq_length=SEQ, micro_batch_size=MBS,
        )
    for p in params:  # sequence-parallel norms: their grads sum over TP
        if getattr(p, "sequence_parallel", False) and p.grad is not None:
            dist.all_reduce(p.grad, group=mpu.get_tensor_model_parallel_group())
    losses = [d["loss"] for d in out] if out else []
    grads = [p.grad.clone() for p in params if p.grad is not None]
    with torch.no_grad():
        for p in params:
            if p.grad is not None:
                p.add_(p.grad, alpha=-0.1)
    return losses, grads


class _Null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _assert_equal(what, xs, ys, rtol=0.0, atol=0.0):
    """Equal lists of tensors (losses exist on the last pipeline stage only, gradients everywhere)."""
    assert len(xs) == len(ys) and (xs or what.endswith("loss")), (what, len(xs), len(ys))
    for i, (x, y) in enumerate(zip(xs, ys)):
        if rtol == 0.0 and atol == 0.0:
            assert torch.equal(x, y), f"{what} {i}: max abs diff {(x - y).abs().max()}"
        else:
            torch.testing.assert_close(x, y, rtol=rtol, atol=atol, msg=lambda m: f"{what} {i}: {m}")


def check_spec_by_name_builds_every_stage():
    """Each virtual stage of each pipeline rank gets its own layers, FP8 layers in an FP8TransformerBlock,
    and the sequence-parallel final norm on the last stage only; together the ranks hold every layer once."""
    spec = _spec("block_spec")
    assert isinstance(spec, TransformerBlockSubmodules), type(spec)
    assert _spec("block_spec") is spec  # one object, used as it is
    cfg = _config()
    with ps.cpu_compat():
        chunks = _build(cfg, lambda v: spec)
    pp_rank = mpu.get_pipeline_model_parallel_rank()
    numbers = []
    for v, chunk in enumerate(chunks):
        block = chunk.decoder
        assert type(block) is FP8TransformerBlock, type(block)
        assert len(block.layers) == get_num_layers_to_build(cfg, vp_stage=v, pp_rank=pp_rank) == LAYERS_PER_CHUNK
        assert all(type(layer) is FP8TransformerLayer for layer in block.layers)
        last = mpu.is_pipeline_last_stage(ignore_virtual=False, vp_stage=v)
        assert isinstance(block.final_layernorm, Norm) if last else block.final_layernorm is None, (v, last)
        numbers += [layer.layer_number for layer in block.layers]
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, (mpu.get_tensor_model_parallel_rank(), numbers))
    held = sorted(n for tp_rank, ns in every if tp_rank == 0 for n in ns)
    assert held == list(range(1, cfg.num_layers + 1)), held
    print(f"seed {test_seed()}: rank {dist.get_rank()} layers {numbers}", flush=True)


def check_one_amax_reduction_per_block_pass():
    """With `block_spec` and no scope of the caller's, a microbatch pass of a chunk costs one amax
    all-reduce per direction (not one per layer), and the run equals the run of `get_gpt_block_spec` (whose
    block is an FP8TransformerBlock too) under a caller's `fp8_context` exactly: losses, gradients, and again
    after a step."""
    cfg = _config()
    with ps.cpu_compat():
        by_name = _build(cfg, lambda v: _spec("block_spec"))
        reference = _build(cfg, lambda v: get_gpt_block_spec(cfg, vp_stage=v))
        assert all(type(c.decoder) is FP8TransformerBlock for c in reference)
        for a, b in zip(by_name, reference):
            b.load_state_dict(a.state_dict())
        counts = []
        for _ in range(2):  # the second step also checks the scales the first step's reductions produced
            counter, ref_counter = _CountAmaxReductions(), _CountAmaxReductions()
            got = _step(by_name, cfg, user_scope=False, counter=counter)
            expected = _step(reference, cfg, user_scope=True, counter=ref_counter)
            _assert_equal("loss", got[0], expected[0])
            _assert_equal("grad", got[1], expected[1])
            counts.append((counter.count, ref_counter.count))
    assert counts[1][0] > 0 or not torch.distributed.get_world_size(ps.dense_amax_group()) > 1
    passes = VPP * M  # microbatch passes of this rank's chunks, forward and backward each
    # the first step adds one layout check per direction and key; from then on only the reductions
    assert counts[1] == (2 * passes, 2 * passes), (counts, passes)
    print(f"seed {test_seed()}: amax all-reduces per step {counts} for {passes} chunk passes", flush=True)


def check_full_recompute_matches_no_recompute():
    """`recompute_granularity="full"` with `config.fp8` set (megatron alone would call TransformerEngine's
    checkpoint) trains with megatron's own checkpoint: losses and gradients equal the run without recompute,
    for both recompute methods."""
    plain_cfg = _config()
    with ps.cpu_compat():
        plain = _build(plain_cfg, lambda v: _spec("block_spec"))
        state = [copy.deepcopy(c.state_dict()) for c in plain]  # before training moves the parameters
        expected = [_step(plain, plain_cfg, user_scope=False) for _ in range(2)]
        for method in ("uniform", "block"):
            cfg = _config(recompute_granularity="full", recompute_method=method, recompute_num_layers=1)
            chunks = _build(cfg, lambda v: _spec("block_spec"))
            for c, s in zip(chunks, state):
                c.load_state_dict(s)
            for step, (losses, grads) in enumerate(expected):
                got_losses, got_grads = _step(chunks, cfg, user_scope=False)
                _assert_equal(f"{method} step {step} loss", got_losses, losses, rtol=1e-6, atol=1e-6)
                _assert_equal(f"{method} step {step} grad", got_grads, grads, rtol=1e-5, atol=1e-6)


if __name__ == "__main__":
    print(f"seed {test_seed()}", flush=True)
    checks = [
        ("spec_by_name_builds_every_stage", check_spec_by_name_builds_every_stage),
        ("one_amax_reduction_per_block_pass", check_one_amax_reduction_per_block_pass),
        ("full_recompute_matches_no_recompute", check_full_recompute_matches_no_recompute),
    ]
    run_checks([c for c in checks if len(sys.argv) < 2 or c[0] in sys.argv[1:]])
    ps.destroy()
    exit_now()  # skip finalization: see exit_now
