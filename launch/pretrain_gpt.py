"""GPT pretraining with FP8 on megatron-core's own training stack (torchrun entry point).

    torchrun --nproc_per_node=4 launch/pretrain_gpt.py                      # the README's run
    torchrun --nproc_per_node=4 launch/pretrain_gpt.py --train-iters 200    # the same run, continued to 200
    torchrun --nproc_per_node=1 launch/pretrain_gpt.py --preset gpu1        # one GPU
    torchrun --nproc_per_node=2 launch/pretrain_gpt.py --preset none --tensor-model-parallel-size 2 ...

Flags are megatron's (`--help`). A run starts from a preset and each flag changes only its own setting. The
`default` preset: on 4 ranks a small MoE GPT on TP2 x PP2 (EP2, expert TP 1) with FP8 (hybrid, delayed
scaling) for 40 iterations on a generated Markov corpus (`launch/train/corpus.py`), saving a checkpoint to
checkpoints/gpt_default; gloo on CPU, NCCL with bf16 and CUDA graphs on GPUs. A save directory that holds
checkpoints is resumed from. The components live in `launch/train/`.
"""
from __future__ import annotations

import os
import sys
import warnings

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)

# megatron-core warns at import, once per module and rank, that TransformerEngine / Apex are missing and that
# it falls back to torch. The job says it once, on rank 0.
_FALLBACK = r".*(Transformer ?Engine|Apex)\b.*(are|is) not installed"

# Third-party warnings expected with megatron-core 0.16 on torch 2.13 without a GPU, none about this job's
# own calls: hidden (one note on rank 0 says which), `--verbose` shows them. (what, message regex)
EXPECTED_WARNINGS = (
    ("megatron-core's imports use deprecated torch.jit / its own moved modules",
     r"(`torch\.jit\.script_method` is deprecated|The following imports from `dynamic_context\.py`)"),
    ("megatron-core's MLP and config defaults (ffn_hidden_size from the config, cuda_graph_scope 'full')",
     r"(MLP requires ffn_hidden_size, but it was not provided|full scope is deprecated)"),
    ("megatron-core's DDP / distributed optimizer call torch's renamed collectives "
     "(all_gather_into_tensor, reduce_scatter_tensor)",
     r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated"),
    ("megatron-core's dist_checkpointing uses torch.distributed.checkpoint's load_state_dict and ShardedTensor",
     r"(`load_state_dict` is deprecated and will be removed|Please use DTensor instead and we are deprecating "
     r"ShardedTensor)"),
    ("megatron-core's indexed dataset passes copy=False to numpy",
     r"__array__ implementation doesn't accept a copy keyword"),
    ("megatron-core's sequence-parallel CUDA_DEVICE_MAX_CONNECTIONS advice (GPU only)",
     r"When using sequence parallelism it is recommended to set the environment variable CUDA_DEVICE_MAX_CONNECTIONS"),
    # megatron's distributed optimizer reads `.grad` of its shard views in zero_grad (harmless: it clears them)
    ("megatron-core's distributed optimizer reads .grad of non-leaf shard views",
     r"The \.grad attribute of a Tensor that is not a leaf Tensor"),
    ("megatron-core's expert linears at expert TP 1 turn sequence parallel off for themselves (MoE with TP > 1)",
     r"`sequence_parallel` is set to `True`, but tensor model parallel size is 1"),
    ("megatron-core's checkpoint writer forks its writers from a rank with threads (Python 3.12+)",
     r"This process \(pid=\d+\) is multi-threaded, use of fork\(\) may lead to deadlocks"),
)


def _filter_megatron_warnings(rank: int, verbose: bool = False, note: bool = True) -> None:
    """Rank 0 shows each warning once; other ranks would repeat the same ones, so they show none. The expected
    third-party warnings are hidden with one note on rank 0 (`note=False`: silently, as for `--help`);
    `verbose`: every warning on every rank."""
    if verbose:
        warnings.simplefilter("default")
        return
    warnings.simplefilter("once" if rank == 0 else "ignore")
    warnings.filterwarnings("ignore", message=_FALLBACK)
    for _, pattern in EXPECTED_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern)
    if rank == 0 and note:
        import importlib.util

        print("warnings: hiding those expected from third-party code here (--verbose shows them): "
              + "; ".join(what for what, _ in EXPECTED_WARNINGS), flush=True)
        missing = [name for name, module in (("TransformerEngine", "transformer_engine"), ("Apex", "apex"))
                   if importlib.util.find_spec(module) is None]
        if missing:
            print(f"note: {' and '.join(missing)} missing: megatron-core uses its torch fallbacks (optimizers, "
                  "norms, multi-tensor ops); this job's FP8 layers do not need them", flush=True)


def _usage_error(rank: int, err: Exception) -> int:
    """An argument or path error: one line from rank 0, exit status 2, before any process group exists.

    The other ranks print nothing; they wait for torchrun to stop them once rank 0 has exited, so that rank 0's
    line is not cut off by torchrun ending the group at the first failed rank."""
    if rank == 0:
        from launch.train.elastic import report_error_to_torchrun

        text = "pretrain_gpt.py: error: " + " ".join(str(err).split())
        print(text, file=sys.stderr, flush=True)
        report_error_to_torchrun(text)
    elif os.environ.get("TORCHELASTIC_RUN_ID"):
        import time

        time.sleep(60)
    return 2


def main(argv=None) -> int:
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    argv = list(sys.argv[1:] if argv is None else argv)
    _filter_megatron_warnings(rank, verbose="--verbose" in argv, note=not {"-h", "--help"} & set(argv))
    import torch

    from fp8_parallel.startup import import_megatron_core

    import_megatron_core()  # (without importing torch's compiler: about 2 s less per rank)
    from launch.train.arguments import ArgumentError, describe, parse_args
    from launch.train.datapath import DataError, check_data_path
    from launch.train.preflight import PathError, plan_resume

    try:
        args = parse_args(argv, world_size=world, gpu=torch.cuda.is_available(), preset="default")
        check_data_path(args.data_path)
        plan = plan_resume(args)
    except (ArgumentError, DataError, PathError) as err:
        return _usage_error(rank, err)
    if rank == 0:
        print(describe(args, plan), flush=True)
    from launch.train.loop import run

    return run(args, plan)


if __name__ == "__main__":
    sys.exit(main())
