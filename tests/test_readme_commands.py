"""Every command the README and the configs' comments show, run as written (at tiny sizes).

Training commands on the quickstart config run with a tiny overlay config appended (small model,
two steps); commands that need 8 GPUs or FineWeb are checked to parse with ``--print_config``
(in this process: a parse there costs no interpreter start-up);
the FineWeb download is checked to accept its options; ``tensorboard --logdir logs`` is started
and stopped. ``describe``, ``generate``, ``plot`` and ``compare`` run as written (on the runs the commands
before them made; in this process, as they train nothing); ``ablate`` on the quickstart config
runs in this process too and trains its runs, each in a process of its own, with the tiny overlay
after its ``--``, and on a GPU config each of its runs' configs is checked to parse. The two
set-up commands at the top (pip install ...) are what CI runs.
"""

from __future__ import annotations

import csv
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from background import command_env
from conftest import cli_in_process, cli_in_process_as_command
from test_cli import ROOT
from warm_python import run as warm_run

README = ROOT / "README.md"
GPU_CONFIGS = ("configs/speedrun.yaml", "configs/speedrun_1gpu.yaml", "configs/speedrun_24gb.yaml",
               "configs/gpu_smoke.yaml")
ENV_PREFIX = re.compile(r"^(?:[A-Z_][A-Z0-9_]*=\S+\s+)+")  # VAR=value words before a command

TINY = {
    "model": {"gpt": {"model_dim": 32, "num_heads": 2, "head_dim": 16, "mlp_hidden": 64}},
    "schedule": {"stages": [{"steps": 4, "batch_tokens": 2048, "seq_len": 1024, "max_doc_len": 512,
                             "window_short": 128, "window_long": 512, "candidates": 2048}],
                 "warmup_steps": 1},
    "data": {"val_tokens": 2048, "val_seq_len": 1024},
    "trainer": {"accelerator": "cpu", "enable_progress_bar": False, "max_steps": 2},
}


def readme_commands() -> list[str]:
    """The README's code-block lines after its two set-up commands, comments stripped."""
    lines = README.read_text().splitlines()
    out = []
    for line in lines:
        if line.startswith("    ") and line.strip() and "pip install" not in line:
            out.append(shlex.join(shlex.split(line.strip(), comments=True)))
    return out


def config_comment_commands() -> tuple[list[str], list[tuple[str, str, str]]]:
    """From configs/*.yaml comments: the commands (``#   python ...``) and the ``e.g. --key value`` switches."""
    commands, switches = [], []
    for cfg in sorted((ROOT / "configs").rglob("*.yaml")):
        for line in cfg.read_text().splitlines():
            if not line.startswith("#"):
                continue
            body = line.lstrip("#").strip()
            if ENV_PREFIX.sub("", body).startswith(("python ", "nanogpt-pl ")):
                commands.append(shlex.join(shlex.split(body, comments=True)))
                continue
            for key, value in re.findall(r"(--[\w.]+) ([^\s,]+)", body):
                switches.append((str(cfg.relative_to(ROOT)), key, value))
    return commands, switches


def argv_of(command: str) -> list[str]:
    """The command's argv; leading ``VAR=value`` words are dropped (the one used, the CUDA
    allocator's setting, means nothing to the parse-only GPU commands it prefixes)."""
    words = shlex.split(ENV_PREFIX.sub("", command))
    if words[0] == "python":
        return [sys.executable, *words[1:]]
    if words[0] == "nanogpt-pl":  # the console script is `nanogpt_pl.cli:main` (pyproject.toml)
        return [sys.executable, "-m", "nanogpt_pl.cli", *words[1:]]
    return words


def run(argv: list[str], cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    """``argv`` in a process of its own (forked from the warm process of tests/warm_python.py)."""
    return warm_run(argv, cwd=cwd, env=command_env(), timeout=timeout)


@pytest.fixture
def workdir(tmp_path):
    """A working directory laid out like a checkout: main.py and configs/ at the top."""
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    (tmp_path / "main.py").symlink_to(ROOT / "main.py")
    return tmp_path


def test_the_readme_shows_the_commands_it_promises():
    commands = readme_commands()
    assert any("--model.gpt.num_layers 2" in c for c in commands)
    for tool in ("describe", "generate", "plot", "compare", "ablate"):
        assert any(c.startswith(f"nanogpt-pl {tool} ") for c in commands), tool
    assert any("--config configs/ablations/" in c for c in commands)
    assert any(c.startswith("python main.py validate") for c in commands)
    assert any(c.startswith("tensorboard --logdir logs") for c in commands)
    assert any("--trainer.callbacks+=" in c for c in commands)
    # the first lines give exactly the two set-up commands
    head = README.read_text().split("---")[0]
    assert len(re.findall(r"^    pip install", head, re.M)) == 2


def test_config_comment_switches_apply(workdir):
    _, switches = config_comment_commands()
    assert ("configs/speedrun.yaml", "--schedule.stages.2.candidates", "null") in switches
    for config, key, value in switches:
        code, stdout, stderr = cli_in_process(["fit", "--config", config, key, value, "--print_config"], workdir)
        assert code == 0, (config, key, value, stderr[-2000:])
        node = yaml.safe_load(stdout)
        for part in key[2:].split("."):
            node = node[int(part)] if isinstance(node, list) else node[part]
        assert node == yaml.safe_load(value), (config, key, node)


def check_ablation_configs(argv: list[str], cwd: Path) -> None:
    """``nanogpt-pl ablate`` on a config that needs GPUs: every run it would start parses (``--print_config``)."""
    from nanogpt_pl.tools import build_parser
    from nanogpt_pl.tools.ablate import resolve_ablations

    args = build_parser("ablate").parse_args(argv[4:])
    here = Path.cwd()
    os.chdir(cwd)  # the overlays are found under configs/ablations of the working directory, as ablate finds them
    try:
        overlays = [None, *resolve_ablations(args.ablations)]
    finally:
        os.chdir(here)
    assert len(overlays) > 1
    for overlay in overlays:
        configs = ["--config", args.config] + ([] if overlay is None else ["--config", str(overlay)])
        fit = ["fit", *configs, "--trainer.max_steps", str(args.steps), *args.overrides, "--print_config"]
        code, stdout, stderr = cli_in_process(fit, cwd)
        assert code == 0, (overlay, stderr[-2000:])
        assert yaml.safe_load(stdout)["trainer"]["max_steps"] == args.steps


def tool_of(argv: list[str]) -> str | None:
    """The ``nanogpt-pl`` sub-command of ``argv`` (None for ``main.py`` and other programs)."""
    return argv[3] if argv[1:3] == ["-m", "nanogpt_pl.cli"] and len(argv) > 3 else None


def parse_only(argv: list[str]) -> bool:
    """A fit or an ablation on a config that needs GPUs or FineWeb: checked to parse, not run."""
    return tool_of(argv) in (None, "ablate") and any(c in argv for c in GPU_CONFIGS)


def cli_args(argv: list[str]) -> list[str] | None:
    """The arguments ``nanogpt_pl.cli.main`` gets from ``python main.py ARGS`` or ``nanogpt-pl ARGS``."""
    if argv[1:2] == ["main.py"]:
        return argv[2:]
    if argv[1:3] == ["-m", "nanogpt_pl.cli"]:
        return argv[3:]
    return None


def check_parses(argv: list[str], cwd: Path) -> None:
    """Parse-only commands run in this process, through the CLI's ``main``."""
    if tool_of(argv) == "ablate":
        check_ablation_configs(argv, cwd)
        return
    args = cli_args(argv)
    assert args is not None, argv
    args = args if "--print_config" in args else args + ["--print_config"]
    code, stdout, stderr = cli_in_process(args, cwd)
    assert code == 0, (shlex.join(argv), stderr[-3000:])
    assert "Traceback" not in stderr, (shlex.join(argv), stderr[-3000:])
    yaml.safe_load(stdout)


def test_every_readme_and_config_command_runs(workdir):
    tiny = workdir / "tiny.yaml"
    tiny.write_text(yaml.safe_dump(TINY))
    resume = workdir / "tiny_resume.yaml"
    resume.write_text(yaml.safe_dump({**TINY, "trainer": {**TINY["trainer"], "max_steps": 3}}))
    # each distinct command once (a config's comment may repeat a README line)
    commands = list(dict.fromkeys(readme_commands() + config_comment_commands()[0]))
    ran = []
    # the commands that need GPUs or FineWeb, and --print_config ones, only parse (in this process)
    for command in commands:
        argv = argv_of(command)
        if parse_only(argv) or "--print_config" in argv:
            check_parses(argv, workdir)
            ran.append(command)
            continue
        if argv[0] == "tensorboard":
            log = workdir / "tensorboard.out"
            with open(log, "w") as out_file:
                proc = subprocess.Popen(argv + ["--port", "0"], cwd=workdir, stdout=out_file,
                                        stderr=subprocess.STDOUT, text=True)
                try:
                    deadline = time.time() + 120
                    while time.time() < deadline and "http://" not in log.read_text() and proc.poll() is None:
                        time.sleep(0.1)
                    assert "http://" in log.read_text(), log.read_text()[-2000:]
                finally:
                    proc.terminate()
                    proc.wait(30)
            ran.append(command)
            continue
        if "data" in argv and argv[argv.index("data") + 1] == "fineweb":
            # downloads 400 MB: check that it takes the options shown (in this process: it only parses)
            at = argv.index("data") + 2
            code, stdout, stderr = cli_in_process(cli_args(argv[:at] + ["--help"]), workdir)
            assert code == 0 and all(a in stdout for a in argv[at:] if a.startswith("--")), (stdout, stderr)
            ran.append(command)
            continue
        tool = tool_of(argv)
        if tool in ("describe", "generate", "plot", "compare"):
            # they train nothing: in this process, which saves an interpreter start-up each
            code, stdout, stderr = cli_in_process(cli_args(argv), workdir)
            assert code == 0 and "Traceback" not in stderr, (command, stderr[-3000:])
            assert stdout.strip() or tool == "plot", command  # the table / the sampled text / the comparison
            ran.append(command)
            continue
        if tool == "ablate":  # its runs train the tiny overlay: the options after -- go to every run
            argv = argv + ([] if "--" in argv else ["--"]) + ["--config", str(tiny)]
            # in this process too: ablate trains nothing itself, each run is a process of its own,
            # started with the environment `run` gives a command
            code, stdout, stderr = cli_in_process_as_command(cli_args(argv), workdir)
            assert code == 0 and "Traceback" not in stderr, (command, stderr[-3000:])
            ran.append(command)
            continue
        argv = argv + ["--config", str(resume if "--ckpt_path" in argv else tiny)]
        out = run(argv, workdir)
        assert out.returncode == 0, (command, out.stderr[-3000:])
        assert "Traceback" not in out.stderr, (command, out.stderr[-3000:])
        ran.append(command)
    assert len(ran) == len(commands)
    # what the research tools wrote: the ablation table with its base row, and the plots
    table = (workdir / "ablations" / "quickstart" / "ablation.md").read_text()
    assert all(f"| {name} |" in table for name in ("base", "adamw_matrices", "no_fp8")), table
    plots = {p.name for p in (workdir / "plots").iterdir()}
    assert {"loss_vs_step.png", "loss_vs_tokens.png", "tokens_per_s.png"} <= plots, plots

    # the resume continued the newest quickstart run: its folder, its last.ckpt now at step 3,
    # and validate logged at that step
    versions = sorted((workdir / "logs" / "quickstart" / "csv").glob("version_*"))
    resumed = [v for v in versions if (v / "checkpoints" / "last.ckpt").exists()
               and torch.load(v / "checkpoints" / "last.ckpt", map_location="cpu",
                              weights_only=False)["global_step"] == 3]
    assert len(resumed) == 1, versions
    rows = list(csv.DictReader(open(resumed[0] / "metrics.csv")))
    steps = [int(r["step"]) for r in rows if r.get("train/loss")]
    assert steps == sorted(steps) and 2 in steps, steps  # the first run's rows kept, the resumed ones appended
    # the fit's final validation and `validate` both at the last trained step (global_step 3 - 1)
    assert [int(r["step"]) for r in rows if r.get("val/loss")][-2:] == [2, 2], rows
