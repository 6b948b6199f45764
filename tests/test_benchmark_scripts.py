"""Every benchmark script answers `--help` with its usage and exits 0, on any machine (no GPU needed), so
a script broken at import or argument parsing shows up in the CPU suite rather than on the GPU machine."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from launcher import child_env

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
SCRIPTS = sorted(p.name for p in BENCHMARKS.glob("*.py") if 'if __name__ == "__main__"' in p.read_text())


def test_the_scripts_were_found():
    assert {"bench_e2e.py", "bench_modules.py", "profile_host.py", "amax_cost_model.py"} <= set(SCRIPTS)


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_prints_usage_and_exits_0(script):
    proc = subprocess.run([sys.executable, script, "--help"], cwd=BENCHMARKS, env=child_env(), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, f"{script} --help exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr[-4000:]}"
    assert proc.stdout.lstrip().startswith("usage:"), proc.stdout[:500]
    assert "-h, --help" in proc.stdout
