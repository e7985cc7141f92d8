"""The stage table: every step-indexed quantity of a run, as pure functions of the step.

The data loader, the module, the optimizers and the callbacks all read this one
object; nothing else hard-codes a step number. Defaults are the record's table
(``shared/RECORD.md`` §9, §2, §5, §6, §8); ``configs/*.yaml`` override any field.

A run is a list of :class:`Stage` s. Each stage fixes the batch shape (global batch
tokens, packed sequence length per micro-batch, document cap), the attention
windows and an lr multiplier; a few per-stage quantities (sampled-softmax
candidates, prefix-loss weight) may be lists, which split the stage into equal
parts. Stages flagged ``extension`` run after the scheduled steps at the lr floor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Union


@dataclass
class Stage:
    """One stage of the schedule.

    Args:
        steps: number of optimizer steps in the stage.
        batch_tokens: global tokens per step (all ranks, all micro-batches).
        seq_len: tokens of one packed micro-batch on one rank; micro-batches per step are
            ``batch_tokens / (world_size * seq_len)``.
        max_doc_len: documents are truncated to this many tokens.
        window_short: left attention window (tokens) of the short-window layers.
        window_long: left attention window (tokens) of the long-window layers.
        lr_mul: lr multiplier of the stage before the cooldown blends it to the floor.
        candidates: sampled-softmax candidate count; ``None`` = the full vocabulary; a list
            splits the stage into equal parts.
        prefix_weight: weight of the prefix-token auxiliary loss; a list splits the stage.
        mtp_start: multi-token-prediction weights at the stage's first step.
        mtp_end: weights at its last step (linear in between); ``None`` = constant.
        extension: runs after the scheduled steps (lr at the floor, outside the cooldown).
    """

    steps: int
    batch_tokens: int
    seq_len: int
    max_doc_len: int
    window_short: int = 128
    window_long: int = 384
    lr_mul: float = 1.0
    candidates: Optional[Union[int, list[int]]] = None
    prefix_weight: Union[float, list[float]] = 0.0
    mtp_start: list[float] = field(default_factory=lambda: [1.0])
    mtp_end: Optional[list[float]] = None
    extension: bool = False


def _record_stages() -> list[Stage]:
    # RECORD.md §9: stage ends [320, 681, 1107, 1174, 1194]; windows in 128-token blocks;
    # §6 candidate counts; §2 MTP and prefix weights.
    return [
        Stage(steps=320, batch_tokens=131_072, seq_len=16_384, max_doc_len=896, window_short=128, window_long=384,
              lr_mul=1.0, candidates=10_240, prefix_weight=0.25, mtp_start=[1.0, 0.5, 0.25],
              mtp_end=[1.0, 0.5, 0.0]),
        Stage(steps=361, batch_tokens=262_144, seq_len=32_768, max_doc_len=2048, window_short=384, window_long=896,
              lr_mul=1.52, candidates=10_240, prefix_weight=[0.20, 0.15, 0.10, 0.05], mtp_start=[1.0, 0.5],
              mtp_end=[1.0, 0.0]),
        Stage(steps=426, batch_tokens=393_216, seq_len=49_152, max_doc_len=3072, window_short=640, window_long=1408,
              lr_mul=1.73, candidates=[14_336, 14_336, 24_576]),
        # taper: 20·2048·8 tokens at lr_mul 1.73·sqrt(20/24)
        Stage(steps=67, batch_tokens=327_680, seq_len=40_960, max_doc_len=3072, window_short=640, window_long=1408,
              lr_mul=1.73 * math.sqrt(20 / 24)),
        Stage(steps=20, batch_tokens=131_072, seq_len=16_384, max_doc_len=3072, window_short=768, window_long=1664,
              lr_mul=1.0, extension=True),
    ]


@dataclass
class Schedule:
    """The run's stage table and the step-indexed scalars derived from it.

    Args:
        stages: the stage table, in order; ``None`` = the record's table (RECORD §9).
        warmup_steps: linear lr warmup from 0 over this many steps (the record uses none).
        cooldown_frac: fraction of the scheduled (non-extension) steps spent cooling down.
        final_lr_mul: the absolute lr multiplier reached at the end of the cooldown; the
            extension stages run at it (RECORD §9: 0.30).
        momentum_start: ANVIL momentum at step 0 and at the last step.
        momentum_peak: momentum after the warmup (RECORD §8: 0.85 → 0.93 → 0.85).
        momentum_warmup_steps: steps of the linear rise to the peak.
        momentum_cooldown_steps: steps of the linear fall at the end of the run.
        anvil_engage_step: from this step ANVIL blends its slow rail in (RECORD §8: 514).
        sparse_cadence_start: from this step the n-gram table and value embeddings update
            every ``sparse_cadence`` steps instead of every ``adam_every`` (RECORD §5: 336).
        sparse_cadence: the cadence after ``sparse_cadence_start`` (4).
        adam_every: Adam groups update every this many steps, on the last step of each
            cycle (RECORD §8: 2, odd steps).
        untie_step: until this step the embedding and the lm_head are tied: the embedding's
            gradient is added to the lm_head's, only the lm_head is updated and the embedding
            copies it; from this step each has its own update (RECORD §2: 1175). ``None`` =
            never tied.
        val_window_short: short window of validation passes (tokens).
        val_window_long: long window of validation passes (RECORD §9: 2560).
        attention_cap: pieces longer than this are split into attention segments when the
            document cap exceeds it (RECORD §1: 2560); ``None`` disables.
    """

    stages: Optional[list[Stage]] = None
    warmup_steps: int = 0
    cooldown_frac: float = 0.80
    final_lr_mul: float = 0.30
    momentum_start: float = 0.85
    momentum_peak: float = 0.93
    momentum_warmup_steps: int = 240
    momentum_cooldown_steps: int = 50
    anvil_engage_step: int = 514
    sparse_cadence_start: int = 336
    sparse_cadence: int = 4
    adam_every: int = 2
    untie_step: Optional[int] = 1175
    val_window_short: int = 768
    val_window_long: int = 2560
    attention_cap: Optional[int] = 2560

    def __post_init__(self) -> None:
        if self.stages is None:
            self.stages = _record_stages()
        if not self.stages:
            raise ValueError("schedule.stages is empty: give at least one stage")
        self._ends: list[int] = []
        total = 0
        seen_extension = False
        for i, st in enumerate(self.stages):
            if isinstance(st, dict):  # built from plain YAML without jsonargparse
                st = self.stages[i] = Stage(**st)
            if st.steps <= 0:
                raise ValueError(f"schedule.stages[{i}].steps must be positive, got {st.steps}")
            if st.seq_len <= 0 or st.batch_tokens % st.seq_len:
                raise ValueError(
                    f"schedule.stages[{i}]: batch_tokens {st.batch_tokens} is not a multiple of "
                    f"seq_len {st.seq_len}"
                )
            if seen_extension and not st.extension:
                raise ValueError(f"schedule.stages[{i}]: a scheduled stage cannot follow an extension stage")
            seen_extension |= st.extension
            total += st.steps
            self._ends.append(total)
        self.total_steps = total
        self.scheduled_steps = sum(st.steps for st in self.stages if not st.extension)
        self.cooldown_start = int(self.scheduled_steps * (1 - self.cooldown_frac))

    # -- stage lookup -------------------------------------------------------------
    def stage_index(self, step: int) -> int:
        """Index of the stage that holds ``step`` (the last stage for steps past the end)."""
        for i, end in enumerate(self._ends):
            if step < end:
                return i
        return len(self.stages) - 1

    def run_steps(self, max_steps: Optional[int] = None) -> int:
        """Steps a run trains: the schedule's end, or ``max_steps`` (``trainer.max_steps``) if smaller.

        ``None`` or a value <= 0 (Lightning's -1: no limit) leaves the schedule's end; the run's
        last step is ``run_steps(max_steps) - 1``.
        """
        if max_steps is not None and max_steps > 0:
            return min(self.total_steps, max_steps)
        return self.total_steps

    def stage(self, step: int) -> Stage:
        return self.stages[self.stage_index(step)]

    def stage_start(self, index: int) -> int:
        return self._ends[index] - self.stages[index].steps

    def _part(self, step: int, values: list) -> object:
        """The entry of ``values`` for ``step`` when its stage is split into len(values) equal parts."""
        i = self.stage_index(step)
        start, n = self.stage_start(i), self.stages[i].steps
        k = min(len(values) - 1, max(0, (step - start) * len(values) // n))
        return values[k]

    # -- batch shape -----------------------------------------------------------------
    def batch_tokens(self, step: int) -> int:
        return self.stage(step).batch_tokens

    def seq_len(self, step: int) -> int:
        return self.stage(step).seq_len

    def max_doc_len(self, step: int) -> int:
        return self.stage(step).max_doc_len

    def tokens_through(self, step: int) -> int:
        """Global training tokens consumed by steps 0..step (0 for step < 0)."""
        total = 0
        for i, st in enumerate(self.stages):
            start = self.stage_start(i)
            if step < start:
                break
            total += st.batch_tokens * (min(step, start + st.steps - 1) - start + 1)
        return total

    def grad_accum(self, step: int, world_size: int) -> int:
        """Micro-batches per rank at ``step``; raises if the batch does not split evenly."""
        st = self.stage(step)
        per = world_size * st.seq_len
        if st.batch_tokens % per:
            raise ValueError(
                f"schedule stage {self.stage_index(step)}: batch_tokens {st.batch_tokens} is not divisible "
                f"by world_size {world_size} x seq_len {st.seq_len}; choose --trainer.devices/num_nodes or "
                f"schedule.stages[*].seq_len so that it is"
            )
        return st.batch_tokens // per

    def check_world_size(self, world_size: int) -> None:
        """Raise a clear error if any stage's batch cannot be split over ``world_size`` ranks."""
        for i in range(len(self.stages)):
            self.grad_accum(self.stage_start(i), world_size)

    # -- attention -------------------------------------------------------------------
    def windows(self, step: int) -> tuple[int, int]:
        """(short, long) left attention windows in tokens."""
        st = self.stage(step)
        return st.window_short, st.window_long

    def attention_split(self, step: int) -> Optional[int]:
        """The attention segment cap for ``step`` (None when documents are not split)."""
        if self.attention_cap is None or self.max_doc_len(step) <= self.attention_cap:
            return None
        return self.attention_cap

    # -- lr and momentum -------------------------------------------------------------
    def lr_mul(self, step: int) -> float:
        """The lr multiplier s(step) of RECORD §9 (warmup, then cooldown to an absolute floor)."""
        st = self.stage(step)
        if st.extension:
            return self.final_lr_mul
        s = st.lr_mul
        if step >= self.cooldown_start and self.scheduled_steps > self.cooldown_start:
            tau = min(1.0, (step - self.cooldown_start) / (self.scheduled_steps - self.cooldown_start))
            s = s * (1 - tau) + self.final_lr_mul * tau
        if self.warmup_steps > 0 and step < self.warmup_steps:
            s *= (step + 1) / self.warmup_steps
        return s

    def momentum(self, step: int) -> float:
        """ANVIL momentum: linear rise to the peak, flat, linear fall over the last steps."""
        lo, hi = self.momentum_start, self.momentum_peak
        if self.momentum_warmup_steps > 0 and step < self.momentum_warmup_steps:
            return lo + (hi - lo) * step / self.momentum_warmup_steps
        fall_start = self.total_steps - self.momentum_cooldown_steps
        if self.momentum_cooldown_steps > 0 and step >= fall_start:
            frac = min(1.0, (step - fall_start) / self.momentum_cooldown_steps)
            return hi + (lo - hi) * frac
        return hi

    # -- loss ------------------------------------------------------------------------
    def candidates(self, step: int) -> Optional[int]:
        """Sampled-softmax candidate count (None = full vocabulary)."""
        c = self.stage(step).candidates
        if isinstance(c, list):
            return self._part(step, c)  # type: ignore[return-value]
        return c

    def prefix_weight(self, step: int) -> float:
        w = self.stage(step).prefix_weight
        if isinstance(w, list):
            return float(self._part(step, w))  # type: ignore[arg-type]
        return float(w)

    def mtp_weights(self, step: int) -> list[float]:
        """Multi-token prediction weights, linear from ``mtp_start`` to ``mtp_end`` in the stage.

        Trailing zero weights are dropped, so the list length changes only where a weight
        reaches zero.
        """
        i = self.stage_index(step)
        st = self.stages[i]
        if st.mtp_end is None or st.steps == 1:
            w = list(st.mtp_start)
        else:
            frac = (step - self.stage_start(i)) / (st.steps - 1)
            w = [a + (b - a) * frac for a, b in zip(st.mtp_start, st.mtp_end)]
        while len(w) > 1 and w[-1] <= 0.0:
            w.pop()
        return w

    # -- optimizer cadences ----------------------------------------------------------
    def adam_step(self, step: int) -> bool:
        """Whether the dense Adam groups update at ``step`` (last step of each cycle)."""
        return (step + 1) % self.adam_every == 0

    def sparse_step(self, step: int) -> bool:
        """Whether the sparse channels (n-gram table, value embeddings) update at ``step``."""
        if step >= self.sparse_cadence_start:
            return (step + 1) % self.sparse_cadence == 0
        return self.adam_step(step)

    def sparse_cadence_engaged(self, step: int) -> bool:
        return step >= self.sparse_cadence_start

    def anvil_engaged(self, step: int) -> bool:
        return step >= self.anvil_engage_step

    def tied(self, step: int) -> bool:
        return self.untie_step is not None and step < self.untie_step
