"""Applies the stage table (``nanogpt_pl.schedule.Schedule``) to the module every step.

Before each training step it sets the lr multiplier, the ANVIL momentum, the attention
windows (stretching the rotary frequencies with YaRN where a window grows, RECORD §2),
the sampled-softmax candidate count, multi-token and prefix-loss weights, and which
optimizer parts update this step (RECORD §5 cadences). Everything is a pure function
of ``trainer.global_step``, so a resumed run applies exactly what the straight run
would have. The data loader reads the same schedule for batch size and sequence length.

``SpeedrunModule.configure_callbacks`` adds this callback to every run.
"""

from __future__ import annotations

from typing import Any

import lightning as L


def apply_schedule(pl_module: L.LightningModule, step: int, previous_step: int | None = None) -> None:
    """Set ``step``'s values on the module.

    YaRN fires when the windows of ``step`` differ from those of ``previous_step``
    (default ``step - 1``), the step whose windows the rotary state currently reflects.
    """
    sched = pl_module.schedule
    pl_module.set_lr_scale(sched.lr_mul(step))
    pl_module.set_momentum(sched.momentum(step))
    short, long = sched.windows(step)
    if previous_step is None:
        previous_step = step - 1
    prev = sched.windows(previous_step) if previous_step >= 0 else (short, long)
    pl_module.set_windows(short, long, yarn_from=prev if prev != (short, long) else None)
    pl_module.set_loss_options(sched.candidates(step), sched.mtp_weights(step), sched.prefix_weight(step))
    pl_module.set_active_parts(pl_module.active_parts_for(step))
    pl_module.set_tied(sched.tied(step), untie_now=step > 0 and sched.tied(step - 1) and not sched.tied(step))


class ScheduleCallback(L.Callback):
    """Sets the step's schedule values through the module's public hooks."""

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        apply_schedule(pl_module, trainer.global_step)
