"""What every command-line run gets: the final checkpoint, a clean stop on SIGTERM/SIGINT,
a progress bar with a total, and no empty log folders from runs that fail.

The CLI adds :class:`RunControl` to ``trainer.callbacks`` on its own, so a config's list of
callbacks stays the user's.
"""

from __future__ import annotations

import math
import shutil
import signal
import sys
import threading
from pathlib import Path
from typing import Any, Optional

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint, TQDMProgressBar
from lightning.pytorch.utilities.exceptions import SIGTERMException


def _checkpoints(trainer: L.Trainer) -> list[ModelCheckpoint]:
    return [cb for cb in trainer.callbacks if isinstance(cb, ModelCheckpoint)]


def save_last(trainer: L.Trainer, in_step: bool = False) -> list[str]:
    """Save ``last.ckpt`` in every ModelCheckpoint's folder unless it already holds this step.

    ``in_step``: called from ``on_train_batch_end``, before the checkpoint callbacks' own hook
    (Lightning runs them last); a step they save themselves is left to them.
    """
    saved = []
    for cb in _checkpoints(trainer):
        if cb.dirpath is None:
            continue
        if cb._last_global_step_saved == trainer.global_step and cb.last_model_path:
            saved.append(cb.last_model_path)
            continue
        every = cb._every_n_train_steps
        if in_step and every and trainer.global_step % every == 0:
            continue  # the callback saves this step (and its last.ckpt) itself, right after this hook
        if cb.save_last:
            cb._save_last_checkpoint(trainer, cb._monitor_candidates(trainer))
            saved.append(cb.last_model_path)
        else:
            path = str(Path(cb.dirpath) / f"{cb.CHECKPOINT_NAME_LAST}{cb.FILE_EXTENSION}")
            trainer.save_checkpoint(path)
            saved.append(path)
        cb._last_global_step_saved = trainer.global_step
    return saved


def remove_unused_log_dirs(trainer: L.Trainer) -> None:
    """Delete this run's log folders when it failed before its first step.

    Such a folder holds only what the loggers write at start (config.yaml, hparams.yaml, an
    empty TensorBoard event file); one with metrics or a checkpoint is kept.
    """
    if trainer.global_rank != 0 or trainer.global_step > 0:
        return
    for logger in trainer.loggers:
        # a logger's log_dir property creates nothing; only look at folders that exist
        log_dir = getattr(logger, "log_dir", None)
        if not log_dir or not Path(log_dir).is_dir():
            continue
        files = [p for p in Path(log_dir).rglob("*") if p.is_file()]
        if not any(p.suffix == ".ckpt" or p.name == "metrics.csv" for p in files):
            shutil.rmtree(log_dir, ignore_errors=True)


class RunControl(L.Callback):
    """Final checkpoint, SIGTERM/SIGINT handling, progress-bar total, no empty version folders.

    - ``last.ckpt`` holds the final step (Lightning saves only at ``every_n_train_steps``
      multiples and at epoch ends): it is saved right after that step.
    - SIGTERM (Lightning's own handler) and the first SIGINT stop training after the current
      step; the step's checkpoint is saved as ``last.ckpt`` and the process exits with status 0.
      Stopped before the first step (in the speedrun timer's warmup), the run saves nothing and
      keeps no empty log folder.
      A second SIGINT interrupts at once.
    - The progress bar's total is the number of steps this fit will train, so it shows an ETA.
    - A run that fails before it logs anything removes its ``version_N`` folders.
    """

    def __init__(self) -> None:
        self.stopped_by: Optional[str] = None
        self.saved: list[str] = []
        self._previous_sigint: Any = None

    # -- signals -----------------------------------------------------------------------
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        connector = trainer._signal_connector
        stop = getattr(trainer.strategy, "stop_signal", None)  # SpeedrunStrategy's: every rank at one step

        def stop_after_this_step(signum, frame) -> None:
            if (stop.requested if stop is not None else connector.received_sigterm):  # second Ctrl-C: stop now
                signal.signal(signal.SIGINT, signal.default_int_handler)
                raise KeyboardInterrupt
            self.stopped_by = "SIGINT"
            if stop is not None:
                stop.request()
            else:
                connector.received_sigterm = True

        self._previous_sigint = signal.signal(signal.SIGINT, stop_after_this_step)

    def _restore_sigint(self) -> None:
        if self._previous_sigint is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, self._previous_sigint)
            self._previous_sigint = None

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._restore_sigint()
        if isinstance(exception, SIGTERMException):
            self.stopped_by = self.stopped_by or "SIGTERM"
            if trainer.global_step == 0:  # stopped before the first step (in the speedrun timer's warmup)
                if trainer.global_rank == 0:
                    print(f"stopped by {self.stopped_by} before the first step; no checkpoint (nothing was trained)",
                          file=sys.stderr, flush=True)
                remove_unused_log_dirs(trainer)
                return
            self.saved = save_last(trainer)
            if trainer.global_rank == 0:
                where = (f"checkpoint {self.saved[0]} (resume: --ckpt_path last)" if self.saved
                         else "no checkpoint (checkpointing is off: trainer.enable_checkpointing)")
                print(f"stopped by {self.stopped_by} after step {trainer.global_step}; {where}", file=sys.stderr,
                      flush=True)
        else:
            remove_unused_log_dirs(trainer)

    # -- the final checkpoint ------------------------------------------------------------
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        # Saved where ModelCheckpoint saves its step checkpoints (after the step, before the final
        # validation, which leaves the weights as they are): a checkpoint written after the loops
        # have finished would resume into empty epochs when the run is extended.
        schedule = getattr(pl_module, "schedule", None)
        if schedule is not None and trainer.global_step >= schedule.run_steps(trainer.max_steps):
            self.saved = save_last(trainer, in_step=True)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._restore_sigint()
        if not self.saved and trainer.global_step > 0:  # the data ended before the schedule did
            self.saved = save_last(trainer)  # (a run that trained no step, e.g. --warmup_only, has nothing to keep)

    # -- progress-bar total ------------------------------------------------------------
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        bar = trainer.progress_bar_callback
        schedule = getattr(pl_module, "schedule", None)
        if not isinstance(bar, TQDMProgressBar) or bar._train_progress_bar is None or schedule is None:
            return
        tqdm_bar = bar.train_progress_bar
        if tqdm_bar.total is None or tqdm_bar.total == math.inf or tqdm_bar.total == float("inf"):
            tqdm_bar.total = tqdm_bar.n + max(schedule.run_steps(trainer.max_steps) - trainer.global_step, 0)
            tqdm_bar.refresh()
