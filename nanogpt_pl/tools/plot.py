"""``nanogpt-pl plot RUN_DIR...``: loss and throughput curves from the CSV logs.

Each RUN_DIR is a run's log folder (the ``save_dir`` of its CSVLogger, e.g.
``logs/quickstart``, or any folder above a ``metrics.csv``; the newest version is used).
One PNG per figure, every run overlaid with a legend:

- ``loss_vs_step.png``: train loss (lines) and validation loss (markers) against the step;
- ``loss_vs_tokens.png``: the same against the training tokens seen;
- ``tokens_per_s.png``: training throughput against the step.
"""

from __future__ import annotations

import csv
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

FIGURES = ("loss_vs_step", "loss_vs_tokens", "tokens_per_s")
DEFAULT_SIZE = (960, 600)  # pixels
DPI = 100


@dataclass
class RunLog:
    """The curves of one run, read from its ``metrics.csv``."""

    label: str
    path: Path
    train: list[tuple[int, float]] = field(default_factory=list)  # (step, train/loss)
    val: list[tuple[int, float]] = field(default_factory=list)  # (step, val/loss)
    tokens: dict[int, float] = field(default_factory=dict)  # step -> tokens through that step
    tokens_per_s: list[tuple[int, float]] = field(default_factory=list)
    columns: dict[str, list[tuple[int, float]]] = field(default_factory=dict)  # every numeric column

    def last(self, column: str) -> Optional[float]:
        values = self.columns.get(column)
        return values[-1][1] if values else None

    def at_tokens(self, points: list[tuple[int, float]]) -> list[tuple[float, float]]:
        return [(self.tokens[s], v) for s, v in points if s in self.tokens]


def _version(path: Path) -> tuple[int, float]:
    m = re.search(r"version_(\d+)", str(path))
    return (int(m.group(1)) if m else -1, path.stat().st_mtime)


def find_metrics(run_dir: str | Path) -> Path:
    """The newest ``metrics.csv`` at or under ``run_dir``."""
    p = Path(run_dir)
    if p.is_file():
        if p.suffix != ".csv":
            raise ValueError(f"{p} is not a CSV file; pass a run's log folder (the save_dir of its CSVLogger)")
        return p
    if not p.is_dir():
        raise FileNotFoundError(f"run folder {p} not found; pass a run's log folder, e.g. logs/quickstart")
    found = sorted(p.rglob("metrics.csv"), key=_version)
    if not found:
        raise FileNotFoundError(f"no metrics.csv under {p}; log the run with lightning.pytorch.loggers.CSVLogger "
                                "(configs/quickstart.yaml does), then pass its save_dir")
    return found[-1]


def distinct_labels(paths: Sequence[str | Path]) -> list[str]:
    """Default names of runs: the fewest trailing path parts that tell them apart.

    ``logs/a/csv/version_0`` and ``logs/b/csv/version_0`` are ``a/csv/version_0`` and
    ``b/csv/version_0``; ``x/metrics.csv`` and ``y/metrics.csv`` are ``x`` and ``y`` (a
    ``metrics.csv`` file name says nothing), and so on for any other common file name.
    """
    parts = []
    for p in paths:
        q = Path(p).resolve()
        if q.suffix == ".csv" and len({Path(o).name for o in paths}) == 1:
            q = q.parent  # one file name in every path (or one path): the folders are the names
        parts.append(q.parts)
    longest = max((len(x) for x in parts), default=1)
    for k in range(1, longest + 1):
        labels = ["/".join(x[-k:]) for x in parts]
        if len(set(labels)) == len(labels):
            return labels
    return ["/".join(x) for x in parts]  # the same path twice: its full name, twice


def load_run(run_dir: str | Path, label: Optional[str] = None) -> RunLog:
    """Read one run's CSV log (Lightning's CSVLogger format: one row per logging call)."""
    path = find_metrics(run_dir)
    run = RunLog(label=label or Path(run_dir).name, path=path)
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            step_text = row.get("step") or ""
            if not step_text:
                continue
            step = int(float(step_text))
            for key, text in row.items():
                if key in ("step", "epoch") or not text:
                    continue
                try:
                    value = float(text)
                except ValueError:
                    continue
                run.columns.setdefault(key, []).append((step, value))
    if "train/loss" not in run.columns:
        raise ValueError(f"{path} has no train/loss column; is it the metrics.csv of a nanogpt-pl training run?")
    finite = lambda pts: [(s, v) for s, v in pts if math.isfinite(v)]
    run.train = finite(run.columns["train/loss"])
    run.val = finite(run.columns.get("val/loss", []))
    run.tokens = dict(run.columns.get("train/tokens", []))
    run.tokens_per_s = finite(run.columns.get("train/tokens_per_s", []))
    return run


def plot_runs(runs: Sequence[RunLog], out_dir: str | Path, size: tuple[int, int] = DEFAULT_SIZE,
              title: Optional[str] = None) -> list[Path]:
    """Write the figures of :data:`FIGURES` for ``runs`` into ``out_dir``; returns their paths."""
    try:
        import matplotlib  # optional: the [plot] extra
    except ImportError as e:
        raise ImportError("plotting needs matplotlib: pip install -e '.[plot]'") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after matplotlib.use: the headless backend first

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    paths = []
    for name in FIGURES:
        fig, ax = plt.subplots(figsize=(size[0] / DPI, size[1] / DPI), dpi=DPI)
        for i, run in enumerate(runs):
            c = colors[i % len(colors)]
            if name == "tokens_per_s":
                pts = run.tokens_per_s
                if pts:
                    ax.plot(*zip(*pts), color=c, label=run.label)
                continue
            train = run.train if name == "loss_vs_step" else run.at_tokens(run.train)
            val = run.val if name == "loss_vs_step" else run.at_tokens(run.val)
            if train:
                ax.plot(*zip(*train), color=c, label=f"{run.label} train")
            if val:
                ax.plot(*zip(*val), color=c, marker="o", linestyle="--", label=f"{run.label} val")
        ax.set_xlabel("tokens" if name == "loss_vs_tokens" else "step")
        ax.set_ylabel("tokens/s" if name == "tokens_per_s" else "loss (nats)")
        ax.set_title(title or {"loss_vs_step": "loss", "loss_vs_tokens": "loss against tokens",
                               "tokens_per_s": "training throughput"}[name])
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
        fig.tight_layout()
        path = out / f"{name}.png"
        fig.savefig(path, dpi=DPI)
        plt.close(fig)
        paths.append(path)
    return paths


def add_arguments(parser) -> None:
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR",
                        help="log folders of runs (a CSVLogger's save_dir, or a metrics.csv)")
    parser.add_argument("--labels", nargs="+", default=None, help="legend labels, one per RUN_DIR "
                        "(default: the folder names, with as many trailing parts as tell them apart)")
    parser.add_argument("--out", default="plots", help="folder for the PNG files (default plots/)")
    parser.add_argument("--size", type=int, nargs=2, default=list(DEFAULT_SIZE), metavar=("WIDTH", "HEIGHT"),
                        help=f"figure size in pixels (default {DEFAULT_SIZE[0]} {DEFAULT_SIZE[1]})")


def run(args) -> int:
    if args.labels is not None and len(args.labels) != len(args.run_dirs):
        raise ValueError(f"--labels got {len(args.labels)} labels for {len(args.run_dirs)} RUN_DIRs; give one each")
    labels = args.labels or distinct_labels(args.run_dirs)
    runs = [load_run(d, label) for d, label in zip(args.run_dirs, labels)]
    for path in plot_runs(runs, args.out, tuple(args.size)):
        print(path)
    return 0
