"""Process groups of the multi-rank CPU tests: gloo on a file store.

A file store has no server: with a TCP store, rank 0 hosts one on a background thread, a
port picked before the spawn can be taken by another process in between, and a rank that
exits while a peer still talks to the server can abort ("terminate called without an active
exception"). Each spawn gets a fresh store file in the test's temporary directory.
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import torch.distributed as dist

_spawns = itertools.count()


def store_path(tmp_path: Path | str) -> str:
    """A file-store path no earlier spawn of this test process has used."""
    return str(Path(tmp_path) / f"gloo-store-{next(_spawns)}")


def init_gloo(rank: int, world: int, store: str) -> None:
    """Join this spawn's gloo group (over the loopback interface) as ``rank`` of ``world``."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)

