"""BOS-aligned step plans: which document pieces make up each slice of a training step (RECORD.md §1).

Every step the global batch of ``schedule.batch_tokens(step)`` tokens is cut into
``W * A`` packed sequences ("slices") of ``T + 1`` tokens, ``T = schedule.seq_len(step)``,
``W`` ranks, ``A`` micro-batches per rank. All ranks walk the same document cursor, so
they agree on every slice without communicating: slice ``i`` is rank ``i % W``'s
micro-batch ``i // W``. A slice is a run of document *pieces*, each starting at a BOS
token (50256) and ending at the first of: the next BOS, ``max_doc_len`` tokens, or the
tokens the slice still needs. Truncated tails are dropped and the next piece starts at
the next unused BOS. The tokens a step loses to ``max_doc_len`` are counted
(``doc_tokens_cut`` of each micro-batch, logged as ``train/doc_tokens_cut``);
``long_documents="error"`` refuses such documents instead.

Because slices are cut in the same global order whatever ``W`` and ``A`` are, one rank
with 8 micro-batches sees exactly the data of 8 ranks with one each, and a cursor saved
at one world size resumes at another.

When a shard has too few documents left for the whole step, the step is dropped and cut
again from the start of the next shard, as the record does. One difference: the record
starts on an index of a shard's first 6M tokens while the full index is built in the
background, and would move to the next shard early if that index ran out first (RECORD
§15.8); here a shard is fully indexed before it is used.

The prefetching, resumable stream over these plans is :mod:`nanogpt_pl.data.stream`;
the validation set is :mod:`nanogpt_pl.data.validation`.
"""

from __future__ import annotations

import collections
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence, Union

import numpy as np
import torch

from nanogpt_pl.data.shards import MAKE_DATA_HINT, ShardError, list_shards, open_shard, read_header
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

Files = Union[str, Sequence[Union[str, Path]]]


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
    out = np.full(packed_length(n, seq_len), seq_len, dtype=np.int32)
    out[:n] = boundaries
    return out


def packed_length(boundaries: int, seq_len: int) -> int:
    """The length :func:`pack_cu_seqlens` gives ``boundaries`` entries of a sequence of ``seq_len`` tokens."""
    length = max_num_docs(seq_len)
    if boundaries > length:
        length = -(-boundaries // CU_SEQLENS_MULTIPLE) * CU_SEQLENS_MULTIPLE
    return length


def slice_segments(lengths: np.ndarray, attention_split: Optional[int]) -> np.ndarray:
    """The attention segments of a slice whose pieces have ``lengths`` (summing to T + 1): the
    last piece loses its final token to the target shift, and pieces longer than
    ``attention_split`` are split (RECORD.md §1)."""
    seg = np.asarray(lengths, dtype=np.int64).copy()
    seg[-1] -= 1
    if seg[-1] == 0:
        seg = seg[:-1]
    return split_segments(seg, attention_split)


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



def slice_tokens(shard: "IndexedShard", starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The ``T + 1`` tokens of one slice: its pieces, concatenated.

    The pieces are sliced from a plain ndarray view of the shard: slicing the memory map itself
    costs ~1 µs more a piece (its ``__getitem__`` and ``__array_finalize__`` in Python), and a
    slice of short documents has hundreds of pieces (on the embedded corpus, about 375).
    """
    tokens = np.asarray(shard.tokens)
    return np.concatenate([tokens[s : s + n] for s, n in zip(starts.tolist(), lengths.tolist())])


def distinct_tokens(tokens: np.ndarray) -> int:
    """How many different token ids ``tokens`` holds: the value-embedding rows a micro-batch reads."""
    return int(np.count_nonzero(np.bincount(tokens.ravel())))


def to_tensor(arr: np.ndarray, pin: bool) -> torch.Tensor:
    """A contiguous tensor sharing ``arr``'s memory, or a pinned copy for asynchronous host-to-device copies."""
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
            raise ValueError(
                f"schedule.stages: max_doc_len must be positive, got {max_doc_len} at step {step}; set it in that stage"
            )
        c = cursor
        no_bos: list[Path] = []  # shards walked that hold no document at all
        while c.shard < len(self.shards) * self.epochs:
            shard = self.shards.get(c.shard % len(self.shards))
            cut = plan_slices(shard, c.bos, n_slices, seq_len, max_doc_len, self.long_documents, step)
            if cut is not None:
                starts, lengths, pos, dropped = cut
                return StepPlan(step, seq_len, shard, starts, lengths, c, Cursor(c.shard, pos), dropped)
            if shard.bos.size == 0:
                no_bos.append(shard.path)
            c = Cursor(c.shard + 1, 0)
        walked = min(c.shard - cursor.shard, len(self.shards))
        if no_bos and len(set(no_bos)) >= walked:  # every shard walked lacks documents: that is the cause
            others = len(set(no_bos)) - 1
            raise ShardError(
                f"{no_bos[0]}: no BOS token {BOS_ID} (<|endoftext|>)"
                + (f" (nor in {others} more shard(s) of {self.shards.option})" if others else "")
                + f", so there is no document to start step {step} at: it was not written by `nanogpt-pl data "
                f"prepare` (GPT-2 tokens, each document starting with {BOS_ID}); make the shards with "
                f"`nanogpt-pl data prepare`"
            )
        self._check_step_fits(step, n_slices, seq_len)
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


    def _check_step_fits(self, step: int, n_slices: int, seq_len: int) -> None:
        """Name the real cause when a step needs more tokens than any one shard holds."""
        need = n_slices * (seq_len + 1)
        total, largest = self.shards.total_tokens, max(self.shards.sizes)
        if need <= largest:
            return
        shape = (f"step {step} needs {need:,} tokens ({n_slices} sequence(s) of schedule seq_len {seq_len:,} + 1, "
                 f"batch_tokens {self.schedule.batch_tokens(step):,})")
        lower = "lower batch_tokens or seq_len in schedule.stages"
        if need > total:
            raise DataExhaustedError(
                f"{shape}, but the whole training set ({self.shards.option}, {len(self.shards)} shard(s)) has "
                f"{total:,} tokens: {lower}, or add data"
            )
        raise DataExhaustedError(
            f"{shape}, but a step is cut from one shard and the largest shard of {self.shards.option} has "
            f"{largest:,} tokens: {lower}, or prepare larger shards (`nanogpt-pl data prepare --shard-tokens`)"
        )
