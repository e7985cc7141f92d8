"""SpeedrunStrategy: Lightning's process-group plumbing without the DDP wrapper.

The speedrun's optimizers communicate their own gradients: ANVIL reduce-scatters the
matrix banks and all-gathers the updated shards, Adam averages the replicated
parameters, and the n-gram table exchanges only the rows a batch touched. A DDP
wrapper would all-reduce every gradient a second time. This strategy keeps what DDP
gives Lightning (the launcher, cluster environments such as torchrun and SLURM, NCCL
on GPUs and gloo on CPUs, rank bookkeeping, barriers, broadcasts, metric reduction)
and leaves the module unwrapped, with parameters and buffers broadcast from rank 0
once at setup so every rank starts identical.

Use it as ``trainer.strategy: speedrun`` (registered name) or by class path.
"""

from __future__ import annotations

from typing import Any, Optional

import torch.distributed as dist
from lightning.pytorch.overrides.distributed import _sync_module_states
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry


class SpeedrunStrategy(DDPStrategy):
    """Multi-process strategy (one process per device) with optimizer-owned communication.

    Accepts DDPStrategy's arguments (``process_group_backend``, ``timeout``, ``start_method``);
    DDP-wrapper options (bucket sizes, comm hooks, unused-parameter detection) do not apply.
    """

    strategy_name = "speedrun"

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
    # by rank 0 as usual, keeps only a marker with the world size.
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any,
                        storage_options: Optional[Any] = None) -> None:
        from .side_files import save_rank_local

        checkpoint = save_rank_local(checkpoint, filepath, self.global_rank, self.world_size)
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def load_checkpoint(self, checkpoint_path: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        from .side_files import load_rank_local

        checkpoint = super().load_checkpoint(checkpoint_path, *args, **kwargs)
        return load_rank_local(checkpoint, checkpoint_path, self.global_rank, self.world_size)

    def remove_checkpoint(self, filepath: Any) -> None:
        from .side_files import remove_rank_local

        super().remove_checkpoint(filepath)
        remove_rank_local(filepath, self.global_rank)

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name,
            cls,
            description="Multi-process training without a DDP wrapper; optimizers own gradient communication",
        )


if SpeedrunStrategy.strategy_name not in StrategyRegistry:
    SpeedrunStrategy.register_strategies(StrategyRegistry)
