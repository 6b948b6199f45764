"""Plot a run's loss and, for FP8 runs, its FP8 amax / scale histories by role (from its metrics file) to a PNG.

    python launch/plot_run.py <save>/logs/metrics.jsonl run.png      # or a run's --log-json file

Top: loss per iteration. With FP8 on (some tensor recorded an amax), one row per role (input, weight, grad)
with the newest amax (left) and the scale (right) of that role's FP8 tensors over the iterations the job
recorded them (`fp8_layers`, at its log intervals), log scale: the median over the role's tensors, a band
from their minimum to their maximum, and the few tensors whose scale moved most as lines named by layer.
A run without FP8 gets the loss panel alone. The job draws this plot into `<save>/logs/run.png` at its end.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Dict, List, Optional, Tuple

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)

from launch.train.fp8_roles import ROLES, role_of, tensor_name  # noqa: E402

Series = List[Tuple[int, float]]
TensorKey = Tuple[str, int]  # (FP8 meta name, row)
ROLE_COLORS = {"input": "tab:blue", "weight": "tab:green", "grad": "tab:red"}
OUTLIER_COLORS = ("tab:orange", "tab:purple", "tab:brown")
KINDS = (("amax", "amax (newest)"), ("scale", "scale"))


def read_log(path: str) -> Tuple[Series, Dict[TensorKey, Dict[str, Series]]]:
    """(iteration, loss) pairs and, per FP8 tensor (meta name, row), its amax and scale series. A resumed
    run's repeated iterations keep their last value.

    Raises:
        ValueError: a line that is not a JSON object with an `iteration` (the message names the line).
    """
    losses: Dict[int, float] = {}
    series: Dict[TensorKey, Dict[str, Dict[int, float]]] = {}
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
                        series.setdefault((name, i), {"amax": {}, "scale": {}})[kind][it] = float(value)
    out = {key: {k: sorted(v.items()) for k, v in kinds.items()} for key, kinds in series.items()}
    return sorted(losses.items()), out


def fp8_on(tensors: Dict[TensorKey, Dict[str, Series]]) -> bool:
    """Whether the run computed in FP8: some tensor recorded an amax (with FP8 off every amax stays 0)."""
    return any(v > 0 for kinds in tensors.values() for _, v in kinds["amax"])


def by_role(tensors: Dict[TensorKey, Dict[str, Series]]) -> Dict[str, Dict[TensorKey, Dict[str, Series]]]:
    """The tensors grouped by role, in `ROLES` order (roles without tensors left out)."""
    groups: Dict[str, Dict[TensorKey, Dict[str, Series]]] = {}
    for key, kinds in sorted(tensors.items()):
        role = role_of(*key)
        if role is not None:
            groups.setdefault(role, {})[key] = kinds
    return {role: groups[role] for role in ROLES if role in groups}


def band(group: Dict[TensorKey, Dict[str, Series]], kind: str) -> Tuple[List[int], List[float], List[float],
                                                                      List[float]]:
    """Per recorded iteration: the minimum, median and maximum of `kind` over the group's positive values."""
    import numpy as np

    at: Dict[int, List[float]] = {}
    for kinds in group.values():
        for it, v in kinds[kind]:
            if v > 0:
                at.setdefault(it, []).append(v)
    its = sorted(at)
    return (its, [min(at[i]) for i in its], [float(np.median(at[i])) for i in its], [max(at[i]) for i in its])


def movers(group: Dict[TensorKey, Dict[str, Series]], count: int = 3) -> List[Tuple[TensorKey, float]]:
    """The `count` tensors whose scale moved most (the ratio of its largest to its smallest recorded scale),
    largest first, with that ratio; tensors whose scale never moved are left out."""
    moved = []
    for key, kinds in group.items():
        scales = [v for _, v in kinds["scale"] if v > 0]
        if scales and max(scales) > min(scales):
            moved.append((key, max(scales) / min(scales)))
    return sorted(moved, key=lambda kv: (-kv[1], kv[0]))[:count]


def figure(log_path: str, title: Optional[str] = None):
    """The figure of the run whose metrics file is `log_path` (see `draw`).

    Raises:
        ValueError: no loss values in the file, or a line that is no log row.
    """
    losses, tensors = _read_run(log_path)
    return draw(losses, tensors, title or log_path)


def _read_run(log_path: str) -> Tuple[Series, Dict[TensorKey, Dict[str, Series]]]:
    """`read_log`, refusing a file without loss values."""
    losses, tensors = read_log(log_path)
    if not losses:
        raise ValueError(f"{log_path}: no loss values (is it the metrics file of a run?)")
    return losses, tensors


def draw(losses: Series, tensors: Dict[TensorKey, Dict[str, Series]], title: str):
    """A matplotlib Figure on the Agg canvas: the loss panel, and with FP8 on the amax and scale panels of
    each role."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    roles = by_role(tensors) if fp8_on(tensors) else {}
    height = 3.2 + 3.0 * len(roles)
    fig = Figure(figsize=(13, height))
    FigureCanvasAgg(fig)
    grid = fig.add_gridspec(1 + len(roles), 2)
    loss_ax = fig.add_subplot(grid[0, :])
    _draw_loss(loss_ax, losses, fp8=bool(roles))
    for i, (role, group) in enumerate(roles.items()):
        named = movers(group)
        for j, (kind, label) in enumerate(KINDS):
            ax = fig.add_subplot(grid[1 + i, j], sharex=loss_ax)
            _draw_role(ax, role, kind, group, named)
            ax.set_title(f"FP8 {role}: {label} of {len(group)} tensors", fontsize=10)
            if i == len(roles) - 1:
                ax.set_xlabel("iteration")
    fig.suptitle(title, fontsize=11)
    # fixed margins in inches (tight_layout measured every label: most of the plot's time at the end of a run)
    fig.subplots_adjust(left=0.075, right=0.985, top=1 - 0.8 / height, bottom=0.55 / height, wspace=0.2,
                        hspace=0.5 * 3.0 / 2.6)
    return fig


def _draw_loss(ax, losses: Series, fp8: bool) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.plot([i for i, _ in losses], [v for _, v in losses], color="black")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # shared by the FP8 panels
    ax.set_title("loss" if fp8 else "loss (FP8 off: no FP8 panels)", fontsize=10)
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    if not fp8:
        ax.set_xlabel("iteration")


def _draw_role(ax, role: str, kind: str, group: Dict[TensorKey, Dict[str, Series]],
               named: List[Tuple[TensorKey, float]]) -> None:
    """One role's `kind` panel: median line, min-max band, and the named tensors whose scale moved most."""
    its, lo, med, hi = band(group, kind)
    color = ROLE_COLORS[role]
    ax.fill_between(its, lo, hi, color=color, alpha=0.2, label=f"{role}: min-max")
    ax.plot(its, med, color=color, marker=".", label=f"{role}: median")
    for (key, ratio), line_color in zip(named, OUTLIER_COLORS):
        pts = [(i, v) for i, v in group[key][kind] if v > 0]
        ax.plot([i for i, _ in pts], [v for _, v in pts], color=line_color, linestyle="--", linewidth=1,
                label=f"{tensor_name(key[0])} (scale moved x{ratio:.3g})")
    if its:
        ax.set_yscale("log")
    ax.set_ylabel(kind)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best", framealpha=0.6)


def plot(log_path: str, png_path: str, title: Optional[str] = None) -> int:
    """Write the figure to `png_path`; returns the number of FP8 tensors plotted (0: FP8 off)."""
    losses, tensors = _read_run(log_path)
    draw(losses, tensors, title or log_path).savefig(png_path, dpi=100)
    return sum(len(group) for group in by_role(tensors).values()) if fp8_on(tensors) else 0


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("log_json", help="the run's metrics file (<save>/logs/metrics.jsonl or its --log-json file)")
    p.add_argument("png", help="output PNG path")
    p.add_argument("--title", default=None)
    args = p.parse_args(argv)
    try:
        n = plot(args.log_json, args.png, args.title)
    except (OSError, ValueError) as err:
        print(f"plot_run.py: error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {args.png} (" + (f"loss and {n} FP8 tensors by role)" if n else "loss; FP8 off)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
