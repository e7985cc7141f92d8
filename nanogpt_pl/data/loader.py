"""BOS-aligned training batches and the fixed validation set (RECORD.md §1, §12).

Training: every step the global batch of ``schedule.batch_tokens(step)`` tokens is cut
into ``W * A`` packed sequences ("slices") of ``T + 1`` tokens, ``T =
schedule.seq_len(step)``, ``W`` ranks, ``A`` micro-batches per rank. All ranks walk
the same document cursor, so they agree on every slice without communicating:
slice ``i`` is rank ``i % W``'s micro-batch ``i // W``. A slice is a run of
document *pieces*, each starting at a BOS token (50256) and ending at the first
of: the next BOS, ``max_doc_len`` tokens, or the tokens the slice still needs.
Truncated tails are dropped and the next piece starts at the next unused BOS. The tokens a
step loses to ``max_doc_len`` are counted (``doc_tokens_cut`` of each micro-batch, logged as
``train/doc_tokens_cut``); ``long_documents="error"`` refuses such documents instead.

Because slices are cut in the same global order whatever ``W`` and ``A`` are, one
rank with 8 micro-batches sees exactly the data of 8 ranks with one each, and a
cursor saved at one world size resumes at another.

When a shard has too few documents left for the whole step, the step is dropped and
cut again from the start of the next shard, as the record does. One difference: the
record starts on an index of a shard's first 6M tokens while the full index is built
in the background, and would move to the next shard early if that index ran out
first (RECORD §15.8); here a shard is fully indexed before it is used.

Validation: the first ``val_tokens`` (+1) tokens of the validation shards,
contiguous and not BOS-aligned, cut into batches of ``W * val_seq_len``.
"""

from __future__ import annotations

import collections
import itertools
import queue
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence, Union

import numpy as np
import torch

from nanogpt_pl.data.shards import (
    MAKE_DATA_HINT,
    ShardError,
    check_vocab,
    list_shards,
    open_shard,
    read_header,
)
from nanogpt_pl.data.tokenizer import EOT_TOKEN, TOKENIZER_VOCAB
from nanogpt_pl.schedule import Schedule

# RECORD.md §1: every document is prefixed by <|endoftext|>, which serves as the BOS.
BOS_ID = EOT_TOKEN
# RECORD.md §1: the record's fixed cu_seqlens lengths for its per-rank sequence lengths;
# other lengths use the next multiple of 128 of T / 300.
TRAIN_MAX_NUM_DOCS = {16384: 64, 32768: 96, 40960: 128, 49152: 128}
CU_SEQLENS_MULTIPLE = 128
TOKENS_PER_DOC_ESTIMATE = 300
# Shard indexes kept in memory: the current shard, the preloaded next one, and slack for
# a cursor walk that restarts from an earlier step.
SHARD_CACHE_SIZE = 4
STATE_FORMAT = 1

Files = Union[str, Sequence[Union[str, Path]]]
MicroBatch = dict


class DataExhaustedError(ShardError):
    """The training shards ran out before the requested number of steps."""


# ---------------------------------------------------------------------------------------
# packing helpers


def max_num_docs(seq_len: int) -> int:
    """The padded length of ``cu_seqlens`` for packed sequences of ``seq_len`` tokens.

    RECORD.md §1: the record's table for its shapes, otherwise the next multiple of 128
    of ``seq_len // 300`` (at least 128).
    """
    if seq_len in TRAIN_MAX_NUM_DOCS:
        return TRAIN_MAX_NUM_DOCS[seq_len]
    estimate = seq_len // TOKENS_PER_DOC_ESTIMATE
    return max(CU_SEQLENS_MULTIPLE, -(-estimate // CU_SEQLENS_MULTIPLE) * CU_SEQLENS_MULTIPLE)


def pack_cu_seqlens(boundaries: np.ndarray, seq_len: int) -> np.ndarray:
    """Pad cumulative segment boundaries ``[0, ..., seq_len]`` with ``seq_len``.

    The result has :func:`max_num_docs` entries, or the next multiple of 128 that holds
    them all when a sequence has more segments than the bucket (so compiled kernels see
    few distinct shapes). Padding entries are zero-length segments.
    """
    n = len(boundaries)
    length = max_num_docs(seq_len)
    if n > length:
        length = -(-n // CU_SEQLENS_MULTIPLE) * CU_SEQLENS_MULTIPLE
    out = np.full(length, seq_len, dtype=np.int32)
    out[:n] = boundaries
    return out


def split_segments(lengths: np.ndarray, cap: Optional[int]) -> np.ndarray:
    """Split every segment longer than ``cap`` into consecutive segments of at most ``cap``."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if cap is None or lengths.size == 0 or lengths.max() <= cap:
        return lengths
    parts = []
    for n in lengths.tolist():
        full, rest = divmod(n, cap)
        parts.extend([cap] * full)
        if rest:
            parts.append(rest)
    return np.asarray(parts, dtype=np.int64)


def _to_torch(arr: np.ndarray, pin: bool) -> torch.Tensor:
    t = torch.from_numpy(np.ascontiguousarray(arr))
    return t.pin_memory() if pin else t


# ---------------------------------------------------------------------------------------
# shards with a document index


@dataclass
class IndexedShard:
    """A shard's tokens and the positions of its documents."""

    path: Path
    tokens: np.ndarray
    bos: np.ndarray  # int64 positions of BOS tokens
    doc_end: np.ndarray  # int64 end of the document starting at each BOS (next BOS or shard end)

    @classmethod
    def load(cls, path: Path, vocab_size: Optional[int]) -> "IndexedShard":
        tokens = open_shard(path, vocab_size)
        bos = np.flatnonzero(tokens == BOS_ID).astype(np.int64)
        doc_end = np.empty_like(bos)
        if bos.size:
            doc_end[:-1] = bos[1:]
            doc_end[-1] = tokens.size
        return cls(path, tokens, bos, doc_end)


class ShardSet:
    """Ordered training shards, indexed on first use; the next shard is indexed in the background.

    Args:
        files: a glob or a list of shard paths (sorted order is the stream order).
        vocab_size: token ids must be below it (checked once per shard).
        option: the config option the files came from, named in errors.
    """

    def __init__(self, files: Files, vocab_size: Optional[int] = TOKENIZER_VOCAB, option: str = "data.train_files"):
        if isinstance(files, (str, Path)):
            self.paths = list_shards(files, option)
        else:
            self.paths = [Path(p) for p in files]
            if not self.paths:
                raise ShardError(f"{option} is an empty list of shards; {MAKE_DATA_HINT}")
        self.sizes = [read_header(p) for p in self.paths]
        self.vocab_size = vocab_size
        self.option = option
        self._lock = threading.Lock()
        self._cache: "collections.OrderedDict[int, Future]" = collections.OrderedDict()
        self._pool: Optional[ThreadPoolExecutor] = None

    def __len__(self) -> int:
        return len(self.paths)

    @property
    def total_tokens(self) -> int:
        return sum(self.sizes)

    def _future(self, i: int) -> Future:
        with self._lock:
            fut = self._cache.get(i)
            if fut is None:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard-index")
                fut = self._pool.submit(IndexedShard.load, self.paths[i], self.vocab_size)
                self._cache[i] = fut
                while len(self._cache) > SHARD_CACHE_SIZE:
                    self._cache.popitem(last=False)
            else:
                self._cache.move_to_end(i)
            return fut

    def get(self, i: int) -> IndexedShard:
        """Shard ``i`` with its document index; starts indexing the shard after it."""
        fut = self._future(i)
        if len(self.paths) > 1:
            self._future((i + 1) % len(self.paths))
        return fut.result()

    def close(self) -> None:
        with self._lock:
            if self._pool is not None:
                self._pool.shutdown(wait=False, cancel_futures=True)
                self._pool = None
            self._cache.clear()


# ---------------------------------------------------------------------------------------
# the document cursor


@dataclass(frozen=True)
class Cursor:
    """Position of the stream: shard number and index of the next unused BOS in it."""

    shard: int = 0
    bos: int = 0


@dataclass
class StepPlan:
    """Where the slices of one step come from: piece starts and lengths in one shard."""

    step: int
    seq_len: int
    shard: IndexedShard
    starts: list  # per slice: int64 array of piece starts
    lengths: list  # per slice: int64 array of piece lengths (sum seq_len + 1)
    cursor: Cursor  # where this step started
    next_cursor: Cursor
    cut: list  # per slice: tokens its documents lost to max_doc_len


LONG_DOCUMENTS = ("truncate", "error")


def check_long_documents(value: str) -> str:
    """``value`` if it is a ``data.long_documents`` choice, else a ValueError naming the option."""
    if value not in LONG_DOCUMENTS:
        raise ValueError(f"data.long_documents={value!r}: choose one of {list(LONG_DOCUMENTS)}")
    return value


class DocumentTooLongError(ValueError):
    """A document is longer than the schedule's ``max_doc_len`` and ``data.long_documents`` is "error"."""


def plan_slices(
    shard: IndexedShard, pos: int, n_slices: int, seq_len: int, max_doc_len: int,
    long_documents: str = "truncate", step: Optional[int] = None,
) -> Optional[tuple[list, list, int, list]]:
    """Cut ``n_slices`` slices of ``seq_len + 1`` tokens starting at BOS number ``pos``.

    Returns ``(starts, lengths, next_pos, cut)`` per slice (``cut``: tokens beyond
    ``max_doc_len`` in the slice's documents, dropped), or None when the shard runs out of
    documents first (the caller drops the partial step and moves to the next shard).
    ``long_documents="error"`` raises :class:`DocumentTooLongError` for such a document.
    """
    need = seq_len + 1
    n_bos = shard.bos.size
    all_starts, all_lengths, all_cut = [], [], []
    window = max(16, need // 256)
    for _ in range(n_slices):
        while True:
            hi = min(pos + window, n_bos)
            starts = shard.bos[pos:hi]
            full = shard.doc_end[pos:hi] - starts
            lengths = np.minimum(full, max_doc_len)
            cum = np.cumsum(lengths)
            if cum.size and cum[-1] >= need:
                k = int(np.searchsorted(cum, need))  # first piece that completes the slice
                over = full[: k + 1] - lengths[: k + 1]
                if long_documents == "error" and over.any():
                    i = int(np.flatnonzero(over)[0])
                    at = f" at step {step}" if step is not None else ""
                    raise DocumentTooLongError(
                        f"{shard.path}: the document at token {int(starts[i]):,} has {int(full[i]):,} tokens, "
                        "more than "
                        f"the schedule's max_doc_len of {max_doc_len:,}{at}, and data.long_documents is 'error'. "
                        f"Set data.long_documents: truncate (the record's rule: keep its first max_doc_len tokens), "
                        f"raise max_doc_len in schedule.stages, or split long documents when preparing the data")
                lengths = lengths[: k + 1].copy()
                lengths[k] -= int(cum[k]) - need
                all_starts.append(starts[: k + 1])
                all_lengths.append(lengths)
                all_cut.append(int(over.sum()))
                pos += k + 1
                break
            if hi >= n_bos:
                return None
            window *= 4
    return all_starts, all_lengths, pos, all_cut


class DocumentWalker:
    """Plans the slices of each step from a cursor, following the schedule's shapes.

    The cursor's shard number counts on through repeated passes (``epochs > 1``): shard
    ``k`` of the stream is file ``k % len(shards)``.
    """

    def __init__(self, shards: ShardSet, schedule: Schedule, world_size: int, epochs: int = 1,
                 long_documents: str = "truncate"):
        if epochs < 1:
            raise ValueError(f"data.epochs must be >= 1, got {epochs}")
        self.long_documents = check_long_documents(long_documents)
        self.shards = shards
        self.schedule = schedule
        self.world_size = world_size
        self.epochs = epochs

    def slices_per_step(self, step: int) -> int:
        return self.world_size * self.schedule.grad_accum(step, self.world_size)

    def plan(self, step: int, cursor: Cursor) -> StepPlan:
        """The slices of ``step`` starting at ``cursor``; moves to later shards as needed."""
        seq_len = self.schedule.seq_len(step)
        n_slices = self.slices_per_step(step)
        max_doc_len = self.schedule.max_doc_len(step)
        if max_doc_len <= 0:
            raise ValueError(f"schedule: max_doc_len must be positive at step {step}, got {max_doc_len}")
        c = cursor
        while c.shard < len(self.shards) * self.epochs:
            shard = self.shards.get(c.shard % len(self.shards))
            cut = plan_slices(shard, c.bos, n_slices, seq_len, max_doc_len, self.long_documents, step)
            if cut is not None:
                starts, lengths, pos, dropped = cut
                return StepPlan(step, seq_len, shard, starts, lengths, c, Cursor(c.shard, pos), dropped)
            c = Cursor(c.shard + 1, 0)
        passes = f" in {self.epochs} passes (data.epochs)" if self.epochs > 1 else ""
        served = f"steps 0..{step - 1} were served" if step > 0 else "not one step could be served"
        raise DataExhaustedError(
            f"the training data ran out at step {step}: {served} from "
            f"{len(self.shards)} shard(s) of {self.shards.option} ({self.shards.total_tokens:,} tokens){passes}, "
            f"and step {step} needs {self.schedule.batch_tokens(step):,} more. Add shards (e.g. "
            f"`nanogpt-pl data fineweb --train-shards N` with a larger N, or more text through "
            f"`nanogpt-pl data prepare`), train fewer steps (--trainer.max_steps, schedule.stages), or "
            f"repeat the data explicitly with data.epochs; it is never repeated silently."
        )


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
    """Gather one slice's tokens and its packed-sequence boundaries."""
    buf = np.concatenate([shard.tokens[s : s + n] for s, n in zip(starts.tolist(), lengths.tolist())])
    assert buf.size == seq_len + 1
    seg = lengths.astype(np.int64).copy()
    seg[-1] -= 1  # the last piece loses its final token to the target shift
    if seg[-1] == 0:
        seg = seg[:-1]
    seg = split_segments(seg, attention_split)
    boundaries = np.concatenate([[0], np.cumsum(seg)])
    return {
        "inputs": _to_torch(buf[:-1].astype(np.int32), pin),
        "targets": _to_torch(buf[1:].astype(np.int64), pin),
        "cu_seqlens": _to_torch(pack_cu_seqlens(boundaries, seq_len), pin),
        "max_seqlen": int(seg.max()),
        "step": int(step),
        "doc_tokens_cut": int(doc_tokens_cut),
    }


# ---------------------------------------------------------------------------------------
# the training stream


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
                plan = stream.walker.plan(step, cursor)
                batch = stream.micro_batches(plan)
                stream._remember(step + 1, plan.next_cursor)
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
    def _remember(self, step: int, cursor: Cursor) -> None:
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
        self._remember(step, cursor)
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
            raise ValueError(f"training stream state has format {state.get('format')!r}, expected {STATE_FORMAT}")
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


# ---------------------------------------------------------------------------------------
# validation


class ValidationSet:
    """The fixed validation batches of this rank (RECORD.md §12).

    The first ``val_tokens + 1`` tokens of the validation shards, contiguous and not
    BOS-aligned. Batch ``b`` covers tokens ``[b * W * S, (b + 1) * W * S)``; rank ``r``
    takes its contiguous ``S = val_seq_len`` slice; targets are the next tokens. Segment
    boundaries are the BOS positions in the slice (plus 0), padded like training.

    Args:
        files: validation shards: a glob or a list of paths.
        val_tokens: tokens per validation pass (a multiple of ``W * val_seq_len``).
        val_seq_len: tokens per rank per batch.
        world_size: ranks ``W``; rank: this rank.
        vocab_size: every token id must be below it.
        pin_memory: pin batches (default: when CUDA is available).
    """

    def __init__(
        self,
        files: Files,
        val_tokens: int,
        val_seq_len: int,
        world_size: int = 1,
        rank: int = 0,
        vocab_size: Optional[int] = TOKENIZER_VOCAB,
        pin_memory: Optional[bool] = None,
        option: str = "data.val_files",
    ):
        if val_seq_len <= 0 or val_tokens <= 0:
            raise ValueError(f"data.val_tokens ({val_tokens}) and data.val_seq_len ({val_seq_len}) must be positive")
        per_batch = world_size * val_seq_len
        if val_tokens % per_batch:
            lower = val_tokens // per_batch * per_batch
            raise ValueError(
                f"data.val_tokens={val_tokens} is not a multiple of world_size {world_size} x "
                f"data.val_seq_len {val_seq_len} = {per_batch}; use a multiple such as "
                f"{max(lower, per_batch)} or change data.val_seq_len"
            )
        paths = list_shards(files, option) if isinstance(files, (str, Path)) else [Path(p) for p in files]
        if not paths:
            raise ShardError(f"{option} lists no shards; {MAKE_DATA_HINT}")
        need = val_tokens + 1
        pieces, have = [], 0
        for p in paths:
            tokens = open_shard(p)
            take = min(tokens.size, need - have)
            if vocab_size is not None:
                check_vocab(p, tokens, vocab_size, limit=take)
            pieces.append(tokens[:take])
            have += take
            if have == need:
                break
        if have < need:
            usable = (have - 1) // per_batch * per_batch
            raise ShardError(
                f"data.val_tokens={val_tokens} needs {need} tokens but {option} ({len(paths)} shard(s)) holds "
                f"only {have}; lower data.val_tokens to {usable} or less (a multiple of {per_batch}) or add "
                f"validation data"
            )
        self.tokens = pieces[0] if len(pieces) == 1 else np.concatenate(pieces)
        self.paths = paths
        self.val_tokens = val_tokens
        self.seq_len = val_seq_len
        self.world_size = world_size
        self.rank = rank
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory

    def __len__(self) -> int:
        return self.val_tokens // (self.world_size * self.seq_len)

    def batch(self, index: int) -> MicroBatch:
        """Validation batch ``index`` of this rank."""
        if not 0 <= index < len(self):
            raise IndexError(f"validation batch {index} out of range [0, {len(self)})")
        start = (index * self.world_size + self.rank) * self.seq_len
        buf = np.asarray(self.tokens[start : start + self.seq_len + 1])
        inputs = buf[:-1]
        bos = np.flatnonzero(inputs == BOS_ID)
        boundaries = np.unique(np.concatenate([[0], bos, [self.seq_len]]))
        return {
            "inputs": _to_torch(inputs.astype(np.int32), self.pin_memory),
            "targets": _to_torch(buf[1:].astype(np.int64), self.pin_memory),
            "cu_seqlens": _to_torch(pack_cu_seqlens(boundaries, self.seq_len), self.pin_memory),
            "max_seqlen": int(np.diff(boundaries).max()),
        }

    def __iter__(self) -> Iterator[MicroBatch]:
        return (self.batch(i) for i in range(len(self)))


def iter_steps(stream: TrainStream, n: int) -> list:
    """The next ``n`` items of ``stream`` (a small convenience for scripts and tests)."""
    return list(itertools.islice(iter(stream), n))
