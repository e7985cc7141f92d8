"""SpeedrunStrategy: Lightning's process-group plumbing without the DDP wrapper.

The speedrun's optimizers communicate their own gradients: ANVIL reduce-scatters the
matrix banks and all-gathers the updated shards, Adam averages the replicated
parameters, and the n-gram table exchanges only the rows a batch touched. A DDP
wrapper would all-reduce every gradient a second time. This strategy keeps what DDP
gives Lightning (the launcher, cluster environments such as torchrun and SLURM, NCCL
on GPUs and gloo on CPUs, rank bookkeeping, barriers, broadcasts, metric reduction)
and leaves the module unwrapped, with parameters and buffers broadcast from rank 0
once at setup so every rank starts identical.

Use it as ``trainer.strategy: speedrun`` (registered name) or by class path; with
``async_checkpoint: true`` a checkpoint save returns after a snapshot and the files are
written in the background (``async_checkpoint.py``). On SIGTERM every rank stops at the same
step, agreed over a gloo group without a device sync (``stop_signal.py``).
"""

from __future__ import annotations

import os
import re
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.overrides.distributed import _sync_module_states
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning_utilities.core.apply_func import apply_to_collection

from . import side_files
from .async_checkpoint import DEFAULT_PEER_WAIT_S, AsyncCheckpointWriter, new_save_id
from .side_files import (
    RANK_LOCAL_KEY,
    check_complete,
    load_rank_local,
    remove_rank_local,
    save_rank_local,
    side_file_marker,
    tensor_bytes,
)
from .stop_signal import StopSignal, install_stop_signal

# ModelCheckpoint's name for its last checkpoint (``last.ckpt``, ``last-v1.ckpt``).
_LAST_NAME = re.compile(r"^last(-v\d+)?\.ckpt$")


class SpeedrunStrategy(DDPStrategy):
    """Multi-process strategy (one process per device) with optimizer-owned communication.

    Accepts DDPStrategy's arguments (``process_group_backend``, ``timeout``, ``start_method``);
    DDP-wrapper options (bucket sizes, comm hooks, unused-parameter detection) do not apply.

    Args:
        async_checkpoint: a save takes a snapshot and returns; a background thread per rank
            writes the side file and (rank 0) the main file, which appears only once every
            rank's side file is written (``async_checkpoint.py``). With ``ModelCheckpoint(save_last=True)``
            ``last.ckpt`` becomes a link to the newest complete checkpoint instead of a second copy.
        checkpoint_wait_s: how long rank 0's writer waits for the other ranks' side files.
    """

    strategy_name = "speedrun"

    def __init__(self, *args: Any, async_checkpoint: bool = False, checkpoint_wait_s: float = DEFAULT_PEER_WAIT_S,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.async_checkpoint = async_checkpoint
        self.checkpoint_wait_s = checkpoint_wait_s
        self._writer: Optional[AsyncCheckpointWriter] = None
        self._snapshot_fence: Optional[torch.cuda.Event] = None
        self.stop_signal: Optional[StopSignal] = None

    def setup(self, trainer: Any) -> None:
        super().setup(trainer)
        # SIGTERM: one decision for all ranks at a step's start, no collective in the signal
        # handler and no device sync in the step (stop_signal.py)
        # (the agreement's gloo group is made once, at the first setup)
        group = self.stop_signal.group if self.stop_signal is not None else None
        self.stop_signal = install_stop_signal(trainer, self.world_size, group)
        if self.async_checkpoint:
            for cb in trainer.checkpoint_callbacks:
                if isinstance(cb, ModelCheckpoint) and cb.save_last == "link":
                    raise ValueError(
                        "ModelCheckpoint(save_last='link') links last.ckpt before an asynchronous save is written; "
                        "with trainer.strategy async_checkpoint: true use save_last: true (the strategy then links "
                        "last.ckpt to the newest complete checkpoint)"
                    )

    def configure_ddp(self) -> None:
        # No DistributedDataParallel: only make the replicas identical.
        if self.world_size > 1 and dist.is_available() and dist.is_initialized():
            _sync_module_states(self.model)

    @property
    def process_group(self) -> Optional[dist.ProcessGroup]:
        """The group the optimizers communicate over (None = the default group)."""
        return None

    # -- per-rank side files for rank-local state (the n-gram table shard) ---------------
    # Each rank writes its own ``<ckpt>.ngram-rank<r>.pt`` (nanogpt_pl.distributed.side_files),
    # so a record-size shard (15 GiB per rank) never travels to rank 0; the main file, written
    # by rank 0 as usual, keeps only a marker with the world size. With async_checkpoint the
    # same files are written by a background thread per rank (async_checkpoint.py).
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any,
                        storage_options: Optional[Any] = None) -> None:
        if self.async_checkpoint:
            self._save_async(checkpoint, os.fspath(filepath))
            return
        checkpoint = save_rank_local(checkpoint, filepath, self.global_rank, self.world_size)
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def _save_async(self, checkpoint: dict[str, Any], filepath: str) -> None:
        if self._writer is None:
            self._writer = AsyncCheckpointWriter(self.checkpoint_wait_s)
        writer = self._writer
        writer.wait()  # one save in flight; raises the previous save's error
        step = int(checkpoint.get("global_step", -1))
        if (_LAST_NAME.match(os.path.basename(filepath)) and writer.last_submitted is not None
                and writer.last_submitted[0] == step):
            # ModelCheckpoint(save_last=True) right after the step's own save: link, don't write twice
            writer.submit_link(writer.last_submitted[1], filepath, self.global_rank)
            return
        save_id = self.broadcast(new_save_id() if self.is_global_zero else None)
        state = checkpoint.get(RANK_LOCAL_KEY)
        snap = None if state is None else writer.snapshot.take(state)
        host_state, event = (None, None) if snap is None else (snap.state, snap.done)
        limit = side_files.INLINE_STATE_LIMIT_BYTES
        inline = state is not None and self.world_size == 1 and tensor_bytes(state) <= limit
        main = None
        if self.is_global_zero:
            main = dict(checkpoint)
            main.pop(RANK_LOCAL_KEY, None)
            main = _clone_tensors(main)
            if state is not None:
                main[RANK_LOCAL_KEY] = host_state if inline else side_file_marker(self.world_size, save_id)
        if snap is not None and snap.reads_live:
            self._snapshot_fence = event
        writer.submit_save(filepath, self.global_rank, self.world_size, save_id, None if inline else host_state,
                           event, main, self._write_main, step)

    def _write_main(self, checkpoint: dict[str, Any], path: str) -> None:
        self.checkpoint_io.save_checkpoint(checkpoint, path)

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        fence = self._snapshot_fence
        if fence is not None:
            active = optimizer.active_names() if hasattr(optimizer, "active_names") else ["sparse"]
            if "sparse" in active:
                # the sparse update overwrites rows the snapshot may still be copying: the GPU waits, not the host
                torch.cuda.current_stream(self.root_device).wait_event(fence)
                self._snapshot_fence = None
        return super().optimizer_step(optimizer, closure, model, **kwargs)

    def finish_checkpoints(self) -> None:
        """Block until every asynchronous save, removal and link has been written; raise a write error."""
        if self._writer is not None:
            self._writer.wait()

    def load_checkpoint(self, checkpoint_path: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        check_complete(checkpoint_path)
        checkpoint = super().load_checkpoint(checkpoint_path, *args, **kwargs)
        return load_rank_local(checkpoint, checkpoint_path, self.global_rank, self.world_size)

    def remove_checkpoint(self, filepath: Any) -> None:
        if self._writer is not None and self.async_checkpoint:
            rank, parent = self.global_rank, super()

            def remove() -> None:
                parent.remove_checkpoint(filepath)  # the main file, on rank 0
                remove_rank_local(filepath, rank)

            self._writer.submit_remove(remove)
            return
        super().remove_checkpoint(filepath)
        remove_rank_local(filepath, self.global_rank)

    def teardown(self) -> None:
        writer, self._writer = self._writer, None
        try:
            if writer is not None:
                writer.close()
        finally:
            super().teardown()

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name,
            cls,
            description="Multi-process training without a DDP wrapper; optimizers own gradient communication",
        )


def _clone_tensors(checkpoint: dict[str, Any]) -> dict[str, Any]:
    # a point-in-time copy on the tensors' device, as Lightning's AsyncCheckpointIO takes
    return apply_to_collection(checkpoint, torch.Tensor, lambda t: t.detach().clone())


if SpeedrunStrategy.strategy_name not in StrategyRegistry:
    SpeedrunStrategy.register_strategies(StrategyRegistry)
