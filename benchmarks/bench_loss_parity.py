"""Loss parity of FP8 against BF16 on a ~1B GPT, through the training job (megatron's optimizer with fp32
master weights, bf16 parameters): the same seed, data and steps twice, FP8 off and FP8 on (hybrid, delayed).

    python bench_loss_parity.py results.jsonl [--steps 300] [--nproc 1]

The data is the job's generated corpus (a word-level Markov chain, spelled in bytes), generated here with enough
documents that the run sees each token about once: the job's built-in 2000 documents would be repeated ~10
times in 300 steps of this size, and the late losses would then measure memorisation.

Records both final losses (mean of the last 10 iterations), their ratio, and the largest one-step loss rise of
each run (a spike FP8 shows and BF16 does not); writes the loss curves of both runs to loss_parity.png beside
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
from typing import List

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import dump, record  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
MODEL = ["--num-layers", "16", "--hidden-size", "2048", "--ffn-hidden-size", "8192", "--num-attention-heads", "16",
         "--seq-length", "1024", "--micro-batch-size", "4", "--global-batch-size", "16", "--lr", "3e-4",
         "--min-lr", "3e-5", "--lr-warmup-iters", "30", "--lr-decay-style", "cosine", "--clip-grad", "1.0",
         "--bf16", "--log-interval", "50", "--no-progress-bar", "--seed", "1234"]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_job(extra: List[str], steps: int, nproc: int, log: Path) -> List[float]:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={_port()}",
           str(ROOT / "launch" / "pretrain_gpt.py"), *MODEL, "--train-iters", str(steps), "--log-json", str(log), *extra]
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


def main(argv: List[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", nargs="?", default="bench_results.jsonl")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("--documents", type=int, default=24000, help="generated corpus size (documents of ~230 bytes)")
    p.add_argument("--log-dir", default=None, help="keep both runs' JSON logs here (default: a temporary directory)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        logs = Path(args.log_dir or tmp).resolve()
        logs.mkdir(parents=True, exist_ok=True)
        write_corpus(Path(tmp) / "corpus", args.documents)
        data = ["--data-path", str(Path(tmp) / "corpus"), "--data-cache-path", str(Path(tmp) / "cache"),
                "--split", "100,0,0"]
        bf16 = run_job(data, args.steps, args.nproc, logs / "bf16.jsonl")
        fp8 = run_job(data + ["--fp8-format", "hybrid", "--fp8-recipe", "delayed"], args.steps, args.nproc,
                      logs / "fp8.jsonl")
    final_bf16, final_fp8 = sum(bf16[-10:]) / 10, sum(fp8[-10:]) / 10
    case = f"~1B GPT, {args.steps} steps, {args.nproc} GPU"
    record("loss_parity", f"{case} BF16 final loss", "loss", final_bf16)
    record("loss_parity", f"{case} FP8 final loss", "loss", final_fp8, "BF16 final loss", final_fp8 / final_bf16)
    record("loss_parity", f"{case} BF16 largest rise", "rel", largest_rise(bf16))
    record("loss_parity", f"{case} FP8 largest rise", "rel", largest_rise(fp8))
    print("iteration  bf16     fp8")
    for i in range(0, len(bf16), max(1, len(bf16) // 15)):
        print(f"{i + 1:9d}  {bf16[i]:.4f}  {fp8[i]:.4f}")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 4))
        ax.plot(range(1, len(bf16) + 1), bf16, label="BF16")
        ax.plot(range(1, len(fp8) + 1), fp8, label="FP8 hybrid, delayed")
        ax.set_xlabel("iteration"), ax.set_ylabel("loss"), ax.set_yscale("log"), ax.legend()
        png = Path(os.path.abspath(args.out)).with_name("loss_parity.png")
        fig.savefig(png, dpi=100)
        print(f"plot: {png}")
    except ImportError:
        print("matplotlib not installed: no plot")
    dump(args.out)


if __name__ == "__main__":
    main(sys.argv[1:])
