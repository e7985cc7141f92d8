"""The training data as a prefetching, resumable stream of steps (RECORD.md §1).

:class:`TrainStream` turns the step plans of :mod:`nanogpt_pl.data.planning` into this
rank's micro-batches on a background thread, and saves and restores the document
cursor of the first untrained step, so a resumed run sees the data a straight run would.
"""

from __future__ import annotations

import collections
import itertools
import queue
import threading
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Union

import numpy as np
import torch
from torch.profiler import record_function

from nanogpt_pl.data.planning import (
    Cursor,
    DocumentWalker,
    Files,
    IndexedShard,
    ShardSet,
    StepPlan,
    distinct_tokens,
    pack_cu_seqlens,
    packed_length,
    slice_segments,
    slice_tokens,
    to_tensor,
)
from nanogpt_pl.data.shards import ShardError
from nanogpt_pl.data.tokenizer import TOKENIZER_VOCAB
from nanogpt_pl.schedule import Schedule

STATE_FORMAT = 1

MicroBatch = dict


@dataclass
class PlanBounds:
    """Per sequence length T, the largest micro-batch shapes of a stretch of the batch plan."""

    cu_seqlens: dict[int, int]  # T -> the longest ``cu_seqlens`` (boundaries, padded as packed)
    distinct_tokens: dict[int, int]  # T -> the most distinct token ids one micro-batch's inputs hold


def build_micro_batch(
    shard: IndexedShard,
    starts: np.ndarray,
    lengths: np.ndarray,
    seq_len: int,
    step: int,
    attention_split: Optional[int] = None,
    pin: bool = False,
    doc_tokens_cut: int = 0,
) -> MicroBatch:
    """Gather one slice's tokens and its packed-sequence boundaries.

    ``distinct_tokens`` (host-side, from the same tokens) is how many different ids the inputs
    hold: the fixed value-embedding pull checks it against its plan-sized capacity without
    asking the device (``SparseChannels.value_rows``).
    """
    buf = slice_tokens(shard, starts, lengths)
    assert buf.size == seq_len + 1
    seg = slice_segments(lengths, attention_split)
    boundaries = np.concatenate([[0], np.cumsum(seg)])
    return {
        "inputs": to_tensor(buf[:-1].astype(np.int32), pin),
        "targets": to_tensor(buf[1:].astype(np.int64), pin),
        "cu_seqlens": to_tensor(pack_cu_seqlens(boundaries, seq_len), pin),
        "max_seqlen": int(seg.max()),
        "step": int(step),
        "doc_tokens_cut": int(doc_tokens_cut),
        "distinct_tokens": distinct_tokens(buf[:-1]),
    }


class _Failure:
    def __init__(self, error: BaseException):
        self.error = error


_END = object()


class _StreamIterator:
    """One pass over a :class:`TrainStream`; a background thread runs ``prefetch`` steps ahead.

    The thread starts on the first ``next()`` (Lightning calls ``iter()`` once just to check
    the object is iterable).
    """

    def __init__(self, stream: "TrainStream", start: int):
        self._stream = stream
        self._start = start
        self._thread: Optional[threading.Thread] = None
        self._stop = threading.Event()
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, stream.prefetch))
        self._done = False

    def __iter__(self) -> "_StreamIterator":
        return self

    def _put(self, item: object, stop: threading.Event, q: queue.Queue) -> bool:
        while not stop.is_set():
            try:
                q.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _produce(self, start: int, stop: threading.Event, q: queue.Queue) -> None:
        stream = self._stream
        try:
            step = start
            cursor = stream.cursor_at(step)
            while step < stream.stop_step and not stop.is_set():
                with record_function("data/produce"):  # a profile's view of this thread's work
                    plan = stream.walker.plan(step, cursor)
                    batch = stream.micro_batches(plan)
                stream.remember(step + 1, plan.next_cursor)
                if not self._put((step, batch), stop, q):
                    return
                step, cursor = step + 1, plan.next_cursor
            self._put(_END, stop, q)
        except BaseException as e:  # re-raised in the consumer
            self._put(_Failure(e), stop, q)

    def _start_thread(self) -> None:
        self._stop = threading.Event()
        self._queue = queue.Queue(maxsize=max(1, self._stream.prefetch))
        self._thread = threading.Thread(
            target=self._produce, args=(self._start, self._stop, self._queue), name="train-stream", daemon=True
        )
        self._thread.start()

    def __next__(self) -> list:
        if self._done:
            raise StopIteration
        if self._thread is None:
            self._start_thread()
        while True:
            try:
                item = self._queue.get(timeout=1.0)
                break
            except queue.Empty:
                assert self._thread is not None
                if not self._thread.is_alive() and self._queue.empty():
                    self._done = True
                    raise RuntimeError("the training data thread stopped without a result")
        if isinstance(item, _Failure):
            self._done = True
            self.close()
            raise item.error
        if item is _END:
            self._done = True
            raise StopIteration
        step, batch = item
        self._stream._delivered(step)
        return batch

    def rewind(self, step: int) -> None:
        """Stop prefetching; the next ``next()`` yields ``step``."""
        self.close()
        self._start = step
        self._done = False
        self._thread = None

    def close(self) -> None:
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            while thread.is_alive():
                try:  # unblock a producer waiting on a full queue
                    self._queue.get_nowait()
                except queue.Empty:
                    pass
                thread.join(timeout=0.05)


class TrainStream:
    """The training data as an iterable of steps, resumable through ``state_dict``.

    Each item is the list of this rank's ``A`` micro-batches of one step, each a dict
    ``{"inputs": int32 [T], "targets": int64 [T], "cu_seqlens": int32 [M + 1],
    "max_seqlen": int, "step": int}``; ``cu_seqlens`` holds the packed segment
    boundaries padded with ``T`` (see :func:`pack_cu_seqlens`). The stream stops after
    step ``stop_step - 1``.

    Resume: the stream runs ahead of training, so ``state_dict()`` asks
    ``consumed_steps()`` for the first step not yet trained and saves the cursor that
    step starts at; ``load_state_dict`` restarts there. Lightning saves and restores
    both automatically for a train dataloader that has the two methods.

    Args:
        files: training shards: a glob or a list of paths (or a :class:`ShardSet`), in stream order.
        schedule: batch tokens, sequence length and document cap per step.
        world_size: number of ranks ``W``.
        rank: this rank.
        vocab_size: every token id must be below it.
        prefetch: steps prepared ahead on a background thread.
        start_step: the first step (the cursor is advanced over the earlier steps).
        epochs: passes over the shards; after the last shard the stream starts again at the
            first (the default 1 stops with an error when the data runs out).
        long_documents: ``"truncate"`` (the record's rule: a document longer than the step's
            ``max_doc_len`` keeps its first ``max_doc_len`` tokens; the rest are dropped and
            counted) or ``"error"`` (raise :class:`DocumentTooLongError` naming the shard).
        stop_step: the stream ends before this step (default ``schedule.total_steps``).
        consumed_steps: a counter that grows by one per trained step (the data module passes
            the fit loop's processed-batch count); ``start_step`` (or the step of the last
            ``seek``/``load_state_dict``) corresponds to its value at that time. Default: the
            steps this stream has handed out.
        pin_memory: pin batches for asynchronous host-to-device copies (default: when
            CUDA is available).
    """

    def __init__(
        self,
        files: Union[Files, ShardSet],
        schedule: Optional[Schedule] = None,
        world_size: int = 1,
        rank: int = 0,
        vocab_size: Optional[int] = TOKENIZER_VOCAB,
        prefetch: int = 8,
        start_step: int = 0,
        stop_step: Optional[int] = None,
        consumed_steps: Optional[Callable[[], int]] = None,
        pin_memory: Optional[bool] = None,
        option: str = "data.train_files",
        epochs: int = 1,
        long_documents: str = "truncate",
    ):
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
        if prefetch < 1:
            raise ValueError(f"data.prefetch must be >= 1, got {prefetch}")
        self.schedule = schedule if schedule is not None else Schedule()
        self.schedule.check_world_size(world_size)
        self.shards = files if isinstance(files, ShardSet) else ShardSet(files, vocab_size, option)
        self.world_size = world_size
        self.rank = rank
        self.prefetch = prefetch
        self.stop_step = self.schedule.total_steps if stop_step is None else int(stop_step)
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self.walker = DocumentWalker(self.shards, self.schedule, world_size, epochs, long_documents)
        self._consumed_steps = consumed_steps
        self._lock = threading.Lock()
        # cursor before each recent step; step 0 always starts at the first BOS of shard 0
        self._cursors: "collections.OrderedDict[int, Cursor]" = collections.OrderedDict({0: Cursor()})
        self._anchor = (0, Cursor())
        self._next_step = int(start_step)
        # consumed_steps() counts trained batches; this pair maps a count to a stream step
        # (reset by seek/load_state_dict, so a count that does not start at 0 still maps).
        self._count_base = (int(start_step), int(consumed_steps()) if consumed_steps is not None else 0)
        self._live: Optional[_StreamIterator] = None

    # -- iteration -------------------------------------------------------------------
    def __iter__(self) -> Iterator[list]:
        if self._live is not None:
            self._live.close()
        self._live = _StreamIterator(self, self._next_step)
        return self._live

    def micro_batches(self, plan: StepPlan) -> list:
        """This rank's micro-batches of a planned step (slice ``i`` is rank ``i % W``'s)."""
        split = self.schedule.attention_split(plan.step)
        return [
            build_micro_batch(plan.shard, plan.starts[i], plan.lengths[i], plan.seq_len, plan.step, split,
                              self.pin_memory, plan.cut[i])
            for i in range(self.rank, len(plan.starts), self.world_size)
        ]

    def plan_bounds(self, start: int = 0, stop: Optional[int] = None) -> PlanBounds:
        """The largest micro-batch shapes of steps ``[start, stop)`` (default: to ``stop_step``),
        per sequence length T, over every rank's slices (so every rank gets the same bounds).

        Walks the plans and counts each slice's distinct tokens on the host. Sizing every
        micro-batch of a T to these bounds gives a run one input shape per T, whatever order
        its steps are visited in (the speedrun timer's warmup seeds its CUDA graphs with it).
        """
        stop = self.stop_step if stop is None else min(int(stop), self.stop_step)
        bounds = PlanBounds({}, {})
        step = int(start)
        cursor = self.cursor_at(step) if step < stop else None
        while step < stop:
            plan = self.walker.plan(step, cursor)
            split = self.schedule.attention_split(step)
            T = plan.seq_len
            for starts, lengths in zip(plan.starts, plan.lengths):
                docs = packed_length(slice_segments(lengths, split).size + 1, T)
                ids = distinct_tokens(slice_tokens(plan.shard, starts, lengths)[:-1])
                bounds.cu_seqlens[T] = max(bounds.cu_seqlens.get(T, 0), docs)
                bounds.distinct_tokens[T] = max(bounds.distinct_tokens.get(T, 0), ids)
            step, cursor = step + 1, plan.next_cursor
            self.remember(step, cursor)
        return bounds

    def seek(self, step: int) -> None:
        """Continue from ``step``: the next batch handed out, and the next batch trained, is ``step``.

        A live iterator is rewound in place and its prefetched steps dropped. A consumer
        that holds a batch fetched ahead (Lightning fetches one batch ahead) still sees it.
        """
        step = int(step)
        self._next_step = step
        self._count_base = (step, int(self._consumed_steps()) if self._consumed_steps is not None else 0)
        if self._live is not None:
            self._live.rewind(step)

    def close(self) -> None:
        """Stop the prefetch thread and release shard indexes."""
        if self._live is not None:
            self._live.close()
            self._live = None
        self.shards.close()

    # -- cursor bookkeeping ----------------------------------------------------------
    def remember(self, step: int, cursor: Cursor) -> None:
        """Record that ``step`` starts at ``cursor``.

        A caller that plans steps itself (``walker.plan(step, cursor_at(step))``) passes the
        plan's ``next_cursor`` for ``step + 1``, so the next ``cursor_at`` finds it instead of
        walking there. The most recent ``prefetch + 256`` cursors are kept.
        """
        with self._lock:
            self._cursors[step] = cursor
            self._cursors.move_to_end(step)
            while len(self._cursors) > self.prefetch + 256:
                self._cursors.popitem(last=False)

    def _delivered(self, step: int) -> None:
        self._next_step = step + 1

    def cursor_at(self, step: int) -> Cursor:
        """The cursor ``step`` starts at: remembered, or walked from the nearest earlier known one."""
        with self._lock:
            if step in self._cursors:
                return self._cursors[step]
            known = [(s, c) for s, c in self._cursors.items() if s <= step]
        known.append(self._anchor)
        s, cursor = max(known, key=lambda sc: sc[0])
        while s < step:
            cursor = self.walker.plan(s, cursor).next_cursor
            s += 1
        self.remember(step, cursor)
        return cursor

    def consumed(self) -> int:
        """The first step not yet trained."""
        if self._consumed_steps is not None:
            step, count = self._count_base
            return step + int(self._consumed_steps()) - count
        return self._next_step

    def state_dict(self) -> dict:
        """The cursor of the first untrained step, plus the shard names for a consistency check."""
        step = self.consumed()
        cursor = self.cursor_at(step)
        shard_names = self._names_through(cursor.shard)
        return {"format": STATE_FORMAT, "step": step, "shard": cursor.shard, "bos": cursor.bos, "shards": shard_names}

    def _names_through(self, shard: int) -> list[str]:
        return [p.name for p in self.shards.paths[: min(shard, len(self.shards) - 1) + 1]]

    def load_state_dict(self, state: dict) -> None:
        """Resume at the saved step, with the data that step would have had."""
        if state.get("format") != STATE_FORMAT:
            raise ValueError(
                f"the checkpoint's training stream state has format {state.get('format')!r}, not {STATE_FORMAT}: "
                "it was saved by another version of nanogpt-pl; resume it with that version, or start from its weights"
            )
        step, cursor = int(state["step"]), Cursor(int(state["shard"]), int(state["bos"]))
        names = self._names_through(cursor.shard)
        if list(state["shards"]) != names:
            raise ShardError(
                f"the checkpoint's data stream was in shard {cursor.shard} with shards {state['shards']}, but "
                f"{self.shards.option} now lists {names}; resume with the same training files"
            )
        with self._lock:
            self._cursors.clear()
            self._cursors[step] = cursor
        self.seek(step)



def iter_steps(stream: TrainStream, n: int) -> list:
    """The next ``n`` items of ``stream`` (a small convenience for scripts and tests)."""
    return list(itertools.islice(iter(stream), n))
