"""Sequence-parallel column linear (TP=2, two GPUs): FP8 all-gather of the input (uint8 bytes) vs megatron's
bf16 all-gather, forward + backward, delayed scaling.

    python bench_sp_gather.py results.jsonl     # starts itself under torchrun with 2 ranks when 2 GPUs exist
"""
from __future__ import annotations


import torch

import fp8_parallel as fp
from common import cli, bench_ms, dump, record, run_on_two_gpus, slowest_rank_ms

SEQ, BATCH, HIDDEN, FFN = 8192, 1, 8192, 28672


def run(out: str) -> None:
    import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    ps.initialize(tp=2)
    model_parallel_cuda_manual_seed(7)
    cfg = TransformerConfig(num_layers=1, hidden_size=HIDDEN, ffn_hidden_size=FFN, num_attention_heads=64,
                            tensor_model_parallel_size=2, sequence_parallel=True, params_dtype=torch.bfloat16,
                            bf16=True)
    fc1 = fp.ColumnParallelLinear(HIDDEN, FFN, config=cfg, init_method=torch.nn.init.normal_, bias=False,
                                  gather_output=False)
    recipe = fp.DelayedScaling(amax_history_len=16)
    x = torch.randn(SEQ // 2, BATCH, HIDDEN, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(SEQ, BATCH, FFN // 2, device="cuda", dtype=torch.bfloat16)

    def step():
        fc1.weight.grad = None
        with fp.autocast(recipe=recipe, group=ps.dense_amax_group()):
            y, _ = fc1(x)
        y.backward(grad)

    times = {}
    for fp8_gather in (False, True):
        fc1.fp8_input_gather = fp8_gather
        times[fp8_gather] = bench_ms(step, warmup=5, iters=30)
    t_bf16, t_fp8 = slowest_rank_ms(times[False], times[True])
    if torch.distributed.get_rank() == 0:
        case = f"TP2 SP column {HIDDEN}->{FFN} s={SEQ}"
        record("sp_gather", f"{case} bf16 gather", "ms", t_bf16)
        record("sp_gather", f"{case} fp8 gather", "ms", t_fp8, "bf16 gather time", t_bf16 / t_fp8)
        dump(out)
    ps.destroy()


if __name__ == "__main__":
    args = cli(__doc__, "--worker: run as one rank of the two-GPU part (started by the script itself)")
    out = args.results
    if args.worker:
        run(out)
    elif not run_on_two_gpus(__file__, out, "--worker", timeout=300):
        print("bench_sp_gather: needs 2 GPUs; skipped")
