"""Checkpoint saves that do not stall the training step (``SpeedrunStrategy(async_checkpoint=True)``).

A record-size n-gram shard is 15.13 GiB per rank (RECORD §3); ``torch.save`` of it stalls
for many seconds. An asynchronous save takes a snapshot and returns; one background
thread per rank writes the files:

1. **Snapshot** (training thread). This rank's side-file state is copied to host memory:
   on CUDA into pinned buffers kept from save to save, by non-blocking copies on a side
   stream that first waits for the compute stream; an event marks their end. The copies
   read device clones of the state when the GPU has room for them (milliseconds of
   device time); otherwise they read the live tensors and the strategy makes the next
   optimizer step that runs the sparse part wait for the event on the GPU (the sparse
   update is the only code that changes that state in place). On CPU it is a plain copy.
   The main checkpoint (written by rank 0) is cloned on its device, as Lightning's
   ``AsyncCheckpointIO`` does.
2. **Write** (background thread). Every rank writes ``<ckpt>.ngram-rank<r>.pt`` under a
   temporary name and renames it; the file carries the save's id. Rank 0 waits until
   every rank's side file of this save is in place, writes the main file the same way,
   and only then points ``last.ckpt`` at it (when a ``ModelCheckpoint`` asks for a last
   checkpoint). The main file therefore exists only once every part does: a run killed
   mid-write leaves side files without a main file, which ``--ckpt_path last`` never
   picks and :func:`~.side_files.check_complete` names as incomplete.
3. **Order.** One save is in flight at a time. The next save, ``remove_checkpoint``
   (queued behind the save that replaced the file, skipped if that save failed) and
   teardown wait for it; a write error is raised there.

The rank-0 wait needs the checkpoint folder on a filesystem every rank writes to (one
node, or a shared filesystem across nodes), as resuming does.
"""

from __future__ import annotations

import os
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, NamedTuple, Optional

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor

from .side_files import rank_file, side_file_snapshot, write_side_file

# How long rank 0 waits for the other ranks' side files of a save before failing it.
DEFAULT_PEER_WAIT_S = 1800.0
_POLL_S = 0.05
# Driver-free device memory needed, per byte of state, to stage a snapshot in device clones: the clones
# may come from the allocator's cached blocks, and the next steps must still find that much memory.
STAGING_HEADROOM = 1.25


class Snapshot(NamedTuple):
    """A host copy of a state: ``done`` marks the end of its copies (None: complete already);
    ``reads_live`` says whether they read the live tensors, so in-place updates must wait for ``done``."""

    state: Any
    done: Optional[torch.cuda.Event]
    reads_live: bool


class HostSnapshot:
    """Copies of a state's tensors in host memory, taken without blocking the training thread on CUDA.

    On CUDA the tensors are first cloned on the device when the driver has room for the
    clones with :data:`STAGING_HEADROOM` to spare (a device-to-device copy of a record
    rank's 15 GiB takes milliseconds); the device-to-host copies then read the private
    clones and training need not wait for them. Without room they read the live tensors
    (``Snapshot.reads_live``). Host buffers are pinned and reused while a state's tensors
    keep their shapes (pinned memory is slow to allocate: the first snapshot of a
    record-size shard pays it once).

    Args:
        device_staging: allow the device clones (False: always read the live tensors).
    """

    def __init__(self, device_staging: bool = True) -> None:
        self.device_staging = device_staging
        self._buffers: list[Tensor] = []
        self._stream: Optional[torch.cuda.Stream] = None

    def take(self, state: Any) -> Snapshot:
        """Start copying every tensor of ``state`` to host memory; the copy and when it is done."""
        tensors = _tensors(state)
        cuda = [t for t in tensors if t.is_cuda]
        if not cuda:
            return Snapshot(apply_to_collection(state, Tensor, lambda t: t.detach().clone()), None, False)
        device = cuda[0].device
        need = sum(t.numel() * t.element_size() for t in cuda)
        staged = self.device_staging and torch.cuda.mem_get_info(device)[0] >= STAGING_HEADROOM * need
        # clones are taken on the compute stream, in order with the updates before and after them
        sources = [t.detach().clone() if (staged and t.is_cuda) else t.detach() for t in tensors]
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream(device))
        for i, src in enumerate(sources):
            if i == len(self._buffers):
                self._buffers.append(torch.empty(0))
            if self._buffers[i].shape != src.shape or self._buffers[i].dtype != src.dtype:
                self._buffers[i] = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
            if src.is_cuda:
                src.record_stream(stream)  # freed on the compute stream, it must outlive the copy
            with torch.cuda.stream(stream):
                self._buffers[i].copy_(src, non_blocking=True)
        del sources
        event = torch.cuda.Event()
        event.record(stream)
        index = iter(range(len(tensors)))
        return Snapshot(apply_to_collection(state, Tensor, lambda t: self._buffers[next(index)]), event, not staged)


def _tensors(state: Any) -> list[Tensor]:
    found: list[Tensor] = []
    apply_to_collection(state, Tensor, found.append)
    return found


def new_save_id() -> str:
    return uuid.uuid4().hex


class AsyncCheckpointWriter:
    """The background thread of one rank: writes saves in order, then runs queued removals and links."""

    def __init__(self, peer_wait_s: float = DEFAULT_PEER_WAIT_S) -> None:
        self.peer_wait_s = peer_wait_s
        self.snapshot = HostSnapshot()
        self._executor: Optional[ThreadPoolExecutor] = None
        self._futures: list[Future] = []
        self._error: Optional[BaseException] = None
        self.last_ok = True  # the most recent save finished (removals behind it may run)
        self.saves_written = 0
        # (global step, path) of the most recent save submitted, for aliasing last.ckpt to it
        self.last_submitted: Optional[tuple[int, str]] = None

    def _submit(self, job: Callable[[], None]) -> None:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-writer")

        def run() -> None:
            try:
                job()
            except BaseException as e:  # raised on the training thread at the next wait()
                self.last_ok = False
                if self._error is None:
                    self._error = e

        self._futures.append(self._executor.submit(run))

    def busy(self) -> bool:
        return any(not f.done() for f in self._futures)

    def wait(self) -> None:
        """Block until every submitted job ran; raise the first error a job met."""
        for f in self._futures:
            f.result()
        self._futures = []
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"asynchronous checkpoint save failed: {error}") from error

    def close(self) -> None:
        try:
            self.wait()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None

    # -- jobs ---------------------------------------------------------------------------
    def submit_save(self, filepath: str, rank: int, world_size: int, save_id: str, side_state: Any,
                    event: Optional[torch.cuda.Event], main: Optional[dict[str, Any]],
                    write_main: Callable[[dict[str, Any], str], None], step: int) -> None:
        """Write this rank's side file (if ``side_state``) and, on rank 0, the main file ``main``."""
        self.last_submitted = (step, filepath)

        def job() -> None:
            self.last_ok = False
            if event is not None:
                event.synchronize()
            if side_state is not None:
                write_side_file(side_state, filepath, rank, save_id)
            if main is not None:
                if side_state is not None:
                    self._wait_for_peers(filepath, world_size, save_id)
                tmp = f"{filepath}.tmp"
                write_main(main, tmp)
                os.replace(tmp, filepath)
            self.last_ok = True
            self.saves_written += 1

        self._submit(job)

    def _wait_for_peers(self, filepath: str, world_size: int, save_id: str) -> None:
        deadline = time.monotonic() + self.peer_wait_s
        waiting = set(range(world_size))
        while waiting:
            for r in sorted(waiting):
                path = rank_file(filepath, r)
                if os.path.exists(path) and side_file_snapshot(path) == save_id:
                    waiting.discard(r)
            if not waiting:
                return
            if time.monotonic() > deadline:
                r = min(waiting)
                raise TimeoutError(
                    f"rank {r}'s side file {rank_file(filepath, r)} of checkpoint {filepath} did not appear within "
                    f"{self.peer_wait_s:.0f} s; every rank must write to the same checkpoint folder (a shared "
                    "filesystem across nodes), or raise trainer.strategy.checkpoint_wait_s"
                )
            time.sleep(_POLL_S)

    def submit_link(self, target: str, linkpath: str, rank: int) -> None:
        """Point ``linkpath`` at ``target`` once the save of ``target`` finished (rank 0 links; every
        rank drops a stale side file of ``linkpath`` left by an earlier synchronous save)."""

        def job() -> None:
            if not self.last_ok:
                return
            stale = rank_file(linkpath, rank)
            if os.path.isfile(stale) and not os.path.islink(stale):
                os.remove(stale)
            if rank == 0:
                tmp = f"{linkpath}.link-tmp"
                if os.path.lexists(tmp):
                    os.remove(tmp)
                os.symlink(os.path.relpath(target, os.path.dirname(os.path.abspath(linkpath))), tmp)
                os.replace(tmp, linkpath)

        self._submit(job)

    def submit_remove(self, remove: Callable[[], None]) -> None:
        """Run ``remove`` after the save in flight, only if that save finished (its predecessor stays otherwise)."""

        def job() -> None:
            if self.last_ok:
                remove()

        self._submit(job)
