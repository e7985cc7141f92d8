"""Stops a run at the first non-finite loss or gradient, with a checkpoint of the last good state.

The check runs before the optimizer step, so the weights, optimizer state and data
position saved are those after the last good step (``global_step`` steps done); resuming
from the file replays the failing step. The error names the step and the first
non-finite part: the loss (checked before its backward), or the first parameter, by
optimizer group (``matrices``, ``embed``, ``lm_head``, ``value_embeds``, ``scalars``), whose
gradient is not finite.

Each check reads a flag back from the device (one synchronization per micro-batch and
per step) and agrees on it over the ranks; ``check_every_n_steps`` thins it out.
"""

from __future__ import annotations

import os
from typing import Any, Optional

import lightning as L
import torch


class NonFiniteError(RuntimeError):
    """A non-finite loss or gradient stopped training."""


class FiniteGuard(L.Callback):
    """Stop on a non-finite loss or gradient, saving the last good state first.

    Args:
        dirpath: folder of the checkpoint (default: the ModelCheckpoint's folder, else the
            trainer's ``default_root_dir``).
        check_every_n_steps: check the steps whose index is a multiple of this.
    """

    def __init__(self, dirpath: Optional[str] = None, check_every_n_steps: int = 1) -> None:
        if check_every_n_steps < 1:
            raise ValueError(f"FiniteGuard.check_every_n_steps must be >= 1, got {check_every_n_steps}")
        self.dirpath = dirpath
        self.check_every_n_steps = check_every_n_steps
        self.checkpoint_path: Optional[str] = None

    def _checking(self, trainer: L.Trainer) -> bool:
        return trainer.training and trainer.global_step % self.check_every_n_steps == 0

    def _stop(self, trainer: L.Trainer, found: Optional[str]) -> None:
        """Agree over the ranks; on a failure anywhere, save the last good state and raise."""
        if not trainer.strategy.reduce_boolean_decision(found is not None, all=False):
            return
        folder = self.dirpath or getattr(trainer.checkpoint_callback, "dirpath", None) or trainer.default_root_dir
        path = os.path.join(folder, f"last-good-step={trainer.global_step}.ckpt")
        trainer.save_checkpoint(path)
        self.checkpoint_path = path
        where = found if found is not None else "on another rank"
        raise NonFiniteError(f"non-finite {where} at step {trainer.global_step}; the state before this step is "
                             f"saved in {path} (resume with --ckpt_path {path} after lowering the lr or fixing "
                             "the data)")

    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor) -> None:
        if self._checking(trainer):
            bad = not bool(torch.isfinite(loss.detach()).all())
            self._stop(trainer, f"loss ({float(loss.detach().float().flatten()[0])})" if bad else None)

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        if not self._checking(trainer):
            return
        found = None
        model = pl_module.model
        names = {id(p): n for n, p in model.named_parameters()}
        roles = model.param_roles() if hasattr(model, "param_roles") else {"parameters": list(model.parameters())}
        grads = [(role, p) for role, params in roles.items() for p in params if p.grad is not None]
        if grads:
            flags = torch.stack([torch.isfinite(p.grad).all() for _, p in grads]).cpu()  # one read-back
            if not bool(flags.all()):
                role, p = grads[int((~flags).nonzero()[0])]
                found = f"gradient in parameter group '{role}' ({names.get(id(p), '?')})"
        self._stop(trainer, found)
