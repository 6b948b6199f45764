"""Install fp8_parallel and its process-group layer, parallel_state.

With a CUDA build of torch and a CUDA toolkit visible to the build (`pip install --no-build-isolation -e .`),
the compiled host path `fp8_parallel._native` (fp8_parallel/csrc) is built too; otherwise, and with
FP8_PARALLEL_NATIVE=0, the install is pure Python and the same code runs through the Python path.
"""
import os
import sys

from setuptools import find_packages, setup


def native_extension():
    """`(ext_modules, cmdclass)` for the CUDA extension, or empty ones where it cannot be built."""
    if os.environ.get("FP8_PARALLEL_NATIVE", "1") == "0":
        return [], {}
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CUDAExtension
    except ImportError:  # an isolated build environment without torch, or no torch yet: pure Python
        return [], {}
    if torch.version.cuda is None or CUDA_HOME is None:
        return [], {}
    # FP8P_NATIVE_SANITIZE=1: the host code with AddressSanitizer and UBSan (docs/testing.md says how to run it)
    sanitize = ["-fsanitize=address,undefined", "-fno-omit-frame-pointer"]
    sanitized = os.environ.get("FP8P_NATIVE_SANITIZE", "0") == "1"
    ext = CUDAExtension(
        "fp8_parallel._native",
        sources=["fp8_parallel/csrc/native.cpp", "fp8_parallel/csrc/cast_kernels.cu", "fp8_parallel/csrc/lt_gemm.cpp"],
        # (fp8_parallel.native.sources() lists the same files)
        define_macros=[("FP8P_WITH_CUDA", None)],
        extra_compile_args={"cxx": ["-O1", "-g", *sanitize] if sanitized else ["-O3"],
                            "nvcc": ["-O3", "--expt-relaxed-constexpr"]},
        extra_link_args=sanitize if sanitized else [],
    )
    class OptionalBuildExt(BuildExtension):
        """A failed build of the extension leaves a working pure-Python install (and says why)."""

        def build_extension(self, extension):
            try:
                super().build_extension(extension)
            except Exception as err:  # a compiler or a CUDA header missing: the Python path serves
                print(f"fp8_parallel: the compiled host path was not built ({err}); the Python path runs",
                      file=sys.stderr)

    return [ext], {"build_ext": OptionalBuildExt.with_options(use_ninja=True)}


ext_modules, cmdclass = native_extension()

setup(
    name="fp8_parallel",
    version="0.1.0",
    description="FP8 training for Megatron-style parallelism on PyTorch and megatron-core",
    packages=find_packages(include=["fp8_parallel", "fp8_parallel.*", "parallel_state", "parallel_state.*"]),
    package_data={"fp8_parallel": ["csrc/*.cpp", "csrc/*.cu", "csrc/*.h"]},
    python_requires=">=3.10",
    # torch is deliberately unpinned: a GPU user keeps the torch they have, and a machine without torch gets
    # the one the README's commands install first (the build its package index serves).
    install_requires=["torch>=2.6", "megatron-core>=0.16", "numpy", "packaging", "psutil", "tqdm", "matplotlib", "tensorboard"],
    extras_require={
        "test": ["pytest>=8", "pytest-timeout", "pytest-xdist", "torchao>=0.14", "ninja", "ruff>=0.6"],
        "gpu": ["triton"],
    },
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
