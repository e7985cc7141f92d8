"""``nanogpt-pl compare RUN_A RUN_B [--noise RUN_C]``: do two runs' curves agree, and how fast was each?

For a change that should leave the numbers alone (CUDA graphs on or off, another attention
kernel, compile on or off), the question is whether the loss curves differ by more than a
run's own noise. Each RUN is a run's log folder or ``metrics.csv`` (Lightning's CSVLogger,
as for ``nanogpt-pl plot``). Printed as markdown:

- **loss**: per run, the train loss at the logged steps both runs share (in ``--from-step`` ..
  ``--to-step``), its mean there, and the last validation loss in that window;
- **differences**: for A − B, and with ``--noise RUN_C`` (a run that differs from A only in its
  seed) for A − C: the mean, the mean absolute and the largest absolute difference of the train
  loss over the shared steps. A and B **agree within noise** when their mean absolute difference
  is at most that of A and C; without ``--noise`` no verdict is printed;
- **speed**: each stretch of the run whose logged intervals all trained the same tokens per
  step (a stage of the schedule), with ms/step and tokens/s from the cumulative ``train/time``
  and ``train/tokens`` columns, and B's ms/step over A's on the same steps. An interval that
  straddles a change of tokens per step belongs to no stretch; a stretch needs two logged
  intervals.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

from .plot import RunLog, distinct_labels, load_run


@dataclass
class Difference:
    """Statistics of ``a - b`` over the train-loss points two runs share."""

    steps: int
    mean: float
    mean_abs: float
    max_abs: float
    max_step: int


@dataclass
class Stretch:
    """Logged steps ``first`` .. ``last`` of one run at ``tokens_per_step``: ms per step and tokens/s."""

    first: int
    last: int
    tokens_per_step: float
    ms_per_step: float
    tokens_per_s: float


def _window(points: Sequence[tuple[int, float]], lo: int, hi: Optional[int]) -> dict[int, float]:
    return {s: v for s, v in points if s >= lo and (hi is None or s <= hi)}


def shared_losses(a: RunLog, b: RunLog, lo: int = 0, hi: Optional[int] = None) -> list[tuple[int, float, float]]:
    """(step, a's train loss, b's train loss) at the logged steps both have in [lo, hi]."""
    pa, pb = _window(a.train, lo, hi), _window(b.train, lo, hi)
    return [(s, pa[s], pb[s]) for s in sorted(pa.keys() & pb.keys())]


def difference(a: RunLog, b: RunLog, lo: int = 0, hi: Optional[int] = None) -> Difference:
    """The train-loss difference ``a - b`` over their shared logged steps."""
    pts = shared_losses(a, b, lo, hi)
    if not pts:
        span = f"steps {lo}..{'end' if hi is None else hi}"
        raise ValueError(f"{a.path} and {b.path} log train/loss at no common step in {span}; "
                         "log both runs with the same trainer.log_every_n_steps, or widen --from-step/--to-step")
    d = [(s, x - y) for s, x, y in pts]
    max_step, max_d = max(d, key=lambda p: abs(p[1]))
    return Difference(steps=len(d), mean=sum(v for _, v in d) / len(d), mean_abs=sum(abs(v) for _, v in d) / len(d),
                      max_abs=abs(max_d), max_step=max_step)


def stretches(run: RunLog, lo: int = 0, hi: Optional[int] = None) -> list[Stretch]:
    """The run's stretches of constant tokens per step (at least two logged intervals each)."""
    time = _window(run.columns.get("train/time", []), lo, hi)
    tokens = _window(run.columns.get("train/tokens", []), lo, hi)
    steps = sorted(time.keys() & tokens.keys())
    # (start step, end step, tokens per step) of each interval between consecutive logged steps
    intervals = [(s0, s1, (tokens[s1] - tokens[s0]) / (s1 - s0)) for s0, s1 in zip(steps, steps[1:])]
    groups: list[list[tuple[int, int, float]]] = []
    for iv in intervals:
        if groups and groups[-1][-1][2] == iv[2]:
            groups[-1].append(iv)
        else:
            groups.append([iv])
    out = []
    for g in groups:
        if len(g) < 2:  # one interval alone: a stage change inside it, or too short to stand for a stage
            continue
        first, last = g[0][0], g[-1][1]
        seconds = time[last] - time[first]
        if seconds <= 0:
            continue
        n = last - first
        out.append(Stretch(first=first, last=last, tokens_per_step=g[0][2], ms_per_step=1000 * seconds / n,
                           tokens_per_s=(tokens[last] - tokens[first]) / seconds))
    return out


def _ms_per_step(run: RunLog, first: int, last: int) -> Optional[float]:
    time = dict(run.columns.get("train/time", []))
    if first in time and last in time and time[last] > time[first]:
        return 1000 * (time[last] - time[first]) / (last - first)
    return None


def _fmt(x: float) -> str:
    return f"{x:+.4f}"


def report(runs: Sequence[RunLog], noise: Optional[RunLog] = None, lo: int = 0, hi: Optional[int] = None) -> str:
    """The markdown report of two runs (``runs[0]`` = A, ``runs[1]`` = B) and an optional seed twin of A."""
    a, b = runs
    everyone = [a, b] + ([noise] if noise is not None else [])
    shared = shared_losses(a, b, lo, hi)
    lines = [f"## {a.label} against {b.label}", ""]
    if noise is not None:
        lines += [f"Noise: {noise.label} (A with another seed).", ""]
    lines += ["| run | metrics.csv | train-loss points | mean train loss (shared steps) | last val/loss (step) |",
              "|---|---|---|---|---|"]
    shared_steps = {s for s, _, _ in shared}
    for r in everyone:
        pts = {s: v for s, v in r.train if s in shared_steps}
        mean = sum(pts.values()) / len(pts) if pts else math.nan
        vals = sorted(_window(r.val, lo, hi).items())
        val = f"{vals[-1][1]:.4f} ({vals[-1][0]})" if vals else "—"
        lines.append(f"| {r.label} | {r.path} | {len(pts)} | {mean:.4f} | {val} |")
    lines += ["", f"Train-loss differences over the {len(shared)} logged steps A and B share "
              f"({shared[0][0] if shared else '-'}..{shared[-1][0] if shared else '-'}):", "",
              "| pair | steps | mean | mean abs | max abs (step) |", "|---|---|---|---|---|"]
    pair = difference(a, b, lo, hi)
    rows = [(f"{a.label} − {b.label}", pair)]
    seed_pair = None
    if noise is not None:
        seed_pair = difference(a, noise, lo, hi)
        rows.append((f"{a.label} − {noise.label} (noise)", seed_pair))
    for name, d in rows:
        lines.append(f"| {name} | {d.steps} | {_fmt(d.mean)} | {d.mean_abs:.4f} | {d.max_abs:.4f} ({d.max_step}) |")
    if seed_pair is not None:
        agree = pair.mean_abs <= seed_pair.mean_abs
        verdict = "agree within noise" if agree else "differ by more than the noise"
        ratio = (f"{seed_pair.mean_abs / pair.mean_abs:.2f}x" if pair.mean_abs > 0
                 else "the two are equal at every shared step")
        lines += ["", f"**{a.label} and {b.label} {verdict}**: mean |Δ| {pair.mean_abs:.4f} against "
                  f"{seed_pair.mean_abs:.4f} between seeds ({ratio})."]
    speed = stretches(a, lo, hi)
    if speed:
        lines += ["", f"Speed, from train/time (B / A > 1: {a.label} is faster):", "",
                  f"| steps | tokens/step | {a.label} ms/step | {a.label} tokens/s | "
                  + " | ".join(f"{r.label} ms/step | {r.label} / {a.label}" for r in everyone[1:]) + " |",
                  "|---|---|---|---|" + "---|---|" * (len(everyone) - 1)]
        for st in speed:
            cells = []
            for r in everyone[1:]:
                ms = _ms_per_step(r, st.first, st.last)
                cells += [f"{ms:.1f}", f"{ms / st.ms_per_step:.3f}x"] if ms else ["—", "—"]
            lines.append(f"| {st.first}-{st.last} | {st.tokens_per_step:,.0f} | {st.ms_per_step:.1f} | "
                         f"{st.tokens_per_s:,.0f} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def add_arguments(parser) -> None:
    parser.add_argument("run_dirs", nargs=2, metavar="RUN",
                        help="the two runs: log folders (a CSVLogger's save_dir) or metrics.csv files")
    parser.add_argument("--noise", default=None, metavar="RUN",
                        help="a run that differs from the first only in its seed: its difference is the noise")
    parser.add_argument("--labels", nargs="+", default=None,
                        help="names of the runs, one per RUN (and one for --noise); default: the folder "
                        "names (as many trailing parts as tell them apart)")
    parser.add_argument("--from-step", type=int, default=0, help="compare logged steps from this one on")
    parser.add_argument("--to-step", type=int, default=None, help="compare logged steps up to this one")


def run(args) -> int:
    paths = list(args.run_dirs) + ([args.noise] if args.noise else [])
    if args.labels is not None and len(args.labels) != len(paths):
        raise ValueError(f"--labels got {len(args.labels)} labels for {len(paths)} runs "
                         "(the two RUNs, and --noise when given); give one each")
    labels = args.labels or distinct_labels(paths)
    runs = [load_run(p, label) for p, label in zip(paths, labels)]
    print(report(runs[:2], runs[2] if args.noise else None, args.from_step, args.to_step), end="")
    return 0
