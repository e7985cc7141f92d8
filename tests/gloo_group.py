"""Process groups of the multi-rank CPU tests: gloo on a file store, and a clean exit.

A file store has no server: with a TCP store, rank 0 hosts one on a background thread, and a
port picked before the spawn can be taken by another process in between. Each spawn gets a
fresh store file in the test's temporary directory.

Ranks start through :func:`spawn_ranks`: ``mp.spawn``'s contract, with each rank forked from a
forkserver that imported torch once, where a fresh interpreter per rank would import it again
(an 8-rank test took 11.0 s spawned and 4.6 s forked so, on a 2-core machine).

A rank that finished its work leaves through :func:`leave`, without the interpreter's
teardown: CI runs saw a rank abort after its work was done ("terminate called without an
active exception", SIGABRT), which is how gloo objects destroyed while Python clears its
modules end (pytorch/pytorch issues 65231 and 60998 show the same abort in that phase). A
worker calls it only after its group is destroyed and its results are saved, so a failing
worker still raises and its traceback reaches the parent.
"""

from __future__ import annotations

import faulthandler
import gc
import itertools
import multiprocessing
import os
import sys
from pathlib import Path
from typing import Any, Callable

import torch.distributed as dist
import torch.multiprocessing as mp

_spawns = itertools.count()


def store_path(tmp_path: Path | str) -> str:
    """A file-store path no earlier spawn of this test process has used."""
    return str(Path(tmp_path) / f"gloo-store-{next(_spawns)}")


def spawn_ranks(fn: Callable[..., Any], args: tuple, nprocs: int) -> None:
    """Run ``fn(rank, *args)`` in ``nprocs`` processes and wait for them; a rank's failure is
    raised here with its traceback, as ``mp.spawn`` does. The forkserver (one per test process,
    started at the first call) imports torch and the package before it forks any rank."""
    multiprocessing.set_forkserver_preload(["torch", "torch.distributed", "nanogpt_pl"])
    mp.start_processes(fn, args=args, nprocs=nprocs, join=True, start_method="forkserver")


def init_gloo(rank: int, world: int, store: str) -> None:
    """Join this spawn's gloo group (over the loopback interface) as ``rank`` of ``world``.

    A rank killed by a signal (an abort inside gloo, say) prints every thread's Python stack to
    stderr, which the parent test shows.
    """
    faulthandler.enable(all_threads=True)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)


def leave() -> None:
    """End a rank whose work succeeded: exit code 0, skipping the interpreter's teardown."""
    gc.collect()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
