"""Install fp8_parallel and its process-group layer, parallel_state."""
from setuptools import find_packages, setup

setup(
    name="fp8_parallel",
    version="0.1.0",
    description="FP8 training for Megatron-style parallelism on PyTorch and megatron-core",
    packages=find_packages(include=["fp8_parallel", "fp8_parallel.*", "parallel_state", "parallel_state.*"]),
    python_requires=">=3.10",
    # torch is deliberately unpinned: a GPU user keeps the torch they have. On a fresh CPU machine the
    # README's commands install the CPU build first, so nothing here pulls a CUDA build.
    install_requires=["torch>=2.6", "megatron-core>=0.16", "numpy", "packaging", "psutil", "tqdm", "matplotlib", "tensorboard"],
    extras_require={
        "test": ["pytest>=8", "pytest-timeout", "torchao>=0.14"],
        "gpu": ["triton"],
    },
)
