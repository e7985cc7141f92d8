"""Tail averaging and the terminal "ships" (RECORD.md §10): the callback that ticks them.

Over the last few hundred steps the record keeps several running averages of the
weights, each on its own cadence, and just before the final validation blends them
into the live weights ("ships"), then rescales the shipped matrices back to their
pre-ship Frobenius norms ("decontraction"). Each :class:`TailTrack`
(``nanogpt_pl.averaging``, with the table and the ship itself) is one such accumulator:

- it is seeded (a copy) at its first tick, then ticks ``E ← E + rate·(θ − E)`` on steps
  where ``step % every == phase`` (plus the last ``extra_last`` steps), from the window
  start ``total_steps − window`` on;
- at the end it ships ``θ ← θ + blend·(E − θ)`` (``blend = 1``: θ ← E).

Why not Lightning's ``WeightAveraging``: it keeps one averaged copy of the whole module
with one update rule and swaps it in for every validation. The record needs several
accumulators over different parameter families with different cadences and rates,
partial blends instead of a swap, a fixed ship order, and a one-time ship before the
final validation only. What this callback shares with it is the contract: state in
checkpoints (``state_dict``), updates after optimizer steps, the ship before validation.

Parameter families are the model's roles: ``embed``, ``lm_head``, ``value_embeds``,
``qk``, ``vo``, ``mlp`` (see ``GPT.param_families``).
"""

from __future__ import annotations

from typing import Any, Optional

import lightning as L
import torch
from torch import Tensor

from nanogpt_pl.averaging import DECONTRACT_FAMILIES, TailTrack, family_params, record_tracks, ship_tail

__all__ = ["TailAveraging", "TailTrack", "record_tracks"]


class TailAveraging(L.Callback):
    """Tail accumulators ticked after optimizer steps and shipped before the final validation.

    Args:
        tracks: the accumulators, shipped in this order (default: the record's table).
        decontract: parameter families rescaled to their pre-ship Frobenius norms after the ships.
    """

    def __init__(self, tracks: Optional[list[TailTrack]] = None, decontract: Optional[list[str]] = None) -> None:
        self.tracks = record_tracks() if tracks is None else list(tracks)
        self.decontract = list(DECONTRACT_FAMILIES) if decontract is None else list(decontract)
        self._acc: dict[str, list[Tensor]] = {}
        self.shipped = False
        self._pending: Optional[dict[str, Any]] = None  # a checkpoint's state, applied at train start

    # -- helpers ---------------------------------------------------------------------
    def _last_step(self, trainer: L.Trainer, pl_module: L.LightningModule) -> int:
        return pl_module.schedule.run_steps(trainer.max_steps) - 1

    def ticks(self, track: TailTrack, step: int, last: int) -> tuple[bool, bool]:
        """(ticks at ``step``, this tick is the seed) for a run whose final step is ``last``."""
        start = last + 1 - track.window
        if step < start:
            return False, False
        first = track.name not in self._acc
        on_cadence = step % track.every == track.phase or step > last - track.extra_last
        if first:
            return (on_cadence or (track.seed_at_start and step == start)), True
        return on_cadence, False

    # -- hooks -----------------------------------------------------------------------
    @torch.no_grad()
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step = trainer.global_step - 1
        last = self._last_step(trainer, pl_module)
        for track in self.tracks:
            fires, seed = self.ticks(track, step, last)
            if not fires:
                continue
            params = family_params(pl_module.model, track.params)
            if seed:
                self._acc[track.name] = [p.detach().float().clone() for p in params]
            else:
                rate = track.last_rate if (track.last_rate is not None and step == last) else track.rate
                for e, p in zip(self._acc[track.name], params):
                    e.lerp_(p.detach().float(), rate)
        if step == last and not self.shipped:
            self.ship(pl_module)

    def ship(self, pl_module: L.LightningModule) -> None:
        """Blend every accumulator into the weights, then decontract (RECORD §10 order)."""
        ship_tail(pl_module.model, self.tracks, self._acc, self.decontract)
        self.shipped = True

    # -- checkpoint ------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"acc": {k: [t.cpu() for t in v] for k, v in self._acc.items()}, "shipped": self.shipped}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._pending = state_dict

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        pending = self._pending
        if pending is not None:
            device = pl_module.device
            self._acc = {k: [t.to(device) for t in v] for k, v in pending["acc"].items()}
            self.shipped = pending["shipped"]
            self._pending = None

    def reset(self) -> None:
        """Forget every accumulator (used by the speedrun timer after its untimed warmup)."""
        self._acc = {}
        self.shipped = False
