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


def test_bench_e2e_llama_preset_runs_on_cpu_and_agrees_with_megatrons_spec(tmp_path):
    """`bench_e2e.py --preset llama-1b` shrunk to CPU size: a Llama-style GPTModel (RMSNorm, SwiGLU, rotary
    embeddings, grouped-query attention, no biases) builds from megatron's local spec and ours; FP8 + graphed
    layers (the layers' samples include the model's rotary frequencies) starts from the local spec's loss (same
    weights and data: FP8 rounding only). The two variants run in processes of their own
    (`--process-per-variant`): one report of both, with the same weights in each process."""
    import json

    out = tmp_path / "e2e.jsonl"
    argv = [sys.executable, "bench_e2e.py", str(out), "--device", "cpu", "--preset", "llama-1b", "--layers", "1",
            "--hidden", "64", "--heads", "4", "--groups", "2", "--ffn", "128", "--vocab", "96", "--seq", "32",
            "--micro", "2", "--warmup", "1", "--steps", "1", "--variants", "local,fp8_graphs",
            "--process-per-variant"]
    proc = subprocess.run(argv, cwd=BENCHMARKS, env=child_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "L1 h64 a4 f128 llama g2 v96" in proc.stdout, proc.stdout[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    loss = {r["case"]: r["value"] for r in rows if r["metric"] == "loss"}
    (local,) = [v for case, v in loss.items() if case.endswith("megatron local spec BF16")]
    (fp8,) = [v for case, v in loss.items() if case.endswith("our spec FP8 + graphs")]
    assert abs(fp8 - local) < 0.02 * local, loss
    assert proc.stdout.count(": a process of its own") == 2, proc.stdout[-3000:]
    sums = {line for line in proc.stdout.splitlines() if line.startswith("reference weights: sum")}
    assert len(sums) == 1, sums  # the two processes built the same weights and data


def test_bench_e2e_flops_count_grouped_query_attention_and_swiglu():
    if str(BENCHMARKS) not in sys.path:  # (bench_e2e puts it there itself when imported)
        sys.path.insert(0, str(BENCHMARKS))
    from bench_e2e import Size

    gpt = Size(layers=2, hidden=64, heads=4, ffn=128, vocab=96, seq=32, mbs=1, micro=1)
    gqa = Size(layers=2, hidden=64, heads=4, ffn=128, vocab=96, seq=32, mbs=1, micro=1, llama=True, groups=2)
    # per token and layer: key / value projections 2 * 64 * 32 instead of 2 * 64 * 64; one more FFN matrix 64 x 128
    per_layer = 2 * (-2 * 64 * 32 + 64 * 128)
    assert gqa.model_flops() - gpt.model_flops() == 3.0 * 2 * per_layer * 32
