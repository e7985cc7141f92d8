"""The command line: configs, overrides, multi-process CPU training and user errors."""

from __future__ import annotations

import csv
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from background import command_env
from conftest import cli_in_process

from nanogpt_pl.config_files import expand_config_bases, load_config

ROOT = Path(__file__).resolve().parents[1]


def test_print_config_applies_overrides(tmp_path, toy_files, toy_config):
    cfg = toy_config(tmp_path, toy_files)
    code, stdout, stderr = cli_in_process(["fit", "--config", str(cfg), "--trainer.max_steps", "50",
                                           "--model.gpt.num_layers", "3", "--print_config"], tmp_path)
    assert code == 0, stderr
    printed = yaml.safe_load(stdout)
    assert printed["trainer"]["max_steps"] == 50
    assert printed["model"]["gpt"]["num_layers"] == 3
    assert printed["schedule"]["stages"][0]["candidates"] == 2048


def test_unknown_config_key_is_named(tmp_path, toy_files, toy_config):
    cfg = toy_config(tmp_path, toy_files, **{"model.gpt.num_layerz": 3})
    code, _, stderr = cli_in_process(["fit", "--config", str(cfg)], tmp_path)  # it stops in the parse
    assert code != 0
    assert "num_layerz" in stderr


@pytest.mark.slow
def test_two_gloo_processes_match_one_process_with_accumulation(tmp_path, toy_files, toy_config, run_cli):
    """devices=2 (gloo, one micro-batch each) trains the same weights as devices=1 with two micro-batches."""
    results = {}
    for devices in (1, 2):
        work = tmp_path / f"d{devices}"
        work.mkdir()
        cfg = toy_config(work, toy_files)
        out = run_cli(["fit", "--config", str(cfg), "--trainer.devices", str(devices)], work)
        assert out.returncode == 0, out.stderr[-3000:]
        ckpt = torch.load(work / "ckpt" / "last.ckpt", map_location="cpu", weights_only=False)
        results[devices] = ckpt
    a, b = results[1]["state_dict"], results[2]["state_dict"]
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], torch.Tensor) and torch.is_floating_point(a[k]):
            assert torch.allclose(a[k], b[k], atol=2e-5, rtol=1e-4), k
    assert results[1]["global_step"] == results[2]["global_step"] == 6


@pytest.mark.parametrize("ablation", sorted(p.name for p in (ROOT / "configs" / "ablations").glob("*.yaml")))
def test_ablation_configs_compose_with_the_speedrun_config(tmp_path, ablation):
    code, stdout, stderr = cli_in_process(["fit", "--config", str(ROOT / "configs" / "speedrun.yaml"), "--config",
                                           str(ROOT / "configs" / "ablations" / ablation), "--print_config"], tmp_path)
    assert code == 0, stderr[-2000:]
    cfg = yaml.safe_load(stdout)
    assert cfg["model"]["gpt"]["num_layers"] == 11  # the speedrun config underneath
    expect = {
        "no_fp8.yaml": lambda c: not any(c["model"]["gpt"][k] for k in ("fp8_mlp", "fp8_head", "fp8_qkv")),
        "no_ngram.yaml": lambda c: c["model"]["gpt"]["ngram_rows"] == 0,
        "full_softmax.yaml": lambda c: all(s["candidates"] is None for s in c["schedule"]["stages"]),
        "adamw_matrices.yaml": lambda c: c["model"]["optim"]["matrix_optimizer"] == "adamw",
        "no_tail_averaging.yaml": lambda c: all("ema" not in cb["class_path"] for cb in c["trainer"]["callbacks"]),
        "no_mudd.yaml": lambda c: c["model"]["gpt"]["mudd"] is False,
        "uniform_widths.yaml": lambda c: not (c["model"]["gpt"]["narrow_layers"] or c["model"]["gpt"]["dv64_layers"]
                                              or c["model"]["gpt"]["paired_layers"]),
        "no_xsa.yaml": lambda c: c["model"]["gpt"]["xsa_layers"] == [],
        "no_attn_gate.yaml": lambda c: c["model"]["gpt"]["attn_gate_layers"] == [],
        "no_key_offset.yaml": lambda c: c["model"]["gpt"]["key_offset_layers"] == [],
        "no_parallel_mlp.yaml": lambda c: c["model"]["gpt"]["parallel_mlp_layers"] == [],
        "plain_network.yaml": lambda c: not c["model"]["gpt"]["mudd"] and c["model"]["gpt"]["x0_layers"] is None,
        "no_cuda_graphs.yaml": lambda c: c["model"]["cuda_graphs"] is False,
    }[ablation]
    assert expect(cfg)


def test_a_user_callback_in_yaml_runs_alongside_ours(tmp_path, toy_files, toy_config, run_cli):
    cfg = toy_config(tmp_path, toy_files)
    data = yaml.safe_load(cfg.read_text())
    out_file = tmp_path / "lrs.json"
    data["trainer"]["callbacks"].append({"class_path": "tests.user_callback.RecordLearningRates",
                                         "init_args": {"path": str(out_file)}})
    cfg.write_text(yaml.safe_dump(data))
    out = run_cli(["fit", "--config", str(cfg)], tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    lrs = json.loads(out_file.read_text())
    assert len(lrs) == 6
    # the module applied the schedule's warmup lr ramp, which the user callback sees
    assert lrs[0] < lrs[1] and (tmp_path / "ckpt" / "last.ckpt").exists()


def test_speedrun_1gpu_is_speedrun_with_only_its_differences(tmp_path):
    """speedrun_1gpu.yaml holds only what differs; alone on the command line it resolves to the
    full speedrun config with exactly these changes."""
    printed = {}
    for name in ("speedrun.yaml", "speedrun_1gpu.yaml"):
        code, stdout, stderr = cli_in_process(["fit", "--config", str(ROOT / "configs" / name), "--print_config"],
                                              tmp_path)
        assert code == 0, stderr[-2000:]
        printed[name] = yaml.safe_load(stdout)
    base, one = printed["speedrun.yaml"], printed["speedrun_1gpu.yaml"]
    assert one["trainer"]["devices"] == 1 and base["trainer"]["devices"] == 8
    assert one["model"]["gpt"]["ngram_rows"] == 21_150_720 and base["model"]["gpt"]["ngram_rows"] == 84_602_880
    assert [lg["init_args"]["save_dir"] for lg in one["trainer"]["logger"]] == ["logs/speedrun_1gpu"] * 2
    for cfg in (base, one):
        cfg["trainer"]["devices"] = None
        cfg["model"]["gpt"]["ngram_rows"] = None
        for lg in cfg["trainer"]["logger"]:
            lg["init_args"]["save_dir"] = None
    assert one == base


def test_config_base_chain_and_errors(tmp_path):
    (tmp_path / "a.yaml").write_text("trainer: {devices: 8, max_steps: 10}\nmodel: {compile: true}\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.yaml").write_text("base: ../a.yaml\ntrainer: {devices: 1}\n")
    (tmp_path / "c.yaml").write_text("base: sub/b.yaml\nmodel: {compile: false}\n")
    args = expand_config_bases(["fit", "--config", str(tmp_path / "c.yaml"), "--trainer.max_steps", "5"])
    assert args[:3] == ["fit", "--config", str((tmp_path / "a.yaml").resolve())]
    assert [yaml.safe_load(a) for a in args[4:7:2]] == [{"trainer": {"devices": 1}}, {"model": {"compile": False}}]
    assert args[7:] == ["--trainer.max_steps", "5"]
    assert load_config(tmp_path / "c.yaml") == {"trainer": {"devices": 1, "max_steps": 10}, "model": {"compile": False}}
    plain = ["fit", f"--config={tmp_path / 'a.yaml'}"]
    assert expand_config_bases(plain) == ["fit", "--config", str(tmp_path / "a.yaml")]
    as_string = "trainer: {devices: 1}\n" + "# a YAML string longer than any file name\n" * 10
    assert expand_config_bases(["--config", as_string]) == ["--config", as_string]
    (tmp_path / "a.yaml").write_text("base: c.yaml\n")
    with pytest.raises(ValueError, match="cycle"):
        expand_config_bases(["--config", str(tmp_path / "c.yaml")])
    (tmp_path / "d.yaml").write_text("base: missing.yaml\n")
    with pytest.raises(FileNotFoundError, match=r"missing.yaml \(the `base:` of .*d.yaml\) does not exist"):
        load_config(tmp_path / "d.yaml")


def test_gpu_smoke_config_runs_alone_on_the_one_gpu_config(tmp_path):
    code, stdout, stderr = cli_in_process(["fit", "--config", str(ROOT / "configs" / "gpu_smoke.yaml"),
                                           "--print_config"], tmp_path)
    assert code == 0, stderr[-2000:]
    cfg = yaml.safe_load(stdout)
    assert cfg["trainer"]["devices"] == 1 and cfg["model"]["gpt"]["ngram_rows"] == 21_150_720  # from speedrun_1gpu
    assert sum(s["steps"] for s in cfg["schedule"]["stages"]) == 24 and cfg["data"]["corpus"] == "quickstart"


# -- a researcher's first hour: options, errors, checkpoints per run, signals, metrics ---------------

RUN_CHECKPOINT = [{"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                   "init_args": {"save_last": True, "every_n_train_steps": 4}}]


def ckpt_step(path: Path) -> int:
    return torch.load(path, map_location="cpu", weights_only=False)["global_step"]


def test_an_abbreviated_option_is_rejected(tmp_path, toy_files, toy_config):
    cfg = toy_config(tmp_path, toy_files)
    code, _, stderr = cli_in_process(["fit", "--config", str(cfg), "--trainer.max_step", "3", "--print_config"],
                                     tmp_path)
    assert code != 0 and "--trainer.max_step" in stderr


def test_help_lists_the_commands_that_work(tmp_path):
    code, stdout, _ = cli_in_process(["--help"], tmp_path)
    assert code == 0
    assert "data" in stdout and "{fit,validate}" in stdout
    assert "predict" not in stdout and "test" not in stdout.split("subcommands")[0]


def test_lightning_optimizer_options_point_to_model_optim(tmp_path, toy_files, toy_config):
    cfg = toy_config(tmp_path, toy_files)
    code, _, stderr = cli_in_process(["fit", "--config", str(cfg), "--optimizer", "AdamW"], tmp_path)
    assert code == 1
    lines = stderr.strip().splitlines()
    assert "model.optim" in lines[-1] and "KeyError" not in stderr and "Traceback" not in stderr


def test_a_user_error_is_one_line_and_the_traceback_is_behind_debug(tmp_path, toy_files, toy_config, run_cli):
    cfg = toy_config(tmp_path, toy_files)
    args = ["fit", "--config", str(cfg), "--model.gpt.num_layers", "1"]
    code, _, stderr = cli_in_process(args, tmp_path)  # the model's check fails before any training
    assert code == 1 and "Traceback" not in stderr and "[rank0]" not in stderr
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("error: model.gpt.long_window_layers: layer 1 is outside 0..0") and "num_layers" in last
    assert "NANOGPT_PL_DEBUG=1" in last
    out = run_cli(args + ["--debug"], tmp_path)
    assert out.returncode != 0 and "Traceback" in out.stderr and "long_window_layers" in out.stderr


# torch 2.11's message for the out-of-memory error of a speedrun_1gpu.yaml warmup on an 80 GB H100
H100_OOM = ("CUDA out of memory. Tried to allocate 264.00 MiB. GPU 0 has a total capacity of 79.18 GiB of which "
            "40.12 MiB is free. Including non-PyTorch memory, this process has 79.13 GiB memory in use. Of the "
            "allocated memory 60.59 GiB is allocated by PyTorch, with 16.99 GiB allocated in private pools (e.g., "
            "CUDA Graphs), and 17.23 GiB is reserved by PyTorch but unallocated. If reserved but unallocated memory "
            "is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See "
            "documentation for Memory Management  (https://docs.pytorch.org/docs/stable/notes/cuda.html)")


def test_out_of_gpu_memory_is_one_line_with_its_figures_and_what_to_change(monkeypatch, capsys):
    import nanogpt_pl.cli as cli

    def fails(argv):
        raise torch.OutOfMemoryError(H100_OOM)

    monkeypatch.setattr(cli, "cli_main", fails)
    monkeypatch.delenv(cli.DEBUG_ENV, raising=False)
    assert cli.main(["fit", "--config", "configs/speedrun_1gpu.yaml"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert err[0].startswith("error: out of GPU memory (a request of 264.00 MiB, a card of 79.18 GiB, 79.13 GiB in "
                             "use, 16.99 GiB in CUDA graph pools); lower model.gpt.ngram_rows")
    assert "model.cuda_graphs false" in err[0] and "configs/speedrun_24gb.yaml" in err[0]
    assert (ROOT / "configs" / "speedrun_24gb.yaml").is_file()
    # a message without the figures is kept whole
    assert cli._one_line(torch.OutOfMemoryError("out of memory")).startswith("out of GPU memory (out of memory); ")


def test_stage_field_override_from_the_command_line(tmp_path, toy_files, toy_config, run_cli):
    cfg = toy_config(tmp_path, toy_files)
    code, stdout, stderr = cli_in_process(["fit", "--config", str(cfg), "--schedule.stages.0.candidates", "null",
                                           "--print_config"], tmp_path)
    assert code == 0, stderr[-2000:]
    stage = yaml.safe_load(stdout)["schedule"]["stages"][0]
    assert stage["candidates"] is None and stage["steps"] == 6
    code, _, stderr = cli_in_process(["fit", "--config", str(cfg), "--schedule.stages.3.candidates", "null"], tmp_path)
    assert code == 1 and "the schedule has stages 0..0" in stderr


def test_gpu_only_options_on_cpu_are_one_error_and_leave_no_log_folder(tmp_path, toy_files, toy_config):
    cfg = toy_config(tmp_path, toy_files, **{"trainer.callbacks": RUN_CHECKPOINT})
    code, _, stderr = cli_in_process(["fit", "--config", str(cfg), "--model.compile", "true", "--model.gpt.fp8_mlp",
                                      "true"], tmp_path)
    assert code == 1 and "Traceback" not in stderr
    last = stderr.strip().splitlines()[-1]
    assert "model.compile" in last and "model.gpt.fp8_mlp" in last and "--model.compile false" in last
    assert not list((tmp_path / "logs").glob("*/version_*")), list((tmp_path / "logs").rglob("*"))


def test_checkpoints_per_run_final_step_and_last_means_this_lineage(tmp_path, toy_files, toy_config, run_cli):
    cfg = toy_config(tmp_path, toy_files, **{"trainer.callbacks": RUN_CHECKPOINT})
    runs = tmp_path / "logs" / "toy"
    # a run cut short at step 3 (checkpoints every 4 steps: only the final save holds step 3)
    out = run_cli(["fit", "--config", str(cfg), "--trainer.max_steps", "3"], tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "args parameter is intended" not in out.stderr and "Starting with 1 processes" not in out.stderr
    assert "MEMBER: 1/1" not in out.stderr + out.stdout
    assert ckpt_step(runs / "version_0" / "checkpoints" / "last.ckpt") == 3
    # another architecture of the same config: its own folder, newer
    wide = ["--model.gpt.model_dim", "64", "--model.gpt.head_dim", "32"]
    out = run_cli(["fit", "--config", str(cfg), "--trainer.max_steps", "2", *wide], tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert ckpt_step(runs / "version_1" / "checkpoints" / "last.ckpt") == 2
    # `last` resumes the run that fits, in its folder, to the end of the schedule
    out = run_cli(["fit", "--config", str(cfg), "--ckpt_path", "last"], tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert sorted(p.name for p in runs.iterdir()) == ["version_0", "version_1"]
    assert ckpt_step(runs / "version_0" / "checkpoints" / "last.ckpt") == 6
    rows = list(csv.DictReader(open(runs / "version_0" / "metrics.csv")))
    assert [int(r["step"]) for r in rows if r.get("val/loss")] == [2, 5]  # the first run's rows are kept
    # the real learning rates per optimizer part, not the schedule multiplier under the name lr
    assert "lr" not in rows[0] and {"lr/matrix", "lr/adam_embed", "schedule/lr_mul"} <= set(rows[0])
    for r in rows:
        if r.get("lr/matrix"):
            assert abs(float(r["lr/matrix"]) - 0.023 * float(r["schedule/lr_mul"])) < 1e-7
    # when no run's checkpoint fits: one line naming the newest one and the shapes
    # (an explicit --ckpt_path FILE takes the model's hyperparameters from the file: LightningCLI)
    own = runs / "version_0" / "checkpoints" / "last.ckpt"
    own.rename(tmp_path / "aside.ckpt")
    out = run_cli(["fit", "--config", str(cfg), "--ckpt_path", "last"], tmp_path)
    (tmp_path / "aside.ckpt").rename(own)
    assert out.returncode == 1 and "Traceback" not in out.stderr
    last = out.stderr.strip().splitlines()[-1]
    other = Path("logs") / "toy" / "version_1" / "checkpoints" / "last.ckpt"
    assert f"checkpoint {tmp_path / other}" in last or f"checkpoint {other}" in last, last
    assert re.search(r"checkpoint \(\d+, 64\) vs model \(\d+, 32\)", last), last
    assert sorted(p.name for p in runs.iterdir()) == ["version_0", "version_1"]
    # validate the resumed run's last checkpoint: its rows carry the training step
    out = run_cli(["validate", "--config", str(cfg), "--ckpt_path", "last"], tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = list(csv.DictReader(open(runs / "version_0" / "metrics.csv")))
    assert [int(r["step"]) for r in rows if r.get("val/loss")] == [2, 5, 5]


def _sigterm_long_run(cfg: Path, cwd: Path, devices: int, ready: bytes) -> tuple[int, str]:
    """``main.py fit`` with ``cfg``'s stage made 2,000 steps long, on ``devices`` ranks; SIGTERM to the
    main process once its output (stdout and stderr together) matches ``ready``. (exit code, output)."""
    import signal
    import threading

    data = yaml.safe_load(cfg.read_text())
    data["schedule"]["stages"][0]["steps"] = 2000
    data["data"]["epochs"] = 10
    cfg.write_text(yaml.safe_dump(data))
    proc = subprocess.Popen([sys.executable, str(ROOT / "main.py"), "fit", "--config", str(cfg), "--trainer.devices",
                             str(devices)], cwd=cwd, env=command_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    out = bytearray()
    reader = threading.Thread(target=lambda: [out.extend(c) for c in iter(lambda: proc.stdout.read1(4096), b"")])
    reader.start()
    try:
        deadline = time.time() + 300
        while time.time() < deadline and not re.search(ready, bytes(out)) and proc.poll() is None:
            time.sleep(0.1)
        assert re.search(ready, bytes(out)), bytes(out)[-3000:]
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(120)
    finally:
        if proc.poll() is None:
            proc.kill()
        reader.join(30)
    return rc, bytes(out).decode(errors="replace")


@pytest.mark.parametrize("devices", [1, 2])
def test_sigterm_saves_a_checkpoint_and_exits_cleanly(tmp_path, toy_files, toy_config, run_cli, devices):
    """SIGTERM to the main process mid-training: every rank stops at the same step (with two gloo ranks,
    Lightning's own handling hung some runs: stop_signal.py), saves it, and the run resumes from it."""
    cfg = toy_config(tmp_path, toy_files, **{"trainer.callbacks": RUN_CHECKPOINT, "trainer.enable_progress_bar": True})
    # the progress bar knows the run's total (2000 steps): the signal comes after the third step
    rc, text = _sigterm_long_run(cfg, tmp_path, devices, rb" [3-9]/2000 \[")
    assert rc == 0, text[-3000:]
    assert "Traceback" not in text
    stopped = re.search(r"stopped by SIGTERM after step (\d+); checkpoint (\S+last\.ckpt)", text)
    assert stopped, text[-3000:]
    step = int(stopped.group(1))
    assert 3 <= step < 2000 and ckpt_step(tmp_path / stopped.group(2)) == step
    # the interrupted run resumes from it
    out = run_cli(["fit", "--config", str(cfg), "--ckpt_path", "last", "--trainer.max_steps", str(step + 1),
                   "--trainer.devices", str(devices)], tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert ckpt_step(tmp_path / stopped.group(2)) == step + 1


TIMER = {"class_path": "callbacks.speedrun_timer.SpeedrunTimer", "init_args": {"target": 0.0}}


@pytest.mark.parametrize("devices", [1, 2])
def test_sigterm_in_the_speedrun_warmup_stops_the_run_with_nothing_saved(tmp_path, toy_files, toy_config, devices):
    """The timer's warmup runs inside ``on_train_start``, before any of Lightning's loops look at
    SIGTERM: the warmup stops at its next step, the run exits 0 with one line, and leaves no
    checkpoint of the warmup's weights and no empty log folder."""
    timer = {"class_path": "callbacks.speedrun_timer.SpeedrunTimer",
             "init_args": {"target": 0.0, "warmup_steps": list(range(300))}}
    cfg = toy_config(tmp_path, toy_files, **{"trainer.callbacks": RUN_CHECKPOINT + [timer]})
    rc, text = _sigterm_long_run(cfg, tmp_path, devices, rb"speedrun warmup: 3/300,")
    assert rc == 0 and "Traceback" not in text, text[-3000:]
    stopped = re.search(r"speedrun warmup: stopped by a signal after (\d+) of 300 steps", text)
    assert stopped and 3 <= int(stopped[1]) < 300, text[-3000:]
    last = text.strip().splitlines()[-1]
    assert last == "stopped by SIGTERM before the first step; no checkpoint (nothing was trained)", last
    assert not list(tmp_path.rglob("*.ckpt")) and not list(tmp_path.rglob("version_*")), list(tmp_path.rglob("*"))



def test_warmup_only_runs_the_warmup_and_stops_before_the_first_step(tmp_path, toy_files, toy_config, run_cli):
    """``--warmup_only true``: the timer's warmup runs its steps, then the run ends at step 0 with no clock,
    no validation and no checkpoint (the machine's compile caches are what it leaves)."""
    cfg = toy_config(tmp_path, toy_files, **{"trainer.callbacks": RUN_CHECKPOINT + [TIMER]})
    out = run_cli(["fit", "--config", str(cfg), "--warmup_only", "true"], tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    said = re.search(r"speedrun timer: warmup_only, (\d+) warmup steps run", out.stderr + out.stdout)
    assert said and int(said[1]) >= 2, (out.stderr + out.stdout)[-3000:]
    assert not list(tmp_path.rglob("*.ckpt"))
    rows = [r for p in tmp_path.rglob("metrics.csv") for r in csv.DictReader(open(p))]
    assert not [r for r in rows if r.get("val/loss") or r.get("train/loss")], rows
    assert "speedrun/train_time_s" not in {k for r in rows for k, v in r.items() if v}


def test_warmup_only_without_the_timer_or_with_validate_is_one_line(tmp_path, toy_files, toy_config):
    cfg = toy_config(tmp_path, toy_files, **{"trainer.callbacks": RUN_CHECKPOINT})
    code, _, stderr = cli_in_process(["fit", "--config", str(cfg), "--warmup_only", "true"], tmp_path)
    assert code == 1 and "Traceback" not in stderr
    last = stderr.strip().splitlines()[-1]
    assert "--warmup_only needs the SpeedrunTimer" in last and "--trainer.callbacks+=" in last
    code, _, stderr = cli_in_process(["validate", "--config", str(cfg), "--warmup_only", "true"], tmp_path)
    assert code == 1 and "--warmup_only is for fit" in stderr.strip().splitlines()[-1]
