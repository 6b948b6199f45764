"""Plot a run's loss and per-layer FP8 amax / scale histories (from its --log-json file) to a PNG.

    python launch/plot_run.py run.jsonl run.png

Top: loss per iteration. Middle and bottom: for each FP8 tensor the job recorded at its log intervals
(`fp8_layers`: newest amax and scale of every FP8 tensor, named by global layer), the amax and the scale
over iterations, log scale; one line per tensor, coloured by layer.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Dict, List, Optional, Tuple


def read_log(path: str) -> Tuple[List[Tuple[int, float]], Dict[str, Dict[str, List[Tuple[int, float]]]]]:
    """(iteration, loss) pairs and per tensor name: amax and scale series. A resumed run's repeated
    iterations keep their last value.

    Raises:
        ValueError: a line that is not a JSON object with an `iteration` (the message names the line).
    """
    losses: Dict[int, float] = {}
    series: Dict[str, Dict[str, Dict[int, float]]] = {}
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                it = int(row["iteration"])
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as err:
                raise ValueError(f"{path}:{number}: not a log row of the job ({err})") from None
            if row.get("loss") is not None:
                losses[it] = float(row["loss"])
            for name, state in (row.get("fp8_layers") or {}).items():
                for kind in ("amax", "scale"):
                    for i, value in enumerate(state.get(kind, [])):
                        series.setdefault(f"{name}[{i}]", {"amax": {}, "scale": {}})[kind][it] = float(value)
    loss_pairs = sorted(losses.items())
    out = {name: {k: sorted(v.items()) for k, v in kinds.items()} for name, kinds in series.items()}
    return loss_pairs, out


def plot(log_path: str, png_path: str, title: Optional[str] = None) -> int:
    """Write the figure; returns the number of FP8 tensors plotted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    losses, series = read_log(log_path)
    if not losses:
        raise ValueError(f"{log_path}: no loss values (is it the --log-json file of a run?)")
    fig, axes = plt.subplots(3, 1, figsize=(10, 11), sharex=True)
    axes[0].plot([i for i, _ in losses], [v for _, v in losses], color="black")
    axes[0].set_ylabel("loss")
    axes[0].set_title(title or log_path)
    axes[0].grid(alpha=0.3)
    layers = sorted({name.split("/")[0] for name in series})
    cmap = plt.get_cmap("viridis", max(len(layers), 2))
    for name, kinds in sorted(series.items()):
        color = cmap(layers.index(name.split("/")[0]))
        for ax, kind in ((axes[1], "amax"), (axes[2], "scale")):
            pts = [(i, v) for i, v in kinds[kind] if v > 0]
            if pts:
                ax.plot([i for i, _ in pts], [v for _, v in pts], color=color, alpha=0.6, linewidth=0.8, marker=".")
    for ax, label in ((axes[1], "FP8 amax (newest)"), (axes[2], "FP8 scale")):
        ax.set_yscale("log")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    if layers:
        handles = [plt.Line2D([], [], color=cmap(i), label=layer) for i, layer in enumerate(layers)]
        axes[1].legend(handles=handles, fontsize=7, ncol=4, loc="best")
    else:
        axes[1].text(0.5, 0.5, "no FP8 state recorded (FP8 off?)", ha="center", transform=axes[1].transAxes)
    axes[2].set_xlabel("iteration")
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
    return len(series)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("log_json", help="the run's --log-json file")
    p.add_argument("png", help="output PNG path")
    p.add_argument("--title", default=None)
    args = p.parse_args(argv)
    try:
        n = plot(args.log_json, args.png, args.title)
    except (OSError, ValueError) as err:
        print(f"plot_run.py: error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {args.png} (loss and {n} FP8 tensors)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
