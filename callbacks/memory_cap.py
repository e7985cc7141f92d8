"""Cap the GPU memory PyTorch may use, to run a config as it would on a smaller card.

``GpuMemoryCap(max_gib=22)`` on an 80 or 141 GB GPU lets the caching allocator (CUDA-graph
pools included) reserve at most 22 GiB, what PyTorch gets on a 24 GB card once the CUDA
context is loaded; an allocation past it raises ``torch.OutOfMemoryError`` as it would
there. At the end of training it logs the peaks, ``gpu/peak_allocated_gib`` and
``gpu/peak_reserved_gib``, to every logger and prints them. A GPU smaller than the cap is
left as it is; off CUDA the callback says once that it has no effect.
"""

from __future__ import annotations

import warnings

import lightning as L
import torch

GIB = 2**30


def memory_fraction(max_gib: float, total_bytes: int) -> float:
    """The fraction of a device of ``total_bytes`` that ``max_gib`` is (at most 1)."""
    if max_gib <= 0:
        raise ValueError(f"GpuMemoryCap.max_gib must be positive, got {max_gib}")
    return min(1.0, max_gib * GIB / total_bytes)


class GpuMemoryCap(L.Callback):
    """Limit this process's GPU memory to ``max_gib`` GiB (``torch.cuda.set_per_process_memory_fraction``).

    Args:
        max_gib: the most the caching allocator may reserve on the run's GPU, in GiB.
    """

    def __init__(self, max_gib: float) -> None:
        memory_fraction(max_gib, 1)  # checks the value
        self.max_gib = float(max_gib)
        self.fraction: float | None = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        device = trainer.strategy.root_device
        if device.type != "cuda":
            warnings.warn(f"GpuMemoryCap(max_gib={self.max_gib}) has no effect on {device.type}: it caps CUDA memory")
            return
        total = torch.cuda.get_device_properties(device).total_memory
        self.fraction = memory_fraction(self.max_gib, total)
        torch.cuda.set_per_process_memory_fraction(self.fraction, device)
        torch.cuda.reset_peak_memory_stats(device)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        device = trainer.strategy.root_device
        if self.fraction is None or device.type != "cuda":
            return
        peaks = {"gpu/peak_allocated_gib": torch.cuda.max_memory_allocated(device) / GIB,
                 "gpu/peak_reserved_gib": torch.cuda.max_memory_reserved(device) / GIB}
        for logger in trainer.loggers:
            logger.log_metrics(peaks, step=trainer.global_step)
        if trainer.is_global_zero:
            alloc, reserved = peaks["gpu/peak_allocated_gib"], peaks["gpu/peak_reserved_gib"]
            print(f"GpuMemoryCap: cap {self.max_gib:.1f} GiB; peak allocated {alloc:.2f} GiB, "
                  f"peak reserved {reserved:.2f} GiB")
