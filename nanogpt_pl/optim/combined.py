"""One optimizer object over several optimizers, each stepping on its own cadence.

Lightning counts ``trainer.global_step`` in optimizer steps, and the speedrun steps
different parameter families at different cadences (matrices every step, Adam groups
every second step, sparse tables every fourth; RECORD §5). Handing Lightning one
:class:`CombinedOptimizer` keeps ``global_step`` equal to training steps while each
part keeps its own schedule: before ``step()`` the caller names the parts that update
(:meth:`set_active`); ``zero_grad()`` then clears only those parts' gradients, so the
others keep accumulating over their cycle.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Iterable, Optional

import torch


class _MergedState(MutableMapping):
    """``optimizer.state`` of the parts as one mapping (param -> its part's state)."""

    def __init__(self, parts: dict[str, torch.optim.Optimizer]) -> None:
        self._parts = parts

    def _owner(self, key) -> torch.optim.Optimizer:
        for part in self._parts.values():
            for group in part.param_groups:
                if any(p is key for p in group["params"]):
                    return part
        raise KeyError(key)

    def __getitem__(self, key):
        return self._owner(key).state[key]

    def __setitem__(self, key, value) -> None:
        self._owner(key).state[key] = value

    def __delitem__(self, key) -> None:
        del self._owner(key).state[key]

    def __iter__(self):
        for part in self._parts.values():
            yield from part.state

    def __len__(self) -> int:
        return sum(len(part.state) for part in self._parts.values())


class CombinedOptimizer(torch.optim.Optimizer):
    """Named optimizers stepped as one.

    Args:
        parts: name -> optimizer. Names are used by :meth:`set_active` and in checkpoints.
    """

    def __init__(self, parts: dict[str, torch.optim.Optimizer]) -> None:
        if not parts:
            raise ValueError("CombinedOptimizer needs at least one part")
        # Deliberately not calling Optimizer.__init__: the parts own the param groups.
        self.parts = dict(parts)
        self.defaults = {}
        self._active: Optional[set[str]] = None
        self._last_stepped: set[str] = set(self.parts)
        self._optimizer_step_pre_hooks = {}
        self._optimizer_step_post_hooks = {}
        self._optimizer_state_dict_pre_hooks = {}
        self._optimizer_state_dict_post_hooks = {}
        self._optimizer_load_state_dict_pre_hooks = {}
        self._optimizer_load_state_dict_post_hooks = {}

    @property
    def param_groups(self) -> list[dict]:
        return [g for part in self.parts.values() for g in part.param_groups]

    @property
    def state(self) -> _MergedState:
        return _MergedState(self.parts)

    def set_active(self, names: Optional[Iterable[str]]) -> None:
        """Parts the next ``step()`` updates (None = all)."""
        if names is None:
            self._active = None
            return
        names = set(names)
        unknown = names - set(self.parts)
        if unknown:
            raise KeyError(f"unknown optimizer parts {sorted(unknown)}; have {sorted(self.parts)}")
        self._active = names

    def active_names(self) -> list[str]:
        return [n for n in self.parts if self._active is None or n in self._active]

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        names = self.active_names()
        for name in names:
            self.parts[name].step()
        self._last_stepped = set(names)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients of the parts that stepped last; the others keep accumulating."""
        for name in self._last_stepped:
            self.parts[name].zero_grad(set_to_none=set_to_none)

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Collective: let sharded parts gather full state on rank ``to`` for the next state_dict().

        Lightning calls this before saving a checkpoint on every rank, so a run with sharded
        optimizer state resumes on any world size.
        """
        for part in self.parts.values():
            if hasattr(part, "consolidate_state_dict"):
                part.consolidate_state_dict(to=to)

    def state_dict(self) -> dict:
        return {"parts": {name: part.state_dict() for name, part in self.parts.items()}}

    def load_state_dict(self, state_dict: dict) -> None:
        saved = state_dict["parts"]
        if set(saved) != set(self.parts):
            raise ValueError(
                f"checkpoint optimizer parts {sorted(saved)} differ from this run's {sorted(self.parts)}; "
                "the optimizer configuration (model.optim) must match the checkpoint's"
            )
        for name, part in self.parts.items():
            part.load_state_dict(saved[name])

    def __repr__(self) -> str:
        inner = ", ".join(f"{n}={type(p).__name__}" for n, p in self.parts.items())
        return f"CombinedOptimizer({inner})"
