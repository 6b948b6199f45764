"""What the job reports: FP8 health, per-layer FP8 histories, and the outputs (progress bar, log lines,
TensorBoard, JSON lines) written by one rank of the last pipeline stage."""
from __future__ import annotations

import json
import math
import os
import resource
import sys
import time
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

from megatron.core import parallel_state as mpu

import fp8_parallel as fp
from fp8_parallel.meta import FP8Meta

from .fp8_roles import ROLES, role_of


def _fp8_metas(model: List[torch.nn.Module]) -> List[FP8Meta]:
    return [m for chunk in model for m in chunk.modules() if isinstance(m, FP8Meta)]


def fp8_health(model: List[torch.nn.Module], scopes_opened: int, scopes_reduced: int) -> Dict[str, Any]:
    """FP8 health over all ranks (collective): the largest non-finite amax count of any rank, the smallest and
    largest scale of any FP8 tensor, and the FP8 scopes opened / reduced in the step (summed over ranks).
    A scope that opened but did not reduce means some amax reduction did not run."""
    metas = _fp8_metas(model)
    device = metas[0].scale.device if metas else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    nonfinite = sum(int(fp.nonfinite_amax_count(chunk)) for chunk in model)
    if metas:
        scales = torch.cat([m.scale.float() for m in metas])
        lo, hi = float(scales.min()), float(scales.max())
    else:
        lo, hi = math.inf, -math.inf
    maxes = torch.tensor([float(nonfinite), -lo, hi], dtype=torch.float64, device=device)
    sums = torch.tensor([scopes_opened, scopes_reduced], dtype=torch.float64, device=device)
    dist.all_reduce(maxes, op=dist.ReduceOp.MAX)
    dist.all_reduce(sums)
    lo, hi = -float(maxes[1]), float(maxes[2])
    return {
        "fp8_nonfinite_amax": int(maxes[0]),
        "fp8_scale_min": lo if math.isfinite(lo) else None,
        "fp8_scale_max": hi if math.isfinite(hi) else None,
        "fp8_scopes_opened": int(sums[0]),
        "fp8_scopes_reduced": int(sums[1]),
    }


def fp8_layer_state(model: List[torch.nn.Module]) -> Dict[str, Dict[str, List[float]]]:
    """This rank's FP8 tensors by a rank-independent name: newest amax and scale of each.

    Names carry the global layer number (`layer03/...`) and, for experts, the expert-parallel rank, so the
    same tensor on TP/DP replicas gets the same name."""
    out: Dict[str, Dict[str, List[float]]] = {}
    ep_rank = mpu.get_expert_model_parallel_rank()
    for chunk in model:
        for _name, module in chunk.named_modules():
            number = getattr(module, "layer_number", None)
            if number is None or not hasattr(module, "self_attention"):
                continue
            for sub, meta in module.named_modules():
                if not isinstance(meta, FP8Meta):
                    continue
                key = f"layer{number:02d}/{sub}"
                if ".experts." in f".{sub}":
                    key = f"layer{number:02d}/ep{ep_rank}/{sub}"
                out[key] = {"amax": meta.amax_history[:, 0].float().tolist(), "scale": meta.scale.float().tolist()}
    return out


def _collective_device() -> torch.device:
    """Where this rank's tensors for a collective live: its GPU under NCCL, else the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def fp8_role_summary(model: List[torch.nn.Module]) -> Dict[str, Optional[float]]:
    """Per FP8 role (input, weight, grad) over all ranks (collective): the smallest and largest scale and
    newest amax of its tensors, as `fp8_<role>_scale_min`, `..._scale_max`, `..._amax_min`, `..._amax_max`.

    Amaxes count the tensors that recorded one (amax > 0; a tensor that never ran keeps 0); None where a role
    has no such tensor on any rank."""
    device = _collective_device()
    parts = []
    for role in ROLES:
        scale, amax = _role_tensors(model, role, device)
        unset = amax <= 0
        parts += [_largest(-scale), _largest(scale),
                  _largest((-amax).masked_fill(unset, -math.inf)), _largest(amax.masked_fill(unset, -math.inf))]
    figures = torch.stack(parts).to(torch.float64)
    dist.all_reduce(figures, op=dist.ReduceOp.MAX)
    out: Dict[str, Optional[float]] = {}
    for i, role in enumerate(ROLES):
        lo_s, hi_s, lo_a, hi_a = figures[4 * i: 4 * i + 4].tolist()
        for key, value in (("scale_min", -lo_s), ("scale_max", hi_s), ("amax_min", -lo_a), ("amax_max", hi_a)):
            out[f"fp8_{role}_{key}"] = value if math.isfinite(value) else None
    return out


def _role_tensors(model: List[torch.nn.Module], role: str, device: torch.device):
    """This rank's scales and newest amaxes of the FP8 tensors of `role`, as two 1-D float32 tensors."""
    scales, amaxes = [], []
    for chunk in model:
        for name, meta in chunk.named_modules():
            if not isinstance(meta, FP8Meta):
                continue
            for row in range(meta.num_tensors):
                if role_of(name, row) == role:
                    scales.append(meta.scale[row])
                    amaxes.append(meta.amax_history[row, 0])
    if not scales:
        empty = torch.zeros(0, device=device)
        return empty, empty
    return torch.stack(scales).float().to(device), torch.stack(amaxes).float().to(device)


def _largest(values: torch.Tensor) -> torch.Tensor:
    """The largest of `values` as a 0-d tensor, -inf when there are none (no read-back to the host)."""
    return torch.cat([values, values.new_full((1,), -math.inf)]).max()


def peak_memory_mib() -> float:
    """This process's peak memory so far in MiB: on a GPU the most torch has allocated on it
    (`torch.cuda.max_memory_allocated`), on the CPU the peak resident set size (`getrusage`, KiB on Linux)."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10


def job_peak_memory_mib() -> float:
    """`peak_memory_mib` of the rank that uses most (collective)."""
    peak = torch.tensor([peak_memory_mib()], dtype=torch.float64, device=_collective_device())
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return float(peak.item())


def training_flops_per_iteration(num_layers: int, hidden: int, ffn_hidden: int, seq_length: int, vocab: int,
                                 global_batch: int, experts: Optional[int] = None, topk: int = 1) -> float:
    """Model FLOPs of one training iteration (forward and backward over the global batch), from the GEMMs.

    Per token, the forward of one layer costs 8 h^2 (QKV 6 h^2, output projection 2 h^2) + 4 s h (attention
    scores and weighted values, the whole s x s matrix) + 4 h f k (the MLP's two GEMMs, for each of the k
    experts a token is routed to; k = 1 dense) + 2 h E (the MoE router; 0 dense), and the output layer 2 h V.
    The backward costs twice the forward, so

        FLOPs = 3 B s (L (8 h^2 + 4 s h + 4 h f k + 2 h E) + 2 h V)

    with B the global batch, s the sequence length, L layers, h hidden size, f FFN hidden size, E experts and
    V the padded vocabulary. Recomputed forwards (activation recompute), norms, softmax and the embedding
    lookup are not counted."""
    h, f, s = hidden, ffn_hidden, seq_length
    k = topk if experts else 1
    layer = 8 * h * h + 4 * s * h + 4 * h * f * k + 2 * h * (experts or 0)
    return 3.0 * global_batch * s * (num_layers * layer + 2 * h * vocab)


def tflops_per_s(flops_per_iteration: float, step_ms: float) -> float:
    """The whole job's model TFLOP/s for an iteration of `step_ms` milliseconds."""
    return flops_per_iteration / (step_ms / 1e3) / 1e12


def logging_rank() -> int:
    """The global rank that logs: the last pipeline stage's first tensor-, context- and data-parallel rank
    (collective)."""
    mine = (mpu.is_pipeline_last_stage(ignore_virtual=True) and mpu.get_tensor_model_parallel_rank() == 0
            and mpu.get_data_parallel_rank(with_context_parallel=True) == 0)
    rank = torch.tensor([dist.get_rank() if mine else -1], device=_collective_device())
    dist.all_reduce(rank, op=dist.ReduceOp.MAX)
    return int(rank.item())


def gather_layer_state(model: List[torch.nn.Module], dst: int) -> Optional[Dict[str, Dict[str, List[float]]]]:
    """Every rank's `fp8_layer_state`, merged on `dst` (collective; None elsewhere)."""
    mine = fp8_layer_state(model)
    gathered = [None] * dist.get_world_size() if dist.get_rank() == dst else None
    dist.gather_object(mine, gathered, dst=dst)
    if gathered is None:
        return None
    merged: Dict[str, Dict[str, List[float]]] = {}
    for part in gathered:
        merged.update(part or {})
    return dict(sorted(merged.items()))


class RunLog:
    """Progress bar, interval log lines, TensorBoard scalars (`train/<key>` of every number in a row) and JSON
    lines; active on the logging rank only."""

    def __init__(self, active: bool, train_iters: int, start_iteration: int, log_interval: int,
                 tensorboard_dir: Optional[str], log_json: Optional[str], progress_bar: bool,
                 run_json: Optional[str] = None):
        self.active = active
        self.log_interval = log_interval
        self.bar = None
        self.tb = None
        self.json = None
        self.run_json = None
        if not active:
            return
        if progress_bar:
            from tqdm import tqdm

            self.bar = tqdm(total=train_iters, initial=start_iteration, desc="train", unit="it", dynamic_ncols=True)
        if tensorboard_dir:
            self.tb = self._tensorboard(tensorboard_dir)
        if log_json:
            os.makedirs(os.path.dirname(os.path.abspath(log_json)), exist_ok=True)
            self.json = open(log_json, "a", buffering=1)
        if run_json and (not log_json or os.path.abspath(run_json) != os.path.abspath(log_json)):
            os.makedirs(os.path.dirname(os.path.abspath(run_json)), exist_ok=True)
            self.run_json = open(run_json, "a", buffering=1)  # the save directory's metrics (logs/metrics.jsonl)

    def _tensorboard(self, log_dir: str):
        """A SummaryWriter into `log_dir`, or None (with one note) when tensorboard is not installed."""
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            self.write(f"note: tensorboard is not installed: no TensorBoard events in {log_dir}")
            return None
        return SummaryWriter(log_dir=log_dir)

    def write(self, text: str) -> None:
        if not self.active:
            return
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, flush=True)

    def record(self, row: Dict[str, Any]) -> None:
        """One iteration's figures (and `fp8_layers` on log intervals)."""
        if not self.active:
            return
        it = row["iteration"]
        for out in (self.json, self.run_json):
            if out is not None:
                out.write(json.dumps(row) + "\n")
        if self.tb is not None:
            for key, value in row.items():
                if isinstance(value, (int, float)) and key != "iteration" and value is not None:
                    self.tb.add_scalar(f"train/{key}", value, it)
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{row['loss']:.4f}" if row.get("loss") is not None else "-")
        if it % self.log_interval == 0:
            fp8 = (f"fp8 nonfinite amax {row['fp8_nonfinite_amax']} | scale [{_fmt(row['fp8_scale_min'])}, "
                   f"{_fmt(row['fp8_scale_max'])}] | scopes reduced {row['fp8_scopes_reduced']}/"
                   f"{row['fp8_scopes_opened']}") if row.get("fp8_scopes_opened") else "fp8 off"
            self.write(
                f"iteration {it:6d} | loss {row['loss']:.5f} | lr {row['lr']:.3e} | grad norm "
                f"{row['grad_norm'] if row['grad_norm'] is None else format(row['grad_norm'], '.4f')} | "
                f"tokens/s {row['tokens_per_s']:.0f} | TFLOP/s {row['tflops_per_s']:.3g} | step "
                f"{row['step_ms']:.1f} ms | mem {row['memory_peak_mib']:.0f} MiB | {fp8}"
            )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.tb is not None:
            self.tb.close()
        for out in (self.json, self.run_json):
            if out is not None:
                out.close()


def _fmt(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.3g}"


class TextLog:
    """Copies this process's stdout and stderr lines into `path` (appending; one file may be shared by two
    ranks: lines are appended whole). `close()` puts the streams back."""

    def __init__(self, path: str):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.file = open(path, "a", buffering=1)
        self.streams = (sys.stdout, sys.stderr)
        sys.stdout, sys.stderr = _Tee(sys.stdout, self.file), _Tee(sys.stderr, self.file)

    def close(self) -> None:
        sys.stdout, sys.stderr = self.streams
        self.file.close()


class _Tee:
    def __init__(self, stream, file):
        self.stream, self.file, self.pending = stream, file, ""

    def write(self, text: str) -> int:
        self.stream.write(text)
        self.pending += text
        if "\n" in self.pending:  # whole lines only (a progress bar's carriage returns stay out)
            lines, self.pending = self.pending.rsplit("\n", 1)
            kept = [line.rsplit("\r", 1)[-1] for line in lines.split("\n")]
            self.file.write("".join(line + "\n" for line in kept if line.strip()))
        return len(text)

    def flush(self) -> None:
        self.stream.flush()
        self.file.flush()

    def __getattr__(self, name):
        return getattr(self.stream, name)


class StepTimer:
    def __init__(self) -> None:
        self.t0 = time.perf_counter()

    def elapsed_ms(self) -> float:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return (time.perf_counter() - self.t0) * 1e3
