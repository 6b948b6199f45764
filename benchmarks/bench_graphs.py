"""Graphed vs eager step time of FP8 transformer layers in a launch-bound configuration, and the graphs'
memory pool against the eager step's peak memory.

    python bench_graphs.py results.jsonl          # one GPU: 8 layers, hidden 1024, seq 512, micro batch 1,
                                                  # 8 microbatches; then PP=2 on two GPUs when present
    torchrun --nproc_per_node=2 bench_graphs.py results.jsonl --pp2   # (started by the line above)
"""
from __future__ import annotations

import statistics
import sys
import time

import torch

import fp8_parallel as fp
from common import cli, bench_ms, dump, record, run_on_two_gpus, slowest_rank_ms

HIDDEN, LAYERS, SEQ, MBS, M = 1024, 8, 512, 1, 8
RECIPE = fp.DelayedScaling(amax_history_len=16)


def _config(pp: int = 1):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HIDDEN // 64, params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16, bf16=True, hidden_dropout=0.0, attention_dropout=0.0,
        pipeline_model_parallel_size=pp,
    )


def _footprint(pool) -> tuple:
    """(bytes of the graphs' private pool, bytes allocated outside it) from the allocator's segments."""
    in_pool = outside = 0
    for seg in torch.cuda.memory._snapshot()["segments"]:
        if tuple(seg.get("segment_pool_id", ())) == tuple(pool):
            in_pool += seg["total_size"]
        else:
            outside += seg["allocated_size"]
    return in_pool, outside


def _peak(fn) -> int:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated()


# the safe default (each microbatch's outputs and input grads its own, returned parameter grads cloned)
# against TransformerEngine's memory-saving options, which megatron's schedule makes safe
GRAPH_MODES = {
    "owned buffers": {},
    "shared buffers": {"_reuse_graph_input_output_buffers": True, "clone_param_grads_on_return": False},
}


def _build_layers(cfg) -> list:
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.spec_utils import build_module

    from fp8_parallel.megatron import get_gpt_layer_spec

    torch.manual_seed(1234)  # host-side inits (megatron's learned position embeddings): as Megatron-LM seeds
    model_parallel_cuda_manual_seed(1234, use_cudagraphable_rng=True)
    return [build_module(get_gpt_layer_spec(), config=cfg, layer_number=i + 1).cuda() for i in range(LAYERS)]


def _step_fn(layers: list):
    params = [p for layer in layers for p in layer.parameters()]
    gen = torch.Generator(device="cuda").manual_seed(99)
    xs = [torch.randn(SEQ, MBS, HIDDEN, device="cuda", dtype=torch.bfloat16, requires_grad=True, generator=gen)
          for _ in range(M)]
    gs = [torch.randn(SEQ, MBS, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(M)]

    def step():
        for p in params:
            p.grad = None
        for x, g in zip(xs, gs):
            with fp.autocast(recipe=RECIPE):
                h = x
                for layer in layers:
                    h = layer(hidden_states=h)[0]
            h.backward(g)

    return step


def bench_single_gpu() -> None:
    import parallel_state as ps

    from fp8_parallel.pipeline import capture_order

    ps.initialize()
    cfg = _config()
    case = f"{LAYERS} layers h={HIDDEN} s={SEQ} mb={MBS} x{M}"
    step = _step_fn(_build_layers(cfg))
    t_eager = bench_ms(step, warmup=3, iters=15)
    peak_eager = _peak(step)  # everything allocated at the eager step's peak: weights, grads, activations
    record("graphs", f"{case} eager", "ms", t_eager)
    record("graphs", f"{case} eager", "peak MiB", peak_eager / 2**20)
    del step
    owned = {}
    for mode, options in GRAPH_MODES.items():
        torch.cuda.empty_cache()
        layers = _build_layers(cfg)
        step = _step_fn(layers)
        pool = torch.cuda.graph_pool_handle()
        samples = [{"hidden_states": torch.randn(SEQ, MBS, HIDDEN, device="cuda", dtype=torch.bfloat16,
                                                 requires_grad=True)} for _ in range(LAYERS)]
        fp.make_graphed_callables(layers, [()] * LAYERS, sample_kwargs=samples, fp8_enabled=True,
                                  fp8_recipe=RECIPE, fp8_weight_caching=True, order=capture_order(M, 1, 0),
                                  pool=pool, **options)
        t_graph = bench_ms(step, warmup=3, iters=15)
        step()
        torch.cuda.synchronize()
        pool_bytes, outside = _footprint(pool)  # after a step: grads held, static buffers, weight caches
        record("graphs", f"{case} graphed, {mode}", "ms", t_graph, "eager step time", t_eager / t_graph)
        record("graphs", f"{case} graph pool, {mode}", "MiB", pool_bytes / 2**20, "eager peak",
               pool_bytes / peak_eager)
        record("graphs", f"{case} graphed total, {mode}", "MiB", (pool_bytes + outside) / 2**20, "eager peak",
               (pool_bytes + outside) / peak_eager)
        if not owned:
            owned = {"ms": t_graph, "pool": pool_bytes}
        else:
            record("graphs", f"{case} {mode} vs owned", "ms", t_graph, "owned buffers ms", owned["ms"] / t_graph)
            record("graphs", f"{case} {mode} vs owned", "pool MiB", pool_bytes / 2**20, "owned buffers pool",
                   pool_bytes / owned["pool"])
        del layers, step, samples, pool
    ps.destroy()


def bench_pp2(out: str) -> None:
    """Under torchrun (2 ranks): megatron's 1F1B schedule over a PP=2 GPT, eager vs graphed layers."""
    import parallel_state as ps
    from megatron.core import parallel_state as mpu
    from megatron.core.models.gpt import GPTModel
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from fp8_parallel.megatron import get_gpt_block_spec
    from fp8_parallel.pipeline import graph_megatron_layers

    ps.initialize(pp=2)
    cfg = _config(pp=2)
    torch.manual_seed(1234)  # host-side inits (megatron's learned position embeddings): as Megatron-LM seeds
    model_parallel_cuda_manual_seed(1234, use_cudagraphable_rng=True)
    from megatron.core.transformer.module import Float16Module

    model = Float16Module(cfg, GPTModel(config=cfg, transformer_layer_spec=get_gpt_block_spec(cfg), vocab_size=4096,
                                        max_sequence_length=SEQ, pre_process=mpu.is_pipeline_first_stage(),
                                        post_process=mpu.is_pipeline_last_stage()).cuda())
    tokens = [torch.randint(0, 4096, (MBS, SEQ), device="cuda") for _ in range(M)]
    pos = torch.arange(SEQ, device="cuda").expand(MBS, SEQ)

    def loss_func(out):
        loss = out.float().mean()
        # a copy: megatron's schedule divides the returned loss in place by the number of microbatches
        return loss, {"loss": loss.detach().clone()}

    def forward_step(it, chunk):
        t = next(it)
        with fp.autocast(recipe=RECIPE, group=ps.dense_amax_group()):
            return chunk(t, pos, None, labels=t), loss_func

    def timed_steps(step_func, n=12):
        times = []
        for i in range(n + 3):
            for p in model.parameters():
                p.grad = None
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            get_forward_backward_func()(forward_step_func=step_func, data_iterator=iter(tokens), model=model,
                                        num_microbatches=M, seq_length=SEQ, micro_batch_size=MBS)
            torch.cuda.synchronize()
            if i >= 3:
                times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    t_eager = timed_steps(forward_step)
    graphed = graph_megatron_layers(model, cfg, num_microbatches=M, seq_length=SEQ, micro_batch_size=MBS,
                                    fp8_recipe=RECIPE, fp8_weight_caching=True)
    t_graph = timed_steps(graphed.forward_step(forward_step))
    t_eager, t_graph = slowest_rank_ms(t_eager, t_graph)
    if torch.distributed.get_rank() == 0:
        case = f"PP2 GPT {LAYERS} layers h={HIDDEN} s={SEQ} x{M}"
        record("graphs", f"{case} eager", "ms", t_eager)
        record("graphs", f"{case} graphed", "ms", t_graph, "eager step time", t_eager / t_graph)
        dump(out)
    ps.destroy()


if __name__ == "__main__":
    args = cli(__doc__, "--pp2: run as one rank of the two-GPU pipeline part (started by the script itself)")
    out = args.results
    if args.pp2:
        bench_pp2(out)
        sys.exit(0)
    bench_single_gpu()
    dump(out)
    run_on_two_gpus(__file__, out, "--pp2")
