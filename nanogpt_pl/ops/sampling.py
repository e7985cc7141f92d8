"""The candidate set of the sampled softmax (RECORD §6): every target plus negatives.

The lm_head loss (:func:`nanogpt_pl.ops.cross_entropy.lm_head_loss`) computes logits only
for the classes of one candidate set ``C`` per micro-batch; :class:`CandidateSampler`
builds ``C`` on the host, one step ahead, from the micro-batch's targets.
"""

from __future__ import annotations

import math
from typing import Sequence, Union

import numpy as np
import torch

from ..data.tokenizer import PADDED_VOCAB

__all__ = ["CANDIDATE_MULTIPLE", "CandidateSampler"]

# RECORD §6: P must be a multiple of 2048 (the record's CE kernel: block 256 × vector 8).
CANDIDATE_MULTIPLE = 2048
# RECORD §6: negatives come from perm[k] = 20011·k mod V (20011 is coprime to 50,304); each
# call draws a window of min(V, ⌊1.7·need⌋ + 256) entries of it.
SAMPLER_STRIDE = 20011
SAMPLER_DRAW_FACTOR = 1.7
SAMPLER_DRAW_EXTRA = 256


class CandidateSampler:
    """Builds the sampled-softmax candidate set of one micro-batch (RECORD §6).

    ``C`` = every class among the targets (and ``extra``), plus duplicate-free negatives
    from the stride sweep ``perm[k] = stride·k mod V`` to exactly ``num_candidates`` classes,
    sorted ascending. Each rank starts the sweep at offset ``V·rank/world_size``; every call
    that needs negatives takes the next window of ``min(V, ⌊1.7·need⌋ + 256)`` entries,
    advances the offset by that length (wrapping), drops the classes already in ``C``, and
    if fewer than ``need`` remain fills the gap with evenly spaced free classes. The padded
    ids (50,257..50,303) are ordinary negatives, as in the record (RECORD §15.6).

    Runs on the host in numpy (about 0.1 ms for 49,152 targets): pass the loader's CPU copy
    of the targets so no device sync is needed, and move the result to the GPU with the batch.

    Args:
        vocab_size: number of classes V (the lm_head rows).
        rank: this process's rank.
        world_size: number of ranks.
        stride: the sweep stride, coprime to ``vocab_size``.
        multiple: ``num_candidates`` must be a multiple of this (RECORD §6: 2048).
    """

    def __init__(self, vocab_size: int = PADDED_VOCAB, rank: int = 0, world_size: int = 1,
                 stride: int = SAMPLER_STRIDE, multiple: int = CANDIDATE_MULTIPLE) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"CandidateSampler: rank {rank} is not in [0, world_size={world_size})")
        if math.gcd(stride, vocab_size) != 1:
            raise ValueError(f"CandidateSampler: stride {stride} must be coprime to vocab_size "
                             f"{vocab_size} for a duplicate-free sweep")
        self.vocab_size = vocab_size
        self.rank = rank
        self.world_size = world_size
        self.stride = stride
        self.multiple = multiple
        one = (stride * np.arange(vocab_size, dtype=np.int64)) % vocab_size
        # Doubled so any window of the sweep is one contiguous slice.
        self._perm = np.concatenate((one, one))
        self._mark = np.zeros(vocab_size, dtype=bool)
        self.offset = (vocab_size * rank) // world_size

    def _check_count(self, num_candidates: int) -> None:
        if num_candidates == self.vocab_size:
            return
        if num_candidates <= 0 or num_candidates % self.multiple or num_candidates > self.vocab_size:
            raise ValueError(
                f"sampled-softmax candidate count {num_candidates} must be a positive multiple of "
                f"{self.multiple} below the vocabulary ({self.vocab_size}), or the full vocabulary; "
                f"fix schedule.stages[*].candidates (RECORD §6 uses 10240, 14336, 24576, then null)")

    def build(self, targets: Union[torch.Tensor, np.ndarray], num_candidates: int,
              extra: Union[torch.Tensor, np.ndarray, None] = None) -> torch.Tensor:
        """The sorted, duplicate-free candidate ids of one micro-batch.

        Args:
            targets: the micro-batch's targets (any shape; a CPU copy avoids a device sync).
                MTP targets are the same array shifted, so they are covered.
            num_candidates: P, a multiple of 2048 (or the full vocabulary).
            extra: further classes to force in (e.g. prefix targets); negatives are ignored.

        Returns:
            CPU int64 tensor of exactly ``num_candidates`` ids, ascending, containing every
            target and every ``extra`` class.
        """
        self._check_count(num_candidates)
        V = self.vocab_size
        if num_candidates == V:
            return torch.arange(V, dtype=torch.int64)
        mark = self._mark
        mark.fill(False)
        t = _as_numpy(targets).reshape(-1)
        if t.size and (t.min() < 0 or t.max() >= V):
            raise ValueError(f"CandidateSampler: targets must lie in [0, {V}); got "
                             f"[{t.min()}, {t.max()}]")
        mark[t] = True
        if extra is not None:
            e = _as_numpy(extra).reshape(-1)
            e = e[(e >= 0) & (e < V)]
            mark[e] = True
        unique = int(np.count_nonzero(mark))
        if unique > num_candidates:
            raise ValueError(
                f"sampled softmax: the micro-batch has {unique} distinct targets, more than the "
                f"{num_candidates} candidates; raise schedule.stages[*].candidates (a multiple of "
                f"{self.multiple}) or shorten the micro-batch")
        need = num_candidates - unique
        if need:
            draw = min(V, int(need * SAMPLER_DRAW_FACTOR) + SAMPLER_DRAW_EXTRA)
            window = self._perm[self.offset:self.offset + draw]
            self.offset = (self.offset + draw) % V
            window = window[~mark[window]]
            if window.size >= need:
                mark[window[:need]] = True
            else:
                free = np.flatnonzero(~mark)
                mark[free[:: max(1, free.size // need)][:need]] = True
        return torch.from_numpy(np.flatnonzero(mark))

    def state_dict(self) -> dict:
        """This rank's sweep position (save one per rank for an exact resume)."""
        return {"offset": int(self.offset), "rank": self.rank, "world_size": self.world_size,
                "vocab_size": self.vocab_size, "stride": self.stride}

    def load_state_dict(self, state: Union[dict, Sequence[dict]]) -> None:
        """Restore the sweep position: one rank's ``state_dict()``, or a list of them (one per
        rank, as gathered for a checkpoint) from which this rank's entry is taken."""
        if not isinstance(state, dict):
            states = list(state)
            if len(states) != self.world_size:
                raise ValueError(f"CandidateSampler: checkpoint holds {len(states)} ranks' states, "
                                 f"this run has world_size {self.world_size}")
            state = states[self.rank]
        if state.get("vocab_size") != self.vocab_size or state.get("stride") != self.stride:
            raise ValueError(f"CandidateSampler: checkpoint was built for vocab_size "
                             f"{state.get('vocab_size')} / stride {state.get('stride')}, this run "
                             f"uses {self.vocab_size} / {self.stride}")
        self.offset = int(state["offset"]) % self.vocab_size


def _as_numpy(x: Union[torch.Tensor, np.ndarray]) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().to("cpu", torch.int64).numpy()
    return np.asarray(x, dtype=np.int64)
