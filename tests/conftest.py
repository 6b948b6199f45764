import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent / "workers"))  # helpers shared with the workers

# The suite has two parts: the tests marked `gpu`, run with `-m gpu` (benchmarks/gpu_test_shards.py and
# run_gpu.sh do), and the rest, written for CPU ranks on gloo. The rest runs with CUDA hidden on every machine,
# so on a GPU machine it runs as it does on a CPU-only one (its modules default to CUDA when there is one, and
# its torchrun workers would pick NCCL); FP8P_TEST_CUDA=1 keeps CUDA visible to a run without `-m gpu`.
_GPU_SKIP_REASON = "needs a CUDA GPU, and `-m gpu` (without it the suite runs with CUDA hidden)"


def _selects_gpu_tests(config) -> bool:
    expr = (config.getoption("markexpr", "") or "").strip()
    return expr == "gpu" or expr.startswith("gpu ") or os.environ.get("FP8P_TEST_CUDA") == "1"


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped without one)")
    if not _selects_gpu_tests(config):
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before anything asks torch for its devices


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=_GPU_SKIP_REASON)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
