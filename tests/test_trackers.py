"""Trackers run for real: CSV, TensorBoard, W&B (offline) and MLflow (SQLite) logged by one CLI run and read back."""

from __future__ import annotations

import csv
import importlib.util
import json
import struct
import sys
from pathlib import Path

import pytest
import yaml
from test_tools import STEPS, TINY, nanogpt_pl

ROOT = Path(__file__).resolve().parents[1]
HAS_WANDB = importlib.util.find_spec("wandb") is not None
HAS_MLFLOW = importlib.util.find_spec("mlflow") is not None
MISSING = 'not installed (pip install -e ".[trackers]")'


def loggers(save: Path) -> list[dict]:
    out = [{"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": str(save), "name": "csv"}},
           {"class_path": "lightning.pytorch.loggers.TensorBoardLogger",
            "init_args": {"save_dir": str(save), "name": "tb"}}]
    if HAS_WANDB:
        out.append({"class_path": "lightning.pytorch.loggers.WandbLogger",
                    "init_args": {"save_dir": str(save / "wandb"), "offline": True, "project": "tiny"}})
    if HAS_MLFLOW:
        # no tracking_uri: MLflow 3's file store is refused, the CLI gives it a SQLite store in save_dir
        out.append({"class_path": "lightning.pytorch.loggers.MLFlowLogger",
                    "init_args": {"save_dir": str(save / "mlflow"), "experiment_name": "tiny"}})
    return out


@pytest.fixture(scope="module")
def logged(tmp_path_factory):
    work = tmp_path_factory.mktemp("trackers")
    overlay = work / "trackers.yaml"
    overlay.write_text(yaml.safe_dump({"trainer": {"logger": loggers(work / "logs")}}))
    done = nanogpt_pl(["fit", "--config", str(ROOT / "configs" / "quickstart.yaml"), "--config", str(overlay),
                       "--trainer.max_steps", str(STEPS), *TINY], cwd=work)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = list(csv.DictReader(open(next((work / "logs" / "csv").rglob("metrics.csv")))))
    train = [(int(r["step"]), float(r["train/loss"])) for r in rows if r.get("train/loss")]
    return work / "logs", train, rows


@pytest.mark.slow
def test_csv(logged):
    _, train, rows = logged
    assert [s for s, _ in train] == list(range(STEPS))
    assert train[-1][1] < train[0][1]
    assert any(r.get("val/loss") for r in rows)


@pytest.mark.slow
def test_tensorboard(logged):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logs, train, _ = logged
    acc = EventAccumulator(str(next((logs / "tb").glob("version_*"))))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == train
    assert len(acc.Scalars("val/loss")) == 1


def wandb_history(path: Path) -> list[dict]:
    """History rows of an offline W&B run file (LevelDB-style log of protobuf ``Record`` s)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    block, pos, buf, out = 32768, 7, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if left < 7 or (length == 0 and kind == 0):  # block trailer / padding
            pos += left
            continue
        buf += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST chunk of a record
            record = wandb_internal_pb2.Record()
            record.ParseFromString(buf)
            buf = b""
            if record.WhichOneof("record_type") == "history":
                out.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item})
    return out


@pytest.mark.slow
@pytest.mark.skipif(not HAS_WANDB, reason=f"wandb {MISSING}")
def test_wandb_offline(logged):
    logs, train, _ = logged
    run_file = next((logs / "wandb").rglob("offline-run-*/run-*.wandb"))
    rows = wandb_history(run_file)
    assert [(r["trainer/global_step"], r["train/loss"]) for r in rows if "train/loss" in r] == train
    assert any("val/loss" in r for r in rows)


@pytest.mark.slow
@pytest.mark.skipif(not HAS_MLFLOW, reason=f"mlflow {MISSING}")
def test_mlflow_sqlite(logged):
    from mlflow.tracking import MlflowClient

    logs, train, _ = logged
    db = logs / "mlflow" / "mlflow.db"
    assert db.is_file() and not (logs.parent / "mlruns").exists()  # not the refused file store
    client = MlflowClient(tracking_uri=f"sqlite:///{db}")
    (run,) = client.search_runs([client.get_experiment_by_name("tiny").experiment_id])
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "train/loss")] == train


@pytest.mark.skipif(not HAS_MLFLOW, reason=f"mlflow {MISSING}")
def test_mlflow_file_store_is_refused_in_one_line(tmp_path, capsys, monkeypatch):
    from nanogpt_pl.cli import cli_main
    from nanogpt_pl.trackers import mlflow_major

    if mlflow_major() < 3:
        pytest.skip("MLflow 2 still accepts the file store")
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as stop:
        cli_main(["--config", str(ROOT / "configs" / "quickstart.yaml"),
                  '--trainer.logger+={"class_path": "MLFlowLogger", "init_args": {"tracking_uri": "file:./mlruns"}}'],
                 run=False)
    message = str(stop.value.code)
    assert "\n" not in message and "Not a valid subclass" not in message
    assert "refuses the file store 'file:./mlruns'" in message and f"sqlite:///{tmp_path}/mlruns/mlflow.db" in message


@pytest.mark.parametrize("logger,package,fix", [("WandbLogger", "wandb", '".[trackers]"'),
                                                ("MLFlowLogger", "mlflow", '".[trackers]"')])
def test_a_missing_tracker_package_names_the_extra(tmp_path, monkeypatch, logger, package, fix):
    from nanogpt_pl.cli import cli_main

    monkeypatch.setitem(sys.modules, package, None)  # what an environment without the package imports
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as stop:
        cli_main(["--config", str(ROOT / "configs" / "quickstart.yaml"), f"--trainer.logger+={logger}"],
                 run=False)
    message = str(stop.value.code)
    assert "\n" not in message and f"{logger} needs the {package} package" in message and fix in message
