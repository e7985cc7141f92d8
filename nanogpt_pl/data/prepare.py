"""Tokenize text files into training and validation shards (``nanogpt-pl data prepare``).

Inputs (files, directories searched recursively, or globs), read in sorted order:

- ``.txt`` (or ``.txt.gz``): the whole file is one document, unless ``txt_separator``
  is given, in which case the file is split on that string (e.g. ``"\\n\\n\\n"``).
- ``.jsonl`` (or ``.jsonl.gz``): one JSON object per line; the document is its
  ``text_field`` (default ``text``).
- ``.parquet`` (needs pyarrow): the ``text_field`` column, one document per row.

Each document is encoded with GPT-2's tokenizer (tiktoken ``r50k_base``, special
tokens treated as plain text) and prefixed by ``<|endoftext|>`` (50256), the BOS the
training loader aligns to; empty documents are skipped. Documents are assigned to
validation or training, then packed back to back into shards of ``shard_tokens``
tokens (a document may continue in the next shard, as in the FineWeb cache), named
like FineWeb's: ``<name>_val_000000.bin``, ``<name>_train_000001.bin``, ...
"""

from __future__ import annotations

import glob
import gzip
import io
import json
import multiprocessing
import os
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Iterable, Iterator, Optional, Sequence

import numpy as np

from nanogpt_pl.data.shards import write_shard
from nanogpt_pl.data.tokenizer import EOT_TOKEN, get_encoding

# RECORD.md §1: FineWeb shards hold 100,000,000 tokens each.
DEFAULT_SHARD_TOKENS = 100_000_000
# RECORD.md §1: the FineWeb cache keeps 100M of its ~10B tokens (1%) for validation.
DEFAULT_VAL_FRACTION = 0.01
SUFFIXES = (".txt", ".txt.gz", ".jsonl", ".jsonl.gz", ".parquet")
# documents handed to a worker at a time, and the text size that closes a batch early
BATCH_DOCUMENTS = 512
BATCH_CHARS = 4_000_000
DEFAULT_WORKERS = max(1, (os.cpu_count() or 2) - 1)


@dataclass
class PrepareResult:
    """What :func:`prepare` wrote."""

    val_paths: list[Path] = field(default_factory=list)
    train_paths: list[Path] = field(default_factory=list)
    val_documents: int = 0
    train_documents: int = 0
    val_tokens: int = 0
    train_tokens: int = 0
    skipped_empty: int = 0

    def summary(self) -> str:
        lines = [
            f"validation: {self.val_documents:,} documents, {self.val_tokens:,} tokens "
            f"in {len(self.val_paths)} shard(s)",
            f"training:   {self.train_documents:,} documents, {self.train_tokens:,} tokens "
            f"in {len(self.train_paths)} shard(s)",
        ]
        if self.skipped_empty:
            lines.append(f"skipped {self.skipped_empty:,} empty documents")
        for p in self.val_paths + self.train_paths:
            lines.append(f"  {p}")
        return "\n".join(lines)


def _suffix(path: Path) -> Optional[str]:
    name = path.name.lower()
    return next((s for s in sorted(SUFFIXES, key=len, reverse=True) if name.endswith(s)), None)


def find_inputs(inputs: Sequence[str]) -> list[Path]:
    """Expand files, directories (recursive) and globs into the sorted list of input files."""
    if isinstance(inputs, (str, os.PathLike)):
        inputs = [str(inputs)]
    found: list[Path] = []
    for item in inputs:
        text = os.path.expanduser(str(item))
        p = Path(text)
        if p.is_dir():
            found.extend(q for q in sorted(p.rglob("*")) if q.is_file() and _suffix(q))
        elif p.is_file():
            if _suffix(p) is None:
                raise ValueError(f"input {p}: unsupported file type; use one of {', '.join(SUFFIXES)}")
            found.append(p)
        else:
            matches = sorted(Path(m) for m in glob.glob(text, recursive=True))
            files = [m for m in matches if m.is_file() and _suffix(m)]
            if not files:
                raise FileNotFoundError(
                    f"input {item!r} matches no {'/'.join(SUFFIXES)} file; give text files, directories or globs"
                )
            found.extend(files)
    seen, unique = set(), []
    for p in found:
        if p.resolve() not in seen:
            seen.add(p.resolve())
            unique.append(p)
    return unique


def _open_text(path: Path) -> io.TextIOBase:
    if path.name.lower().endswith(".gz"):
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8")
    return open(path, encoding="utf-8")


def iter_documents(paths: Iterable[Path], text_field: str = "text",
                   txt_separator: Optional[str] = None) -> Iterator[str]:
    """The documents of the input files, in order (see the module docstring for the formats)."""
    for path in paths:
        kind = _suffix(path)
        if kind in (".txt", ".txt.gz"):
            with _open_text(path) as f:
                text = f.read()
            if txt_separator:
                yield from text.split(txt_separator)
            else:
                yield text
        elif kind in (".jsonl", ".jsonl.gz"):
            with _open_text(path) as f:
                for lineno, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        obj = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg})") from e
                    if not isinstance(obj, dict) or text_field not in obj:
                        keys = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
                        raise ValueError(
                            f"{path}:{lineno}: no {text_field!r} field (found {keys}); "
                            "choose the field with --text-field"
                        )
                    value = obj[text_field]
                    if not isinstance(value, str):
                        raise ValueError(f"{path}:{lineno}: field {text_field!r} is {type(value).__name__}, not text")
                    yield value
        elif kind == ".parquet":
            try:
                import pyarrow.parquet as pq  # pyarrow is optional (parquet input only)
            except ImportError as e:
                raise ImportError(f"reading {path} needs pyarrow: pip install pyarrow") from e
            pf = pq.ParquetFile(path)
            names = pf.schema_arrow.names
            if text_field not in names:
                raise ValueError(f"{path}: no column {text_field!r} (columns: {names}); choose it with --text-field")
            for batch in pf.iter_batches(batch_size=1024, columns=[text_field]):
                for value in batch.column(0).to_pylist():
                    yield "" if value is None else value
        else:
            raise ValueError(f"input {path}: unsupported file type; use one of {', '.join(SUFFIXES)}")


# ---------------------------------------------------------------------------------------
# tokenization


_worker_encoding = None


def _init_worker() -> None:
    global _worker_encoding
    _worker_encoding = get_encoding()


def encode_batch(texts: list[str], encoding=None) -> tuple[np.ndarray, np.ndarray]:
    """Encode documents, each prefixed by BOS: (all tokens as uint16, per-document lengths)."""
    enc = encoding if encoding is not None else _worker_encoding
    if enc is None:
        _init_worker()
        enc = _worker_encoding
    # tiktoken's batch call encodes on threads that release the GIL
    parts = [np.asarray([EOT_TOKEN] + ids, dtype=np.uint16) for ids in enc.encode_ordinary_batch(list(texts))]
    lengths = np.asarray([p.size for p in parts], dtype=np.int64)
    tokens = np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint16)
    return tokens, lengths


def _batches(docs: Iterable[str], counter: dict) -> Iterator[list[str]]:
    batch, chars = [], 0
    for text in docs:
        if not text.strip():
            counter["empty"] += 1
            continue
        batch.append(text)
        chars += len(text)
        if len(batch) >= BATCH_DOCUMENTS or chars >= BATCH_CHARS:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def tokenize_documents(docs: Iterable[str], workers: int = 1,
                       counter: Optional[dict] = None) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Encoded batches of documents, in input order; ``workers > 1`` uses that many processes."""
    counter = counter if counter is not None else {"empty": 0}
    batches = _batches(docs, counter)
    if workers <= 1:
        enc = get_encoding()
        for batch in batches:
            yield encode_batch(batch, enc)
        return
    # spawn: forking a parent that already runs tiktoken's or torch's threads is unsafe
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(workers, initializer=_init_worker) as pool:
        yield from pool.imap(encode_batch, batches, chunksize=1)


# ---------------------------------------------------------------------------------------
# shard writing


class ShardWriter:
    """Packs token runs into consecutive shards ``<name>_<split>_<index>.bin``."""

    def __init__(self, out_dir: Path, name: str, split: str, first_index: int, shard_tokens: int):
        self.out_dir, self.name, self.split = Path(out_dir), name, split
        self.index = first_index
        self.shard_tokens = shard_tokens
        self.buf: Optional[np.ndarray] = None
        self.fill = 0
        self.paths: list[Path] = []
        self.tokens = 0

    def add(self, tokens: np.ndarray) -> None:
        if self.buf is None:
            self.buf = np.empty(self.shard_tokens, dtype=np.uint16)
        while tokens.size:
            take = min(self.shard_tokens - self.fill, tokens.size)
            self.buf[self.fill : self.fill + take] = tokens[:take]
            self.fill += take
            tokens = tokens[take:]
            if self.fill == self.shard_tokens:
                self.flush()

    def flush(self) -> None:
        if self.fill == 0 or self.buf is None:
            return
        path = self.out_dir / f"{self.name}_{self.split}_{self.index:06d}.bin"
        write_shard(path, self.buf[: self.fill])
        self.paths.append(path)
        self.tokens += self.fill
        self.index += 1
        self.fill = 0


def _is_val(i: int, val_documents: Optional[int], fraction: Optional[Fraction]) -> bool:
    if val_documents is not None:
        return i < val_documents
    if fraction is None or fraction == 0:
        return False
    # an even, streaming spread: document i is validation when (i+1)·f crosses an integer
    return (fraction * (i + 1)).__floor__() > (fraction * i).__floor__()


def prepare(
    inputs: Sequence[str],
    output_dir: str,
    name: str = "data",
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    val_documents: Optional[int] = None,
    val_fraction: Optional[float] = None,
    text_field: str = "text",
    txt_separator: Optional[str] = None,
    workers: int = DEFAULT_WORKERS,
    overwrite: bool = False,
    progress: bool = True,
) -> PrepareResult:
    """Tokenize ``inputs`` into validation and training shards in ``output_dir``.

    Args:
        inputs: text/jsonl/parquet files, directories (searched recursively) or globs.
        output_dir: where the shards go (created if needed).
        name: shard name prefix: ``<name>_val_000000.bin``, ``<name>_train_000001.bin``, ...
        shard_tokens: tokens per shard (the last shard of each split holds the rest).
        val_documents: the first N documents form the validation split.
        val_fraction: instead, this fraction of the documents, spread evenly (document i is
            validation when ``floor((i+1)·f) > floor(i·f)``). Default when neither is given: 0.01.
        text_field: the JSON field / parquet column holding the text.
        txt_separator: split ``.txt`` files into documents on this string (default: one
            document per file).
        workers: tokenizer processes (1 tokenizes in this process).
        overwrite: replace existing ``<name>_train_*``/``<name>_val_*`` shards in ``output_dir``.
        progress: show a progress bar.

    Returns:
        The shards written and their document and token counts.
    """
    if shard_tokens <= 0:
        raise ValueError(f"--shard-tokens must be positive, got {shard_tokens}")
    if val_documents is not None and val_fraction is not None:
        raise ValueError("give either --val-documents or --val-fraction, not both")
    if val_documents is not None and val_documents < 0:
        raise ValueError(f"--val-documents must be >= 0, got {val_documents}")
    if val_documents is None and val_fraction is None:
        val_fraction = DEFAULT_VAL_FRACTION
    if val_fraction is not None and not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"--val-fraction must lie in [0, 1), got {val_fraction}")
    fraction = Fraction(str(val_fraction)) if val_fraction is not None else None

    paths = find_inputs(inputs)
    if not paths:
        raise FileNotFoundError(f"no input files in {list(inputs)}; give {'/'.join(SUFFIXES)} files")
    out = Path(output_dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    existing = sorted(out.glob(f"{name}_train_*.bin")) + sorted(out.glob(f"{name}_val_*.bin"))
    if existing:
        if not overwrite:
            raise FileExistsError(
                f"{out} already holds {len(existing)} shard(s) named {name}_train_*/{name}_val_* "
                f"(e.g. {existing[0].name}); pass --overwrite to replace them or choose another --name"
            )
        for p in existing:
            p.unlink()

    from tqdm.auto import tqdm  # tqdm only while preparing

    val = ShardWriter(out, name, "val", 0, shard_tokens)
    train = ShardWriter(out, name, "train", 1, shard_tokens)
    result = PrepareResult()
    counter = {"empty": 0}
    doc_index = total_tokens = 0
    bar = tqdm(desc=f"tokenizing into {out}", unit="doc", disable=not progress, dynamic_ncols=True)
    try:
        for tokens, lengths in tokenize_documents(iter_documents(paths, text_field, txt_separator), workers, counter):
            offsets = np.concatenate([[0], np.cumsum(lengths)])
            for j in range(lengths.size):
                piece = tokens[offsets[j] : offsets[j + 1]]
                if _is_val(doc_index, val_documents, fraction):
                    val.add(piece)
                    result.val_documents += 1
                else:
                    train.add(piece)
                    result.train_documents += 1
                doc_index += 1
            total_tokens += int(offsets[-1])
            bar.update(int(lengths.size))
            bar.set_postfix(tokens=f"{total_tokens:,}", refresh=False)
        val.flush()
        train.flush()
    except BaseException:
        for p in val.paths + train.paths:  # leave no partial set of shards behind
            p.unlink(missing_ok=True)
        raise
    finally:
        bar.close()
    result.val_paths, result.train_paths = val.paths, train.paths
    result.val_tokens, result.train_tokens = val.tokens, train.tokens
    result.skipped_empty = counter["empty"]
    if result.train_documents == 0:
        raise ValueError(
            f"no training documents: {result.val_documents} document(s) all went to validation; "
            f"lower --val-documents/--val-fraction or add text"
        )
    if (val_documents or fraction) and result.val_documents == 0:
        raise ValueError(
            f"the validation split is empty: {doc_index} document(s) at --val-fraction {val_fraction}; "
            f"use --val-documents N"
        )
    return result
