"""Every rank stops at the same step on SIGTERM, without a host sync in the step.

Lightning (2.6) handles SIGTERM with two collectives. Its signal handler broadcasts a flag when
it runs, which is wherever each rank's main thread happens to be, so the broadcast can pair with
another rank's gradient collective: through ``main.py`` on two gloo ranks, a SIGTERM during
training hung 4 of 6 runs (``tests/test_cli.py``), and one during the speedrun timer's warmup
2 of 9. And at the start of every training step each rank broadcasts rank 0's flag as a device
tensor and reads it back with ``.item()``: on GPUs a host sync per step, which empties the queue
the captured step keeps two steps deep.

:class:`StopSignal` replaces both (``SpeedrunStrategy`` installs it). The handler only sets a
flag on its own rank (and forwards the signal to the ranks the launcher started, as Lightning's
does). At the start of each step, and between the speedrun timer's warmup steps, every rank
reduces the flags with a one-int ``MAX`` over a gloo group, on the CPU: all ranks see the same
answer at the same point, and the device is not waited for. On one process the flag is read as is.

Lightning's own end-of-step check (``trainer.received_sigterm``) stays: the flag is only set on
every rank at once, by :meth:`StopSignal.agree`, so no rank stops a step before the others.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, Optional

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.exceptions import SIGTERMException

log = logging.getLogger(__name__)


class StopSignal:
    """SIGTERM (and :meth:`request`, e.g. a first Ctrl-C) as one decision shared by every rank.

    Args:
        trainer: the run's Trainer; its signal connector's flag (``received_sigterm``) is what
            Lightning's loops and the project's callbacks read.
        group: the gloo process group of the agreement (``None`` with one process).
    """

    def __init__(self, trainer: Any, group: Optional[dist.ProcessGroup] = None) -> None:
        self.trainer = trainer
        self.group = group
        self.requested = False
        self.agreements = 0  # how many times the ranks compared their flags (for tests and reports)

    @property
    def distributed(self) -> bool:
        return self.group is not None

    def request(self) -> None:
        """This rank asks to stop; with one process the run stops after the current step, with
        several at the next agreement (every rank at the same step)."""
        self.requested = True
        if not self.distributed:
            self.trainer._signal_connector.received_sigterm = True

    def on_sigterm(self, signum: Any, frame: Any) -> None:
        """Lightning's SIGTERM notifier without its collective: log, forward the signal to the
        processes the launcher started (once), set the flag."""
        print(f"[rank: {self.trainer.global_rank}] Received SIGTERM: {signum}", file=sys.stderr, flush=True)
        if not self.requested:
            launcher = self.trainer.strategy.launcher
            if launcher is not None:
                launcher.kill(signum)
        self.request()

    def agree(self) -> bool:
        """Whether any rank asked to stop; every rank must call it at the same point. Sets the
        trainer's flag on every rank when so."""
        mine = self.requested or bool(self.trainer._signal_connector.received_sigterm)
        if not self.distributed:
            return mine
        self.agreements += 1
        flag = torch.tensor([int(mine)], dtype=torch.int32)  # on the CPU: no device sync
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        stop = bool(flag.item())
        if stop:
            self.requested = True
            self.trainer._signal_connector.received_sigterm = True
        return stop

    def at_step_start(self) -> None:
        """In place of Lightning's per-step broadcast (``_broadcast_sigterm_tensor``): stop every
        rank before the step if any rank asked."""
        if self.agree():
            raise SIGTERMException()

    def install(self) -> None:
        """Replace Lightning's SIGTERM notifier and its per-step broadcast with this object's
        (before ``Trainer`` registers its handlers, i.e. from ``Strategy.setup``)."""
        connector = self.trainer._signal_connector
        epoch_loop = getattr(getattr(self.trainer, "fit_loop", None), "epoch_loop", None)
        missing = [name for obj, name in ((connector, "_sigterm_notifier_fn"),
                                          (epoch_loop, "_broadcast_sigterm_tensor")) if not hasattr(obj, name)]
        if missing:
            # another Lightning version: its own handling stays, with the hazards above
            log.warning(f"SpeedrunStrategy: this Lightning has no {', '.join(missing)}; SIGTERM is left to "
                        "Lightning's own handling")
            return
        connector._sigterm_notifier_fn = self.on_sigterm
        epoch_loop._broadcast_sigterm_tensor = self.at_step_start


def agreement_group(world_size: int) -> Optional[dist.ProcessGroup]:
    """The group :class:`StopSignal` reduces over: None with one process, the default group
    where it is gloo, else a gloo group of all ranks (created collectively: every rank calls this).
    Raises ``RuntimeError`` where gloo cannot connect the ranks."""
    if world_size <= 1 or not (dist.is_available() and dist.is_initialized()):
        return None
    if dist.get_backend() == "gloo":
        return dist.group.WORLD
    return dist.new_group(backend="gloo")


def install_stop_signal(trainer: Any, world_size: int, group: Any = None) -> Optional[StopSignal]:
    """A :class:`StopSignal` for ``trainer``, installed; ``group`` is one made before (the
    agreement's group is made once per process). None, with a warning, where several ranks have
    no gloo group: SIGTERM then stays with Lightning's handling."""
    if group is None and world_size > 1:
        try:
            group = agreement_group(world_size)
        except RuntimeError as err:
            log.warning(f"SpeedrunStrategy: no gloo group for the SIGTERM agreement ({err}); SIGTERM is left to "
                        "Lightning's own handling (set GLOO_SOCKET_IFNAME to the interface the ranks share)")
            return None
    stop = StopSignal(trainer, group)
    stop.install()
    return stop
