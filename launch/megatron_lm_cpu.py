"""Run Megatron-LM's own `pretrain_gpt.py` on CPU (gloo) under `parallel_state.cpu_compat()`.

Megatron-LM is not part of this project: point `--megatron-lm` at a checkout of the tag that matches the
installed megatron-core (core_v0.16.1). Everything after `--` goes to `pretrain_gpt.py` unchanged:

    torchrun --nproc_per_node=2 launch/megatron_lm_cpu.py --megatron-lm /path/to/Megatron-LM -- \\
        --spec fp8_parallel.megatron_lm block_spec --transformer-impl local --fp8-format hybrid ...

The script only enters the CPU redirection and runs the file as `__main__`; on a machine with a GPU
`cpu_compat()` does nothing and the run is a plain Megatron-LM run. docs/megatron-lm.md has the full
command line and what it printed.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import os
import runpy
import sys
import warnings
from pathlib import Path
from typing import Iterator, List, Tuple

import torch


def _split_argv(argv: List[str]) -> Tuple[List[str], List[str]]:
    if "--" in argv:
        cut = argv.index("--")
        return argv[:cut], argv[cut + 1:]
    return argv, []


def main() -> None:
    ours, theirs = _split_argv(sys.argv[1:])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--megatron-lm", required=True, type=Path,
                        help="Megatron-LM checkout (the directory that holds pretrain_gpt.py)")
    parser.add_argument("--skip-build-steps", action="store_true",
                        help="on a GPU machine too: skip Megatron-LM's start-up build steps (rank 0's `make` of "
                             "megatron-core's dataset helpers, when the installed ones import; the legacy fused "
                             "kernels' `nvcc -V`, which builds nothing at core_v0.16.1). For machines without "
                             "`make` or `nvcc`; nothing else changes")
    args = parser.parse_args(ours)
    script = args.megatron_lm.resolve() / "pretrain_gpt.py"
    if not script.is_file():
        parser.error(f"--megatron-lm {args.megatron_lm}: no pretrain_gpt.py there")
    # megatron warns once per import site that TransformerEngine / apex are missing; say it once per launch
    if int(os.environ.get("RANK", "0")) != 0:
        warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
    warnings.filterwarnings("once", message=".*Transformer Engine and Apex are not installed.*")
    repo = str(Path(__file__).resolve().parent.parent)
    # --spec imports this package; pretrain_gpt imports its siblings and megatron.training from the checkout.
    # The checkout goes last, so `megatron.core` stays the installed megatron-core (with its built helpers).
    sys.path.insert(0, repo)
    sys.path.append(str(script.parent))

    import parallel_state

    sys.argv = [str(script)] + theirs
    with parallel_state.cpu_compat() as on_cpu, _megatron_lm_on_cpu(on_cpu), \
            _skip_build_steps(args.skip_build_steps and not on_cpu):
        runpy.run_path(str(script), run_name="__main__")


@contextlib.contextmanager
def _skip_build_steps(skip: bool) -> Iterator[None]:
    """`--skip-build-steps` on a GPU machine (on CPU `_megatron_lm_on_cpu` skips them already)."""
    if not skip:
        yield
        return
    with _patched(_build_step_patches()):
        yield


def _build_step_patches() -> List[Tuple[object, str, object]]:
    """Megatron-LM's start-up build steps, skipped: the fused-kernel nvcc probe and (when megatron-core's
    built helpers import) the `make` of its dataset helpers."""
    from megatron.core.datasets import utils as dataset_utils
    from megatron.legacy import fused_kernels

    patches: List[Tuple[object, str, object]] = [(fused_kernels, "load", lambda args: None)]  # noqa: ARG005
    if importlib.util.find_spec("megatron.core.datasets.helpers_cpp") is not None:
        patches.append((dataset_utils, "compile_helpers", lambda: None))
    return patches


@contextlib.contextmanager
def _patched(patches: List[Tuple[object, str, object]]) -> Iterator[None]:
    """Set each `(owner, name, value)` for the duration, then restore the originals."""
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    for owner, name, value in patches:
        setattr(owner, name, value)
    try:
        yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)


@contextlib.contextmanager
def _megatron_lm_on_cpu(on_cpu: bool) -> Iterator[None]:
    """What Megatron-LM's training entry needs on top of `cpu_compat()` (on a GPU machine nothing changes):

    * `pretrain` asserts that CUDA is available unless `initialize_megatron` gets `allow_no_cuda=True`;
    * `initialize_megatron` builds the model-parallel groups and seeds the model-parallel RNG tracker only
      when `torch.cuda.device_count() > 0`: here the count is 1 and `set_device` is a no-op;
    * rank 0 runs `make` on megatron-core's dataset helpers, which the installed megatron-core ships built
      (and without a Makefile): the build step is skipped when the built helpers import;
    * argument validation asks the GPU's architecture (to decide which CUDA settings TP/CP need): the
      CPU reads as architecture 0, before Blackwell, so `CUDA_DEVICE_MAX_CONNECTIONS=1` is required as on
      such GPUs;
    * `initialize_megatron` loads the legacy fused CUDA kernels by asking `nvcc` for its version; on CPU
      there is nothing to load.
    """
    if not on_cpu:
        yield
        return
    from megatron.training import arguments, training

    patches = _build_step_patches() + [
        (arguments, "get_device_arch_version", lambda: 0),
        (training, "initialize_megatron", functools.partial(training.initialize_megatron, allow_no_cuda=True)),
        (torch.cuda, "device_count", lambda: 1),
        (torch.cuda, "set_device", lambda device: None),  # noqa: ARG005
    ]
    with _patched(patches):
        yield

if __name__ == "__main__":
    main()
