"""End-to-end training step of megatron-core's GPTModel: megatron's local spec against our spec, FP8 off (eager
and with graphed layers), FP8 eager and FP8 with graphed layers. One process, one GPU, the same weights and data
for every variant. FP8 + graphs is compared with FP8 off + graphs too: the same graphs without FP8.

    python bench_e2e.py results.jsonl                       # 0.94B: 16 layers, hidden 2048, 16 heads,
                                                            # FFN 8192, vocab 32000, seq 2048, 2 x 4 microbatches
    python bench_e2e.py results.jsonl --layers 4 --hidden 1024 --heads 8 --ffn 4096   # a smaller run
    python bench_e2e.py results.jsonl --preset llama-1b      # Llama-style 1B: RMSNorm, SwiGLU, RoPE, GQA 32/8,
                                                            # no biases, vocab 128256
    python bench_e2e.py results.jsonl --preset llama-8b-wide # Llama 3 8B widths, 4 layers
    python bench_e2e.py out.jsonl --device cpu --layers 2 --hidden 64 --heads 4 --ffn 256 --vocab 128 \
        --seq 64 --micro 2 --warmup 1 --steps 1                                       # CPU dry run
    python bench_e2e.py out.jsonl --process-per-variant     # each variant in its own process: its own peak memory
    torchrun --nproc_per_node=2 bench_e2e.py out.jsonl --tp 2 --sp                  # TP2 + sequence parallel
    torchrun --nproc_per_node=2 bench_e2e.py out.jsonl --pp 2 --vpp 2               # PP2, 2 virtual stages
    python bench_e2e.py out.jsonl --experts 8 --moe-ffn 2048                        # MoE: 8 experts, top-2
    python bench_e2e.py out.jsonl --experts 8 --moe-ffn 2048 --capacity-factor 1    # MoE drop-and-pad, graphed too
    torchrun --nproc_per_node=2 bench_e2e.py out.jsonl --experts 8 --moe-ffn 2048 --ep 2   # MoE, EP2

With model parallelism (--tp/--pp/--ep > 1) only our spec runs (FP8 off, eager and graphed; FP8 eager; FP8 +
graphs): every variant builds its weights from the same seed (identical across variants), and the last rank
reports (tokens/s are the model's: one data-parallel replica). MoE (--experts N): megatron's MoELayer with our
grouped FP8 experts (`moe_grouped_gemm=True`), top-k routing, the alltoall dispatcher, no linear biases;
megatron's local spec does not run. Dropless MoE has no graphed variants (the experts' token counts change
every step, which CUDA graphs cannot capture); with `--capacity-factor F` the model uses megatron's drop-and-pad
(`moe_expert_capacity_factor=F`, `moe_pad_expert_input_to_capacity`): every expert takes exactly its capacity of
rows, so the graphed variants run too.

Each variant: bf16 params in megatron's `Float16Module`, fused AdamW, megatron's bias+GELU and
bias+dropout+add fusions (`--no-fusions` turns them off; `--ce-fusion` adds its fused cross entropy),
`get_forward_backward_func` over the microbatches.
Prints and records wall time per step (median), device-busy time (union of GPU kernel intervals in one
profiled step), tokens/s, model TFLOP/s, peak allocated / reserved memory, the first step's loss (same weights
and data: the variants must agree) and a profile table by kernel category.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import dump, record  # noqa: E402
from memory_report import segment_report, start_recording, stop_recording  # noqa: E402

BENCH = "e2e"
VARIANTS = ("local", "bf16", "bf16_graphs", "fp8", "fp8_graphs")
LABELS = {
    "local": "megatron local spec BF16",
    "bf16": "our spec FP8 off",
    "bf16_graphs": "our spec FP8 off + graphs",
    "fp8": "our spec FP8 eager",
    "fp8_graphs": "our spec FP8 + graphs",
}
CATEGORIES = ("GEMM", "quantize", "attention", "norm/elementwise", "communication", "optimizer", "other")


@dataclasses.dataclass(frozen=True)
class Size:
    layers: int
    hidden: int
    heads: int
    ffn: int
    vocab: int
    seq: int
    mbs: int
    micro: int
    experts: int = 0  # MoE: experts per layer (0: dense)
    topk: int = 2
    moe_ffn: int = 0
    llama: bool = False  # Llama-style: RMSNorm, SwiGLU, rotary embeddings, no linear biases
    groups: int = 0  # key/value heads (grouped-query attention; 0: as many as query heads)
    capacity: float = 0.0  # MoE drop-and-pad: megatron's moe_expert_capacity_factor (0: dropless)

    @property
    def kv_heads(self) -> int:
        return self.groups or self.heads

    @property
    def tokens(self) -> int:
        return self.seq * self.mbs * self.micro

    def model_flops(self) -> float:
        """Training FLOPs of one step (forward x3), megatron's convention: dense matmuls plus full
        (non-causal) attention score and context products, and the logits."""
        h, s = self.hidden, self.seq
        ffn = self.topk * self.moe_ffn if self.experts else self.ffn  # MoE: the experts a token is routed to
        kv = h * self.kv_heads // self.heads  # grouped-query attention: smaller key / value projections
        ffn_matrices = 3 if self.llama else 2  # SwiGLU: gate and up projections, then down
        per_token_layer = 2 * (h * h + 2 * h * kv + h * h + ffn_matrices * h * ffn) + 2 * 2 * s * h
        per_token = self.layers * per_token_layer + 2 * h * self.vocab
        return 3.0 * per_token * self.tokens

    def describe(self) -> str:
        moe = f" moe{self.experts} top{self.topk} f{self.moe_ffn}" if self.experts else ""
        moe += f" cap{self.capacity:g}" if self.experts and self.capacity else ""
        llama = f" llama g{self.kv_heads}" if self.llama else ""
        return (f"L{self.layers} h{self.hidden} a{self.heads} f{self.ffn}{moe}{llama} v{self.vocab} s{self.seq} "
                f"mb{self.mbs}x{self.micro}")


# Models by name (`--preset`); the size flags given on the command line override a preset's.
PRESETS: Dict[str, Dict[str, object]] = {
    # the GPT that docs/benchmarks.md reports at 0.94B: LayerNorm, GELU, learned positions, linear biases
    "gpt-0.94b": dict(layers=16, hidden=2048, heads=16, ffn=8192, vocab=32000),
    # Llama 3.2 1B's shape: 16 layers, hidden 2048, 32 heads over 8 key/value heads, SwiGLU FFN 8192, vocab 128256
    "llama-1b": dict(layers=16, hidden=2048, heads=32, groups=8, ffn=8192, vocab=128256, llama=True),
    # Llama 3 8B's widths (hidden 4096, 32 heads over 8, FFN 14336, vocab 128256) with 4 of its 32 layers
    "llama-8b-wide": dict(layers=4, hidden=4096, heads=32, groups=8, ffn=14336, vocab=128256, llama=True),
}


# -- models ---------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    vpp: Optional[int] = None
    sp: bool = False
    ep: int = 1

    @property
    def parallel(self) -> bool:
        return self.tp * self.pp * self.ep > 1

    def describe(self) -> str:
        return (f" tp{self.tp}{'+sp' if self.sp else ''} pp{self.pp}{f' vpp{self.vpp}' if self.vpp else ''}"
                f"{f' ep{self.ep}' if self.ep > 1 else ''}" if self.parallel else "")


@dataclasses.dataclass(frozen=True)
class Knobs:
    """Training options every variant shares."""

    dropout: float = 0.0
    fusions: bool = True  # megatron's bias+GELU and bias+dropout+add fusions (on in Megatron-LM's defaults)
    weight_cache: bool = True  # FP8 weight casts cached per step (False: megatron's disable_parameter_transpose_cache)
    fp8_format: str = "hybrid"  # megatron's `fp8` field: "hybrid" (E5M2 gradients) or "e4m3" (E4M3 throughout)
    ddp: bool = False  # megatron's DDP (fp32 main grads) and optimizer (fp32 master weights), as the training job
    ce_fusion: bool = False  # megatron's cross_entropy_loss_fusion, "native" impl (Megatron-LM: --cross-entropy-loss-fusion)
    fused_adam: bool = False  # with ddp: megatron's torch Adam switched from foreach to fused kernels
    wgrad_fusion: bool = False  # with ddp: our layers add weight gradients into DDP's main_grad in the GEMM
    foreach_ops: bool = False  # with ddp: megatron's multi-tensor fallbacks (grad norm, scale, copy) on foreach kernels


def _llama_fields(size: Size) -> dict:
    """TransformerConfig fields of a Llama-style model: RMSNorm, SwiGLU, grouped-query attention, no biases."""
    import torch.nn.functional as F

    if not size.llama:
        return {}
    return dict(normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
                num_query_groups=size.kv_heads)


def _gpt_kwargs(size: Size) -> dict:
    """GPTModel arguments beyond the config: rotary embeddings (Llama 3's base) for a Llama-style model."""
    return dict(position_embedding_type="rope", rotary_base=500000) if size.llama else {}


def _config(size: Size, device: str, fp8: bool, knobs: Knobs, layout: Layout = Layout()):
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(
        num_layers=size.layers, hidden_size=size.hidden, num_attention_heads=size.heads,
        ffn_hidden_size=size.ffn, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16, bf16=True,
        hidden_dropout=knobs.dropout, attention_dropout=knobs.dropout, use_cpu_initialization=device == "cpu",
        # bias+GELU needs linear biases, which the MoE configuration has not; SwiGLU's fusion needs none
        bias_activation_fusion=knobs.fusions and (size.llama or not size.experts), bias_dropout_fusion=knobs.fusions,
        cross_entropy_loss_fusion=knobs.ce_fusion, cross_entropy_fusion_impl="native",
        tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp, sequence_parallel=layout.sp,
        **(dict(num_moe_experts=size.experts, moe_router_topk=size.topk, moe_ffn_hidden_size=size.moe_ffn,
                moe_token_dispatcher_type="alltoall", expert_model_parallel_size=layout.ep, add_bias_linear=False)
           if size.experts else {}),
        **(dict(moe_expert_capacity_factor=size.capacity, moe_pad_expert_input_to_capacity=True)
           if size.experts and size.capacity else {}),
        **_llama_fields(size),
    )
    if fp8:  # set after construction, as for MoE (megatron's checks look for TransformerEngine)
        cfg.fp8, cfg.fp8_recipe, cfg.fp8_amax_history_len, cfg.fp8_amax_compute_algo = knobs.fp8_format, "delayed", 16, "max"
        cfg.disable_parameter_transpose_cache = not knobs.weight_cache
    return cfg


def _moe_spec(size: Size) -> dict:
    """`get_gpt_block_spec`'s MoE arguments: our grouped FP8 experts."""
    return dict(num_experts=size.experts, moe_grouped_gemm=True) if size.experts else {}


def _local_to_ours(name: str) -> str:
    """A parameter name of megatron's local spec -> the same tensor in our spec (norms fused into the linears)."""
    return (name.replace("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight")
                .replace("input_layernorm.bias", "self_attention.linear_qkv.layer_norm_bias")
                .replace("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight")
                .replace("pre_mlp_layernorm.bias", "mlp.linear_fc1.layer_norm_bias"))


def _knobs(args) -> Knobs:
    return Knobs(args.dropout, args.fusions, args.weight_cache, args.fp8_format, args.ddp, args.ce_fusion,
                 args.fused_adam, args.wgrad_fusion, args.foreach_multi_tensor)


def _build_chunks(variant: str, size: Size, device: str, knobs: Knobs, layout: Layout):
    """This rank's model chunks (one per virtual stage, each a Float16Module-wrapped GPTModel) and the config,
    under model parallelism; weights from the model-parallel seed, the same for every variant."""
    from megatron.core import parallel_state as mpu
    from megatron.core.models.gpt import GPTModel
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.module import Float16Module

    from fp8_parallel.megatron import get_gpt_block_spec

    cfg = _config(size, device, fp8=variant.startswith("fp8"), knobs=knobs, layout=layout)
    torch.manual_seed(1234)  # host-side inits (megatron's learned position embeddings): as Megatron-LM seeds
    model_parallel_cuda_manual_seed(1234, use_cudagraphable_rng=device == "cuda", force_reset_rng=True)
    chunks = []
    for v in range(layout.vpp or 1):
        stage = dict(vp_stage=v) if layout.vpp else {}
        gpt = GPTModel(config=cfg, transformer_layer_spec=get_gpt_block_spec(cfg, vp_stage=v if layout.vpp else None,
                                                                                 **_moe_spec(size)),
                       vocab_size=size.vocab, max_sequence_length=size.seq, **_gpt_kwargs(size),
                       pre_process=mpu.is_pipeline_first_stage(ignore_virtual=False, **stage),
                       post_process=mpu.is_pipeline_last_stage(ignore_virtual=False, **stage), **stage)
        chunks.append(Float16Module(cfg, gpt.to(device)))
    return chunks, cfg


def _build(variant: str, size: Size, device: str, knobs: Knobs, weights: Optional[Dict[str, torch.Tensor]]):
    """(Float16Module-wrapped GPTModel, config) of `variant`, with `weights` (our spec's names) copied in."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.module import Float16Module

    from fp8_parallel.megatron import get_gpt_block_spec

    cfg = _config(size, device, fp8=variant.startswith("fp8"), knobs=knobs)
    torch.manual_seed(1234)  # host-side inits (megatron's learned position embeddings): as Megatron-LM seeds
    model_parallel_cuda_manual_seed(1234, use_cudagraphable_rng=device == "cuda", force_reset_rng=True)
    spec = get_gpt_layer_local_spec() if variant == "local" else get_gpt_block_spec(cfg, **_moe_spec(size))
    gpt = GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=size.vocab, max_sequence_length=size.seq,
                   **_gpt_kwargs(size))
    model = Float16Module(cfg, gpt.to(device))
    if weights is not None:
        params = dict(gpt.named_parameters())
        rename = _local_to_ours if variant == "local" else (lambda n: n)
        missing = [n for n in params if rename(n) not in weights]
        if missing or len(params) != len(weights):
            raise RuntimeError(f"bench_e2e: {variant} parameters do not map onto the reference: {missing[:4]}")
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(weights[rename(n)])
    return model, cfg


def _batches(size: Size, device: str) -> List[dict]:
    gen = torch.Generator(device=device).manual_seed(4321)
    pos = torch.arange(size.seq, device=device).expand(size.mbs, size.seq)
    out = []
    for _ in range(size.micro):
        tokens = torch.randint(0, size.vocab, (size.mbs, size.seq), generator=gen, device=device)
        out.append({"tokens": tokens, "labels": torch.roll(tokens, -1, 1), "position_ids": pos})
    return out


def _loss_func(per_token: torch.Tensor):
    loss = per_token.float().mean()
    # a copy: megatron's schedule divides the returned loss in place by the number of microbatches
    return loss, {"loss": loss.detach().clone()}


# -- timing and profile ---------------------------------------------------------------------------------------

def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def category(kernel: str) -> str:
    """The profile category of a device kernel, by name."""
    k = kernel.lower()
    if "nccl" in k:
        return "communication"
    if any(s in k for s in ("flash", "fmha", "attention", "attn", "sdpa", "cudnn_generated_fort_native_sdpa")):
        return "attention"
    if any(s in k for s in ("gemm", "nvjet", "cutlass")):  # before the FP8 names: FP8 GEMMs name their dtypes
        return "GEMM"
    if any(s in k for s in ("quant", "amax", "cast_transpose", "_cast", "float8", "fp8", "scale_update")):
        return "quantize"
    if any(s in k for s in ("xmma", "cublas", "matmul", "_mm_", "sm90_", "wgmma")):
        return "GEMM"
    if any(s in k for s in ("adam", "multi_tensor", "foreach", "optimizer")):
        return "optimizer"
    if any(s in k for s in ("norm", "elementwise", "vectorized", "reduce", "softmax", "gelu", "copy", "fill",
                            "cat", "index", "embedding", "dropout", "bias", "mul", "add", "unrolled", "triton")):
        return "norm/elementwise"
    return "other"


PHASES = ("forward", "backward", "optimizer")
_PHASE_PREFIX = "e2e_phase:"


def _union(intervals: List[Tuple[float, float]]) -> List[Tuple[float, float]]:
    """Disjoint, sorted union of (start, end) intervals."""
    merged: List[List[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def _covered(union: List[Tuple[float, float]], start: float, end: float) -> float:
    """How much of [start, end] the disjoint sorted `union` covers."""
    return sum(max(0.0, min(b, end) - max(a, start)) for a, b in union if a < end and b > start)


@contextlib.contextmanager
def _phase_markers():
    """Host-side markers for one profiled step: each microbatch's forward and backward (megatron's
    `backward_step`) and the optimizer step, so that the device's idle time can be put on the host phase that
    was running while the device waited."""
    from megatron.core.pipeline_parallel import schedules

    original = schedules.backward_step

    def marked_backward_step(*args, **kwargs):
        with torch.profiler.record_function(_PHASE_PREFIX + "backward"):
            return original(*args, **kwargs)

    schedules.backward_step = marked_backward_step
    try:
        yield
    finally:
        schedules.backward_step = original


def _phase(name: str):
    """A host-phase marker (see `_phase_markers`); free outside a profile."""
    return torch.profiler.record_function(_PHASE_PREFIX + name)


def _idle_by_phase(prof, busy: List[Tuple[float, float]]) -> Dict[str, Tuple[float, float]]:
    """Per host phase: (host ms in it, ms of it the device was idle); "between" is the rest of the step (from
    the first kernel's start to the last kernel's end, outside every phase)."""
    from torch.autograd import DeviceType

    windows: Dict[str, List[Tuple[float, float]]] = {p: [] for p in PHASES}
    for e in prof.events():
        if e.device_type == DeviceType.CPU and e.name.startswith(_PHASE_PREFIX):
            windows.setdefault(e.name[len(_PHASE_PREFIX):], []).append((e.time_range.start, e.time_range.end))
    out: Dict[str, Tuple[float, float]] = {}
    for name, spans in windows.items():
        spans = _union(spans)
        host = sum(b - a for a, b in spans)
        out[name] = (host / 1e3, (host - sum(_covered(busy, a, b) for a, b in spans)) / 1e3)
    if busy:
        marked = _union([w for spans in windows.values() for w in spans])
        step_start, step_end = busy[0][0], busy[-1][1]
        total = step_end - step_start
        host = total - _covered(marked, step_start, step_end)
        idle_total = total - sum(b - a for a, b in busy)
        out["between"] = (host / 1e3, (idle_total - sum(v[1] * 1e3 for v in out.values())) / 1e3)
    return out


def _profile(step: Callable[[], float], device: str, top: int = 12
             ) -> Tuple[float, Dict[str, float], List[Tuple[str, float, int]], Dict[str, Tuple[float, float]]]:
    """One profiled step: (device-busy ms, ms per category, the `top` kernels (name, ms, calls), per host phase
    its host ms and the device's idle ms while it ran)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with _phase_markers(), profile(activities=activities) as prof:
        step()
        _sync(device)
    # GPU-side ranges of host annotations (record_function, "Optimizer.step#...") are not kernels
    kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA and not e.is_user_annotation]
    busy = _union([(e.time_range.start, e.time_range.end) for e in kernels])
    busy_us = sum(b - a for a, b in busy)
    by_cat = {c: 0.0 for c in CATEGORIES}
    by_name: Dict[str, List[float]] = {}
    for e in kernels:
        us = e.time_range.end - e.time_range.start
        by_cat[category(e.name)] += us / 1e3
        entry = by_name.setdefault(e.name, [0.0, 0])
        entry[0] += us / 1e3
        entry[1] += 1
    top = sorted(((n, ms, int(c)) for n, (ms, c) in by_name.items()), key=lambda t: -t[1])[:top]
    return (busy_us / 1e3 if kernels else float("nan")), by_cat, top, _idle_by_phase(prof, busy)


def _print_pools(when: str) -> None:
    """Reserved and allocated memory per allocator pool (the ordinary one and each graph pool), from the
    allocator's snapshot: where a graphed step's reserve sits."""
    pools: Dict[tuple, List[float]] = {}
    for seg in torch.cuda.memory_snapshot():
        pool = tuple(seg.get("segment_pool_id", (0, 0)))
        entry = pools.setdefault(pool, [0.0, 0.0, 0, 0.0])
        entry[0] += seg["total_size"] / 2**30
        entry[1] += seg["allocated_size"] / 2**30
        entry[2] += 1
        entry[3] = max(entry[3], seg["total_size"] / 2**30)
    for pool, (reserved, allocated, count, largest) in sorted(pools.items()):
        kind = "ordinary" if pool == (0, 0) else f"graph pool {pool}"
        print(f"memory {when}: {kind}: reserved {reserved:.2f} GiB, allocated {allocated:.2f} GiB, "
              f"{count} segments (largest {largest:.2f} GiB)", flush=True)


class _GcTimer:
    """Counts Python's garbage collections and their time per generation while active (`gc.callbacks`)."""

    def __init__(self) -> None:
        self.count = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]
        self._start = 0.0

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.count[info["generation"]] += 1
            self.seconds[info["generation"]] += time.perf_counter() - self._start

    def __enter__(self) -> "_GcTimer":
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._callback)

    def describe(self, steps: int) -> str:
        return ", ".join(f"gen{g} {self.count[g] / steps:.1f}x {self.seconds[g] * 1e3 / steps:.1f} ms" for g in range(3)) + " per step"


def _host_profile(step: Callable[[], object], device: str, variant: str, rows: int, dump: str = "") -> None:
    """Where one step's host time goes: cProfile of one step, the top `rows` functions by own time (and the
    raw statistics written to `dump`-<variant>.prof for `pstats`, when given)."""
    import cProfile
    import pstats

    _sync(device)
    prof = cProfile.Profile()
    prof.enable()
    step()
    _sync(device)
    prof.disable()
    print(f"---- host profile of one step: {LABELS[variant]}")
    pstats.Stats(prof).sort_stats("tottime").print_stats(rows)
    if dump:
        prof.dump_stats(f"{dump}-{variant}.prof")


def _peaks(device: str) -> Tuple[float, float]:
    if device != "cuda":
        return float("nan"), float("nan")
    return torch.cuda.max_memory_allocated() / 2**30, torch.cuda.max_memory_reserved() / 2**30


def _with_ddp(model, cfg, device: str):
    """`model` (a chunk or a list of chunks) under megatron's DistributedDataParallel: fp32 main grads, built
    on a side stream (graph capture of the backward needs its gradient hooks off the default stream)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False)
    chunks = model if isinstance(model, list) else [model]
    with torch.cuda.stream(torch.cuda.Stream()) if device == "cuda" else contextlib.nullcontext():
        wrapped = [DistributedDataParallel(config=cfg, ddp_config=ddp_config, module=c, disable_bucketing=i > 0)
                   for i, c in enumerate(chunks)]
    _sync(device)
    cfg.finalize_model_grads_func = finalize_model_grads
    cfg.no_sync_func = [c.no_sync for c in wrapped] if len(wrapped) > 1 else wrapped[0].no_sync
    return wrapped if isinstance(model, list) else wrapped[0]


def _megatron_optimizer(chunks, fused: bool, foreach: bool = False):
    """megatron's Adam on fp32 master weights (bf16 parameters), as the training job builds it."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    config = OptimizerConfig(optimizer="adam", lr=1e-4, bf16=True, params_dtype=torch.bfloat16,
                             use_distributed_optimizer=False, adam_beta1=0.9, adam_beta2=0.95)
    opt = get_megatron_optimizer(config, chunks)
    if fused:
        from launch.train.model import use_fused_torch_adam

        use_fused_torch_adam(opt)
    if foreach:
        from launch.train.multi_tensor import use_foreach_multi_tensor_ops

        use_foreach_multi_tensor_ops()
    return opt


def run_variant(variant: str, size: Size, args, weights, batches) -> dict:  # noqa: C901
    import fp8_parallel.pipeline as pipeline
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from fp8_parallel.megatron import fp8_context, recipe_from_config

    device = args.device
    if args.memory_history and device == "cuda":
        start_recording()
    layout = Layout(args.tp, args.pp, args.vpp, args.sp, args.ep)
    knobs = _knobs(args)
    if layout.parallel:
        model, cfg = _build_chunks(variant, size, device, knobs, layout)
    else:
        model, cfg = _build(variant, size, device, knobs, weights)
    if knobs.ddp:
        model = _with_ddp(model, cfg, device)
    chunks = model if isinstance(model, list) else [model]
    if knobs.ddp and knobs.wgrad_fusion:  # megatron's local spec has none of our layers: unaffected
        from fp8_parallel.megatron import fuse_wgrad_accumulation

        for c in chunks:
            fuse_wgrad_accumulation(c)
    opt = (_megatron_optimizer(chunks, knobs.fused_adam, knobs.foreach_ops) if knobs.ddp
           else torch.optim.AdamW([p for c in chunks for p in c.parameters()], lr=1e-4, fused=device == "cuda"))
    fp8 = variant.startswith("fp8")

    def forward_step(data_iterator, chunk):
        b = next(data_iterator)
        with _phase("forward"), fp8_context(cfg) if fp8 else contextlib.nullcontext():
            out = chunk(b["tokens"], b["position_ids"], None, labels=b["labels"])
        return out, _loss_func

    graphed = None
    if variant.endswith("_graphs"):
        graphed = pipeline.graph_megatron_layers(
            model, cfg, num_microbatches=size.micro, seq_length=size.seq, micro_batch_size=size.mbs,
            fp8_recipe=recipe_from_config(cfg) if fp8 else None, fp8_weight_caching=fp8 and knobs.weight_cache)
        forward_step = graphed.forward_step(forward_step)
        if args.memory_pools:
            _print_pools("after capture")
        if args.memory_history:
            segment_report("after capture", args.memory_history)

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        if knobs.ddp:
            for c in chunks:
                c.zero_grad_buffer()
        data = [iter(batches) for _ in chunks] if len(chunks) > 1 else iter(batches)
        losses = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=data, model=model,
            num_microbatches=size.micro, seq_length=size.seq, micro_batch_size=size.mbs)
        with _phase("optimizer"):
            opt.step()
        return losses

    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    start_alloc = torch.cuda.memory_allocated() / 2**30 if device == "cuda" else float("nan")
    first = step()  # the weights every variant starts from: its loss must agree across variants
    # (under pipeline parallelism only the last stage has losses)
    first_loss = float(torch.stack([d["loss"] for d in first]).mean()) if first else float("nan")
    if first:  # to tell a forward that differs between processes from one that differs between variants
        print(f"{LABELS[variant]}: first step's microbatch losses "
              + " ".join(f"{float(d['loss']):.6f}" for d in first), flush=True)
    for _ in range(args.warmup - 1):
        step()
    times = []
    if args.manual_gc:  # as Megatron-LM's --manual-gc: no threshold collections inside the timed steps
        gc.collect()
        gc.disable()
    with _GcTimer() as gc_time:
        for _ in range(args.steps):
            _sync(device)
            t0 = time.perf_counter()
            step()
            _sync(device)
            times.append((time.perf_counter() - t0) * 1e3)
            if args.manual_gc:
                gc.collect()  # between steps, not timed
    if args.manual_gc:
        gc.enable()
    peak_alloc, peak_reserved = _peaks(device)
    if args.memory_pools and device == "cuda":
        _print_pools("after the timed steps")
    if args.memory_history and device == "cuda":
        segment_report("after the timed steps", args.memory_history)
        stop_recording()
    if args.host_profile:
        _host_profile(step, device, variant, args.host_profile, args.host_profile_dump)
    busy, by_cat, top, idle = _profile(step, device, args.top)
    wall = statistics.median(times)
    print(f"{LABELS[variant]}: python garbage collection during the timed steps: {gc_time.describe(args.steps)}",
          flush=True)
    result = dict(variant=variant, wall_ms=wall, wall_range_ms=(min(times), max(times)), busy_ms=busy, tokens_s=size.tokens / (wall / 1e3),
                  tflops=size.model_flops() / (wall / 1e3) / 1e12, peak_alloc=peak_alloc,
                  peak_reserved=peak_reserved, loss=first_loss, by_cat=by_cat, top=top, idle=idle,
                  start_alloc=start_alloc)
    if graphed is not None:
        graphed.reset()  # release the graphs and their memory pool
    model = opt = graphed = None  # drop them before the next variant (the step closure refers to them)
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return result


def _reference_weights(size: Size, args) -> Dict[str, torch.Tensor]:
    """Initial weights (our spec's parameter names) shared by every variant, on the host."""
    model, _ = _build("bf16", size, args.device, _knobs(args), None)
    weights = {n: p.detach().to("cpu", copy=True) for n, p in model.module.named_parameters()}
    del model
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return weights


def report(results: List[dict], size: Size, layout: Layout = Layout(), knobs: Knobs = Knobs(),  # noqa: C901
           one_process: bool = True) -> None:
    by = {r["variant"]: r for r in results}
    case = (size.describe() + layout.describe() + ("" if knobs.fusions else " unfused")
            + (" fused-CE" if knobs.ce_fusion else "") + (" DDP" if knobs.ddp else "")
            + (" fused-Adam" if knobs.fused_adam else "") + (" wgrad-fusion" if knobs.wgrad_fusion else "")
            + (" foreach-multi-tensor" if knobs.foreach_ops else "")
            + (" expandable-segments" if "expandable_segments:True" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
               else "")
            + ("" if knobs.weight_cache else " no-weight-cache"))
    print(f"\n{'variant':26s} {'wall ms':>9s} {'busy ms':>9s} {'tok/s':>9s} {'TFLOP/s':>8s} {'alloc GiB':>9s} "
          f"{'rsrv GiB':>9s} {'loss':>8s}")
    for r in results:
        print(f"{LABELS[r['variant']]:26s} {r['wall_ms']:9.1f} {r['busy_ms']:9.1f} {r['tokens_s']:9.0f} "
              f"{r['tflops']:8.1f} {r['peak_alloc']:9.2f} {r['peak_reserved']:9.2f} {r['loss']:8.4f}")
    print(f"\nprofile, device ms per step (one profiled step)\n{'category':18s}"
          + "".join(f"{LABELS[r['variant']][:22]:>24s}" for r in results))
    for c in CATEGORIES:
        print(f"{c:18s}" + "".join(f"{r['by_cat'][c]:24.1f}" for r in results))
    print("\nwhere the device waits: per host phase, host ms / device-idle ms while it ran (one profiled step)")
    for r in results:
        cells = ", ".join(f"{name} {host:.1f} / {idle:.1f}" for name, (host, idle) in r["idle"].items())
        print(f"  {LABELS[r['variant']]:26s} {cells}")
    for r in results:
        print(f"\ntop kernels, {LABELS[r['variant']]}:")
        for name, ms, calls in r["top"]:
            print(f"  {ms:9.2f} ms {calls:6d}x  [{category(name)}] {name[:110]}")

    base = by.get("local")
    bf16 = by.get("bf16")
    bf16_graphs = by.get("bf16_graphs")
    for r in results:
        v = r["variant"]
        label = f"{case} {LABELS[v]}"
        vs_local = base["wall_ms"] / r["wall_ms"] if base else float("nan")
        record(BENCH, label, "ms", r["wall_ms"], "megatron local spec", vs_local)
        record(BENCH, label, "busy ms", r["busy_ms"], "wall time", r["busy_ms"] / r["wall_ms"])
        record(BENCH, label, "tokens/s", r["tokens_s"])
        record(BENCH, label, "TFLOP/s", r["tflops"])
        record(BENCH, label, "alloc GiB", r["peak_alloc"], "FP8 off" if bf16 else "",
               r["peak_alloc"] / bf16["peak_alloc"] if bf16 else float("nan"))
        record(BENCH, label, "rsrv GiB", r["peak_reserved"], "FP8 off" if bf16 else "",
               r["peak_reserved"] / bf16["peak_reserved"] if bf16 else float("nan"))
        record(BENCH, label, "loss", r["loss"], "megatron local spec",
               r["loss"] / base["loss"] if base else float("nan"))
        if v.startswith("fp8") and bf16:
            record(BENCH, label, "speedup", bf16["wall_ms"] / r["wall_ms"], "our spec FP8 off")
        if v.startswith("fp8") and bf16_graphs:  # the same graphs without FP8: like for like
            record(BENCH, label, "speedup", bf16_graphs["wall_ms"] / r["wall_ms"], "our spec FP8 off + graphs")
        if r["busy_ms"] == r["busy_ms"]:  # a device profile exists (not a CPU dry run)
            for c in CATEGORIES:
                record(BENCH, f"{label} {c}", "dev ms", r["by_cat"][c])
            for phase, (host, idle) in r["idle"].items():
                record(BENCH, f"{label} idle in {phase}", "dev ms", idle, "host ms in it", idle / host if host else float("nan"))
    first_start = results[0]["start_alloc"] if results else float("nan")
    for r in results[1:] if one_process else []:  # in processes of their own, nothing is left behind
        left = r["start_alloc"] - first_start  # allocated before its first step, beyond what the first variant saw
        if left > 0.5:
            print(f"WARNING: {LABELS[r['variant']]} started with {left:.2f} GiB more allocated than the first variant "
                  f"(memory an earlier variant left behind): its peak memory includes it; run the variants in "
                  f"separate processes (--process-per-variant) for peak-memory figures", flush=True)
    if base:
        for r in results:
            if abs(r["loss"] - base["loss"]) > 0.02 * abs(base["loss"]):
                print(f"WARNING: {LABELS[r['variant']]} first-step loss {r['loss']:.4f} differs from the local "
                      f"spec's {base['loss']:.4f}: the variants may not share weights", flush=True)


def _size(args) -> Size:
    """The preset's model, with the size flags given on the command line in its place."""
    model = dict(PRESETS[args.preset])
    model.update({k: getattr(args, k) for k in ("layers", "hidden", "heads", "groups", "ffn", "vocab")
                  if getattr(args, k) is not None})
    return Size(model["layers"], model["hidden"], model["heads"], model["ffn"], model["vocab"], args.seq, args.mbs,
                args.micro, args.experts, args.topk, args.moe_ffn or model["ffn"], bool(model.get("llama")),
                model.get("groups", 0), args.capacity_factor)


def main(argv: List[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", nargs="?", default="bench_results.jsonl")
    p.add_argument("--preset", choices=sorted(PRESETS), default="gpt-0.94b",
                   help="the model: " + "; ".join(f"{k}: {v}" for k, v in PRESETS.items())
                        + " (the size flags below override it)")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--hidden", type=int, default=None)
    p.add_argument("--heads", type=int, default=None)
    p.add_argument("--groups", type=int, default=None, help="key/value heads (grouped-query attention)")
    p.add_argument("--ffn", type=int, default=None)
    p.add_argument("--vocab", type=int, default=None)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--mbs", type=int, default=2)
    p.add_argument("--micro", type=int, default=4)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--ddp", action="store_true",
                   help="megatron's DistributedDataParallel (fp32 main grads) and its optimizer (fp32 master weights, "
                        "Adam) instead of torch's fused AdamW on the bf16 parameters, as the training job runs")
    p.add_argument("--fused-adam", action="store_true",
                   help="with --ddp: megatron's optimizer (torch's Adam when TE and apex are absent) on fused kernels "
                        "instead of foreach ones")
    p.add_argument("--wgrad-fusion", action="store_true",
                   help="with --ddp: our layers (FP8 and FP8 off) add their weight gradients into DDP's float32 "
                        "main_grad in the GEMM (megatron's gradient_accumulation_fusion, without apex), as the "
                        "training job does")
    p.add_argument("--foreach-multi-tensor", action="store_true",
                   help="with --ddp: megatron's multi-tensor fallbacks (grad norm without a host read per parameter, "
                        "scale, copy) on torch's foreach kernels (launch/train/multi_tensor.py)")
    p.add_argument("--ce-fusion", action="store_true",
                   help="megatron's fused cross entropy (cross_entropy_loss_fusion, native) for every variant")
    p.add_argument("--no-fusions", dest="fusions", action="store_false",
                   help="without megatron's bias+GELU and bias+dropout+add fusions (on by default for every variant, "
                        "as in Megatron-LM's defaults: the strongest BF16 baseline)")
    p.add_argument("--no-weight-cache", dest="weight_cache", action="store_false",
                   help="FP8 variants cast every weight at every microbatch instead of once per step (megatron's "
                        "disable_parameter_transpose_cache): less memory, more casts")
    p.add_argument("--fp8-format", choices=("hybrid", "e4m3"), default="hybrid",
                   help="FP8 formats (megatron's --fp8-format): e4m3 gradients let the experts' backward be grouped")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated subset of {VARIANTS}")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--tp", type=int, default=1, help="tensor parallel size (with torchrun)")
    p.add_argument("--sp", action="store_true", help="sequence parallel (with --tp > 1)")
    p.add_argument("--pp", type=int, default=1, help="pipeline parallel size (with torchrun)")
    p.add_argument("--vpp", type=int, default=None, help="virtual pipeline stages per rank")
    p.add_argument("--experts", type=int, default=0, help="MoE: experts per layer (0: dense)")
    p.add_argument("--topk", type=int, default=2, help="MoE: experts per token")
    p.add_argument("--moe-ffn", type=int, default=0, help="MoE: an expert's FFN hidden size (default --ffn)")
    p.add_argument("--ep", type=int, default=1, help="expert parallel size (with torchrun)")
    p.add_argument("--capacity-factor", type=float, default=0.0,
                   help="MoE: megatron's drop-and-pad with this capacity factor (static shapes: the graphed "
                        "variants run too); 0: dropless")
    p.add_argument("--top", type=int, default=12, help="kernels listed per variant in the device profile")
    p.add_argument("--host-profile", type=int, default=0, metavar="ROWS",
                   help="also print a cProfile table (top ROWS functions by own time) of one step per variant")
    p.add_argument("--memory-pools", action="store_true",
                   help="print reserved / allocated memory per allocator pool after graph capture and the timed steps")
    p.add_argument("--memory-history", type=int, default=0, metavar="ROWS",
                   help="record the allocator's events per variant and print the ROWS call sites whose segments of "
                        "the ordinary pool hold the most unused reserve, after graph capture and the timed steps")
    p.add_argument("--manual-gc", action="store_true",
                   help="as Megatron-LM's --manual-gc: Python's threshold garbage collection off during the timed "
                        "steps, one collection after each (untimed)")
    p.add_argument("--host-profile-dump", default="", metavar="PREFIX",
                   help="with --host-profile: also write each variant's statistics to PREFIX-<variant>.prof")
    p.add_argument("--process-per-variant", action="store_true",
                   help="run each variant in a process of its own (one GPU, no model parallelism), so its peak "
                        "memory holds nothing an earlier variant left behind; one report compares them")
    p.add_argument("--variant-result", default="", help=argparse.SUPPRESS)  # a child's results file
    args = p.parse_args(argv)
    layout = Layout(args.tp, args.pp, args.vpp, args.sp, args.ep)
    skipped = {"local"} if layout.parallel or args.experts else set()
    skipped |= {"fp8_graphs", "bf16_graphs"} if args.experts and not args.capacity_factor else set()
    variants = [v for v in args.variants.split(",") if v and v not in skipped]
    bad = [v for v in variants if v not in VARIANTS]
    if bad or args.warmup < 1 or args.steps < 1:
        p.error(f"variants {bad} (known: {VARIANTS}); warmup={args.warmup} and steps={args.steps} must be >= 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_e2e: no CUDA device (use --device cpu for a dry run)")
        return
    size = _size(args)
    if args.process_per_variant:
        if layout.parallel:
            p.error("--process-per-variant runs one process per variant: without --tp/--pp/--ep > 1")
        _run_variants_in_processes(argv, variants, size, layout, args)
        return

    import parallel_state as ps

    ps.initialize(tp=args.tp, pp=args.pp, vpp=args.vpp, ep=args.ep,
                  backend="nccl" if args.device == "cuda" else "gloo")
    # the last rank reports: it is on the last pipeline stage, which alone has the losses
    rank0 = torch.distributed.get_rank() == torch.distributed.get_world_size() - 1
    if rank0:
        print(f"bench_e2e {size.describe()}{layout.describe()} on "
              f"{torch.cuda.get_device_name(0) if args.device == 'cuda' else 'cpu'}", flush=True)
    with ps.cpu_compat(enabled=args.device == "cpu"):
        weights = None if layout.parallel else _reference_weights(size, args)
        batches = _batches(size, args.device)
        if rank0 and weights is not None:  # to tell inputs that differ between processes from a forward that does
            w_sum = sum(float(w.double().sum()) for w in weights.values())
            w_abs = sum(float(w.double().abs().sum()) for w in weights.values())
            t_sum = sum(int(b["tokens"].sum()) for b in batches)
            print(f"reference weights: sum {w_sum:.10e}, |sum| {w_abs:.10e}; tokens sum {t_sum}", flush=True)
        results = []
        for v in variants:
            results.append(run_variant(v, size, args, weights, batches))
            r = results[-1]
            if rank0:
                print(f"{LABELS[v]:26s} wall {r['wall_ms']:.1f} ms (steps {r['wall_range_ms'][0]:.1f}-"
                      f"{r['wall_range_ms'][1]:.1f}), busy {r['busy_ms']:.1f} ms, "
                      f"{r['tokens_s']:.0f} tokens/s, loss {r['loss']:.4f}", flush=True)
    if rank0 and args.variant_result:  # a child of --process-per-variant: the parent reports
        Path(args.variant_result).write_text(json.dumps(results))
    elif rank0:
        report(results, size, layout, _knobs(args))
        dump(args.out)
    ps.destroy()


def _run_variants_in_processes(argv: List[str], variants: List[str], size: Size, layout: Layout, args) -> None:
    """`--process-per-variant`: this script once per variant (same flags, `--variants V`), then one report of
    their results, as one process would have printed it."""
    import subprocess
    import tempfile

    results = []
    child_argv = [a for a in argv if a != "--process-per-variant"]
    with tempfile.TemporaryDirectory(prefix="bench_e2e-") as tmp:
        for v in variants:
            path = Path(tmp) / f"{v}.json"
            cmd = [sys.executable, str(Path(__file__).resolve()), *child_argv, "--variants", v,
                   "--variant-result", str(path)]
            print(f"== {LABELS[v]}: a process of its own", flush=True)
            proc = subprocess.run(cmd)
            if proc.returncode != 0 or not path.exists():
                raise SystemExit(f"bench_e2e: the {v} variant's process failed (exit {proc.returncode})")
            results.extend(json.loads(path.read_text()))
    report(results, size, layout, _knobs(args), one_process=False)
    dump(args.out)


if __name__ == "__main__":
    main(sys.argv[1:])
