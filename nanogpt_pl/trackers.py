"""Experiment trackers: checks and defaults applied to ``trainer.logger`` before the CLI builds it.

Any Lightning logger works. Two failures otherwise surface as jsonargparse's unreadable
"Not a valid subclass of Logger", because the logger's constructor raises inside the
config parser; they are turned into one line naming the fix:

- a tracker whose package is missing (W&B, MLflow: ``pip install -e ".[trackers]"``);
- MLflow 3 refuses its plain file store (``./mlruns``). An MLFlowLogger given neither
  ``tracking_uri`` nor ``MLFLOW_TRACKING_URI`` logs to a SQLite database in its
  ``save_dir`` instead (``sqlite:///<save_dir>/mlflow.db``); an explicit file-store URI
  is refused with the SQLite URI to use.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from typing import Any

# logger class name -> (package it imports, how to install it)
TRACKER_PACKAGES = {
    "WandbLogger": ("wandb", 'pip install -e ".[trackers]"'),
    "MLFlowLogger": ("mlflow", 'pip install -e ".[trackers]"'),
    "CometLogger": ("comet_ml", "pip install comet-ml"),
    "NeptuneLogger": ("neptune", "pip install neptune"),
    "TensorBoardLogger": ("tensorboard", "pip install tensorboard"),
}
SQLITE_FILE = "mlflow.db"


def _get(node: Any, key: str, default: Any = None) -> Any:
    if node is None:
        return default
    if isinstance(node, dict):
        return node.get(key, default)
    return getattr(node, key, default)


def _set(node: Any, key: str, value: Any) -> None:
    if isinstance(node, dict):
        node[key] = value
    else:
        setattr(node, key, value)


def mlflow_major() -> int:
    from importlib.metadata import version  # read only when an MLflow logger is configured

    return int(version("mlflow").split(".")[0])


def sqlite_uri(save_dir: str | os.PathLike) -> str:
    """The SQLite tracking URI for an MLflow store in ``save_dir``."""
    return f"sqlite:///{Path(save_dir).resolve() / SQLITE_FILE}"


def _is_file_store(uri: str) -> bool:
    return uri.startswith("file:") or "://" not in uri and not uri.startswith(("databricks", "http"))


def prepare_logger(class_path: str, init_args: Any) -> None:
    """Check one logger's package; give MLflow a SQLite store (see the module docstring). Edits ``init_args``."""
    name = class_path.rsplit(".", 1)[-1]
    if name in TRACKER_PACKAGES:
        package, install = TRACKER_PACKAGES[name]
        try:
            importlib.import_module(package)
        except ImportError as e:
            raise ValueError(f"trainer.logger {name} needs the {package} package ({e}); install it: {install}") from e
    if name != "MLFlowLogger" or init_args is None:
        return
    uri = _get(init_args, "tracking_uri") or os.environ.get("MLFLOW_TRACKING_URI")
    allowed = os.environ.get("MLFLOW_ALLOW_FILE_STORE", "").lower() in ("1", "true", "yes")
    if uri is None:
        save_dir = Path(_get(init_args, "save_dir") or "./mlruns")
        save_dir.mkdir(parents=True, exist_ok=True)
        _set(init_args, "tracking_uri", sqlite_uri(save_dir))
    elif _is_file_store(uri) and mlflow_major() >= 3 and not allowed:
        folder = uri[len("file://"):] if uri.startswith("file://") else uri.removeprefix("file:")
        raise ValueError(f"trainer.logger MLFlowLogger: MLflow 3 refuses the file store {uri!r}; use "
                         f"tracking_uri: {sqlite_uri(folder)} (or MLFLOW_ALLOW_FILE_STORE=true to keep the file store)")


def prepare_loggers(trainer_config: Any) -> None:
    """Apply :func:`prepare_logger` to every logger of a parsed ``trainer`` config section."""
    loggers = _get(trainer_config, "logger")
    if loggers is None or isinstance(loggers, bool):
        return
    for logger in loggers if isinstance(loggers, list) else [loggers]:
        class_path = _get(logger, "class_path")
        if isinstance(class_path, str):
            prepare_logger(class_path, _get(logger, "init_args"))
