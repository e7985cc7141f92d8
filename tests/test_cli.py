"""The command line: configs, overrides, multi-process CPU training and user errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from nanogpt_pl.config_files import expand_config_bases, load_config

ROOT = Path(__file__).resolve().parents[1]


def test_print_config_applies_overrides(tmp_path, toy_files, toy_config, run_cli):
    cfg = toy_config(tmp_path, toy_files)
    out = run_cli(["fit", "--config", str(cfg), "--trainer.max_steps", "50", "--model.gpt.num_layers", "3",
                   "--print_config"], tmp_path)
    assert out.returncode == 0, out.stderr
    printed = yaml.safe_load(out.stdout)
    assert printed["trainer"]["max_steps"] == 50
    assert printed["model"]["gpt"]["num_layers"] == 3
    assert printed["schedule"]["stages"][0]["candidates"] == 2048


def test_unknown_config_key_is_named(tmp_path, toy_files, toy_config, run_cli):
    cfg = toy_config(tmp_path, toy_files, **{"model.gpt.num_layerz": 3})
    out = run_cli(["fit", "--config", str(cfg)], tmp_path)
    assert out.returncode != 0
    assert "num_layerz" in out.stderr


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
def test_ablation_configs_compose_with_the_speedrun_config(tmp_path, ablation, run_cli):
    out = run_cli(["fit", "--config", str(ROOT / "configs" / "speedrun.yaml"), "--config",
                   str(ROOT / "configs" / "ablations" / ablation), "--print_config"], tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    cfg = yaml.safe_load(out.stdout)
    assert cfg["model"]["gpt"]["num_layers"] == 11  # the speedrun config underneath
    expect = {
        "no_fp8.yaml": lambda c: not (c["model"]["gpt"]["fp8_mlp"] or c["model"]["gpt"]["fp8_head"]),
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


def test_speedrun_1gpu_is_speedrun_with_only_its_differences(tmp_path, run_cli):
    """speedrun_1gpu.yaml holds only what differs; alone on the command line it resolves to the
    full speedrun config with exactly these changes."""
    printed = {}
    for name in ("speedrun.yaml", "speedrun_1gpu.yaml"):
        out = run_cli(["fit", "--config", str(ROOT / "configs" / name), "--print_config"], tmp_path)
        assert out.returncode == 0, out.stderr[-2000:]
        printed[name] = yaml.safe_load(out.stdout)
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


def test_gpu_smoke_config_runs_alone_on_the_one_gpu_config(tmp_path, run_cli):
    out = run_cli(["fit", "--config", str(ROOT / "configs" / "gpu_smoke.yaml"), "--print_config"], tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    cfg = yaml.safe_load(out.stdout)
    assert cfg["trainer"]["devices"] == 1 and cfg["model"]["gpt"]["ngram_rows"] == 21_150_720  # from speedrun_1gpu
    assert sum(s["steps"] for s in cfg["schedule"]["stages"]) == 24 and cfg["data"]["corpus"] == "quickstart"
