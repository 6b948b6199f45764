"""The compiled host path (`csrc/`): one C++ call per FP8 cast and per FP8 linear forward / backward.

Built by `setup.py` when torch has CUDA and a CUDA toolkit is found (install with `pip install
--no-build-isolation -e .` so the build sees your torch); CPU-only installs have no build and use the pure-Python
path. It computes the same bytes as the Python path: the cast kernels match the Triton kernels and the torch
formulas, and the linear calls issue the same GEMMs. `FP8_PARALLEL_NATIVE=0` turns it off.
"""
from __future__ import annotations

import os
from types import ModuleType
from typing import List, Optional, Tuple

import torch

__all__ = ["NativeOps", "module", "use", "for_device", "sources", "build_cpu", "sanitized"]

DTYPE_CODES = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}  # as csrc/native.cpp reads them



class NativeOps:
    """The entry points of one build of `csrc/native.cpp`. The compiled functions report a rejected call (a wrong
    size, dtype, device or layout, found before any tensor is touched) by returning its message instead of
    throwing a C++ exception; these methods raise it as a RuntimeError."""

    def __init__(self, ext: ModuleType) -> None:
        self.extension = ext
        self.with_cuda: bool = bool(ext.with_cuda)
        self._cast_into, self._linear_fwd = ext.cast_into, ext.linear_fwd
        self._linear_bwd, self._experts_bwd = ext.linear_bwd, ext.experts_bwd

    def cast_into(self, *args) -> None:
        """`quantize`'s fused cast into given outputs (see csrc/native.cpp for the arguments)."""
        problem = self._cast_into(*args)
        if problem:
            raise RuntimeError(problem)

    def linear_fwd(self, *args) -> List[Optional[torch.Tensor]]:
        """One FP8 linear's forward (see csrc/native.cpp)."""
        problem, out = self._linear_fwd(*args)
        if problem:
            raise RuntimeError(problem)
        return out

    def linear_bwd(self, *args) -> List[Optional[torch.Tensor]]:
        """One FP8 linear's backward (see csrc/native.cpp)."""
        problem, out = self._linear_bwd(*args)
        if problem:
            raise RuntimeError(problem)
        return out

    def experts_bwd(self, *args) -> List[Optional[torch.Tensor]]:
        """The per-expert backward GEMMs of a grouped call (see csrc/native.cpp)."""
        problem, out = self._experts_bwd(*args)
        if problem:
            raise RuntimeError(problem)
        return out


_module: Optional[NativeOps] = None
_loaded = False


def module() -> Optional[NativeOps]:
    """The compiled extension, or None (not built, or turned off by `FP8_PARALLEL_NATIVE=0`)."""
    global _module, _loaded
    if not _loaded:
        _loaded = True
        if os.environ.get("FP8_PARALLEL_NATIVE", "1") != "0":
            try:
                from . import _native  # type: ignore[attr-defined]
            except ImportError:
                _native = None
            _module = NativeOps(_native) if _native is not None else None
    return _module


def use(ext: Optional[NativeOps]) -> Optional[NativeOps]:
    """Use `ext` (a build of `csrc/native.cpp`, e.g. a CPU build for tests) as the extension, or None for the
    pure-Python path; returns the previous one."""
    global _module, _loaded
    previous = module()
    _module, _loaded = ext, True
    return previous


def for_device(device: torch.device) -> Optional[NativeOps]:
    """The extension when it can run on `device` (a CUDA build runs everywhere; a CPU build on the CPU)."""
    ext = module()
    if ext is None:
        return None
    return ext if device.type == "cpu" or (device.type == "cuda" and ext.with_cuda) else None


def sources() -> Tuple[List[str], List[str]]:
    """The extension's source files: `(host code, CUDA-only files)` (the CUDA kernels and the cuBLASLt GEMM)."""
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")
    return ([os.path.join(here, "native.cpp")],
            [os.path.join(here, "cast_kernels.cu"), os.path.join(here, "lt_gemm.cpp")])


_SANITIZE_FLAGS = ["-fsanitize=address,undefined", "-fno-omit-frame-pointer"]


def sanitized() -> bool:
    """True when `FP8P_NATIVE_SANITIZE=1` asks for the extension built with AddressSanitizer and UBSan (see
    docs/testing.md, "The compiled path under AddressSanitizer", for how to run it)."""
    return os.environ.get("FP8P_NATIVE_SANITIZE", "0") == "1"


def build_cpu(build_dir: str, verbose: bool = False) -> NativeOps:
    """Build the CPU variant of the extension into `build_dir` with torch's JIT builder (a C++ compiler is
    needed) and return it, without making it the active one (see `use`). With `FP8P_NATIVE_SANITIZE=1` it is
    built with AddressSanitizer and UBSan, under another name in `build_dir/sanitize` (the ASan runtime must
    then be preloaded into Python)."""
    from torch.utils.cpp_extension import load

    host, _ = sources()
    if sanitized():
        directory = os.path.join(build_dir, "sanitize")
        os.makedirs(directory, exist_ok=True)
        # the compiler runs without the preloaded sanitizer runtime (under it, cc1plus ran out of memory)
        preload = os.environ.pop("LD_PRELOAD", None)
        try:
            return NativeOps(load(name="fp8_parallel_native_cpu_sanitize", sources=host, build_directory=directory,
                                  verbose=verbose, extra_cflags=["-O1", "-g", *_SANITIZE_FLAGS],
                                  extra_ldflags=_SANITIZE_FLAGS))
        finally:
            if preload is not None:
                os.environ["LD_PRELOAD"] = preload
    return NativeOps(load(name="fp8_parallel_native_cpu", sources=host, build_directory=build_dir, verbose=verbose,
                          extra_cflags=["-O2"]))
