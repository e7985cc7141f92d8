"""``nanogpt-pl ablate | plot | generate`` run for real on the quickstart model (tiny overrides, CPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from background import command_env
from conftest import cli_in_process_as_command
from seeds import fresh_seed

ROOT = Path(__file__).resolve().parents[1]
# where a quickstart run started in a folder keeps its checkpoints (the run's log folder, nanogpt_pl/cli.py)
RUN_CHECKPOINTS = Path("logs") / "quickstart" / "csv" / "version_0" / "checkpoints"

# the quickstart config at a size that trains a step in a fraction of a second on one core
TINY = ["--model.gpt.num_layers", "2", "--model.gpt.model_dim", "32", "--model.gpt.mlp_hidden", "64",
        "--model.gpt.head_dim", "16", "--model.gpt.long_window_layers", "[1]", "--model.gpt.value_embed_layers", "[1]",
        "--model.gpt.skip_from", "null", "--model.gpt.skip_to", "null", "--trainer.enable_progress_bar", "false",
        "--trainer.log_every_n_steps", "1", "--data.val_tokens", "4096", "--data.val_seq_len", "4096",
        "--schedule.stages", "[{steps: 20, batch_tokens: 2048, seq_len: 1024, max_doc_len: 512, window_short: 128, "
        "window_long: 512, candidates: 2048}]", "--schedule.val_window_short", "128",
        "--schedule.val_window_long", "384", "--schedule.warmup_steps", "2"]
STEPS = 6
OVERLAYS = ["adamw_matrices", "no_fp8"]


def nanogpt_pl(args: list[str], cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """``nanogpt-pl ARGS`` in a process of its own (forked from the warm process of tests/warm_python.py)."""
    from warm_python import run

    return run([sys.executable, "-m", "nanogpt_pl.cli", *args], cwd=cwd, env=command_env(), timeout=600)


def nanogpt_pl_here(args: list[str], cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """``nanogpt-pl ARGS`` as :func:`nanogpt_pl` runs it, but in this process
    (``cli_in_process_as_command``), for the commands that train nothing themselves: an interpreter
    start-up (about 5 s on 2 cores) saved. ``ablate`` still trains each run in a process of its own."""
    code, stdout, stderr = cli_in_process_as_command(args, cwd)
    return subprocess.CompletedProcess(args, code, stdout, stderr)


def ablate_args(out: Path) -> list[str]:
    return ["ablate", "--config", "configs/quickstart.yaml", "--steps", str(STEPS), "--ablations", *OVERLAYS,
            "--out-dir", str(out), "--", *TINY]


@pytest.fixture(scope="module")
def ablation(tmp_path_factory):
    out = tmp_path_factory.mktemp("ablate")
    done = nanogpt_pl_here(ablate_args(out))
    assert done.returncode == 0, done.stderr[-3000:]
    return out, done


def table_rows(text: str) -> dict[str, list[str]]:
    rows = [line.strip("|").split("|") for line in text.splitlines() if line.startswith("| ") and "---" not in line]
    return {cells[0].strip(): [c.strip() for c in cells[1:]] for cells in rows[1:]}


@pytest.mark.slow
def test_ablate_writes_the_table_and_plots(ablation):
    out, done = ablation
    text = (out / "ablation.md").read_text()
    assert done.stdout == text
    assert "| run | val loss | valΔ (mn) | tokens/s | time (s) | wallΔ (s) |" in text
    rows = table_rows(text)
    assert list(rows) == ["base", *OVERLAYS]
    results = {name: json.loads((out / name / "result.json").read_text()) for name in rows}
    for name, r in results.items():
        assert r["steps"] == STEPS and r["val_loss"] == pytest.approx(float(rows[name][0]), abs=1e-4)
        assert r["tokens_per_s"] > 0 and r["time_s"] > 0
    # quickstart has no FP8 (GPTConfig's defaults): the no_fp8 overlay trains the same numbers, bit for bit on CPU
    assert results["no_fp8"]["val_loss"] == results["base"]["val_loss"] and rows["no_fp8"][1] == "+0.0"
    delta = (results["adamw_matrices"]["val_loss"] - results["base"]["val_loss"]) * 1000
    assert delta != 0 and rows["adamw_matrices"][1] == f"{delta:+.1f}"
    for name in ("loss_vs_step", "loss_vs_tokens", "tokens_per_s"):
        assert (out / "plots" / f"{name}.png").stat().st_size > 10_000


@pytest.mark.slow
def test_ablate_does_not_rerun_finished_runs(ablation):
    out, _ = ablation
    stamps = {p: p.stat().st_mtime_ns for p in out.glob("*/result.json")}
    (out / "no_fp8" / "result.json").unlink()  # as if that run had been interrupted
    done = nanogpt_pl_here(ablate_args(out))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "base: finished earlier" in done.stderr and "adamw_matrices: finished earlier" in done.stderr
    assert "no_fp8: training" in done.stderr
    for p, stamp in stamps.items():
        if p.parent.name != "no_fp8":
            assert p.stat().st_mtime_ns == stamp
    assert (out / "no_fp8" / "result.json").is_file()


@pytest.mark.slow
def test_plot_overlays_runs_at_the_requested_size(ablation, tmp_path):
    from PIL import Image

    from nanogpt_pl.cli import main

    out, _ = ablation
    runs = [str(out / name) for name in ["base", *OVERLAYS]]
    assert main(["plot", *runs, "--out", str(tmp_path), "--size", "640", "400"]) == 0
    for name in ("loss_vs_step", "loss_vs_tokens", "tokens_per_s"):
        path = tmp_path / f"{name}.png"
        assert path.stat().st_size > 5_000
        with Image.open(path) as im:
            assert im.size == (640, 400)
            # not a blank canvas: the curves and legend put many colours on it
            assert len(im.convert("RGB").getcolors(maxcolors=1 << 16) or []) > 50


@pytest.mark.slow
def test_plot_reads_every_curve_of_a_run(ablation):
    from nanogpt_pl.tools.plot import load_run

    out, _ = ablation
    run = load_run(out / "base")
    assert [s for s, _ in run.train] == list(range(STEPS))
    assert len(run.val) == 1 and run.val[0][1] == pytest.approx(json.loads((out / "base/result.json").read_text())
                                                                 ["val_loss"])
    # tokens through each step: 2,048 per step (the stage above)
    assert [run.tokens[s] for s in range(STEPS)] == [2048.0 * (s + 1) for s in range(STEPS)]
    assert run.tokens_per_s and all(v > 0 for _, v in run.tokens_per_s)


@pytest.mark.slow
def test_generate_is_reproducible_for_a_seed(ablation):
    from nanogpt_pl.tools.generate import generate_text, load_for_sampling

    out, _ = ablation
    ckpt = out / "base" / RUN_CHECKPOINTS
    a, which = generate_text(ckpt, "def main(", max_new_tokens=12, temperature=1.0, top_k=50, seed=7)
    b, _ = generate_text(ckpt, "def main(", max_new_tokens=12, temperature=1.0, top_k=50, seed=7)
    c, _ = generate_text(ckpt, "def main(", max_new_tokens=12, temperature=1.0, top_k=50, seed=8)
    assert which == "live weights"
    assert a == b and a.startswith("def main(") and len(a) > len("def main(")
    assert a != c
    _, windows, _ = load_for_sampling(ckpt)
    assert windows == (128, 384)  # schedule.val_window_short / val_window_long of the run


@pytest.mark.slow
def test_generate_command_prints_the_text(ablation):
    out, _ = ablation
    done = nanogpt_pl_here(["generate", str(out / "base" / RUN_CHECKPOINTS / "last.ckpt"), "--prompt",
                            "import os", "--max-new-tokens", "5", "--temperature", "0"])
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("import os") and "[live weights]" in done.stderr


def _one_line_error(capsys, argv: list[str], *expect: str) -> None:
    from nanogpt_pl.cli import main

    assert main(argv) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("error: "), err
    for word in expect:
        assert word in err, err


def test_bad_input_gives_one_line_errors(tmp_path, capsys):
    _one_line_error(capsys, ["plot", str(tmp_path / "missing")], "run folder", "not found", "logs/quickstart")
    (tmp_path / "empty").mkdir()
    _one_line_error(capsys, ["plot", str(tmp_path / "empty")], "no metrics.csv", "CSVLogger")
    (tmp_path / "other.csv").write_text("step,foo\n0,1\n")
    _one_line_error(capsys, ["plot", str(tmp_path / "other.csv")], "no train/loss column")
    _one_line_error(capsys, ["generate", str(tmp_path / "missing.ckpt")], "not found", ".ckpt")
    torch.save({"state_dict": {}}, tmp_path / "foreign.ckpt")
    _one_line_error(capsys, ["generate", str(tmp_path / "foreign.ckpt")], "not a checkpoint of a nanogpt-pl")
    _one_line_error(capsys, ["generate", str(tmp_path / "empty")], "no .ckpt file")
    os.chdir(ROOT)
    _one_line_error(capsys, ["ablate", "--config", "configs/quickstart.yaml", "--steps", "2", "--ablations",
                             "no_such_overlay"], "no_such_overlay", "not found", "adamw_matrices")
    _one_line_error(capsys, ["ablate", "--config", "configs/nope.yaml", "--steps", "2"], "base config", "--config")


def test_generate_uses_the_tail_averaged_weights_of_an_unshipped_checkpoint(tmp_path, one_thread):
    from lightning.pytorch.callbacks import ModelCheckpoint
    from train_helpers import make_run, make_trainer, tiny_schedule

    from callbacks.ema import TailAveraging
    from nanogpt_pl.data.corpus import build_corpus
    from nanogpt_pl.tools.generate import _tail_state, load_for_sampling

    corpus = build_corpus()
    module, data = make_run((corpus.train_pattern, corpus.val_pattern), tiny_schedule(8))
    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=4, save_top_k=-1)
    make_trainer(tmp_path, callbacks=[TailAveraging(), ckpt], enable_checkpointing=True,
                 limit_val_batches=0).fit(module, data)
    path = next(tmp_path.glob("*step=4*.ckpt"))
    raw = torch.load(path, map_location="cpu", weights_only=False)
    assert _tail_state(raw) is not None  # mid-run: accumulating since step 0, shipped only at step 7

    live, _, which_live = load_for_sampling(path, tail_average=False)
    tail, windows, which = load_for_sampling(path)
    assert which_live == "live weights" and which.startswith("tail-averaged weights (tail_ema")
    assert windows == (64, 256)
    # the same ship the callback makes before the final validation
    expect = TailAveraging()
    expect.load_state_dict(_tail_state(raw))
    expect.on_train_start(None, live)
    expect.ship(live)
    saved = raw["state_dict"]
    changed = set()
    for name, a in tail.model.state_dict().items():
        if torch.is_tensor(a):
            assert torch.equal(a, live.model.state_dict()[name]), name
            if not torch.equal(a, saved["model." + name]):
                changed.add(name.split(".")[-1])
    # the ships move embed and lm_head (tail EMA), the qk/vo/mlp banks and the value embeddings
    assert {"embed", "lm_head", "qk_w", "v_w", "o_w", "fc_w", "proj_w"} <= changed, changed


def _logged_run(root: Path, name: str, losses: dict[int, float], tokens_per_step=None, ms_per_step=None,
                val: dict[int, float] | None = None) -> Path:
    """A run's CSVLogger folder with train/loss (and train/tokens, train/time) at the given steps."""
    from lightning.pytorch.loggers import CSVLogger

    logger = CSVLogger(root, name=name)
    tokens = seconds = 0.0
    for step in range(max(losses) + 1):
        if tokens_per_step is not None:
            tokens += tokens_per_step(step)
            seconds += ms_per_step(step) / 1000
        if step in losses:
            row = {"train/loss": losses[step]}
            if tokens_per_step is not None:
                row.update({"train/tokens": tokens, "train/time": seconds})
            logger.log_metrics(row, step=step)
        if val and step in val:
            logger.log_metrics({"val/loss": val[step]}, step=step)
    logger.save()
    return root / name


def test_compare_differences_match_a_plain_reference(tmp_path):
    import numpy as np

    from nanogpt_pl.tools.compare import difference
    from nanogpt_pl.tools.plot import load_run

    rng = np.random.default_rng(fresh_seed())
    steps_a, steps_b = range(9, 400, 10), range(9, 300, 10)  # B logged fewer steps
    base = {s: 7.0 * np.exp(-s / 80) + 1.5 for s in steps_a}
    a = {s: v + rng.normal(0, 0.01) for s, v in base.items()}
    b = {s: base[s] + rng.normal(0, 0.01) for s in steps_b}
    ra = load_run(_logged_run(tmp_path, "a", a))
    rb = load_run(_logged_run(tmp_path, "b", b))
    for lo, hi in ((0, None), (50, 250)):
        shared = [s for s in steps_b if s >= lo and (hi is None or s <= hi)]
        d = np.array([a[s] - b[s] for s in shared])
        got = difference(ra, rb, lo, hi)
        assert got.steps == len(shared)
        assert got.mean == pytest.approx(d.mean(), abs=1e-6)
        assert got.mean_abs == pytest.approx(np.abs(d).mean(), abs=1e-6)
        assert got.max_abs == pytest.approx(np.abs(d).max(), abs=1e-6)
        assert got.max_step == shared[int(np.abs(d).argmax())]


def test_compare_verdict_and_speed_per_stage(tmp_path, capsys):
    import numpy as np

    from nanogpt_pl.cli import main

    rng = np.random.default_rng(fresh_seed())
    steps = range(9, 330, 10)
    curve = {s: 7.0 * np.exp(-s / 60) + 1.3 for s in steps}
    on = {s: v + rng.normal(0, 0.002) for s, v in curve.items()}
    off = {s: v + rng.normal(0, 0.002) for s, v in curve.items()}  # numerics alone: tiny differences
    seed = {s: v + rng.normal(0, 0.02) for s, v in curve.items()}  # another seed: larger ones
    shifted = {s: v + 0.05 for s, v in off.items()}  # a real change of the curve
    stage = lambda s: 131072 if s < 320 else 262144  # the stage changes inside the interval 319..329
    on_ms = lambda s: 155.0 if s < 320 else 280.0
    off_ms = lambda s: 2.3 * on_ms(s)
    dirs = {name: _logged_run(tmp_path, name, losses, stage, ms, val={329: 5.0})
            for name, losses, ms in (("on", on, on_ms), ("off", off, off_ms), ("seed1", seed, on_ms),
                                     ("shifted", shifted, off_ms))}
    assert main(["compare", str(dirs["on"]), str(dirs["off"]), "--noise", str(dirs["seed1"])]) == 0
    out = capsys.readouterr().out
    assert "**on and off agree within noise**" in out
    # one stretch: steps 9..319 of stage 0 (the straddling interval and the lone stage-1 one belong to none)
    rows = [line for line in out.splitlines() if line.startswith("| 9-319 |")]
    assert len(rows) == 1 and "| 131,072 | 155.0 | 845,626 | 356.5 | 2.300x | 155.0 | 1.000x |" in rows[0], out
    assert "| 5.0000 (329) |" in out
    assert main(["compare", str(dirs["on"]), str(dirs["shifted"]), "--noise", str(dirs["seed1"])]) == 0
    assert "**on and shifted differ by more than the noise**" in capsys.readouterr().out
    # without --noise: the differences, no verdict
    assert main(["compare", str(dirs["on"]), str(dirs["off"]), "--labels", "A", "B"]) == 0
    out = capsys.readouterr().out
    assert "| A − B | 33 |" in out and "noise" not in out.split("Speed")[0]


def test_default_run_names_tell_runs_apart(tmp_path, capsys):
    from nanogpt_pl.cli import main
    from nanogpt_pl.tools.plot import distinct_labels

    assert distinct_labels(["logs/a/csv/version_0", "logs/b/csv/version_0"]) == ["a/csv/version_0",
                                                                                   "b/csv/version_0"]
    assert distinct_labels(["x/1/metrics.csv", "y/1/metrics.csv"]) == ["x/1", "y/1"]
    assert distinct_labels(["runs/a.csv", "runs/b.csv"]) == ["a.csv", "b.csv"]
    assert distinct_labels(["logs/first", "logs/second"]) == ["first", "second"]
    assert distinct_labels(["logs/run/metrics.csv"]) == ["run"]
    # two runs' metrics.csv files, as a device copies them back: the report names them by their folders
    files = []
    for name in ("old", "new"):
        d = _logged_run(tmp_path / name, "csv", {9: 5.0, 19: 4.0})
        files.append(str(next(d.rglob("metrics.csv"))))
    assert main(["compare", *files]) == 0
    out = capsys.readouterr().out
    assert "## old/csv/version_0 against new/csv/version_0" in out


def test_compare_errors_are_one_line(tmp_path, capsys):
    a = _logged_run(tmp_path, "a", {s: 3.0 for s in range(0, 50, 10)})
    b = _logged_run(tmp_path, "b", {s: 3.0 for s in range(5, 50, 10)})
    _one_line_error(capsys, ["compare", str(a), str(b)], "no common step", "log_every_n_steps")
    _one_line_error(capsys, ["compare", str(a), str(a), "--labels", "x"], "--labels got 1 labels for 2 runs")
    _one_line_error(capsys, ["compare", str(a), str(tmp_path / "missing")], "run folder", "not found")


@pytest.mark.slow
def test_compare_reads_real_runs(ablation, capsys):
    from nanogpt_pl.cli import main

    out, _ = ablation
    # quickstart has no FP8, so no_fp8 trains the base's bits on CPU: no difference at any step,
    # within the noise of any other run (here the AdamW ablation)
    assert main(["compare", str(out / "base"), str(out / "no_fp8"), "--noise", str(out / "adamw_matrices")]) == 0
    text = capsys.readouterr().out
    assert f"| base − no_fp8 | {STEPS} | +0.0000 | 0.0000 | 0.0000 (0) |" in text, text
    assert "**base and no_fp8 agree within noise**" in text and "(the two are equal at every shared step)" in text
