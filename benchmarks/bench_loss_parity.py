"""Loss parity of FP8 against BF16 on a ~1B GPT, through the training job (megatron's optimizer with fp32
master weights, bf16 parameters): the same seed, data and steps twice, FP8 off and FP8 on (hybrid, delayed).

    python bench_loss_parity.py results.jsonl [--steps 300] [--nproc 1] [--seeds 1234,1235] [--job-args=--cuda-graph]

The data is the job's generated corpus (a word-level Markov chain, spelled in bytes), generated here with enough
documents that the run sees each token about once: the job's built-in 2000 documents would be repeated ~10
times in 300 steps of this size, and the late losses would then measure memorisation.

Records, per seed, both final losses (mean of the last 10 iterations), their ratio, and the largest one-step loss
rise of each run (a spike FP8 shows and BF16 does not); with several seeds, the spread of each kind's final loss
(how much of an FP8 / BF16 gap is run-to-run variation). Writes the loss curves of all runs to loss_parity.png beside
the results when matplotlib is present.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import dump, record  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
MODEL = ["--num-layers", "16", "--hidden-size", "2048", "--ffn-hidden-size", "8192", "--num-attention-heads", "16",
         "--seq-length", "1024", "--micro-batch-size", "4", "--global-batch-size", "16", "--lr", "3e-4",
         "--min-lr", "3e-5", "--lr-warmup-iters", "30", "--lr-decay-style", "cosine", "--clip-grad", "1.0",
         "--bf16", "--log-interval", "50", "--no-progress-bar"]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_job(extra: List[str], steps: int, nproc: int, log: Path) -> List[float]:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={_port()}",
           str(ROOT / "launch" / "pretrain_gpt.py"), "--preset", "none", *MODEL, "--train-iters", str(steps), "--log-json", str(log), *extra]
    print("+ " + " ".join(cmd[3:]), flush=True)
    proc = subprocess.run(cmd, cwd=log.parent, text=True, capture_output=True)
    if proc.returncode != 0:
        raise SystemExit(f"job failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-6000:]}")
    rows = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    return [r["loss"] for r in rows]


def write_corpus(prefix: Path, documents: int) -> None:
    """The job's generated corpus with `documents` documents, as a megatron indexed dataset at `prefix`."""
    sys.path.insert(0, str(ROOT))
    from launch.train.corpus import generate_documents
    from launch.train.indexed import write_indexed_dataset
    from launch.train.tokenizer import ByteTokenizer, token_dtype

    tok = ByteTokenizer()
    write_indexed_dataset(str(prefix), (tok.tokenize(d) for d in generate_documents(documents)),
                          dtype=token_dtype(tok.vocab_size), eod=tok.eod)


def largest_rise(losses: List[float]) -> float:
    """The largest relative one-step rise of the loss, after the first 10% of the run."""
    start = max(1, len(losses) // 10)
    return max((b - a) / a for a, b in zip(losses[start - 1:], losses[start:]))


def plot_runs(runs: Dict[Tuple[int, str], List[float]], png: Path) -> None:
    """The loss curves of `runs` ((seed, "BF16" | "FP8") -> losses): a colour per kind, a line style per seed;
    no plot without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    seeds = sorted({seed for seed, _ in runs})
    fig, ax = plt.subplots(figsize=(8, 4))
    for (seed, kind), losses in sorted(runs.items()):
        ax.plot(range(1, len(losses) + 1), losses, color="C0" if kind == "BF16" else "C1", linewidth=1,
                linestyle=("-", "--", ":", "-.")[seeds.index(seed) % 4],
                label=f"{'BF16' if kind == 'BF16' else 'FP8 hybrid, delayed'}, seed {seed}")
    ax.set_xlabel("iteration"), ax.set_ylabel("loss"), ax.set_yscale("log"), ax.legend(fontsize=7)
    fig.savefig(png, dpi=100)
    print(f"plot: {png}")


def main(argv: List[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", nargs="?", default="bench_results.jsonl")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("--documents", type=int, default=24000, help="generated corpus size (documents of ~230 bytes)")
    p.add_argument("--seeds", default="1234", help="comma-separated seeds; BF16 and FP8 run once per seed")
    p.add_argument("--job-args", default="", help="more flags for both runs of the job, e.g. '--cuda-graph'")
    p.add_argument("--log-dir", default=None, help="keep the runs' JSON logs here (default: a temporary directory)")
    args = p.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    runs = {}  # (seed, "BF16" | "FP8") -> losses
    with tempfile.TemporaryDirectory() as tmp:
        logs = Path(args.log_dir or tmp).resolve()
        logs.mkdir(parents=True, exist_ok=True)
        write_corpus(Path(tmp) / "corpus", args.documents)
        data = ["--data-path", str(Path(tmp) / "corpus"), "--data-cache-path", str(Path(tmp) / "cache"),
                "--split", "100,0,0", *args.job_args.split()]
        for seed in seeds:
            common = data + ["--seed", str(seed)]
            runs[seed, "BF16"] = run_job(common, args.steps, args.nproc, logs / f"bf16_seed{seed}.jsonl")
            runs[seed, "FP8"] = run_job(common + ["--fp8-format", "hybrid", "--fp8-recipe", "delayed"], args.steps,
                                        args.nproc, logs / f"fp8_seed{seed}.jsonl")
    case = f"~1B GPT, {args.steps} steps, {args.nproc} GPU" + (f", {args.job_args}" if args.job_args else "")
    finals = {k: sum(v[-10:]) / 10 for k, v in runs.items()}
    for seed in seeds:
        bf16, fp8 = finals[seed, "BF16"], finals[seed, "FP8"]
        record("loss_parity", f"{case}, seed {seed}, BF16 final loss", "loss", bf16)
        record("loss_parity", f"{case}, seed {seed}, FP8 final loss", "loss", fp8, "BF16 final loss", fp8 / bf16)
        for kind in ("BF16", "FP8"):
            record("loss_parity", f"{case}, seed {seed}, {kind} largest rise", "rel", largest_rise(runs[seed, kind]))
    if len(seeds) > 1:
        for kind in ("BF16", "FP8"):
            values = [finals[s, kind] for s in seeds]
            print(f"{kind} final loss over {len(seeds)} seeds: min {min(values):.4f} max {max(values):.4f} "
                  f"mean {sum(values) / len(values):.4f}")
    first = runs[seeds[0], "BF16"]
    print("iteration  " + "  ".join(f"{k}/{s:<6d}" for s in seeds for k in ("BF16", "FP8")))
    for i in range(0, len(first), max(1, len(first) // 15)):
        print(f"{i + 1:9d}  " + "  ".join(f"{runs[s, k][i]:11.4f}" for s in seeds for k in ("BF16", "FP8")))
    plot_runs(runs, Path(os.path.abspath(args.out)).with_name("loss_parity.png"))
    dump(args.out)


if __name__ == "__main__":
    main(sys.argv[1:])
