"""Tokens per second and MFU, on Lightning's ThroughputMonitor.

ThroughputMonitor counts samples, items and FLOPs per batch over a sliding window and
logs them to the trainer's loggers. This subclass feeds it the speedrun's packed
batches (a step is a list of micro-batches; "items" are tokens), the model's FLOPs per
token (``GPTConfig.flops_per_token`` at the step's sequence length and windows), a
peak-FLOPs figure for GPUs missing from Lightning's table (H200: the H100's dense
bf16 989 TFLOP/s), and shows tokens/s on the progress bar.
"""

from __future__ import annotations

from typing import Any, Optional

import lightning as L
import torch
from lightning.pytorch.callbacks import ThroughputMonitor

H100_BF16_DENSE_FLOPS = 989e12  # vendor datasheet; the H200 has the same tensor cores


def _tokens(batch: Any) -> int:
    micro = batch if isinstance(batch, list) else [batch]
    return int(sum(mb["inputs"].numel() for mb in micro))


def _micro_batches(batch: Any) -> int:
    return len(batch) if isinstance(batch, list) else 1


class SpeedrunThroughput(ThroughputMonitor):
    """Logs ``train|validate/device/items_per_sec`` (tokens/s), FLOPs/s and MFU.

    Args:
        window_size: batches in the sliding window (ThroughputMonitor's argument).
        available_flops: peak FLOP/s of one device for MFU; None = Lightning's table, else
            989e12 on Hopper-class GPUs, else no MFU.
        progress_bar: show tokens/s on the progress bar.
    """

    def __init__(self, window_size: int = 20, available_flops: Optional[float] = None,
                 progress_bar: bool = True) -> None:
        super().__init__(batch_size_fn=_micro_batches, length_fn=_tokens, window_size=window_size)
        self._override_flops = available_flops
        self.progress_bar = progress_bar
        self._last_time: Optional[float] = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self._override_flops is None and trainer.strategy.root_device.type == "cuda":
            name = torch.cuda.get_device_name(trainer.strategy.root_device).lower()
            if any(k in name for k in ("h100", "h200", "gh200", "h800")):
                self._override_flops = H100_BF16_DENSE_FLOPS
        super().setup(trainer, pl_module, stage)
        if self._override_flops is not None:
            self.available_flops = int(self._override_flops)
            for meter in self._throughputs.values():
                meter.available_flops = int(self._override_flops)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if self.progress_bar and trainer.is_global_zero:
            meter = self._throughputs.get(trainer.state.stage)
            if meter is not None and len(meter._time) >= 2:
                dt = meter._time[-1] - meter._time[0]
                n = meter._lengths[-1] - meter._lengths[0]
                if dt > 0:
                    pl_module.log("train/tokens_per_s", n * trainer.world_size / dt, prog_bar=True,
                                  batch_size=1, rank_zero_only=True)
