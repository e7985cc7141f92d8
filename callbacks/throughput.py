"""Tokens per second and MFU, on Lightning's ``Throughput`` meter.

Lightning's ``Throughput`` (``lightning.fabric.utilities.throughput``) keeps a sliding
window of (time, batches, samples, items, FLOPs) and ``compute()`` turns it into rates
and MFU. This callback feeds it the speedrun's packed batches (a step is a list of
micro-batches; "items" are tokens), the model's FLOPs of the rank's step
(``SpeedrunModule.flops_per_batch``: ``GPTConfig.flops_per_token`` at the step's sequence
length and windows) and a peak-FLOPs figure for GPUs missing from Lightning's table (H200:
the H100's dense bf16 989 TFLOP/s), and logs what ``compute()`` returns under ``train/``
(the keys ``ThroughputMonitor`` uses: ``train/device/items_per_sec``, ``train/device/mfu``,
...) plus ``train/tokens_per_s`` (all ranks) on the progress bar.

Why not ``ThroughputMonitor`` itself: it builds its meters with the peak FLOPs of its own
table and keeps them private, so the H200's figure could only be set by reaching into them.
"""

from __future__ import annotations

import time
from typing import Any, Optional

import lightning as L
import torch
from lightning.fabric.utilities.throughput import Throughput, get_available_flops

from nanogpt_pl.module import micro_batches

H100_BF16_DENSE_FLOPS = 989e12  # vendor datasheet; the H200 has the same tensor cores
HOPPER_NAMES = ("h100", "h200", "gh200", "h800")


def peak_flops(device: torch.device) -> Optional[float]:
    """Dense bf16 FLOP/s of one ``device`` (the model's matmuls run in bf16 on GPUs); None when unknown."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device).lower()
    if any(k in name for k in HOPPER_NAMES):
        return H100_BF16_DENSE_FLOPS
    return get_available_flops(device, torch.bfloat16)


class SpeedrunThroughput(L.Callback):
    """Logs ``train/device/items_per_sec`` (tokens/s), FLOPs/s and MFU over a sliding window.

    Args:
        window_size: training steps in the sliding window; rates appear once it is full. A run
            shorter than the window uses its own length, so it still reports its rate at its end.
        available_flops: peak FLOP/s of one device for MFU; None = 989e12 on Hopper-class GPUs,
            else Lightning's table (bf16), else no MFU.
        progress_bar: show tokens/s (all ranks) on the progress bar.
    """

    def __init__(self, window_size: int = 20, available_flops: Optional[float] = None,
                 progress_bar: bool = True) -> None:
        self.window_size = window_size
        self.available_flops = available_flops
        self.progress_bar = progress_bar
        self.meter = Throughput(available_flops=available_flops, window_size=window_size)
        self.t0 = 0.0
        self.steps = 0
        self.micro_batches = 0
        self.tokens = 0

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        flops = self.available_flops
        if flops is None:
            flops = peak_flops(trainer.strategy.root_device)
        # the meter needs two points for a rate; a short run (an ablation of a few steps) fills a window of its length
        window = max(2, min(self.window_size, pl_module.schedule.run_steps(trainer.max_steps)))
        self.meter = Throughput(available_flops=flops, world_size=trainer.world_size, window_size=window)

    @staticmethod
    def _sync(trainer: L.Trainer) -> None:
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize(trainer.strategy.root_device)  # the clock must see the step's kernels finish

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.meter.reset()
        self.steps = self.micro_batches = self.tokens = 0
        self._sync(trainer)
        self.t0 = time.perf_counter()

    @torch.inference_mode()
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._sync(trainer)
        micro = micro_batches(batch)
        self.steps += 1
        self.micro_batches += len(micro)
        self.tokens += int(sum(mb["inputs"].numel() for mb in micro))
        self.meter.update(time=time.perf_counter() - self.t0, batches=self.steps, samples=self.micro_batches,
                          lengths=self.tokens, flops=getattr(pl_module, "flops_per_batch", None))
        metrics = self.meter.compute()
        rates = {f"train/{k}": float(v) for k, v in metrics.items()}
        pl_module.log_dict(rates, batch_size=1, rank_zero_only=True)
        tokens_per_s = metrics.get("device/items_per_sec")
        if self.progress_bar and tokens_per_s is not None:
            pl_module.log("train/tokens_per_s", tokens_per_s * trainer.world_size, prog_bar=True, batch_size=1,
                          rank_zero_only=True)
