"""``nanogpt-pl ablate``: a base config and each ablation overlay at one horizon, as a table.

    nanogpt-pl ablate --config configs/speedrun_1gpu.yaml --steps 300
    nanogpt-pl ablate --config configs/quickstart.yaml --steps 60 \\
        --ablations configs/ablations/adamw_matrices.yaml -- --model.gpt.num_layers 2

Every run is ``nanogpt-pl fit --config BASE [--config OVERLAY] --trainer.max_steps STEPS``
plus the overrides after ``--``, in its own folder ``OUT/NAME/`` (the working directory of
the run, so the config's relative log and checkpoint paths land there). A run that
finished writes ``OUT/NAME/result.json`` and is not run again for the same horizon and
overrides; an interrupted one is run again from its start.

``OUT/ablation.md`` is the table in the form of the record's ablation table (RECORD §12):
validation loss, its difference from the base in milli-nats (ablation − base; 1 mn =
0.001 nats), tokens/s and training time; ``OUT/plots/`` holds the overlaid curves.
The config must log with a CSVLogger (the repository's configs do).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional, Sequence

from .plot import load_run, plot_runs

DEFAULT_ABLATIONS = "configs/ablations"
RESULT_FILE = "result.json"
BASE_NAME = "base"


@dataclass
class AblationResult:
    name: str
    configs: list[str]
    steps: int
    overrides: list[str]
    val_loss: float
    tokens_per_s: Optional[float]
    time_s: Optional[float]


def resolve_ablations(ablations: Optional[Sequence[str]]) -> list[Path]:
    """The overlay files: the given ones, or every ``configs/ablations/*.yaml``."""
    if not ablations:
        folder = Path(DEFAULT_ABLATIONS)
        found = sorted(folder.glob("*.yaml"))
        if not found:
            raise FileNotFoundError(f"no ablation overlays in {folder}/ (run from the repository root, or pass "
                                    "--ablations FILE...)")
        return [p.resolve() for p in found]
    out = []
    for a in ablations:
        p = Path(a)
        if not p.is_file() and (Path(DEFAULT_ABLATIONS) / a).is_file():
            p = Path(DEFAULT_ABLATIONS) / a
        elif not p.is_file() and (Path(DEFAULT_ABLATIONS) / f"{a}.yaml").is_file():
            p = Path(DEFAULT_ABLATIONS) / f"{a}.yaml"
        if not p.is_file():
            known = ", ".join(sorted(q.stem for q in Path(DEFAULT_ABLATIONS).glob("*.yaml"))) or "none found"
            raise FileNotFoundError(f"ablation overlay {a} not found; pass a YAML file or a name from "
                                    f"{DEFAULT_ABLATIONS}/ ({known})")
        out.append(p.resolve())
    names = [p.stem for p in out]
    if BASE_NAME in names or len(set(names)) != len(names):
        raise ValueError(f"ablation overlays need distinct file names other than '{BASE_NAME}': {names}")
    return out


def _summary(run_dir: Path, name: str, configs: list[str], steps: int, overrides: list[str],
             wall: float) -> AblationResult:
    log = load_run(run_dir, name)
    if not log.val:
        raise RuntimeError(f"run {name} logged no val/loss ({log.path}); the run must validate at its end")
    tps = [v for _, v in log.tokens_per_s]
    clock = log.last("speedrun/train_time_s")
    train_time = clock if clock is not None else log.last("train/time")
    if train_time is None:
        train_time = wall
    return AblationResult(name=name, configs=configs, steps=steps, overrides=overrides, val_loss=log.val[-1][1],
                          tokens_per_s=sum(tps) / len(tps) if tps else None, time_s=train_time)


def run_one(name: str, configs: list[Path], steps: int, overrides: list[str], out_dir: Path,
            echo: bool = True) -> AblationResult:
    """Train one configuration in ``out_dir/name`` unless a finished result for it is there."""
    run_dir = out_dir / name
    result_file = run_dir / RESULT_FILE
    config_names = [str(c) for c in configs]
    if result_file.is_file():
        saved = AblationResult(**json.loads(result_file.read_text()))
        if saved.steps == steps and saved.overrides == overrides and saved.configs == config_names:
            if echo:
                print(f"{name}: finished earlier ({result_file}), not run again", file=sys.stderr)
            return saved
    if run_dir.exists():  # an interrupted or outdated run: start it over
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    cmd = [sys.executable, "-m", "nanogpt_pl.cli", "fit"]
    for c in configs:
        cmd += ["--config", str(c)]
    cmd += ["--trainer.max_steps", str(steps), *overrides]
    env = dict(os.environ)
    # the run's working directory is its folder: keep the caller's imports (the top-level callbacks package)
    paths = [str(Path(p).resolve()) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(paths + [str(Path.cwd())])
    if echo:
        print(f"{name}: training {steps} steps in {run_dir}", file=sys.stderr)
    start = time.perf_counter()
    with open(run_dir / "train.log", "w") as log:
        done = subprocess.run(cmd, cwd=run_dir, env=env, stdout=log, stderr=subprocess.STDOUT)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        tail = (run_dir / "train.log").read_text().strip().splitlines()[-1:] or [""]
        raise RuntimeError(f"ablation {name} failed (exit {done.returncode}): {tail[0][:300]}; "
                           f"full log in {run_dir / 'train.log'}")
    result = _summary(run_dir, name, config_names, steps, overrides, wall)
    result_file.write_text(json.dumps(asdict(result), indent=1))
    return result


def _fmt(value: Optional[float], spec: str) -> str:
    return "–" if value is None else format(value, spec)


def markdown_table(results: list[AblationResult], base_config: str, steps: int) -> str:
    """The record's ablation-table form: one row per run, deltas against the base row."""
    base = results[0]
    lines = [
        f"Ablations of `{base_config}` at {steps} steps. Δ = ablation − base; val in milli-nats "
        "(1 mn = 0.001 nats of final validation loss), time in seconds of training.",
        "",
        "| run | val loss | valΔ (mn) | tokens/s | time (s) | wallΔ (s) |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        is_base = r is base
        dval = None if is_base else (r.val_loss - base.val_loss) * 1000
        dtime = None if (is_base or r.time_s is None or base.time_s is None) else r.time_s - base.time_s
        lines.append(f"| {r.name} | {r.val_loss:.4f} | {_fmt(dval, '+.1f')} | {_fmt(r.tokens_per_s, ',.0f')} | "
                     f"{_fmt(r.time_s, '.1f')} | {_fmt(dtime, '+.2f')} |")
    return "\n".join(lines) + "\n"


def ablate(config: str, steps: int, ablations: Optional[Sequence[str]] = None, out_dir: Optional[str] = None,
           overrides: Sequence[str] = ()) -> tuple[Path, list[AblationResult]]:
    """Run the base and every overlay (skipping finished ones); write the table and plots. Returns the table path."""
    base = Path(config)
    if not base.is_file():
        raise FileNotFoundError(f"base config {config} not found; pass --config FILE (e.g. configs/quickstart.yaml)")
    if steps < 1:
        raise ValueError(f"--steps must be >= 1, got {steps}")
    overlays = resolve_ablations(ablations)
    out = Path(out_dir) if out_dir else Path("ablations") / base.stem
    out.mkdir(parents=True, exist_ok=True)
    overrides = list(overrides)
    results = [run_one(BASE_NAME, [base.resolve()], steps, overrides, out)]
    for overlay in overlays:
        results.append(run_one(overlay.stem, [base.resolve(), overlay], steps, overrides, out))
    table = out / "ablation.md"
    table.write_text(markdown_table(results, config, steps))
    plot_runs([load_run(out / r.name, r.name) for r in results], out / "plots",
              title=f"{base.stem}: base and ablations")
    return table, results


def add_arguments(parser) -> None:
    parser.add_argument("--config", required=True, help="the base config (e.g. configs/speedrun_1gpu.yaml)")
    parser.add_argument("--steps", type=int, required=True, help="horizon: training steps of every run")
    parser.add_argument("--ablations", nargs="+", default=None, metavar="OVERLAY",
                        help=f"overlay files or names in {DEFAULT_ABLATIONS}/ (default: every *.yaml there)")
    parser.add_argument("--out-dir", default=None, help="folder for the runs, table and plots "
                        "(default ablations/<base config name>)")
    parser.add_argument("overrides", nargs="*", help="after --: options for every run, e.g. -- --trainer.devices 8")


def run(args) -> int:
    table, _ = ablate(args.config, args.steps, args.ablations, args.out_dir, args.overrides)
    print(table.read_text(), end="")
    print(f"table: {table}\nplots: {table.parent / 'plots'}", file=sys.stderr)
    return 0
