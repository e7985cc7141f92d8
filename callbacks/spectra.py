"""Singular-value spectra of weight matrices, logged every N steps to every logger.

For each parameter whose name (``GPT.named_parameters()``, e.g. ``blocks.3.mlp.fc_w``)
matches one of the patterns, logs its top singular values ``spectra/<name>/sv<i>`` and
its stable rank ``spectra/<name>/stable_rank = ‖W‖_F² / σ_max²`` (a smooth count of the
directions that carry the weight). Parameters with more than two dimensions are
flattened to ``[shape[0], -1]``.

An SVD of every matrix is not free, so the callback stays off the speedrun clock:
while a :class:`~callbacks.speedrun_timer.SpeedrunTimer` is timing, nothing is computed,
and the run says so once at its start.
"""

from __future__ import annotations

import fnmatch
from typing import Any, Optional

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_warn

DEFAULT_PATTERNS = ("blocks.*.attn.*_w", "blocks.*.mlp.*_w")


def spectrum(weight: torch.Tensor, top_k: int) -> dict[str, float]:
    """``sv0..sv{top_k-1}`` (descending) and ``stable_rank`` of a matrix."""
    w = weight.detach().float()
    if w.dim() > 2:
        w = w.flatten(1)
    s = torch.linalg.svdvals(w)
    out = {f"sv{i}": float(v) for i, v in enumerate(s[:top_k])}
    out["stable_rank"] = float(s.square().sum() / s[0].square()) if s[0] > 0 else 0.0
    return out


class Spectra(L.Callback):
    """Logs top singular values and stable rank of the matching weight matrices.

    Args:
        every_n_steps: log after every this many optimizer steps (and after the first).
        patterns: ``fnmatch`` patterns on the model's parameter names.
        top_k: singular values logged per matrix.
    """

    def __init__(self, every_n_steps: int = 100, patterns: Optional[list[str]] = None, top_k: int = 4) -> None:
        if every_n_steps < 1:
            raise ValueError(f"Spectra.every_n_steps must be >= 1, got {every_n_steps}")
        self.every_n_steps = every_n_steps
        self.patterns = list(patterns) if patterns is not None else list(DEFAULT_PATTERNS)
        self.top_k = top_k

    def matrices(self, pl_module: L.LightningModule) -> dict[str, torch.Tensor]:
        model = getattr(pl_module, "model", pl_module)
        found = {name: p for name, p in model.named_parameters()
                 if p.dim() >= 2 and any(fnmatch.fnmatchcase(name, pat) for pat in self.patterns)}
        return found

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self.matrices(pl_module):
            names = [n for n, p in pl_module.model.named_parameters() if p.dim() >= 2]
            names = sorted(names, key=lambda n: not n.startswith("blocks."))[:3]
            raise ValueError(f"Spectra.patterns {self.patterns} match no weight matrix; names look like {names}")
        if self._timer(trainer) is not None:
            rank_zero_warn("Spectra: not computed while the SpeedrunTimer's clock runs (it would cost timed "
                           "seconds); remove the SpeedrunTimer from trainer.callbacks to log spectra")

    @staticmethod
    def _timer(trainer: L.Trainer) -> Any:
        return next((cb for cb in trainer.callbacks if hasattr(cb, "clock_running")), None)

    @torch.no_grad()
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step = trainer.global_step
        if step != 1 and step % self.every_n_steps:
            return
        timer = self._timer(trainer)
        if timer is not None and timer.clock_running:
            return
        if not trainer.is_global_zero:  # the matrices are replicated after each step
            return
        metrics = {f"spectra/{name}/{key}": value for name, w in self.matrices(pl_module).items()
                   for key, value in spectrum(w, self.top_k).items()}
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)
