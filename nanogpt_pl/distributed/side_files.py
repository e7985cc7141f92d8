"""Per-rank checkpoint side files for rank-local state (the n-gram shard, the value-embedding Adam state).

A record-size n-gram shard is 15.13 GiB per rank (RECORD §3), so it never passes through
rank 0: every rank writes its own ``<ckpt>.ngram-rank<r>.pt`` beside the Lightning
checkpoint and the main file keeps only a marker with the world size. With one rank
and a small state the state stays inline in the checkpoint. ``SpeedrunStrategy`` calls
:func:`save_rank_local` / :func:`load_rank_local` / :func:`remove_rank_local`; the module
puts the channels' state under :data:`RANK_LOCAL_KEY`.
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


def _tensor_bytes(obj: Any) -> int:
    if isinstance(obj, Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
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
    if state is None or (world_size == 1 and _tensor_bytes(state) <= limit):
        return checkpoint
    path = rank_file(filepath, rank)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    torch.save(state, tmp)
    os.replace(tmp, path)
    out = dict(checkpoint)
    out[RANK_LOCAL_KEY] = {"side_files": True, "world_size": world_size}
    return out


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
    out = dict(checkpoint)
    out[RANK_LOCAL_KEY] = torch.load(path, map_location="cpu", weights_only=True)
    return out


def remove_rank_local(filepath: str | os.PathLike, rank: int) -> None:
    """Delete this rank's side file of ``filepath`` if it exists."""
    path = rank_file(filepath, rank)
    if os.path.exists(path):
        os.remove(path)
