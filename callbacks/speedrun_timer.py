"""The speedrun clock (RECORD.md §11, §12).

The record's timing convention, as a callback:

1. **Untimed warmup.** Before the clock starts, run real training steps at a sample of
   schedule steps (every distinct batch shape / loss configuration, its first two
   steps, and the steps around each stage boundary), so compilation, autotuning and
   allocator growth happen off the clock. Then restore weights, buffers, optimizer
   state, the candidate sampler and every stateful callback to the start. Warmup
   batches come from a separate stream; the training stream is untouched.
2. **The clock** runs from the first timed step to the start of the final validation;
   validation passes and checkpoint saves are excluded (the clock pauses; after a save it
   restarts with the next step).
3. **Target.** After each validation, ``val/loss <= target`` stops the run;
   ``speedrun/train_time_s`` and ``speedrun/reached_target`` are logged.
"""

from __future__ import annotations

import time
from typing import Any, Optional

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.exceptions import SIGTERMException

from nanogpt_pl.capture import FrozenGC, gpu_memory_gib, schedule_key

RECORD_TARGET = 3.28  # RECORD §12: mean final FineWeb val CE must be <= 3.28


WARMUP_PREFIX = 8  # RECORD §11: the steps 0..7 are visited last
UNTIE_FOLLOW_STEPS = 3  # RECORD §11: the 3 steps after the untie (1176–1178)
SLOW_STEPS_REPORTED = 5  # the end-of-training line names this many of the slowest timed steps


WARMUP_ORDERS = ("largest_first", "schedule")


def check_warmup_order(order: str) -> None:
    if order not in WARMUP_ORDERS:
        raise ValueError(f"SpeedrunTimer warmup_order={order!r}: use one of {', '.join(WARMUP_ORDERS)}")


def default_warmup_steps(schedule: Any, limit: int = 40, order: str = "largest_first") -> list[int]:
    """The untimed warmup steps, chosen as the record chooses them (RECORD §11).

    A configuration key is ``nanogpt_pl.capture.schedule_key`` (batch, sequence length, max
    document length, attention split, windows, candidate count, number of MTP weights, prefix
    weight): a CUDA graph's key, so each key's first two steps give it its two untimed visits
    (capture, self-check). Sampled: steps 0 and 1; the 4 steps s−2..s+1 around every stage
    boundary and every change of the candidate count; the 3 steps after the untie; each key's
    first step and the one after. The prefix 0..7 comes last. On the record's schedule this is
    29 sampled steps plus the prefix, 37 in all (budget 40). At most ``limit`` steps: sampled
    ones are dropped from the end first. ``order="largest_first"`` runs the sampled steps
    longest micro-batch first (:func:`largest_first`), for the graphs' memory; ``"schedule"``
    in step order, as the record lists them.
    """
    check_warmup_order(order)
    total = schedule.total_steps

    def key(s: int) -> tuple:
        return schedule_key(schedule, s)

    firsts = [s for s in range(total) if s == 0 or key(s) != key(s - 1)]
    boundaries = {schedule.stage_start(i) for i in range(1, len(schedule.stages))}
    boundaries |= {s for s in firsts if s > 0 and schedule.candidates(s) != schedule.candidates(s - 1)}
    sampled = {0, 1}
    for b in boundaries:
        sampled.update(range(b - 2, b + 2))
    for s in firsts:
        sampled.update((s, s + 1))
    if schedule.untie_step is not None:
        sampled.update(range(schedule.untie_step + 1, schedule.untie_step + 1 + UNTIE_FOLLOW_STEPS))
    prefix = list(range(min(WARMUP_PREFIX, total)))
    sampled = sorted(s for s in sampled if 0 <= s < total and s not in prefix)
    sampled = sampled[:max(0, limit - len(prefix))]
    return (largest_first(schedule, sampled) if order == "largest_first" else sampled) + prefix[:limit]


def largest_first(schedule: Any, steps: list[int]) -> list[int]:
    """``steps`` (ascending) reordered so the runs of consecutive steps that start with the
    longest micro-batch come first; each run keeps its order (a key's two visits, a stage boundary).

    The micro-batch graphs of every key share one memory pool, and a capture can only reuse
    the pool's free blocks that are large enough. Captured from the shortest sequences up,
    each stage adds segments sized for its own tensors and the pool grows toward the sum of the
    stages' activations (on one H100, ``speedrun_1gpu.yaml``'s warmup in step order ran out of
    memory capturing, with 12-17 GiB in graph pools and 11-17 GiB of free blocks it could not
    use). Largest first, the later keys' tensors can be cut from the largest key's blocks.

    A run is placed by its first step, not its longest: a key is captured at its second
    micro-batch, so the first step of a run is where its first capture happens (a run across
    a stage boundary starting in the shorter stage captures that stage's key first).
    """
    runs: list[list[int]] = []
    for s in steps:
        if runs and s == runs[-1][-1] + 1:
            runs[-1].append(s)
        else:
            runs.append([s])
    runs.sort(key=lambda run: -schedule.seq_len(run[0]))  # stable: ties stay in step order
    return [s for run in runs for s in run]


def reserve_run_shapes(trainer: L.Trainer, pl_module: L.LightningModule) -> None:
    """Size the step's inputs for the whole run (up to ``trainer.max_steps``) from its batch plan
    (``SpeedrunModule.reserve_shapes``), before the first capture: the warmup visits steps out of
    order, and a key captured at a smaller ``cu_seqlens`` than the run reaches by then would be
    captured again on the clock. The value-embedding leaf is sized from the plan too (its distinct
    tokens), instead of min(T, V) rows. Nothing without a datamodule or module that has them."""
    bounds_of = getattr(trainer.datamodule, "plan_bounds", None)
    reserve = getattr(pl_module, "reserve_shapes", None)
    if bounds_of is None or reserve is None:
        return
    stop = trainer.max_steps if trainer.max_steps is not None and trainer.max_steps >= 0 else None
    reserve(bounds_of(stop))


class SpeedrunTimer(L.Callback):
    """Untimed warmup with reset, the training clock, and the stop at the target loss.

    Args:
        warmup_steps: schedule steps to run untimed before the clock starts; ``None`` picks
            them with :func:`default_warmup_steps`; ``[]`` disables the warmup.
        warmup_limit: at most this many automatically chosen warmup steps.
        target: validation loss at which the run stops (RECORD §12: 3.28).
        stop_at_target: stop training once a validation reaches the target.
        warmup_order: ``largest_first`` (default) or ``schedule``: the order of the chosen
            warmup steps (:func:`default_warmup_steps`).
        warmup_only: run the warmup, then end the run before its first step (no clock, no
            validation, no checkpoint): it fills a fresh machine's compile caches (and, with
            ``callbacks.compile_cache.CompileCache``, that callback's file) for the timed run that
            follows. ``python main.py fit ... --warmup_only true`` sets it.

    The warmup prints one line a step (its seconds and the total so far); on a GPU it ends with
    one more: its steps and seconds, and the memory it left (peak allocated, reserved, and
    reserved in CUDA graph pools), also kept as ``warmup_memory``. SIGTERM stops it between two
    steps: the model and callbacks are put back as they were, and the run ends as Lightning ends
    it at a step, before any step was trained (Ctrl-C interrupts it at once, as Lightning does).
    Before it, the CUDA graphs' ``cu_seqlens`` and the value-embedding leaf are sized from the
    run's whole batch plan (``reserve_shapes``), so a key has one shape whatever order the warmup
    visits it in.
    A run resumed from a checkpoint (``global_step > 0``) has no warmup: the callbacks hold
    restored state the warmup's reset would drop. Its graphs are sized the same way, and its keys
    are captured on the clock. While the clock runs, a step that runs a micro-batch eagerly (a key
    the warmup did not capture) is one warning naming the new keys (``clock_eager_steps``);
    training ends (or fails) with one line: the median and slowest timed steps by host wall time.
    """

    def __init__(self, warmup_steps: Optional[list[int]] = None, warmup_limit: int = 40,
                 target: float = RECORD_TARGET, stop_at_target: bool = True,
                 warmup_order: str = "largest_first", warmup_only: bool = False) -> None:
        check_warmup_order(warmup_order)  # at construction: the config's error, before any model is built
        self.warmup_steps = warmup_steps
        self.warmup_limit = warmup_limit
        self.warmup_order = warmup_order
        self.warmup_only = warmup_only
        self.warmup_memory: dict[str, float] = {}
        self.target = target
        self.stop_at_target = stop_at_target
        self.elapsed = 0.0
        self._t0: Optional[float] = None
        self.warmup_seconds = 0.0
        self.reached = False
        self._paused_for_save = False
        self._gc = FrozenGC()  # RECORD §11: no garbage collection while the clock runs
        self._step_seconds: list[tuple[int, float]] = []  # (step, host wall seconds) of each timed step
        self._last_step_end = 0.0
        self._graph_seen: Optional[dict] = None  # the module's graph counts at the last timed step's end
        self.clock_eager_steps: list[int] = []  # timed steps that ran a micro-batch eagerly

    @property
    def clock_running(self) -> bool:
        """Whether timed training is in progress (callbacks that cost time stay out of it)."""
        return self._t0 is not None

    @staticmethod
    def _sync(pl_module: L.LightningModule) -> None:
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)

    # -- warmup --------------------------------------------------------------------------
    def _stateful_callbacks(self, trainer: L.Trainer) -> list[L.Callback]:
        return [cb for cb in trainer.callbacks if cb is not self and hasattr(cb, "reset")]

    def run_warmup(self, trainer: L.Trainer, pl_module: L.LightningModule) -> list[int]:
        steps = (default_warmup_steps(pl_module.schedule, self.warmup_limit, self.warmup_order)
                 if self.warmup_steps is None else list(self.warmup_steps))
        if trainer.max_steps is not None and trainer.max_steps >= 0:
            # a run shortened with trainer.max_steps has no data planned past it
            steps = [s for s in steps if s < trainer.max_steps]
        if not steps:
            return []
        start = time.perf_counter()
        reserve_run_shapes(trainer, pl_module)
        snapshot = pl_module.capture_state()
        previous = 0
        for i, step in enumerate(steps):
            if self._stop_requested(trainer):
                self._restore(trainer, pl_module, snapshot)
                rank_zero_info(f"speedrun warmup: stopped by a signal after {i} of {len(steps)} steps "
                               f"({time.perf_counter() - start:.1f} s); the model is as it was before the warmup")
                raise SIGTERMException()
            t0 = time.perf_counter()
            batch = pl_module.prepare_batch(trainer.datamodule.batch_at(step), step)
            batch = pl_module.transfer_batch_to_device(batch, pl_module.device, 0)
            pl_module.apply_schedule(step, previous_step=previous)
            pl_module.run_step(batch)
            previous = step
            self._sync(pl_module)
            now = time.perf_counter()
            # one line a step: a first visit compiles (with inductor's tuning, minutes), and a
            # silent warmup cannot be told from a hung one
            rank_zero_info(f"speedrun warmup: {i + 1}/{len(steps)}, step {step}, {now - t0:.1f} s "
                           f"({now - start:.1f} s so far)")
        self._restore(trainer, pl_module, snapshot)
        self.warmup_seconds = time.perf_counter() - start
        if pl_module.device.type == "cuda":
            self.warmup_memory = gpu_memory_gib(pl_module.device)
            m = self.warmup_memory
            rank_zero_info(f"speedrun warmup: {len(steps)} steps in {self.warmup_seconds:.1f} s; GPU memory "
                           f"{m['peak_allocated']:.2f} GiB peak allocated, {m['reserved']:.2f} GiB reserved, "
                           f"{m['graph_pools']:.2f} GiB of it in CUDA graph pools")
        return steps

    def _restore(self, trainer: L.Trainer, pl_module: L.LightningModule, snapshot: Any) -> None:
        """Weights, buffers, optimizer state, the schedule and every stateful callback back to the start."""
        self._sync(pl_module)
        pl_module.restore_state(snapshot)
        pl_module.apply_schedule(trainer.global_step)
        for cb in self._stateful_callbacks(trainer):
            cb.reset()
        self._sync(pl_module)

    @staticmethod
    def _stop_requested(trainer: L.Trainer) -> bool:
        """SIGTERM on any rank. The warmup runs inside
        ``on_train_start``, where Lightning's loops do not look at the flag until the first step.
        Under ``SpeedrunStrategy`` every rank takes the decision at the same warmup step (its
        ``stop_signal``); under another strategy it is this rank's flag, reduced as Lightning reduces."""
        stop = getattr(trainer.strategy, "stop_signal", None)
        if stop is not None:
            return stop.agree()
        flag = bool(getattr(trainer, "received_sigterm", False))
        return bool(trainer.strategy.reduce_boolean_decision(flag, all=False))

    def _graph_counts(self, pl_module: L.LightningModule) -> Optional[dict]:
        counts = getattr(pl_module, "graph_counts", None)
        return counts() if counts is not None else None

    def _check_clock_captures(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """One line for each step that ran a micro-batch eagerly on the clock: a CUDA-graph key
        the warmup did not capture (a capture costs two eager visits, compiled code for a new
        shape, and graph memory, all timed)."""
        counts = self._graph_counts(pl_module)
        if counts is None or self._graph_seen is None:
            return
        eager = counts["eager"] - self._graph_seen["eager"]
        if eager > 0:
            step = trainer.global_step - 1
            new = pl_module.graph_key_names(self._graph_seen["keys_seen"])
            self.clock_eager_steps.append(step)
            rank_zero_warn(f"speedrun timer: step {step} ran {eager} micro-batch(es) eagerly on the clock (CUDA "
                           f"graphs not captured in the warmup); new keys: {'; '.join(new) or 'none'}")
        self._graph_seen = counts

    def _step_report(self) -> Optional[str]:
        """The slowest steps of the timed run by host wall time, against the median."""
        if len(self._step_seconds) < 2:
            return None
        by_time = sorted(self._step_seconds, key=lambda ts: -ts[1])
        median = sorted(t for _, t in self._step_seconds)[len(self._step_seconds) // 2]
        slow = ", ".join(f"{step}: {t:.2f}" for step, t in by_time[:SLOW_STEPS_REPORTED])
        return (f"speedrun timer: {len(self._step_seconds)} timed steps, median {median * 1e3:.1f} ms; slowest "
                f"(step: s) {slow}"
                + (f"; {len(self.clock_eager_steps)} step(s) ran micro-batches eagerly, first "
                   f"{self.clock_eager_steps[:SLOW_STEPS_REPORTED]}" if self.clock_eager_steps else ""))

    # -- clock -----------------------------------------------------------------------------
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.warmup_only:
            if trainer.global_step > 0:
                raise ValueError("SpeedrunTimer warmup_only: a resumed run (global_step "
                                 f"{trainer.global_step}) has no warmup; drop --warmup_only or --ckpt_path")
            steps = self.run_warmup(trainer, pl_module)
            rank_zero_info(f"speedrun timer: warmup_only, {len(steps)} warmup steps run; training ends before "
                           "its first step")
            trainer.should_stop = True
            return
        if trainer.global_step == 0:
            self.run_warmup(trainer, pl_module)
        else:
            # a resumed run has no warmup: its keys are captured on the clock (one warning a step),
            # but at the shapes of the whole plan, so none is captured twice as cu_seqlens grow
            reserve_run_shapes(trainer, pl_module)
        self._start(pl_module)

    def _start(self, pl_module: L.LightningModule) -> None:
        self._sync(pl_module)
        self._gc.pause()
        self._t0 = time.perf_counter()
        self._last_step_end = self._t0
        self._graph_seen = self._graph_counts(pl_module)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self._t0 is None:
            return
        now = time.perf_counter()
        self._step_seconds.append((trainer.global_step - 1, now - self._last_step_end))
        self._last_step_end = now
        self._check_clock_captures(trainer, pl_module)

    def _pause(self, pl_module: L.LightningModule) -> None:
        if self._t0 is not None:
            self._sync(pl_module)
            self.elapsed += time.perf_counter() - self._t0
            self._t0 = None
        self._gc.resume()

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.state.fn == "fit" and not trainer.sanity_checking:
            self._pause(pl_module)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.state.fn != "fit" or trainer.sanity_checking:
            return
        loss = trainer.callback_metrics.get("val/loss")
        if loss is not None and float(loss) <= self.target:
            self.reached = True
            if self.stop_at_target:
                trainer.should_stop = True
        for logger in trainer.loggers:
            logger.log_metrics({"speedrun/train_time_s": self.elapsed,
                                "speedrun/reached_target": float(self.reached)}, step=trainer.global_step)
        if not trainer.should_stop:
            self._start(pl_module)

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        if trainer.state.fn == "fit" and self._t0 is not None:
            self._pause(pl_module)
            self._paused_for_save = True

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if self._paused_for_save:
            self._paused_for_save = False
            if self._t0 is None:
                self._start(pl_module)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._pause(pl_module)
        report = self._step_report()
        if report is not None:
            rank_zero_info(report)

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._gc.resume()
        report = self._step_report()
        if report is not None:  # where the time went before the failure
            rank_zero_info(report)

    def state_dict(self) -> dict[str, Any]:
        # a save's state_dict comes before its on_save_checkpoint pause: count the running segment
        running = 0.0 if self._t0 is None else time.perf_counter() - self._t0
        return {"elapsed": self.elapsed + running, "reached": self.reached}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.elapsed = float(state_dict["elapsed"])
        self.reached = bool(state_dict["reached"])
