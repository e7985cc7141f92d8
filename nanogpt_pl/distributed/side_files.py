"""Per-rank checkpoint side files for rank-local state (the n-gram shard, the value-embedding Adam state).

A record-size n-gram shard is 15.13 GiB per rank (RECORD §3), so it never passes through
rank 0: every rank writes its own ``<ckpt>.ngram-rank<r>.pt`` beside the Lightning
checkpoint and the main file keeps only a marker with the world size. With one rank
and a small state the state stays inline in the checkpoint. ``SpeedrunStrategy`` calls
:func:`save_rank_local` / :func:`load_rank_local` / :func:`remove_rank_local`; the module
puts the channels' state under :data:`RANK_LOCAL_KEY`.

Asynchronous saves (``async_checkpoint``) write the same files from a background thread
(:func:`write_side_file`); each side file then carries the save's id, the main file's
marker names it, and the main file is written last, so a checkpoint whose main file
exists is complete (:func:`check_complete` names one that is not).
"""

from __future__ import annotations

import os
from typing import Any, Optional

import torch
from torch import Tensor

# Entry of the checkpoint dict that holds rank-local state (see save_rank_local).
RANK_LOCAL_KEY = "sparse_rank_local"
# Up to this size, a single rank's state stays inline in the main checkpoint file.
INLINE_STATE_LIMIT_BYTES = 256 << 20
# Version of the per-channel state dicts kept in the side files.
STATE_FORMAT = 1


def rank_file(filepath: str | os.PathLike, rank: int) -> str:
    """The side file holding rank ``rank``'s sparse state next to checkpoint ``filepath``."""
    return f"{os.fspath(filepath)}.ngram-rank{rank}.pt"


def tensor_bytes(obj: Any) -> int:
    """Bytes of the tensors in a nested dict/list state."""
    if isinstance(obj, Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


def save_rank_local(checkpoint: dict[str, Any], filepath: str | os.PathLike, rank: int, world_size: int,
                    inline_limit: Optional[int] = None) -> dict[str, Any]:
    """Write this rank's ``checkpoint[RANK_LOCAL_KEY]`` to its side file; return the dict for the main file.

    Called on every rank. With one rank and a state under ``inline_limit`` bytes the
    state stays inline; otherwise each rank writes ``<filepath>.ngram-rank<r>.pt`` itself
    and the main checkpoint keeps only a marker with the world size. ``inline_limit``
    defaults to :data:`INLINE_STATE_LIMIT_BYTES`.
    """
    state = checkpoint.get(RANK_LOCAL_KEY)
    limit = INLINE_STATE_LIMIT_BYTES if inline_limit is None else inline_limit
    if state is None or (world_size == 1 and tensor_bytes(state) <= limit):
        return checkpoint
    path = rank_file(filepath, rank)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    torch.save(state, tmp)
    os.replace(tmp, path)
    out = dict(checkpoint)
    out[RANK_LOCAL_KEY] = side_file_marker(world_size)
    return out


def write_side_file(state: Any, filepath: str | os.PathLike, rank: int, save_id: str) -> str:
    """Write ``state`` as rank ``rank``'s side file of ``filepath``, tagged with ``save_id``; the path.

    Written under a temporary name and renamed, so the side file is either whole or absent.
    """
    path = rank_file(filepath, rank)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    torch.save({"save_id": save_id, "state": state}, tmp)
    os.replace(tmp, path)
    return path


def side_file_snapshot(path: str | os.PathLike) -> Optional[str]:
    """The save id a side file carries (None for a synchronous save's); reads only the header."""
    data = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    return data.get("save_id") if isinstance(data, dict) and set(data) == {"save_id", "state"} else None


def side_file_marker(world_size: int, save_id: Optional[str] = None) -> dict[str, Any]:
    """What the main checkpoint keeps under :data:`RANK_LOCAL_KEY` when the state is in side files."""
    marker: dict[str, Any] = {"side_files": True, "world_size": world_size}
    if save_id is not None:
        marker["save_id"] = save_id
    return marker


def check_complete(filepath: str | os.PathLike) -> None:
    """Raise a one-line error if ``filepath`` is missing because its save never finished."""
    path = os.fspath(filepath)
    if os.path.exists(path):
        return
    folder = os.path.dirname(os.path.abspath(path)) or "."
    prefix = os.path.basename(path) + ".ngram-rank"
    parts = sorted(f for f in os.listdir(folder) if f.startswith(prefix)) if os.path.isdir(folder) else []
    if parts or os.path.exists(path + ".tmp"):
        raise RuntimeError(
            f"checkpoint {path} is incomplete: its save stopped before the main file was written (found only "
            f"{', '.join(parts) or os.path.basename(path) + '.tmp'}); resume from an earlier checkpoint "
            "(--ckpt_path last picks the newest complete one)"
        )


def load_rank_local(checkpoint: dict[str, Any], filepath: str | os.PathLike, rank: int,
                    world_size: int) -> dict[str, Any]:
    """Put this rank's side-file state back into ``checkpoint[RANK_LOCAL_KEY]`` (no-op for inline state)."""
    entry = checkpoint.get(RANK_LOCAL_KEY)
    if not (isinstance(entry, dict) and entry.get("side_files")):
        return checkpoint
    if entry["world_size"] != world_size:
        raise ValueError(
            f"checkpoint {filepath} holds sparse state sharded over {entry['world_size']} ranks; this run has "
            f"{world_size}. Resume with --trainer.devices/num_nodes giving {entry['world_size']} ranks"
        )
    path = rank_file(filepath, rank)
    if not os.path.exists(path):
        real = rank_file(os.path.realpath(filepath), rank)  # a 'last' link points at the real file
        if not os.path.exists(real):
            raise FileNotFoundError(
                f"checkpoint {filepath} keeps rank {rank}'s n-gram/value-embedding state in {path}, which is "
                "missing; copy every .ngram-rank*.pt file along with the checkpoint"
            )
        path = real
    data = torch.load(path, map_location="cpu", weights_only=True)
    wanted = entry.get("save_id")
    if wanted is not None:
        got = data.get("save_id") if isinstance(data, dict) and set(data) == {"save_id", "state"} else None
        if got != wanted:
            raise RuntimeError(
                f"side file {path} belongs to another save than checkpoint {filepath} (save id {got} != {wanted}); "
                "the save that wrote it did not finish: resume from an earlier checkpoint"
            )
        data = data["state"]
    out = dict(checkpoint)
    out[RANK_LOCAL_KEY] = data
    return out


def remove_rank_local(filepath: str | os.PathLike, rank: int) -> None:
    """Delete this rank's side file of ``filepath`` if it exists."""
    path = rank_file(filepath, rank)
    if os.path.exists(path):
        os.remove(path)
