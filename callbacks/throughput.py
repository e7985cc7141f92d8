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

On a GPU the step's time is read from a CUDA event recorded after it, once the GPU has
passed that event: the callback never waits for the GPU (a synchronize per step would undo
the host's run-ahead of the step that CUDA graphs need), so each logged rate is that of the
last step the GPU finished, at most a few steps behind the host. At the end of training the
remaining events are waited for, so ``meter`` holds every step.

Why not ``ThroughputMonitor`` itself: it builds its meters with the peak FLOPs of its own
table and keeps them private, so the H200's figure could only be set by reaching into them.
"""

from __future__ import annotations

import collections
import time
from typing import Any, Optional

import lightning as L
import torch
from lightning.fabric.utilities.throughput import Throughput, get_available_flops

from nanogpt_pl.module import micro_batches

H100_BF16_DENSE_FLOPS = 989e12  # vendor datasheet; the H200 has the same tensor cores
HOPPER_NAMES = ("h100", "h200", "gh200", "h800")
# Steps whose CUDA events may wait unread; past this the oldest is waited for (bounded memory
# when nothing else throttles the host).
MAX_PENDING_STEPS = 8


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
        self._start: Optional[torch.cuda.Event] = None  # recorded at the start of training on a GPU
        self._pending: collections.deque = collections.deque()  # (event, counts) of steps not yet read

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        flops = self.available_flops
        if flops is None:
            flops = peak_flops(trainer.strategy.root_device)
        # the meter needs two points for a rate; a short run (an ablation of a few steps) fills a window of its length
        window = max(2, min(self.window_size, pl_module.schedule.run_steps(trainer.max_steps)))
        self.meter = Throughput(available_flops=flops, world_size=trainer.world_size, window_size=window)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.meter.reset()
        self.steps = self.micro_batches = self.tokens = 0
        self._pending.clear()
        self._start = None
        if trainer.strategy.root_device.type == "cuda":
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()
        self.t0 = time.perf_counter()

    @torch.inference_mode()
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        micro = micro_batches(batch)
        self.steps += 1
        self.micro_batches += len(micro)
        self.tokens += int(sum(mb["inputs"].numel() for mb in micro))
        counts = (self.steps, self.micro_batches, self.tokens, getattr(pl_module, "flops_per_batch", None))
        if self._start is None:
            self._feed(time.perf_counter() - self.t0, counts)
        else:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._pending.append((event, counts))
            if not self._drain(wait_oldest=len(self._pending) > MAX_PENDING_STEPS):
                return
        metrics = self.meter.compute()
        rates = {f"train/{k}": float(v) for k, v in metrics.items()}
        pl_module.log_dict(rates, batch_size=1, rank_zero_only=True)
        tokens_per_s = metrics.get("device/items_per_sec")
        if self.progress_bar and tokens_per_s is not None:
            pl_module.log("train/tokens_per_s", tokens_per_s * trainer.world_size, prog_bar=True, batch_size=1,
                          rank_zero_only=True)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        while self._pending:
            self._drain(wait_oldest=True)

    def _feed(self, seconds: float, counts: tuple) -> None:
        steps, micro, tokens, flops = counts
        self.meter.update(time=seconds, batches=steps, samples=micro, lengths=tokens, flops=flops)

    def _drain(self, wait_oldest: bool = False) -> bool:
        """Feed the meter every step whose event the GPU has passed (waiting for the oldest one
        first if ``wait_oldest``); True if any was fed."""
        fed = False
        while self._pending:
            event, counts = self._pending[0]
            if wait_oldest:
                event.synchronize()
                wait_oldest = False
            elif not event.query():
                break
            self._pending.popleft()
            self._feed(self._start.elapsed_time(event) / 1e3, counts)
            fed = True
        return fed
