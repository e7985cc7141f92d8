"""The Lightning data module: training stream and validation set from token shards."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

import lightning as L

from nanogpt_pl.data.planning import check_long_documents
from nanogpt_pl.data.shards import MAKE_DATA_HINT, ShardError, list_shards
from nanogpt_pl.data.stream import PlanBounds, TrainStream
from nanogpt_pl.data.tokenizer import TOKENIZER_VOCAB
from nanogpt_pl.data.validation import ValidationSet
from nanogpt_pl.schedule import Schedule

# RECORD.md §12: 10,485,760 validation tokens = 5 batches of 262,144 tokens on each of 8 ranks.
RECORD_VAL_TOKENS = 10_485_760
RECORD_VAL_SEQ_LEN = 262_144
CORPORA = ("quickstart",)


class SpeedrunDataModule(L.LightningDataModule):
    """BOS-aligned training batches and the fixed validation set, sized by the schedule.

    Each training step yields this rank's list of micro-batches (see
    :class:`~nanogpt_pl.data.stream.TrainStream`); each validation batch is one dict.

    Args:
        train_files: glob of training shards, e.g. ``data/fineweb10B/fineweb_train_*.bin``.
        val_files: glob of validation shards, e.g. ``data/fineweb10B/fineweb_val_*.bin``.
        corpus: ``"quickstart"``: build (once, cached) and use the embedded corpus of Python's
            documentation when ``train_files``/``val_files`` are not given.
        val_tokens: tokens per validation pass; a multiple of world size x ``val_seq_len``
            (the record: 10,485,760).
        val_seq_len: validation tokens per rank per batch (the record: 262,144).
        vocab_size: every token id in the shards must be below it (GPT-2: 50,257).
        prefetch: training steps prepared ahead on a background thread.
        epochs: passes over the training shards. 1 (the default) stops with an error when
            the data runs out; more repeats the shards in the same order, for corpora smaller
            than the schedule's token count.
        long_documents: ``"truncate"`` (the record's rule: documents longer than the step's
            ``max_doc_len`` keep their first ``max_doc_len`` tokens; the dropped tokens are
            logged as ``train/doc_tokens_cut``) or ``"error"`` (stop with an error naming the
            shard and document).
        schedule: batch tokens, sequence length and document cap per step (linked from the
            top-level ``schedule`` section by the CLI; the record's table if omitted).
    """

    def __init__(
        self,
        train_files: Optional[str] = None,
        val_files: Optional[str] = None,
        corpus: Optional[str] = None,
        val_tokens: int = RECORD_VAL_TOKENS,
        val_seq_len: int = RECORD_VAL_SEQ_LEN,
        vocab_size: int = TOKENIZER_VOCAB,
        prefetch: int = 8,
        epochs: int = 1,
        long_documents: str = "truncate",
        schedule: Optional[Schedule] = None,
    ):
        super().__init__()
        if corpus is not None and corpus not in CORPORA:
            raise ValueError(f"data.corpus={corpus!r} is unknown; the embedded corpora are {list(CORPORA)}")
        if prefetch < 1:
            raise ValueError(f"data.prefetch must be >= 1, got {prefetch}")
        if epochs < 1:
            raise ValueError(f"data.epochs must be >= 1, got {epochs}")
        self.long_documents = check_long_documents(long_documents)
        self.save_hyperparameters(ignore=["schedule"])
        self.train_files = train_files
        self.val_files = val_files
        self.corpus = corpus
        self.val_tokens = val_tokens
        self.val_seq_len = val_seq_len
        self.vocab_size = vocab_size
        self.prefetch = prefetch
        self.epochs = epochs
        self.schedule = schedule if schedule is not None else Schedule()
        self.world_size = 1
        self.rank = 0
        self._stream: Optional[TrainStream] = None
        self._probe: Optional[TrainStream] = None

    # -- data location -----------------------------------------------------------------
    def _corpus_files(self, build: bool) -> tuple[str, str]:
        from nanogpt_pl.data.corpus import build_corpus  # the corpus builder loads only for the embedded corpus

        info = build_corpus(progress=build)
        return info.train_pattern, info.val_pattern

    def resolved_files(self, build: bool = False) -> tuple[Optional[str], Optional[str]]:
        """(train glob, val glob): the configured ones, else the embedded corpus's."""
        train, val = self.train_files, self.val_files
        if self.corpus is not None and (train is None or val is None):
            c_train, c_val = self._corpus_files(build)
            train = train if train is not None else c_train
            val = val if val is not None else c_val
        return train, val

    def prepare_data(self) -> None:
        # Runs on one process per node before setup: build the embedded corpus once.
        if self.corpus is not None and (self.train_files is None or self.val_files is None):
            self._corpus_files(build=True)

    def setup(self, stage: Optional[str] = None) -> None:
        trainer = self.trainer
        if trainer is not None:
            self.world_size, self.rank = trainer.world_size, trainer.global_rank
        if stage in (None, "fit"):
            self.schedule.check_world_size(self.world_size)
            train, _ = self.resolved_files()
            if train is None:
                raise ShardError(f"data.train_files is not set; {MAKE_DATA_HINT}")
            list_shards(train, "data.train_files")

    # -- loaders -------------------------------------------------------------------------
    def _consumed_steps(self) -> Optional[Callable[[], int]]:
        trainer = self.trainer
        if trainer is None:
            return None
        # Batches trained so far, counted by the fit loop (saved in and restored from
        # checkpoints). trainer.global_step counts optimizer.step() calls instead, which
        # differs from the number of batches when manual optimization steps several
        # optimizers per batch or skips one on some steps.
        progress = trainer.fit_loop.epoch_loop.batch_progress
        return lambda: progress.total.processed

    def stop_step(self) -> int:
        """The stream's last step + 1: the schedule's end, or ``trainer.max_steps`` if smaller."""
        return self.schedule.run_steps(None if self.trainer is None else self.trainer.max_steps)

    def train_dataloader(self) -> TrainStream:
        """The training stream (an iterable without ``__len__``, resumable via ``state_dict``)."""
        train, _ = self.resolved_files()
        if train is None:
            raise ShardError(f"data.train_files is not set; {MAKE_DATA_HINT}")
        if self._stream is not None:
            self._stream.close()
        consumed = self._consumed_steps()
        self._stream = TrainStream(
            train,
            self.schedule,
            world_size=self.world_size,
            rank=self.rank,
            vocab_size=self.vocab_size,
            prefetch=self.prefetch,
            # A resumed run whose checkpoint has no stream state still starts at the right
            # step (the cursor is walked there); a saved state, loaded next, skips the walk.
            start_step=consumed() if consumed is not None else 0,
            stop_step=self.stop_step(),
            consumed_steps=consumed,
            epochs=self.epochs,
            long_documents=self.long_documents,
        )
        return self._stream

    def val_dataloader(self) -> ValidationSet:
        """This rank's fixed validation batches."""
        _, val = self.resolved_files()
        if val is None:
            raise ShardError(f"data.val_files is not set; {MAKE_DATA_HINT}")
        return ValidationSet(
            val,
            self.val_tokens,
            self.val_seq_len,
            world_size=self.world_size,
            rank=self.rank,
            vocab_size=self.vocab_size,
        )

    def teardown(self, stage: Optional[str] = None) -> None:
        for stream in (self._stream, self._probe):
            if stream is not None:
                stream.close()
        self._stream = self._probe = None

    def batch_at(self, step: int) -> list:
        """This rank's micro-batches of ``step``, the data a straight run trains on at that step.

        Built synchronously from a separate cursor (for warmup passes that run chosen steps
        off the clock); the training stream handed to the trainer is untouched.
        """
        probe = self._probe_stream()
        plan = probe.walker.plan(step, probe.cursor_at(step))
        probe.remember(step + 1, plan.next_cursor)
        return probe.micro_batches(plan)

    def plan_bounds(self, stop: Optional[int] = None) -> PlanBounds:
        """The largest micro-batch shapes of the run's steps up to ``stop``, per sequence length
        (:meth:`TrainStream.plan_bounds`, from a separate cursor)."""
        return self._probe_stream().plan_bounds(0, stop)

    def _probe_stream(self) -> TrainStream:
        """The stream :meth:`batch_at` and :meth:`plan_bounds` plan from (not the trainer's)."""
        if self._probe is None:
            train, _ = self.resolved_files()
            if train is None:
                raise ShardError(f"data.train_files is not set; {MAKE_DATA_HINT}")
            self._probe = TrainStream(
                train, self.schedule, world_size=self.world_size, rank=self.rank,
                vocab_size=self.vocab_size, prefetch=1, epochs=self.epochs, long_documents=self.long_documents,
            )
        return self._probe

    @property
    def train_stream(self) -> Optional[TrainStream]:
        """The stream handed to the trainer (for callbacks that rewind it, e.g. after warmup)."""
        return self._stream

    def data_paths(self) -> tuple[list[Path], list[Path]]:
        """The training and validation shard paths in use."""
        train, val = self.resolved_files()
        return (
            list_shards(train, "data.train_files") if train else [],
            list_shards(val, "data.val_files") if val else [],
        )
