"""Mutation check: does the suite catch a real break of each invariant the design relies on?

For each mutation below, the git-tracked files of the repository are copied to a temporary directory, one
precise source edit is applied there (a text that must occur exactly once in its file, replaced), and the
tests listed for it run in the copy (`PYTHONPATH` set to the copy, so the copy's package is the one imported,
by pytest and by the torchrun ranks its tests launch). A test that fails has caught the mutation.

    python benchmarks/mutation_check.py                 # every mutation, after a baseline run
    python benchmarks/mutation_check.py --only margin   # one (or a comma-separated few)
    python benchmarks/mutation_check.py --list          # the mutations and their tests, nothing run

The baseline runs every listed test on an unmutated copy first: a test that fails there catches nothing,
and the script stops (fix the suite first). It prints a table (mutation, file, tests run, caught by N,
which) and exits 1 if any mutation is caught by fewer than `--min-caught` (default 3) test functions (the
cases of one parametrized test count once), 2 on a
mutation whose text does not occur exactly once (the source moved on: update the mutation).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Set, Tuple

REPO = Path(__file__).resolve().parent.parent


@dataclasses.dataclass(frozen=True)
class Mutation:
    name: str
    invariant: str
    file: str  # relative to the repository root
    old: str  # must occur exactly once in `file`
    new: str
    tests: Tuple[str, ...]  # pytest node ids, relative to the repository root


MUTATIONS: Tuple[Mutation, ...] = (
    Mutation(
        "weight-cache-version",
        "a cached FP8 weight is used only while the weight's version is the one it was cast from",
        "fp8_parallel/modules/_core.py",
        "current = cached is not None and state.weight_version == weight._version and cached.shape == weight.shape",
        "current = cached is not None and cached.shape == weight.shape",
        (
            "tests/test_weight_cache.py",
            "tests/test_grouped_gemm.py::test_cached_expert_weights_live_in_one_stack",
            "tests/test_modules.py::test_tp2_modules_match_single_rank_cache_and_state_dict",
        ),
    ),
    Mutation(
        "scale-margin",
        "delayed scaling's scale is fp8_max / amax / 2**margin",
        "fp8_parallel/scaling.py",
        "scale = torch.div(limit, amax) / (2.0**margin)",
        "scale = torch.div(limit, amax)",
        (
            "tests/test_numerics.py::test_history_sequences_match_reference",
            "tests/test_numerics.py::test_delayed_scale_is_a_correctly_rounded_division",
            "tests/test_pretrain_gpt.py::test_tp2_run_json_log_and_plot",
        ),
    ),
    Mutation(
        "amax-reduction-group",
        "a scope's amaxes are reduced over its own process group, not the world",
        "fp8_parallel/amax_table.py",
        'self._all_reduce_checked(buf, group, scope, "reduction")',
        'self._all_reduce_checked(buf, dist.group.WORLD, scope, "reduction")',
        (
            "tests/test_scopes.py::test_scopes_multirank",
            "tests/test_modules.py::test_ep2_moe_matches_unsharded_experts",
            "tests/test_parallel_state.py::test_megatron_gpt_dense_and_moe_train_on_cpu",
        ),
    ),
    Mutation(
        "amax-history-roll",
        "the newest amax enters column 0 of the history and the oldest drops off the end",
        "fp8_parallel/scaling.py",
        "rolled = torch.cat([new_amax.float().unsqueeze(1), history[:, :-1]], dim=1)",
        "rolled = torch.cat([new_amax.float().unsqueeze(1), history[:, 1:]], dim=1)",
        (
            "tests/test_numerics.py::test_history_sequences_match_reference",
            "tests/test_backward_expectation.py",
            "tests/test_scopes.py::test_scopes_multirank",
        ),
    ),
    Mutation(
        "gemm-scale-inv",
        "the FP8 GEMM scales the product by both operands' scale_inv",
        "fp8_parallel/gemm.py",
        "scale_b=_scale_operand(b._scale_inv),",
        "scale_b=_scale_operand(a._scale_inv),",
        (
            "tests/test_numerics.py::test_gemm_matches_dequantized_float64",
            "tests/test_scopes.py::test_current_scaling_modules_match_reference",
            "tests/test_modules.py::test_tp2_modules_match_single_rank_cache_and_state_dict",
        ),
    ),
    Mutation(
        "pipeline-capture-order",
        "graphs are captured in megatron's schedule order: (pp - rank - 1) * 2 + (vpp - 1) * group warm-up forwards",
        "fp8_parallel/pipeline.py",
        "warmup = min((pp_size - pp_rank - 1) * 2 + (chunks - 1) * group, len(forward_chunks))",
        "warmup = min((pp_size - pp_rank - 1) + (chunks - 1) * group, len(forward_chunks))",
        (
            "tests/test_pipeline.py",
            "tests/test_graphs.py::test_static_buffers_are_shared_by_microbatches_not_in_flight_together",
        ),
    ),
    Mutation(
        "checkpoint-atomic-rename",
        "a finished save becomes current by renaming its directory (never a copy, nothing left behind)",
        "launch/checkpoint_files.py",
        "    os.rename(tmp_dir, final_dir)\n",
        "    shutil.copytree(tmp_dir, final_dir)\n",
        (
            "tests/test_checkpointing.py::test_publish_latest_and_incomplete_saves",
            "tests/test_checkpointing.py::test_publish_renames_the_finished_save",
            "tests/test_checkpointing.py::test_sigkill_during_save_leaves_previous_checkpoint",
        ),
    ),
)


class MutationError(RuntimeError):
    """A mutation whose text does not occur exactly once in its file."""


def tracked_files(repo: Path) -> List[str]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=repo, capture_output=True, check=True).stdout
    return [p for p in out.decode().split("\0") if p]


def copy_tree(repo: Path, dest: Path) -> None:
    """The git-tracked files of `repo` (as they are in the working tree) into `dest`."""
    for rel in tracked_files(repo):
        src = repo / rel
        if not src.is_file():  # deleted in the working tree
            continue
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, target)


def apply(root: Path, m: Mutation) -> None:
    path = root / m.file
    if not path.is_file():
        raise MutationError(f"{m.name}: {m.file} does not exist")
    text = path.read_text()
    count = text.count(m.old)
    if count != 1:
        raise MutationError(f"{m.name}: the text to replace occurs {count} times in {m.file} (must be exactly once):"
                            f"\n    {m.old!r}")
    path.write_text(text.replace(m.old, m.new))


def _node_id(case: ET.Element) -> str:
    cls, name = case.get("classname", ""), case.get("name", "")
    parts = cls.split(".")
    # classname is `tests.test_x` or `tests.test_x.TestClass`
    for i in range(len(parts), 0, -1):
        if parts[i - 1].startswith("test_"):
            return "/".join(parts[:i]) + ".py::" + "::".join(parts[i:] + [name])
    return f"{cls}::{name}"


def run_tests(root: Path, tests: Sequence[str], timeout: float, workers: int) -> Tuple[Set[str], Set[str], str]:
    """Run `tests` in `root`; (passed, failed node ids, output tail). A run past `timeout` fails them all."""
    report = root / ".mutation-junit.xml"
    if report.exists():
        report.unlink()
    env = dict(os.environ, PYTHONPATH=str(root), PYTHONDONTWRITEBYTECODE="1")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", str(workers),
           f"--junitxml={report}", *tests]
    try:
        proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
        output = proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        return set(), set(tests), f"timed out after {timeout}s\n{e.stdout or ''}"
    passed, failed = set(), set()
    if report.exists():
        for case in ET.parse(report).getroot().iter("testcase"):
            nid = _node_id(case)
            if case.find("failure") is not None or case.find("error") is not None:
                failed.add(nid)
            elif case.find("skipped") is None:
                passed.add(nid)
    if not passed and not failed:  # collection failed as a whole: every listed test failed
        failed = set(tests)
    return passed, failed, output[-4000:]


def check_imports_copy(root: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(root))
    where = subprocess.run([sys.executable, "-c", "import fp8_parallel, launch; print(fp8_parallel.__file__)"],
                           cwd=root, env=env, capture_output=True, text=True, check=True).stdout.strip()
    if not Path(where).resolve().is_relative_to(root.resolve()):
        raise RuntimeError(f"the copy imports fp8_parallel from {where}, not from {root}")


def _function(nid: str) -> str:
    """A node id without its parameters: `test_x.py::test_y[a-b]` -> `test_x.py::test_y`."""
    return nid.replace("tests/", "", 1).split("[", 1)[0]


def caught_functions(failed: Sequence[str]) -> Dict[str, int]:
    """The test functions among `failed` node ids, with how many of their parametrized cases failed."""
    out: Dict[str, int] = {}
    for nid in failed:
        out[_function(nid)] = out.get(_function(nid), 0) + 1
    return dict(sorted(out.items()))


def table(rows: List[Tuple[Mutation, int, List[str], float]]) -> str:
    """Markdown: per mutation, its file, the test cases run, and the test functions that caught it (the
    count in parentheses: how many of a parametrized function's cases failed)."""
    lines = ["| mutation | file | test cases run | caught by (test functions) | which | minutes |",
             "|---|---|---|---|---|---|"]
    for m, ran, caught, seconds in rows:
        funcs = caught_functions(caught)
        names = ", ".join(f"`{f}`" + (f" ({n})" if n > 1 else "") for f, n in funcs.items()) or "-"
        lines.append(f"| {m.name} | `{m.file}` | {ran} | {len(funcs)} | {names} | {seconds / 60:.1f} |")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="", help="comma-separated mutation names (default: all)")
    parser.add_argument("--list", action="store_true", help="print the mutations and their tests; run nothing")
    parser.add_argument("--min-caught", type=int, default=3, help="fewest catching test functions accepted (default 3)")
    parser.add_argument("--no-baseline", action="store_true",
                        help="skip the unmutated run (then a test that fails anyway counts as catching)")
    parser.add_argument("--workers", type=int, default=0, help="pytest-xdist workers per run (default 0: none)")
    parser.add_argument("--timeout", type=float, default=7200.0, help="seconds per pytest run (default 7200)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary copies")
    args = parser.parse_args(argv)

    chosen = list(MUTATIONS)
    if args.only:
        names = [n.strip() for n in args.only.split(",") if n.strip()]
        unknown = [n for n in names if n not in {m.name for m in MUTATIONS}]
        if unknown:
            parser.error(f"unknown mutation(s) {unknown}; known: {[m.name for m in MUTATIONS]}")
        chosen = [m for m in MUTATIONS if m.name in names]
    if args.list:
        for m in chosen:
            print(f"{m.name}: {m.invariant}\n  {m.file}: {m.old.strip()!r}\n    -> {m.new.strip()!r}")
            for t in m.tests:
                print(f"    {t}")
        return 0

    tmp_root = Path(tempfile.mkdtemp(prefix="fp8p-mutation-"))
    try:
        for m in chosen:  # every mutation's text is checked before anything runs
            probe = tmp_root / "probe"
            probe.mkdir(exist_ok=True)
            (probe / m.file).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / m.file, probe / m.file)
            apply(probe, m)
        if not args.no_baseline:
            base = tmp_root / "baseline"
            copy_tree(REPO, base)
            check_imports_copy(base)
            tests = sorted({t for m in chosen for t in m.tests})
            start = time.time()
            passed, failed, out = run_tests(base, tests, args.timeout, args.workers)
            print(f"baseline: {len(passed)} passed, {len(failed)} failed in {(time.time() - start) / 60:.1f} min",
                  flush=True)
            if failed:
                print(out, "\nfailing without any mutation:\n  " + "\n  ".join(sorted(failed)), file=sys.stderr)
                return 1
        rows = []
        for m in chosen:
            root = tmp_root / m.name
            copy_tree(REPO, root)
            check_imports_copy(root)
            apply(root, m)
            start = time.time()
            passed, failed, out = run_tests(root, m.tests, args.timeout, args.workers)
            seconds = time.time() - start
            caught = sorted(failed)  # the baseline (when run) passed every one of them
            rows.append((m, len(passed) + len(failed), caught, seconds))
            print(f"{m.name}: {len(passed) + len(failed)} test cases, caught by {len(caught_functions(caught))} "
                  f"test functions ({len(caught)} cases, {seconds / 60:.1f} min)", flush=True)
            if not args.keep:
                shutil.rmtree(root, ignore_errors=True)
        print()
        print(table(rows))
        weak = [m.name for m, _, caught, _ in rows if len(caught_functions(caught)) < args.min_caught]
        if weak:
            print(f"\ncaught by fewer than {args.min_caught} tests: {', '.join(weak)}", file=sys.stderr)
            return 1
        return 0
    except MutationError as e:
        print(f"mutation_check: {e}", file=sys.stderr)
        return 2
    finally:
        if not args.keep:
            shutil.rmtree(tmp_root, ignore_errors=True)
        else:
            print(f"copies kept in {tmp_root}")


if __name__ == "__main__":
    sys.exit(main())
