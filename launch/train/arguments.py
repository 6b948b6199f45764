"""Command-line flags of the GPT job, under megatron's names, and their validation.

A run starts from a preset (`--preset`, `PRESETS`) and each flag given changes only its own setting. The
`default` preset is the README's run (`embedded_default_argv`): on 4 ranks a small MoE GPT on TP2 x PP2 x EP2
(expert TP 1), FP8 on, a few dozen iterations on the generated corpus that ships with the job
(`launch/train/corpus.py`), a checkpoint at the end; on GPUs the dense GPT with bf16 and CUDA graphs.
`--preset none` starts from megatron's defaults (no parallelism, no experts, no FP8 unless `--fp8-format`).
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
import sys
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple


class ArgumentError(ValueError):
    """Flags that describe no runnable job; the message names the flag and its value."""


class _Parser(argparse.ArgumentParser):
    """argparse that raises ArgumentError (the caller prints it once, from rank 0) instead of exiting on every
    rank, suggests the closest flag for a mistyped one, and prints `--help` on rank 0 only."""

    def error(self, message: str):
        raise ArgumentError(message + _did_you_mean(message, self))

    def print_help(self, file=None) -> None:
        if int(os.environ.get("RANK", "0")) == 0:
            super().print_help(file)

    def exit(self, status: int = 0, message: Optional[str] = None):
        if message and int(os.environ.get("RANK", "0")) == 0:
            self._print_message(message, sys.stderr)
        sys.exit(status)


def _did_you_mean(message: str, parser: argparse.ArgumentParser) -> str:
    """'; did you mean --num-layers?' for each unknown `--flag` in argparse's message (Python 3.11's argparse
    has no suggest_on_error)."""
    if "unrecognized arguments:" not in message:
        return ""
    options = [o for a in parser._actions for o in a.option_strings if o.startswith("--")]
    hints = []
    for token in message.split("unrecognized arguments:", 1)[1].split():
        if token.startswith("--"):
            close = difflib.get_close_matches(token.split("=", 1)[0], options, n=1, cutoff=0.6)
            if close:
                hints.append(f"{token}: did you mean {close[0]}?")
    return ("; " + "; ".join(hints)) if hints else ""


def _parser(defaults: Optional[Dict[str, Any]] = None, preset_help: str = "") -> argparse.ArgumentParser:
    """The flags; `defaults` (a preset's values) replace argparse's defaults, so `--help` shows what a run uses."""
    p = _Parser(
        prog="pretrain_gpt.py", allow_abbrev=False,
        description="GPT pretraining with FP8 on megatron-core (torchrun entry point). A run starts from a preset "
        "(--preset; without it: 'default', the README's run) and each flag given changes only that setting; the "
        "defaults shown are the values this run uses on this many ranks.",
    )
    p.add_argument("--preset", choices=tuple(PRESETS), default="default",
                   help="the values flags start from: " + preset_help)
    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--virtual-pipeline-model-parallel-size", type=int, default=None)
    g.add_argument("--context-parallel-size", type=int, default=1)
    g.add_argument("--expert-model-parallel-size", type=int, default=1)
    g.add_argument("--expert-tensor-parallel-size", type=int, default=1)
    g.add_argument("--sequence-parallel", action=argparse.BooleanOptionalAction, default=False,
                   help="megatron's sequence parallelism (needs TP > 1; a preset's is dropped at TP 1)")

    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=int, default=4)
    g.add_argument("--hidden-size", type=int, default=64)
    g.add_argument("--ffn-hidden-size", type=int, default=None, help="absent: 4 x hidden size")
    g.add_argument("--num-attention-heads", type=int, default=4)
    g.add_argument("--seq-length", type=int, default=64)
    g.add_argument("--max-position-embeddings", type=int, default=None, help="absent: --seq-length")
    g.add_argument("--num-experts", type=int, default=None, help="MoE experts (absent or 0: dense)")
    g.add_argument("--moe-router-topk", type=int, default=2)
    g.add_argument("--moe-aux-loss-coeff", type=float, default=0.0)
    g.add_argument("--moe-expert-capacity-factor", type=float, default=None,
                   help="as megatron's: each expert takes at most this factor x its even share of the routed "
                        "tokens, the rest are dropped (absent: dropless)")
    g.add_argument("--moe-pad-expert-input-to-capacity", action="store_true",
                   help="as megatron's: pad every expert's input to its capacity (drop-and-pad), so every step "
                        "has the same shapes; needs --moe-expert-capacity-factor, allows --cuda-graph with MoE")
    g.add_argument("--moe-token-drop-policy", choices=("probs", "position"), default="probs",
                   help="as megatron's: which tokens an expert over capacity drops (the lowest routing "
                        "probabilities, or the last in the sequence)")
    g.add_argument("--recompute-granularity", choices=("full", "selective"), default=None)

    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=4)
    g.add_argument("--global-batch-size", type=int, default=16)
    g.add_argument("--train-iters", type=int, default=40)
    g.add_argument("--lr", type=float, default=3e-3)
    g.add_argument("--min-lr", type=float, default=3e-4)
    g.add_argument("--lr-warmup-iters", type=int, default=0, help="as megatron's")
    g.add_argument("--lr-decay-style", choices=("constant", "linear", "cosine", "inverse-square-root"),
                   default="cosine")
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=False,
                   help="bf16 parameters with fp32 master weights")
    g.add_argument("--no-gradient-accumulation-fusion", action="store_true",
                   help="as megatron's: weight gradients go through autograd and DDP's hooks instead of being "
                        "added into DDP's float32 buffers by the layers' GEMMs (the default here needs no apex)")
    g.add_argument("--no-foreach-multi-tensor", action="store_true",
                   help="keep megatron's own multi-tensor fallbacks (without TE or apex: a host read-back per "
                        "parameter for the gradient norm) instead of torch's foreach versions "
                        "(launch/train/multi_tensor.py, the default here)")
    g.add_argument("--seed", type=int, default=1234)

    g = p.add_argument_group("fp8")
    g.add_argument("--fp8-format", choices=("e4m3", "hybrid", "none"), default=None,
                   help="FP8 format ('none' or absent: no FP8)")
    g.add_argument("--fp8-recipe", choices=("delayed", "tensorwise"), default="delayed")
    g.add_argument("--fp8-amax-history-len", type=int, default=16)
    g.add_argument("--fp8-amax-compute-algo", choices=("max", "most_recent"), default="max")
    g.add_argument("--fp8-margin", type=int, default=0)
    g.add_argument("--cuda-graph", action=argparse.BooleanOptionalAction, default=False,
                   help="CUDA graphs of the transformer layers (GPUs; eager with one warning on CPU)")

    g = p.add_argument_group("data")
    g.add_argument("--data-path", nargs="+", default=None,
                   help="megatron indexed dataset prefix(es), optionally weighted: [W1] PREFIX1 [W2] PREFIX2 ...; "
                   "absent: the generated corpus")
    g.add_argument("--split", default="98,2,0")
    g.add_argument("--data-cache-path", default=None, help="where the dataset index caches go")
    g.add_argument("--vocab-size", type=int, default=None, help="tokenizer vocab size (absent: byte-level, 257)")
    g.add_argument("--tokenizer-file", default=None, help="a `tokenizers` JSON file used to preprocess the data")

    g = p.add_argument_group("checkpoints and output")
    g.add_argument("--save", default=None)
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--load", default=None,
                   help="a checkpoint directory (the --save directory of an earlier run); anything else is an "
                   "error unless --load-optional. Without --load, a --save directory that holds checkpoints is "
                   "resumed from")
    g.add_argument("--load-optional", action="store_true",
                   help="start from iteration 0 when --load is missing or holds no complete checkpoint (use it "
                   "with torchrun --max-restarts and --load equal to --save)")
    g.add_argument("--overwrite", action="store_true",
                   help="let saves replace newer checkpoints in --save and move its `latest` back; without "
                   "--load, start from scratch instead of resuming from --save")
    g.add_argument("--keep-last", type=int, default=None, metavar="N",
                   help="keep only the N newest checkpoints in --save (absent: keep all)")
    g.add_argument("--override-opt-param-scheduler", "--override-opt_param-scheduler", action="store_true",
                   dest="override_opt_param_scheduler",
                   help="on resume, the LR / weight-decay schedule of this run's flags replaces the checkpoint's")
    g.add_argument("--use-checkpoint-opt_param-scheduler", "--use-checkpoint-opt-param-scheduler",
                   action="store_true", dest="use_checkpoint_opt_param_scheduler",
                   help="on resume, the checkpoint's LR / weight-decay schedule wins over this run's flags (what "
                   "the job does without either flag; the log names each value the checkpoint decided)")
    g.add_argument("--exit-interval", type=int, default=None)
    g.add_argument("--log-interval", type=int, default=5)
    g.add_argument("--tensorboard-dir", default=None)
    g.add_argument("--log-json", default=None, help="one JSON object per iteration")
    g.add_argument("--plot", action=argparse.BooleanOptionalAction, default=True,
                   help="with --save, draw <save>/logs/run.png (loss and FP8 amax / scale by role) at the end of the "
                   "run; --no-plot skips it (about 3 s of CPU; launch/plot_run.py draws it later from the metrics)")
    g.add_argument("--no-progress-bar", action="store_true",
                   help="no tqdm bar on a terminal (piped output never has one: it gets the --log-interval lines)")
    g.add_argument("--verbose", action="store_true",
                   help="show every warning on every rank (by default rank 0 shows each once, and those expected "
                   "from megatron-core / torch here are hidden with one note naming them)")
    if defaults:
        p.set_defaults(**defaults)
        preset = next(a for a in p._actions if a.dest == "preset")
        preset.help += f"; this run: {defaults['preset']}"
    for action in p._actions:  # --help shows every default
        if action.default is not None and action.default is not False and action.default != argparse.SUPPRESS \
                and "default" not in (action.help or ""):
            action.help = (action.help + "; " if action.help else "") + "default: %(default)s"
    return p


@dataclasses.dataclass(frozen=True)
class RunArgs:
    """The parsed flags (attribute names as argparse derives them from megatron's flag names)."""

    values: Dict[str, Any]

    def __getattr__(self, name: str) -> Any:
        try:
            return self.values[name]
        except KeyError:
            raise AttributeError(name) from None

    def as_dict(self) -> Dict[str, Any]:
        return dict(self.values)


def _layout(world_size: int) -> Tuple[int, int, int]:
    """TP, PP and EP of the small presets on `world_size` ranks: TP2 on an even count, PP2 on a multiple of 4,
    EP2 where the data x tensor ranks of a stage are even."""
    tp = 2 if world_size % 2 == 0 else 1
    pp = 2 if world_size % 4 == 0 else 1
    ep = 2 if (world_size // pp) % 2 == 0 else 1
    return tp, pp, ep


def _small_gpt(world_size: int, moe: bool, save: str) -> List[str]:
    """The small FP8 GPT of the CPU-sized presets (TP2 x PP2 on 4 ranks), MoE with 4 experts or dense."""
    tp, pp, ep = _layout(world_size)
    experts = ["--num-experts", "4", "--moe-router-topk", "2", "--expert-model-parallel-size", str(ep),
               "--expert-tensor-parallel-size", "1"] if moe else []
    return [
        "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp), *experts,
        "--fp8-format", "hybrid", "--fp8-recipe", "delayed",
        *(["--sequence-parallel"] if tp > 1 else []),
        "--num-layers", "4", "--hidden-size", "64", "--ffn-hidden-size", "128", "--num-attention-heads", "4",
        "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
        "--lr", "6e-3", "--min-lr", "6e-4", "--lr-warmup-iters", "3", "--lr-decay-style", "cosine",
        "--train-iters", "40", "--save", save, "--log-interval", "5",
    ]


def embedded_default_argv(world_size: int, gpu: bool) -> List[str]:
    """The `default` preset (the README's run) for `world_size` ranks: on CPU ranks a MoE GPT (TP2 x PP2 x EP2
    on 4); on GPUs the same GPT with dense MLPs, in bf16 with CUDA graphs.

    Small on purpose: without a GPU every rank emulates FP8 on the CPU (FP8 GEMMs as float32 matmuls of the
    upcast operands), and a CPU machine may hold several ranks per core."""
    # MoE routes data-dependent token counts, which CUDA graphs cannot capture: on GPUs the default is the
    # same GPT with dense MLPs, graphed.
    argv = _small_gpt(world_size, moe=not gpu, save="checkpoints/gpt_default")
    return argv + (["--bf16", "--cuda-graph"] if gpu else [])


def _moe_argv(world_size: int, gpu: bool) -> List[str]:
    return _small_gpt(world_size, moe=True, save="checkpoints/gpt_moe") + (["--bf16"] if gpu else [])


def _gpu1_argv(world_size: int, _gpu: bool) -> List[str]:
    """A GPT-2-small-sized dense model for one GPU (more GPUs: data parallel), bf16, FP8 hybrid, CUDA graphs."""
    return [
        "--fp8-format", "hybrid", "--fp8-recipe", "delayed", "--bf16", "--cuda-graph",
        "--num-layers", "12", "--hidden-size", "768", "--ffn-hidden-size", "3072", "--num-attention-heads", "12",
        "--seq-length", "1024", "--micro-batch-size", "8", "--global-batch-size", str(8 * world_size),
        "--lr", "6e-4", "--min-lr", "6e-5", "--lr-warmup-iters", "20", "--lr-decay-style", "cosine",
        "--train-iters", "500", "--save", "checkpoints/gpt_gpu1", "--save-interval", "100", "--log-interval", "10",
    ]


@dataclasses.dataclass(frozen=True)
class Preset:
    """A named starting point for the flags: `argv(world_size, gpu)` are the flags it stands for."""

    about: str
    argv: Callable[[int, bool], List[str]]


PRESETS: Dict[str, Preset] = {
    "default": Preset("the README's run: a small FP8 GPT, MoE on CPU ranks (TP2 x PP2 x EP2 on 4), dense bf16 with "
                      "CUDA graphs on GPUs; saves to checkpoints/gpt_default", embedded_default_argv),
    "moe": Preset("the small FP8 MoE GPT on any device (bf16 on GPUs, no graphs); saves to checkpoints/gpt_moe",
                  _moe_argv),
    "gpu1": Preset("a GPT-2-small-sized dense FP8 model for one GPU (bf16, CUDA graphs; more GPUs add data "
                   "parallel); saves to checkpoints/gpt_gpu1", _gpu1_argv),
    "none": Preset("megatron's defaults: no parallelism, no experts, no FP8, a small model, no save",
                   lambda _world_size, _gpu: []),
}


def _preset_help() -> str:
    return "; ".join(f"'{name}': {preset.about}" for name, preset in PRESETS.items())


def split_preset(argv: Sequence[str], default: str = "default") -> Tuple[str, List[str]]:
    """The preset named by `--preset NAME` / `--preset=NAME` in `argv` (the last one wins; else `default`) and
    the other flags.

    Raises:
        ArgumentError: an unknown preset name, or `--preset` without one.
    """
    name, rest, items = default, [], list(argv)
    i = 0
    while i < len(items):
        item = items[i]
        if item == "--preset":
            if i + 1 >= len(items):
                raise ArgumentError("argument --preset: expected one argument")
            name, i = items[i + 1], i + 2
            continue
        if item.startswith("--preset="):
            name = item.split("=", 1)[1]
        else:
            rest.append(item)
        i += 1
    if name not in PRESETS:
        close = difflib.get_close_matches(name, list(PRESETS), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ArgumentError(f"--preset={name}: unknown preset; the presets are {', '.join(PRESETS)}{hint}")
    return name, rest


def _given(flags: Sequence[str], *names: str) -> bool:
    return any(f == n or f.startswith(n + "=") for f in flags for n in names)


def parse_args(argv: Optional[Sequence[str]] = None, world_size: int = 1, gpu: bool = False,
               preset: str = "none") -> RunArgs:
    """Parse and validate the flags for a job of `world_size` ranks, layered over a preset: `--preset` in
    `argv`, else `preset` (the job passes 'default'; 'none' is megatron's defaults). Each flag given replaces
    only its own setting.

    Raises:
        ArgumentError: an unknown preset, or a size or setting that does not fit (the message names the flag
            and value).
    """
    name, flags = split_preset(list(sys.argv[1:] if argv is None else argv), default=preset)
    preset_flags = PRESETS[name].argv(world_size, gpu)
    defaults = vars(_parser().parse_args(preset_flags)) | {"preset": name}
    v = vars(_parser(defaults, _preset_help()).parse_args(flags))
    v["preset"] = name
    if v["sequence_parallel"] and v["tensor_model_parallel_size"] == 1 \
            and not _given(flags, "--sequence-parallel"):  # the preset's, for a TP it no longer has
        v["sequence_parallel"] = False
    fmt = v.pop("fp8_format")
    v["fp8"] = None if fmt == "none" else fmt
    return _finish(v, world_size)


def _finish(v: Dict[str, Any], world_size: int) -> RunArgs:
    """Derived values and validation of parsed flags."""
    v["ffn_hidden_size"] = v["ffn_hidden_size"] or 4 * v["hidden_size"]
    v["max_position_embeddings"] = v["max_position_embeddings"] or v["seq_length"]
    if v["num_experts"] is not None and v["num_experts"] < 0:
        raise ArgumentError(f"--num-experts={v['num_experts']}: must be a positive integer (absent or 0: dense)")
    if v["num_experts"] == 0:
        v["num_experts"] = None
    v["world_size"] = world_size
    v["data_parallel_size"] = validate(v, world_size)
    return RunArgs(v)


def _capacity(args: RunArgs) -> str:
    """The MoE token capacity part of `describe`'s model: empty when dropless."""
    factor = args.moe_expert_capacity_factor
    if factor is None:
        return ""
    return f", capacity {factor:g}{' padded' if args.moe_pad_expert_input_to_capacity else ''}"


def describe(args: RunArgs, plan: Any = None) -> str:
    """One line of what the run will do: preset, layout, model, precision and FP8 recipe, length, where it
    saves and what it starts from (`plan`: the pre-flight `ResumePlan`)."""
    layout = (f"{args.world_size} ranks = TP{args.tensor_model_parallel_size} x PP{args.pipeline_model_parallel_size}"
              f"{f' (VPP{args.virtual_pipeline_model_parallel_size})' if args.virtual_pipeline_model_parallel_size else ''}"
              f" x CP{args.context_parallel_size} x DP{args.data_parallel_size}"
              f"{' + SP' if args.sequence_parallel else ''}")
    model = f"GPT {args.num_layers} layers, hidden {args.hidden_size}, {args.num_attention_heads} heads, seq {args.seq_length}"
    if args.num_experts:
        model += (f", MoE {args.num_experts} experts top-{args.moe_router_topk} "
                  f"(EP{args.expert_model_parallel_size} ETP{args.expert_tensor_parallel_size}"
                  f"{_capacity(args)})")
    fp8 = (f"FP8 {args.fp8} {args.fp8_recipe}"
           f"{f' (amax history {args.fp8_amax_history_len})' if args.fp8_recipe == 'delayed' else ''}"
           if args.fp8 else "FP8 off")
    precision = f"{'bf16' if args.bf16 else 'fp32'}, {fp8}{', CUDA graphs' if args.cuda_graph else ''}"
    start = "from iteration 0"
    if plan is not None and getattr(plan, "load", None):
        start = f"resuming {plan.load} at iteration {plan.iteration}"
    save = f"saves to {args.save}" if args.save else "saves nothing (no --save)"
    return (f"run (preset {args.preset}): {layout}; {model}; {precision}; {args.train_iters} iterations of "
            f"{args.global_batch_size} x {args.seq_length} tokens {start}; {save}")


def _positive(v: Dict[str, Any], names: List[str]) -> None:
    for name in names:
        if v[name] is None or v[name] < 1:
            raise ArgumentError(f"--{name.replace('_', '-')}={v[name]}: must be a positive integer")


def validate(v: Dict[str, Any], world_size: int) -> int:  # noqa: C901
    """Check the sizes against each other and the world size; returns the data-parallel size."""
    _positive(v, ["tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
                  "expert_model_parallel_size", "expert_tensor_parallel_size", "num_layers", "hidden_size",
                  "num_attention_heads", "seq_length", "micro_batch_size", "global_batch_size", "train_iters",
                  "log_interval"])
    tp, pp, cp = v["tensor_model_parallel_size"], v["pipeline_model_parallel_size"], v["context_parallel_size"]
    ep, etp, vpp = v["expert_model_parallel_size"], v["expert_tensor_parallel_size"], v["virtual_pipeline_model_parallel_size"]
    model_parallel = tp * pp * cp
    if world_size % model_parallel:
        raise ArgumentError(
            f"world size {world_size} is not divisible by tensor x pipeline x context parallel = "
            f"{tp} x {pp} x {cp} = {model_parallel}"
        )
    dp = world_size // model_parallel
    if (tp * dp * cp) % (etp * ep):
        raise ArgumentError(
            f"--expert-model-parallel-size={ep} x --expert-tensor-parallel-size={etp} does not divide the "
            f"{tp * dp * cp} ranks of a pipeline stage (tp {tp} x dp {dp} x cp {cp})"
        )
    if vpp is not None:
        if vpp < 1 or pp < 2:
            raise ArgumentError(f"--virtual-pipeline-model-parallel-size={vpp} needs a positive value and "
                                f"--pipeline-model-parallel-size >= 2 (got {pp})")
    chunks = pp * (vpp or 1)
    if v["num_layers"] % chunks:
        raise ArgumentError(f"--num-layers={v['num_layers']} is not divisible by pipeline x virtual stages = {chunks}")
    if v["num_attention_heads"] % tp or v["hidden_size"] % v["num_attention_heads"]:
        raise ArgumentError(
            f"--num-attention-heads={v['num_attention_heads']} must divide --hidden-size={v['hidden_size']} and be "
            f"divisible by --tensor-model-parallel-size={tp}"
        )
    if v["ffn_hidden_size"] % tp:
        raise ArgumentError(f"--ffn-hidden-size={v['ffn_hidden_size']} is not divisible by tensor parallel size {tp}")
    per_step = v["micro_batch_size"] * dp
    if v["global_batch_size"] % per_step:
        raise ArgumentError(
            f"--global-batch-size={v['global_batch_size']} is not divisible by --micro-batch-size x data parallel "
            f"= {v['micro_batch_size']} x {dp}"
        )
    microbatches = v["global_batch_size"] // per_step
    if vpp is not None and microbatches % pp:
        raise ArgumentError(f"interleaved pipelining needs the number of microbatches ({microbatches}) to be a "
                            f"multiple of --pipeline-model-parallel-size={pp}")
    if v["sequence_parallel"] and tp == 1:
        raise ArgumentError("--sequence-parallel needs --tensor-model-parallel-size > 1")
    if v["seq_length"] % (tp if v["sequence_parallel"] else 1) or v["seq_length"] % (2 * cp if cp > 1 else 1):
        raise ArgumentError(f"--seq-length={v['seq_length']} does not split over TP {tp} / CP {cp}")
    if v["num_experts"] is not None:
        if tp > 1 and not v["sequence_parallel"]:
            raise ArgumentError(f"--num-experts={v['num_experts']} with --tensor-model-parallel-size={tp} needs "
                                "--sequence-parallel (megatron's MoE layer requires it in training)")
        if v["num_experts"] % ep:
            raise ArgumentError(f"--num-experts={v['num_experts']} is not divisible by --expert-model-parallel-size={ep}")
        if not 1 <= v["moe_router_topk"] <= v["num_experts"]:
            raise ArgumentError(f"--moe-router-topk={v['moe_router_topk']} must be in [1, --num-experts={v['num_experts']}]")
        capacity = v["moe_expert_capacity_factor"]
        if capacity is not None and not capacity > 0:
            raise ArgumentError(f"--moe-expert-capacity-factor={capacity}: must be > 0")
    if v["num_experts"] is None and v["moe_expert_capacity_factor"] is not None:
        raise ArgumentError(f"--moe-expert-capacity-factor={v['moe_expert_capacity_factor']} without --num-experts")
    if v["moe_pad_expert_input_to_capacity"] and v["moe_expert_capacity_factor"] is None:
        raise ArgumentError("--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor (the capacity "
                            "to pad to)")
    if v["cuda_graph"] and v["num_experts"] is not None and not v["moe_pad_expert_input_to_capacity"]:
        raise ArgumentError("--cuda-graph with --num-experts: dropless MoE layers route a data-dependent number of "
                            "tokens, which a CUDA graph cannot capture; add --moe-expert-capacity-factor F "
                            "--moe-pad-expert-input-to-capacity (drop-and-pad: the same shapes every step) or run "
                            "without --cuda-graph")
    if v["cuda_graph"] and v["recompute_granularity"] == "full":
        raise ArgumentError("--cuda-graph with --recompute-granularity=full: full recompute cannot be captured")
    if v["fp8"] is not None and v["fp8_amax_history_len"] < 1:
        raise ArgumentError(f"--fp8-amax-history-len={v['fp8_amax_history_len']}: must be >= 1")
    if v["save_interval"] is not None and v["save_interval"] < 1:
        raise ArgumentError(f"--save-interval={v['save_interval']}: must be >= 1")
    if v["exit_interval"] is not None and v["exit_interval"] < 1:
        raise ArgumentError(f"--exit-interval={v['exit_interval']}: must be >= 1")
    if v["max_position_embeddings"] < v["seq_length"]:
        raise ArgumentError(f"--max-position-embeddings={v['max_position_embeddings']} is smaller than "
                            f"--seq-length={v['seq_length']}: positions past it have no embedding")
    if v["exit_interval"] is not None and not v["save"]:
        raise ArgumentError(f"--exit-interval={v['exit_interval']} without --save: the run would stop without a "
                            "checkpoint to resume from")
    if v["keep_last"] is not None and v["keep_last"] < 1:
        raise ArgumentError(f"--keep-last={v['keep_last']}: must be >= 1")
    if v["override_opt_param_scheduler"] and v["use_checkpoint_opt_param_scheduler"]:
        raise ArgumentError("--override-opt-param-scheduler and --use-checkpoint-opt_param-scheduler contradict "
                            "each other: give one")
    if v["min_lr"] > v["lr"]:
        raise ArgumentError(f"--min-lr={v['min_lr']} is larger than --lr={v['lr']}")
    return dp
