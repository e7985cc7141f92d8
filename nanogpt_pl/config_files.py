"""Config files that include another: a top-level ``base:`` key.

``configs/speedrun_1gpu.yaml`` holds only what differs from ``configs/speedrun.yaml`` and
names it as its base, so ``python main.py fit --config configs/speedrun_1gpu.yaml`` works on
its own. jsonargparse has no include of its own; the CLI turns each such ``--config`` into
the chain of ``--config`` flags it stands for (:func:`expand_config_bases`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

CONFIG_BASE_KEY = "base"


def _config_layers(path: Path, seen: tuple[Path, ...] = ()) -> list[tuple[Path, dict[str, Any]]]:
    """The YAML at ``path`` and, first, the chain of files it names under ``base:``, base-most first."""
    path = path.resolve()
    if path in seen:
        raise ValueError(f"{path}: `{CONFIG_BASE_KEY}:` includes form a cycle ({' -> '.join(map(str, seen))})")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except FileNotFoundError:
        where = f" (the `{CONFIG_BASE_KEY}:` of {seen[-1]})" if seen else ""
        raise FileNotFoundError(f"config file {path}{where} does not exist") from None
    if not isinstance(data, dict) or CONFIG_BASE_KEY not in data:
        return [(path, data)]
    data = dict(data)
    base = path.parent / str(data.pop(CONFIG_BASE_KEY))  # relative to the including file
    return _config_layers(base, seen + (path,)) + [(path, data)]


def _is_file(value: str) -> bool:
    try:
        return Path(value).is_file()
    except OSError:  # a YAML string given to --config can be longer than a file name may be
        return False


def expand_config_bases(args: list[str]) -> list[str]:
    """Resolve ``base:`` includes of every ``--config FILE`` in ``args``.

    A config may start with ``base: other.yaml`` (a path relative to its own folder) and hold
    only what differs from it, e.g. ``configs/speedrun_1gpu.yaml`` on ``configs/speedrun.yaml``.
    ``--config FILE`` then becomes ``--config other.yaml --config <FILE without its base key>``,
    so LightningCLI merges the layers exactly as it merges several ``--config`` flags given
    by hand (later keys win; a list such as ``trainer.callbacks`` is replaced whole). Bases
    may have bases of their own.
    """
    out: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--config" and i + 1 < len(args):
            value, i = args[i + 1], i + 2
        elif arg.startswith("--config="):
            value, i = arg.split("=", 1)[1], i + 1
        else:
            out.append(arg)
            i += 1
            continue
        layers = _config_layers(Path(value)) if _is_file(value) else []
        if len(layers) < 2:  # no include (or a YAML string): pass it on untouched
            out += ["--config", value]
            continue
        out += ["--config", str(layers[0][0])]
        for _, data in layers[1:]:
            out += ["--config", yaml.safe_dump(data, sort_keys=False)]
    return out


def load_config(path: str | Path) -> dict[str, Any]:
    """The YAML at ``path`` with its ``base:`` chain merged in (mappings merged key by key, anything
    else replaced), for scripts that read a few keys of a config without building the CLI."""

    def merge(a: Any, b: Any) -> Any:
        if isinstance(a, dict) and isinstance(b, dict):
            return {**a, **{k: merge(a[k], v) if k in a else v for k, v in b.items()}}
        return b

    merged: dict[str, Any] = {}
    for _, data in _config_layers(Path(path)):
        merged = merge(merged, data)
    return merged
