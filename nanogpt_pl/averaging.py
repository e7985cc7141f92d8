"""The tail accumulators' table and their ship (RECORD.md §10), as plain functions of tensors.

Over the last few hundred steps the record keeps several running averages of the weights,
each on its own cadence, and just before the final validation blends them into the live
weights ("ships"), then rescales the shipped matrices back to their pre-ship Frobenius norms
("decontraction"). :class:`TailTrack` describes one accumulator; :func:`ship_tail` is the
ship. The callback that ticks the accumulators during training is ``callbacks.ema``;
``nanogpt-pl generate`` ships a checkpoint's unshipped accumulators with the same function.

Parameter families are the model's roles: ``embed``, ``lm_head``, ``value_embeds``, ``qk``,
``vo``, ``mlp`` (see ``GPT.param_families``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor, nn

# RECORD §10: the families rescaled to their pre-ship norms after every blend
DECONTRACT_FAMILIES = ("embed", "lm_head", "mlp", "qk", "vo")


@dataclass
class TailTrack:
    """One tail accumulator and its ship.

    Args:
        name: label used in checkpoints and logs.
        params: parameter families it averages (keys of ``GPT.param_families()``).
        window: ticks start at ``total_steps − window``.
        every: tick cadence.
        phase: ticks where ``step % every == phase``.
        rate: E ← E + rate·(θ − E) at each tick after the seed.
        last_rate: rate used at the final step, if different.
        extra_last: also tick on the last this-many steps whatever the cadence.
        seed_at_start: seed at the window start even off-cadence (the record's TailEMA).
        blend: ship θ ← θ + blend·(E − θ).
    """

    name: str
    params: list[str]
    window: int
    every: int = 1
    phase: int = 0
    rate: float = 0.01
    last_rate: Optional[float] = None
    extra_last: int = 0
    seed_at_start: bool = False
    blend: float = 1.0


def record_tracks() -> list[TailTrack]:
    """RECORD §10's table."""
    ema_rate = 1 - (1 - 2 / 299) ** 2  # 2/299 per step, ticked on odd steps only (Adam cadence)
    return [
        TailTrack(name="tail_ema", params=["embed", "lm_head"], window=298, every=2, phase=1, rate=ema_rate,
                  last_rate=2 / 299, seed_at_start=True, blend=0.65),
        TailTrack(name="tail_avg", params=["vo", "mlp"], window=250, every=4, phase=1, rate=4 / 53, blend=1.0),
        TailTrack(name="value_embed_ship", params=["value_embeds"], window=250, every=4, phase=3, rate=4 / 53,
                  blend=1.0),
        TailTrack(name="bank_blend_qk", params=["qk"], window=298, every=4, phase=1, rate=2 / 75, extra_last=2,
                  blend=0.55),
        TailTrack(name="bank_blend_vo_mlp", params=["vo", "mlp"], window=298, every=4, phase=1, rate=2 / 75,
                  extra_last=2, blend=0.55 - 0.2007),
    ]


def family_params(model: nn.Module, families: list[str]) -> list[Tensor]:
    """The parameters of ``families`` in ``model.param_families()`` order."""
    roles = model.param_families()
    out = []
    for fam in families:
        if fam not in roles:
            raise KeyError(f"TailTrack parameter family {fam!r} is not one of {sorted(roles)}")
        out += roles[fam]
    return out


def _norm(params: list[Tensor]) -> float:
    return float(torch.sqrt(sum(p.detach().float().square().sum() for p in params)))


@torch.no_grad()
def ship_tail(model: nn.Module, tracks: list[TailTrack], acc: dict[str, list[Tensor]],
              decontract: tuple[str, ...] | list[str] = DECONTRACT_FAMILIES) -> None:
    """Blend every track's accumulator ``acc[name]`` into ``model``'s weights in ``tracks`` order, then
    rescale each ``decontract`` family to its pre-ship norm (RECORD §10 order). Tracks without an
    accumulator are skipped."""
    # decontraction works per family, over the whole bank (RECORD §10: "the whole tensor")
    families = {fam: family_params(model, [fam]) for fam in decontract}
    ref = {fam: _norm(ps) for fam, ps in families.items()}
    for track in tracks:
        e_list = acc.get(track.name)
        if e_list is None:
            continue
        for e, p in zip(e_list, family_params(model, track.params)):
            p.copy_(p.float().lerp(e, track.blend))
    for fam, ps in families.items():
        now = _norm(ps)
        if now > 0:
            for p in ps:
                p.mul_(ref[fam] / now)
