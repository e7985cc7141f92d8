"""Input files as documents: text, JSON lines and parquet (read by ``nanogpt-pl data prepare``).

See :mod:`nanogpt_pl.data.prepare` for the formats and the rule that cuts ``.txt`` files
into documents.
"""

from __future__ import annotations

import glob
import gzip
import io
import json
import os
import re
from pathlib import Path
from typing import Iterable, Iterator, Optional, Sequence

# A .txt document is whole paragraphs of at least this many characters (~1,000 GPT-2 tokens),
# long enough for the attention windows to matter, short enough that a book gives hundreds.
DEFAULT_TXT_DOCUMENT_CHARS = 4_000
# one or more blank lines (whitespace-only lines count as blank)
BLANK_LINES = re.compile(r"\n(?:[^\S\n]*\n)+")
LINE_ENDS = re.compile(r"\n+")
SUFFIXES = (".txt", ".txt.gz", ".jsonl", ".jsonl.gz", ".parquet")


def suffix_of(path: Path) -> Optional[str]:
    """The supported suffix ``path`` ends with (longest first), or None."""
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
            found.extend(q for q in sorted(p.rglob("*")) if q.is_file() and suffix_of(q))
        elif p.is_file():
            if suffix_of(p) is None:
                raise ValueError(f"input {p}: unsupported file type; use one of {', '.join(SUFFIXES)}")
            found.append(p)
        else:
            matches = sorted(Path(m) for m in glob.glob(text, recursive=True))
            files = [m for m in matches if m.is_file() and suffix_of(m)]
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


def open_text(path: Path) -> io.TextIOBase:
    """A UTF-8 text reader for a plain or gzip-compressed file."""
    if path.name.lower().endswith(".gz"):
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8")
    return open(path, encoding="utf-8")


def split_text(text: str, min_chars: int) -> tuple[list[str], bool]:
    """Cut ``text`` into documents of whole paragraphs, each of at least ``min_chars`` characters.

    A document closes at the first blank line once it holds ``min_chars`` characters; the
    blank lines at a cut are dropped, those inside a document kept. Text without blank
    lines is cut at line ends instead. The last document holds the rest (it may be shorter).

    Returns:
        The documents, and whether the text was cut at line ends.
    """
    breaks = list(BLANK_LINES.finditer(text))
    at_lines = not breaks
    if at_lines:
        breaks = list(LINE_ENDS.finditer(text))
    docs, start = [], 0
    for m in breaks:
        if m.start() - start >= min_chars:
            docs.append(text[start : m.start()])
            start = m.end()
    if start == 0 or text[start:].strip():  # not the whitespace after the last cut
        docs.append(text[start:])
    return docs, at_lines


def iter_documents(paths: Iterable[Path], text_field: str = "text", txt_separator: Optional[str] = None,
                   txt_document_chars: int = DEFAULT_TXT_DOCUMENT_CHARS,
                   txt_cut_at_lines: Optional[list] = None) -> Iterator[str]:
    """The documents of the input files, in order (see the module docstring for the formats).

    ``txt_cut_at_lines``, when given, collects the ``.txt`` files that had no blank line and
    were cut at line ends.
    """
    for path in paths:
        kind = suffix_of(path)
        if kind in (".txt", ".txt.gz"):
            with open_text(path) as f:
                text = f.read()
            if txt_separator:
                yield from text.split(txt_separator)
            elif txt_document_chars > 0:
                docs, at_lines = split_text(text, txt_document_chars)
                if at_lines and txt_cut_at_lines is not None and len(docs) > 1:
                    txt_cut_at_lines.append(path)
                yield from docs
            else:
                yield text
        elif kind in (".jsonl", ".jsonl.gz"):
            with open_text(path) as f:
                for lineno, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        obj = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg}); fix or remove that line") from e
                    if not isinstance(obj, dict) or text_field not in obj:
                        keys = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
                        raise ValueError(
                            f"{path}:{lineno}: no {text_field!r} field (found {keys}); "
                            "choose the field with --text-field"
                        )
                    value = obj[text_field]
                    if not isinstance(value, str):
                        raise ValueError(
                            f"{path}:{lineno}: field {text_field!r} is {type(value).__name__}, not text; "
                            "choose the text field with --text-field"
                        )
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
