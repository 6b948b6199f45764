"""Cost model of the FP8 amax reductions from 8 to 16k GPUs (docs/scale.md prints its table).

    python3 benchmarks/amax_cost_model.py            # the table of docs/scale.md

What is counted (the design in docs/design.md): every enabled autocast scope key costs one all-reduce(MAX)
per direction and activation, of `HEADER + slots` float32 values. With one scope per model-chunk pass
(megatron's schedule calls the chunk once per microbatch) a pipeline rank issues, per optimizer step,

    microbatches x virtual stages x 2 directions x domains

collectives, where `domains` is 1 for a dense model and 2 for MoE (the dense domain, TP x CP x DP of the
stage, and the expert domain, expert-TP x expert-DP of the stage). Slots per layer: each FP8 linear has two
forward tensors (input, weight) and one backward tensor (grad_output).

Latency is a model, not a measurement: small all-reduces are latency-bound, so the time is taken as a fixed
cost inside one node plus a per-hop cost for a tree over nodes (NCCL picks tree/LL protocols for messages of a
few KB). The intra-node figure is our 2-GPU measurement (docs/benchmarks.md); the inter-node per-hop figure is
an assumption stated in `LatencyModel` and in docs/scale.md.
"""
from __future__ import annotations

import dataclasses
import math
from typing import List, Optional

HEADER = 4  # the reduction header (layout fingerprint and slot count), see fp8_parallel/amax_table.py
BYTES_PER_SLOT = 4  # float32
FWD_SLOTS_PER_LINEAR, BWD_SLOTS_PER_LINEAR = 2, 1
DENSE_LINEARS_PER_LAYER = 4  # qkv, proj, fc1, fc2
ATTENTION_LINEARS_PER_LAYER = 2  # qkv, proj (an MoE layer's dense part)
EXPERT_LINEARS = 2  # fc1, fc2 of each local expert


@dataclasses.dataclass(frozen=True)
class Layout:
    """A model and its parallel layout."""

    name: str
    gpus: int
    layers: int
    tp: int = 1
    pp: int = 1
    vpp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int = 1
    experts: int = 0  # 0: dense
    global_batch: int = 1024  # sequences
    micro_batch: int = 1
    seq: int = 4096
    params_b: float = 8.0  # parameters per token actually used (active parameters), billions
    moe_layer_every: int = 1

    def __post_init__(self) -> None:
        if self.gpus % (self.tp * self.pp * self.cp):
            raise ValueError(f"{self.name}: {self.gpus} GPUs not divisible by TP*PP*CP={self.tp * self.pp * self.cp}")
        if self.layers % (self.pp * self.vpp):
            raise ValueError(f"{self.name}: {self.layers} layers not divisible by PP*VPP={self.pp * self.vpp}")
        if self.experts and (self.gpus // self.pp) % (self.ep * self.etp):
            raise ValueError(f"{self.name}: GPUs per stage not divisible by EP*ETP={self.ep * self.etp}")
        if self.global_batch % (self.micro_batch * self.dp):
            raise ValueError(f"{self.name}: global batch {self.global_batch} not divisible by micro x DP")

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp * self.cp)

    @property
    def microbatches(self) -> int:
        return self.global_batch // (self.micro_batch * self.dp)

    @property
    def dense_domain(self) -> int:
        """Ranks of one dense amax all-reduce: TP x CP x DP of a pipeline stage."""
        return self.gpus // self.pp

    @property
    def expert_domain(self) -> int:
        """Ranks of one expert amax all-reduce: expert-TP x expert-DP (same stage, same EP rank)."""
        return self.gpus // (self.pp * self.ep)

    @property
    def layers_per_chunk(self) -> int:
        return self.layers // (self.pp * self.vpp)


@dataclasses.dataclass(frozen=True)
class Reduction:
    domain: str
    ranks: int
    fwd_values: int  # float32 values reduced in the forward collective (header included)
    bwd_values: int


def reductions_per_pass(layout: Layout) -> List[Reduction]:
    """The collectives one model-chunk pass (one microbatch) issues, with their sizes."""
    n = layout.layers_per_chunk
    if not layout.experts:
        linears = DENSE_LINEARS_PER_LAYER * n
        return [Reduction("dense", layout.dense_domain, HEADER + FWD_SLOTS_PER_LINEAR * linears,
                          HEADER + BWD_SLOTS_PER_LINEAR * linears)]
    moe_layers = math.ceil(n / layout.moe_layer_every)
    dense_linears = ATTENTION_LINEARS_PER_LAYER * n + DENSE_LINEARS_PER_LAYER // 2 * (n - moe_layers)
    expert_linears = EXPERT_LINEARS * (layout.experts // layout.ep) * moe_layers
    return [
        Reduction("dense", layout.dense_domain, HEADER + FWD_SLOTS_PER_LINEAR * dense_linears,
                  HEADER + BWD_SLOTS_PER_LINEAR * dense_linears),
        Reduction("expert", layout.expert_domain, HEADER + FWD_SLOTS_PER_LINEAR * expert_linears,
                  HEADER + BWD_SLOTS_PER_LINEAR * expert_linears),
    ]


def collectives_per_step(layout: Layout) -> int:
    """All-reduces one pipeline rank issues for amaxes per optimizer step (groups of one rank issue none)."""
    per_pass = sum(2 for r in reductions_per_pass(layout) if r.ranks > 1)
    return layout.microbatches * layout.vpp * per_pass


@dataclasses.dataclass(frozen=True)
class LatencyModel:
    """Latency of a small all-reduce over `ranks` GPUs, `gpus_per_node` per node.

    intra_us: one all-reduce inside a node. Measured: 10 us per replay inside a CUDA graph, 49 us eager
        (NCCL 2.28, two H200s, 300 floats; docs/benchmarks.md and NOTES). The eager figure includes the host
        launch; the default is the graphed one.
    hop_us: ASSUMED cost of one level of the inter-node tree (up and down the tree each pass a level once, so a
        tree over `n` nodes costs `2 * ceil(log2 n) * hop_us`). Not measured here: we have no multi-node
        machine. 5 us is a typical InfiniBand/RoCE small-message latency; change it to your fabric's.
    """

    intra_us: float = 10.0
    hop_us: float = 5.0
    gpus_per_node: int = 8

    def all_reduce_us(self, ranks: int, values: int) -> float:
        if ranks <= 1:
            return 0.0
        nodes = math.ceil(ranks / self.gpus_per_node)
        inter = 2 * math.ceil(math.log2(nodes)) * self.hop_us if nodes > 1 else 0.0
        bandwidth_us = values * BYTES_PER_SLOT / 25e3  # 25 GB/s effective for a few KB: negligible
        return self.intra_us + inter + bandwidth_us


def step_time_s(layout: Layout, tflops_per_gpu: float) -> float:
    """Model step time from training FLOPs (6 x active params x tokens), at an achieved rate per GPU."""
    tokens = layout.global_batch * layout.seq
    return 6 * layout.params_b * 1e9 * tokens / (layout.gpus * tflops_per_gpu * 1e12)


def amax_time_per_step_us(layout: Layout, latency: LatencyModel) -> float:
    """Serial time of one pipeline rank's amax collectives per step (no overlap assumed: an upper bound)."""
    per_pass = sum(latency.all_reduce_us(r.ranks, r.fwd_values) + latency.all_reduce_us(r.ranks, r.bwd_values)
                   for r in reductions_per_pass(layout))
    return layout.microbatches * layout.vpp * per_pass


def per_module_collectives_per_step(layout: Layout) -> int:
    """What a per-module reduction (one all-reduce per FP8 linear and direction) would issue instead."""
    n = layout.layers_per_chunk
    if not layout.experts:
        linears = DENSE_LINEARS_PER_LAYER * n
    else:
        moe_layers = math.ceil(n / layout.moe_layer_every)
        linears = (ATTENTION_LINEARS_PER_LAYER * n + DENSE_LINEARS_PER_LAYER // 2 * (n - moe_layers)
                   + EXPERT_LINEARS * (layout.experts // layout.ep) * moe_layers)
    return layout.microbatches * layout.vpp * 2 * linears


LAYOUTS = [
    Layout("8B dense, 1 node", gpus=8, layers=32, tp=2, global_batch=128, micro_batch=2, seq=8192, params_b=8),
    Layout("13B dense", gpus=64, layers=40, tp=4, pp=2, global_batch=256, micro_batch=1, seq=4096, params_b=13),
    Layout("70B dense", gpus=512, layers=80, tp=8, pp=4, vpp=5, global_batch=1024, micro_batch=1, seq=8192,
           params_b=70),
    Layout("175B dense", gpus=2048, layers=96, tp=8, pp=8, vpp=3, global_batch=1536, micro_batch=1, seq=4096,
           params_b=175),
    Layout("405B dense", gpus=16384, layers=128, tp=8, pp=16, vpp=2, global_batch=2048, micro_batch=1, seq=8192,
           params_b=405),
    Layout("405B long context", gpus=16384, layers=128, tp=8, pp=16, vpp=2, cp=4, global_batch=512, micro_batch=1,
           seq=32768, params_b=405),
    Layout("8x7B MoE", gpus=64, layers=32, tp=2, pp=2, ep=8, experts=8, global_batch=512, micro_batch=1,
           seq=4096, params_b=13),
    Layout("256-expert MoE", gpus=2048, layers=64, tp=1, pp=16, ep=64, experts=256, global_batch=4096,
           micro_batch=1, seq=4096, params_b=37),
]


def table(latency: Optional[LatencyModel] = None, tflops_per_gpu: float = 400.0) -> str:
    latency = latency or LatencyModel()
    head = ("| layout | GPUs | TP/PP/VPP/CP/EP | DP | microbatches | domains (ranks) | bytes fwd/bwd per collective "
            "| collectives/step | per-module loop | amax time/step | step (model) | share |")
    rows = [head, "|" + "---|" * 12]
    for lay in LAYOUTS:
        reds = reductions_per_pass(lay)
        domains = ", ".join(f"{r.domain} {r.ranks}" for r in reds)
        sizes = ", ".join(f"{r.fwd_values * BYTES_PER_SLOT}/{r.bwd_values * BYTES_PER_SLOT}" for r in reds)
        amax_ms = amax_time_per_step_us(lay, latency) / 1e3
        step_ms = step_time_s(lay, tflops_per_gpu) * 1e3
        rows.append(
            f"| {lay.name} | {lay.gpus} | {lay.tp}/{lay.pp}/{lay.vpp}/{lay.cp}/{lay.ep} | {lay.dp} | "
            f"{lay.microbatches} | {domains} | {sizes} | {collectives_per_step(lay)} | "
            f"{per_module_collectives_per_step(lay)} | {amax_ms:.2f} ms | {step_ms:.0f} ms | "
            f"{100 * amax_ms / step_ms:.2f}% |"
        )
    return "\n".join(rows)


if __name__ == "__main__":
    from common import cli

    cli(__doc__, results=False)
    print(table())
