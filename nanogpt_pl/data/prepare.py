"""Tokenize text files into training and validation shards (``nanogpt-pl data prepare``).

Inputs (files, directories searched recursively, or globs), read in sorted order:

- ``.txt`` (or ``.txt.gz``): cut into documents at blank lines (paragraph breaks): a
  document closes at the first blank line once it holds ``txt_document_chars``
  characters (default 4,000, about 1,000 tokens), so a document is whole paragraphs; the
  blank lines at a cut are dropped. A file without blank lines is cut at line ends
  instead; a file shorter than that is one document. ``txt_document_chars=0`` keeps each
  file whole; ``txt_separator`` splits on that string instead (e.g. ``"\\n\\n\\n"``).
- ``.jsonl`` (or ``.jsonl.gz``): one JSON object per line; the document is its
  ``text_field`` (default ``text``).
- ``.parquet`` (needs pyarrow): the ``text_field`` column, one document per row.

Each document is encoded with GPT-2's tokenizer (tiktoken ``r50k_base``, special
tokens treated as plain text) and prefixed by ``<|endoftext|>`` (50256), the BOS the
training loader aligns to; empty documents are skipped. Documents are assigned to
validation or training (by default document 0 and every 100th after it are
validation), then packed back to back into shards of ``shard_tokens`` tokens (a
document may continue in the next shard, as in the FineWeb cache), named like
FineWeb's: ``<name>_val_000000.bin``, ``<name>_train_000001.bin``, ...

The shards are written into a hidden folder inside the output directory and moved into
place only when all of them are written and both splits hold documents, so a failed or
interrupted run leaves no shard behind.
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Iterable, Iterator, Optional, Sequence

import numpy as np

from nanogpt_pl.data.documents import (
    DEFAULT_TXT_DOCUMENT_CHARS,
    SUFFIXES,
    find_inputs,
    iter_documents,
    open_text,
    split_text,
    suffix_of,
)
from nanogpt_pl.data.shards import write_shard
from nanogpt_pl.data.tokenizer import EOT_TOKEN, get_encoding

# RECORD.md §1: FineWeb shards hold 100,000,000 tokens each.
DEFAULT_SHARD_TOKENS = 100_000_000
# RECORD.md §1: the FineWeb cache keeps 100M of its ~10B tokens (1%) for validation.
DEFAULT_VAL_FRACTION = 0.01
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
    document_rule: str = ""

    def summary(self) -> str:
        lines = [self.document_rule] if self.document_rule else []
        lines += [
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


def _is_val(i: int, val_documents: Optional[int], fraction: Optional[Fraction], from_first: bool = False) -> bool:
    if val_documents is not None:
        return i < val_documents
    if fraction is None or fraction == 0:
        return False
    # an even, streaming spread: document i is validation when (i+1)·f crosses an integer
    if from_first:  # ... counted from document 0 (ceil), so any input has a validation document
        return (fraction * (i + 1)).__ceil__() > (fraction * i).__ceil__()
    return (fraction * (i + 1)).__floor__() > (fraction * i).__floor__()


def _txt_rule(paths: Sequence[Path], txt_separator: Optional[str], txt_document_chars: int,
              cut_at_lines: Sequence[Path]) -> str:
    """The summary line saying how .txt inputs became documents (empty without .txt inputs)."""
    if not any(suffix_of(p) in (".txt", ".txt.gz") for p in paths):
        return ""
    if txt_separator:
        return f".txt files: split into documents on --txt-separator {txt_separator!r}"
    if txt_document_chars <= 0:
        return ".txt files: one document per file (--txt-document-chars 0)"
    rule = (f".txt files: cut at blank lines into documents of at least {txt_document_chars:,} characters "
            f"(--txt-document-chars)")
    if cut_at_lines:
        rule += f"; {len(cut_at_lines)} file(s) without blank lines cut at line ends (e.g. {cut_at_lines[0]})"
    return rule


def prepare(
    inputs: Sequence[str],
    output_dir: str,
    name: str = "data",
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    val_documents: Optional[int] = None,
    val_fraction: Optional[float] = None,
    text_field: str = "text",
    txt_separator: Optional[str] = None,
    txt_document_chars: int = DEFAULT_TXT_DOCUMENT_CHARS,
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
            validation when ``floor((i+1)·f) > floor(i·f)``). Default when neither is given:
            document 0 and every 100th after it (1%, and never an empty validation split).
        text_field: the JSON field / parquet column holding the text.
        txt_separator: split ``.txt`` files into documents on this string.
        txt_document_chars: without ``txt_separator``, cut ``.txt`` files at blank lines into
            documents of at least this many characters (see :func:`split_text`); 0 keeps each
            file one document.
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
    if txt_document_chars < 0:
        raise ValueError(f"--txt-document-chars must be >= 0 (0 keeps each .txt file whole), got {txt_document_chars}")
    from_first = val_documents is None and val_fraction is None
    if from_first:
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
    if existing and not overwrite:
        raise FileExistsError(
            f"{out} already holds {len(existing)} shard(s) named {name}_train_*/{name}_val_* "
            f"(e.g. {existing[0].name}); pass --overwrite to replace them or choose another --name"
        )

    from tqdm.auto import tqdm  # tqdm only while preparing

    # shards go to a hidden folder first and move into place only once the whole set is good
    staging = Path(tempfile.mkdtemp(prefix=f".{name}-prepare-", dir=out))
    val = ShardWriter(staging, name, "val", 0, shard_tokens)
    train = ShardWriter(staging, name, "train", 1, shard_tokens)
    result = PrepareResult()
    counter = {"empty": 0}
    cut_at_lines: list[Path] = []
    doc_index = total_tokens = 0
    bar = tqdm(desc=f"tokenizing into {out}", unit="doc", disable=not progress, dynamic_ncols=True)
    try:
        docs = iter_documents(paths, text_field, txt_separator, txt_document_chars, cut_at_lines)
        for tokens, lengths in tokenize_documents(docs, workers, counter):
            offsets = np.concatenate([[0], np.cumsum(lengths)])
            for j in range(lengths.size):
                piece = tokens[offsets[j] : offsets[j + 1]]
                if _is_val(doc_index, val_documents, fraction, from_first):
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
        bar.close()
        rule = _txt_rule(paths, txt_separator, txt_document_chars, cut_at_lines)
        _check_splits(result, doc_index, paths, val_documents, val_fraction, txt_separator, txt_document_chars)
        for p in existing:
            p.unlink()
        for p in val.paths + train.paths:
            os.replace(p, out / p.name)
        result.val_paths = [out / p.name for p in val.paths]
        result.train_paths = [out / p.name for p in train.paths]
    finally:
        bar.close()
        shutil.rmtree(staging, ignore_errors=True)
    result.val_tokens, result.train_tokens = val.tokens, train.tokens
    result.skipped_empty = counter["empty"]
    result.document_rule = rule
    return result


def _check_splits(result: PrepareResult, n_docs: int, paths: Sequence[Path], val_documents: Optional[int],
                  val_fraction: Optional[float], txt_separator: Optional[str], txt_document_chars: int) -> None:
    """Raise a one-line error naming the option to change when a split came out empty."""
    inputs = f"{paths[0]}" + (f" and {len(paths) - 1} more file(s)" if len(paths) > 1 else "")
    if n_docs == 0:
        raise ValueError(f"{inputs}: no documents (every one was empty); give files that hold text")
    if result.train_documents == 0:
        if val_documents is not None and n_docs > 1:
            fix = f"lower --val-documents below {n_docs}"
        elif any(suffix_of(p) in (".txt", ".txt.gz") for p in paths) and not txt_separator:
            smaller = _fewer_chars_per_document(paths, txt_document_chars)
            fix = (f"cut the text into more documents with --txt-document-chars {smaller} (now {txt_document_chars})"
                   if smaller else "the text has no blank line or line end to cut at; add text")
        else:
            fix = "add documents"
        raise ValueError(
            f"no training documents: {inputs} gave {n_docs} document(s) and all went to validation; {fix}"
        )
    if val_fraction and result.val_documents == 0:
        raise ValueError(
            f"the validation split is empty: {n_docs} document(s) at --val-fraction {val_fraction}; "
            f"use --val-documents N (N < {n_docs}) or a --val-fraction of at least {1 / n_docs:.3g}"
        )


def _fewer_chars_per_document(paths: Sequence[Path], txt_document_chars: int) -> Optional[int]:
    """The largest halving of ``txt_document_chars`` that cuts the .txt inputs into two or more documents.

    Only called when all the inputs gave one document, so re-reading them is cheap.
    """
    texts = []
    for p in paths:
        if suffix_of(p) in (".txt", ".txt.gz"):
            with open_text(p) as f:
                texts.append(f.read())
    chars = txt_document_chars if txt_document_chars > 0 else 2 * DEFAULT_TXT_DOCUMENT_CHARS
    while chars > 1:
        chars //= 2
        if sum(1 for t in texts for d in split_text(t, chars)[0] if d.strip()) >= 2:
            return chars
    return None
