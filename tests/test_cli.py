"""The command line: configs, overrides, multi-process CPU training and user errors."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

sys.path.insert(0, str(Path(__file__).parent))
from train_helpers import write_markov_shards  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def toy_config(tmp: Path, files: tuple[str, str], **overrides) -> Path:
    cfg = yaml.safe_load((ROOT / "configs" / "quickstart.yaml").read_text())
    cfg["trainer"].update(accelerator="cpu", enable_progress_bar=False, enable_model_summary=False)
    cfg["trainer"]["logger"] = [{"class_path": "lightning.pytorch.loggers.CSVLogger",
                                 "init_args": {"save_dir": str(tmp / "logs"), "name": "toy"}}]
    cfg["trainer"]["callbacks"] = [{"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                                    "init_args": {"dirpath": str(tmp / "ckpt"), "save_last": True}}]
    cfg["model"]["gpt"].update(num_layers=2, model_dim=32, num_heads=2, head_dim=16, mlp_hidden=64,
                               long_window_layers=[1], value_embed_layers=[1], skip_from=None, skip_to=None)
    cfg["schedule"]["stages"] = [dict(steps=6, batch_tokens=1024, seq_len=512, max_doc_len=256, window_short=64,
                                      window_long=256, candidates=2048)]
    cfg["schedule"]["warmup_steps"] = 2
    cfg["data"] = dict(train_files=files[0], val_files=files[1], val_tokens=4096, val_seq_len=1024, prefetch=2)
    for key, value in overrides.items():
        node = cfg
        *path, last = key.split(".")
        for p in path:
            node = node.setdefault(p, {})
        node[last] = value
    out = tmp / "config.yaml"
    out.write_text(yaml.safe_dump(cfg))
    return out


# Rendezvous variables an earlier in-process Lightning run leaves in os.environ: a child CLI
# that inherits LOCAL_RANK would take itself for a launched rank and wait for its peers.
LAUNCH_VARS = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "WORLD_SIZE", "RANK", "PL_GLOBAL_SEED",
               "PL_SEED_WORKERS")


def run_cli(args: list[str], cwd: Path, timeout: int = 600, threads: int | None = 1) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env.update(PYTHONPATH=str(ROOT))
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    return subprocess.run([sys.executable, str(ROOT / "main.py"), *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="module")
def toy_files(tmp_path_factory):
    return write_markov_shards(tmp_path_factory.mktemp("toy"))


def test_print_config_applies_overrides(tmp_path, toy_files):
    cfg = toy_config(tmp_path, toy_files)
    out = run_cli(["fit", "--config", str(cfg), "--trainer.max_steps", "50", "--model.gpt.num_layers", "3",
                   "--print_config"], tmp_path)
    assert out.returncode == 0, out.stderr
    printed = yaml.safe_load(out.stdout)
    assert printed["trainer"]["max_steps"] == 50
    assert printed["model"]["gpt"]["num_layers"] == 3
    assert printed["schedule"]["stages"][0]["candidates"] == 2048


def test_unknown_config_key_is_named(tmp_path, toy_files):
    cfg = toy_config(tmp_path, toy_files, **{"model.gpt.num_layerz": 3})
    out = run_cli(["fit", "--config", str(cfg)], tmp_path)
    assert out.returncode != 0
    assert "num_layerz" in out.stderr


@pytest.mark.slow
def test_two_gloo_processes_match_one_process_with_accumulation(tmp_path, toy_files):
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
    out = run_cli(["fit", "--config", str(ROOT / "configs" / "speedrun.yaml"), "--config",
                   str(ROOT / "configs" / "ablations" / ablation), "--print_config"], tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    cfg = yaml.safe_load(out.stdout)
    assert cfg["model"]["gpt"]["num_layers"] == 11  # the speedrun config underneath
    expect = {
        "no_fp8.yaml": lambda c: not any(c["model"]["gpt"][k] for k in ("fp8_mlp", "fp8_head", "fp8_qkv")),
        "no_ngram.yaml": lambda c: c["model"]["gpt"]["ngram_rows"] == 0,
        "full_softmax.yaml": lambda c: all(s["candidates"] is None for s in c["schedule"]["stages"]),
        "adamw_matrices.yaml": lambda c: c["model"]["optim"]["matrix_optimizer"] == "adamw",
        "no_tail_averaging.yaml": lambda c: all("ema" not in cb["class_path"] for cb in c["trainer"]["callbacks"]),
    }[ablation]
    assert expect(cfg)


def test_a_user_callback_in_yaml_runs_alongside_ours(tmp_path, toy_files):
    import json

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
    # the schedule callback (added by the module) set a warmup lr ramp the user callback sees
    assert lrs[0] < lrs[1] and (tmp_path / "ckpt" / "last.ckpt").exists()
