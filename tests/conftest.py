import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent / "workers"))  # helpers shared with the workers

import seeds  # noqa: E402  (tests/, put on the path above)

# The suite has two parts: the tests marked `gpu`, run with `-m gpu` (benchmarks/gpu_test_shards.py and
# run_gpu.sh do), and the rest, written for CPU ranks on gloo. The rest runs with CUDA hidden on every machine,
# so on a GPU machine it runs as it does on a CPU-only one (its modules default to CUDA when there is one, and
# its torchrun workers would pick NCCL); FP8P_TEST_CUDA=1 keeps CUDA visible to a run without `-m gpu`.
_GPU_SKIP_REASON = "needs a CUDA GPU, and `-m gpu` (without it the suite runs with CUDA hidden)"


def _selects_gpu_tests(config) -> bool:
    expr = (config.getoption("markexpr", "") or "").strip()
    return expr == "gpu" or expr.startswith("gpu ") or os.environ.get("FP8P_TEST_CUDA") == "1"


def pytest_addoption(parser):
    group = parser.getgroup("fp8_parallel")
    group.addoption("--seed", type=int, default=None, metavar="N",
                    help=f"the run's seed (default: ${seeds.ENV_VAR}, else {seeds.DEFAULT_SEED})")
    group.addoption("--random-seed", action="store_true", default=False,
                    help="draw a fresh random seed for the run (printed with the summary)")


def _choose_seed(config) -> int:
    """The run's seed, chosen once in the controlling process: --seed, --random-seed, $FP8P_TEST_SEED, default."""
    seed, fresh = config.getoption("seed"), config.getoption("random_seed")
    if seed is not None and fresh:
        raise pytest.UsageError("--seed and --random-seed exclude each other")
    if seed is not None:
        return seed
    return seeds.draw_seed() if fresh else seeds.session_seed()


def pytest_configure(config):
    # the markers `gpu` and `slow` are registered in pytest.ini
    if not _selects_gpu_tests(config):
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before anything asks torch for its devices
    workerinput = getattr(config, "workerinput", None)
    if workerinput is None:  # the controller (or a run without xdist): choose the seed, before workers start
        config.fp8p_test_seed = _choose_seed(config)
        workers = getattr(config.option, "numprocesses", None)
        if isinstance(workers, int) and workers > 1:  # the workers share the cores: torch's threads too
            os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // workers)))
    else:  # an xdist worker: the controller's seed
        config.fp8p_test_seed = int(workerinput["fp8p_test_seed"])
    if workerinput is not None or getattr(config.option, "numprocesses", None) in (None, 0):
        # a process that runs tests: megatron-core without torch's compiler (fp8_parallel/startup.py), before
        # the test modules import it (CUDA is hidden above first)
        from fp8_parallel.startup import import_megatron_core

        import_megatron_core()
    # read by seeds.session_seed here, in xdist workers (started after this) and in every subprocess
    os.environ[seeds.ENV_VAR] = str(config.fp8p_test_seed)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """xdist: hand the controller's seed to each worker."""
    node.workerinput["fp8p_test_seed"] = node.config.fp8p_test_seed


def pytest_xdist_auto_num_workers(config):
    """`-n auto`: one worker per core, at most 8 (each torchrun test starts several processes of its own)."""
    return min(os.cpu_count() or 1, 8)


def _seed_line(config) -> str:
    seed = config.fp8p_test_seed
    return f"fp8_parallel test seed: {seed} (reproduce with --seed {seed} or {seeds.ENV_VAR}={seed})"


def pytest_report_header(config):
    return _seed_line(config)


def pytest_terminal_summary(terminalreporter, config):
    """The seed again at the end, where a failure is read; `-q` leaves the header out, so it is the only one."""
    if getattr(config, "workerinput", None) is None:
        terminalreporter.write_line(_seed_line(config))


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=_GPU_SKIP_REASON)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


_CPU_LOG_VAR = "FP8P_TEST_CPU_LOG"  # a file: one JSON line per test with its CPU seconds (docs/testing.md)


def _cpu_seconds() -> float:
    """CPU time of this process and of its children that have ended (torchrun's ranks among them)."""
    import resource

    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """With $FP8P_TEST_CPU_LOG set: append each test's CPU seconds (setup, call and teardown, its subprocesses
    included) and wall seconds to that file. On a machine whose cores the workers share, CPU time is what a
    test costs the run; wall time also counts the waits for the other worker's processes."""
    path = os.environ.get(_CPU_LOG_VAR)
    if not path:
        yield
        return
    import json
    import time

    cpu, wall = _cpu_seconds(), time.monotonic()
    yield
    row = {"test": item.nodeid, "cpu_s": round(_cpu_seconds() - cpu, 2), "wall_s": round(time.monotonic() - wall, 2)}
    with open(path, "a") as log:
        log.write(json.dumps(row) + "\n")
