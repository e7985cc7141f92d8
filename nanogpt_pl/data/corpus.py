"""The embedded quickstart corpus: Python's own documentation, found on every machine.

Documents, in a fixed order:

1. every topic of the interactive help (``pydoc_data.topics.topics``, sorted by name);
2. the docstrings of the standard library's ``.py`` sources (sorted by path; test
   packages and third-party ``site-packages`` left out), read with :mod:`ast` without
   importing anything: each module, class and function docstring is one document,
   headed by its qualified name (and a function's signature).

The documents are tokenized like ``nanogpt-pl data prepare`` does (BOS-prefixed
GPT-2 tokens) and written once into ``~/.cache/nanogpt-pl/corpus/<key>/``; the key
holds the Python version and a hash of the text sources, so another Python gets its
own corpus and the same Python reuses it. A fixed number of documents spread evenly
over the corpus forms the validation shard.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import shutil
import sys
import sysconfig
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import numpy as np

from nanogpt_pl.data.prepare import ShardWriter, encode_batch
from nanogpt_pl.data.tokenizer import get_encoding

CORPUS_NAME = "quickstart"
# Bump when the document extraction or the split changes: it is part of the cache key.
CORPUS_FORMAT = 1
VAL_DOCUMENTS = 1024
SHARD_TOKENS = 100_000_000
SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})
MANIFEST = "manifest.json"


@dataclass
class CorpusInfo:
    """Where the corpus lives and how big it is."""

    directory: Path
    key: str
    train_paths: list[Path]
    val_paths: list[Path]
    train_tokens: int
    val_tokens: int
    train_documents: int
    val_documents: int

    @property
    def train_pattern(self) -> str:
        return str(self.directory / f"{CORPUS_NAME}_train_*.bin")

    @property
    def val_pattern(self) -> str:
        return str(self.directory / f"{CORPUS_NAME}_val_*.bin")

    def summary(self) -> str:
        return "\n".join(
            [
                f"quickstart corpus {self.key} in {self.directory}",
                f"  train: {self.train_tokens:,} tokens, {self.train_documents:,} documents: {self.train_pattern}",
                f"  val:   {self.val_tokens:,} tokens, {self.val_documents:,} documents: {self.val_pattern}",
            ]
        )


def cache_root() -> Path:
    """``$XDG_CACHE_HOME/nanogpt-pl/corpus`` (default ``~/.cache/nanogpt-pl/corpus``)."""
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return base / "nanogpt-pl" / "corpus"


def stdlib_sources(root: Optional[Path] = None) -> list[tuple[str, bytes]]:
    """(path relative to the stdlib, bytes) of the standard library's ``.py`` files, sorted."""
    root = Path(root if root is not None else sysconfig.get_paths()["stdlib"])
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.startswith("."))
        for name in sorted(filenames):
            if name.endswith(".py"):
                path = Path(dirpath) / name
                out.append((path.relative_to(root).as_posix(), path.read_bytes()))
    out.sort(key=lambda item: item[0])
    return out


def help_topics() -> list[tuple[str, str]]:
    """(name, text) of the interactive help's topics, sorted by name."""
    from pydoc_data.topics import topics  # read only when building the corpus

    return sorted(topics.items())


def _module_name(rel: str) -> str:
    parts = rel[: -len(".py")].split("/")
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _docstrings(module: str, tree: ast.Module) -> Iterator[str]:
    doc = ast.get_docstring(tree)
    if doc:
        yield f"{module}\n\n{doc}"

    def visit(body: list, prefix: str) -> Iterator[str]:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                qual = f"{prefix}.{node.name}"
                doc = ast.get_docstring(node)
                if doc:
                    if isinstance(node, ast.ClassDef):
                        head = f"class {qual}:"
                    else:
                        head = f"def {qual}({ast.unparse(node.args)}):"
                    yield f"{head}\n\n{doc}"
                yield from visit(node.body, qual)

    yield from visit(tree.body, module)


def corpus_documents(sources: Optional[list[tuple[str, bytes]]] = None) -> list[str]:
    """All documents of the corpus, in order."""
    docs = [text.strip() for _, text in help_topics() if text.strip()]
    for rel, src in sources if sources is not None else stdlib_sources():
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # invalid escapes etc. in old sources
                tree = ast.parse(src, filename=rel)
        except (SyntaxError, ValueError):
            continue
        docs.extend(_docstrings(_module_name(rel), tree))
    return docs


def corpus_key(sources: list[tuple[str, bytes]]) -> str:
    """``py<major>.<minor>-<hash>`` of the format version, the help topics and the sources."""
    h = hashlib.sha256()
    h.update(f"format {CORPUS_FORMAT} val {VAL_DOCUMENTS}\n".encode())
    for name, text in help_topics():
        h.update(name.encode() + b"\0" + text.encode() + b"\0")
    for rel, src in sources:
        h.update(rel.encode() + b"\0" + hashlib.sha256(src).digest())
    return f"py{sys.version_info.major}.{sys.version_info.minor}-{h.hexdigest()[:16]}"


def val_indices(n_docs: int, n_val: int = VAL_DOCUMENTS) -> set[int]:
    """``n_val`` document indices spread evenly over ``n_docs``."""
    n_val = min(n_val, n_docs // 2)
    return {(j * n_docs) // n_val for j in range(n_val)}


def _load(directory: Path) -> Optional[CorpusInfo]:
    manifest = directory / MANIFEST
    if not manifest.is_file():
        return None
    m = json.loads(manifest.read_text())
    info = CorpusInfo(
        directory=directory,
        key=m["key"],
        train_paths=[directory / n for n in m["train"]],
        val_paths=[directory / n for n in m["val"]],
        train_tokens=m["train_tokens"],
        val_tokens=m["val_tokens"],
        train_documents=m["train_documents"],
        val_documents=m["val_documents"],
    )
    if not all(p.is_file() for p in info.train_paths + info.val_paths):
        return None
    return info


def write_corpus(directory: Path, docs: list[str], key: str) -> CorpusInfo:
    """Tokenize ``docs`` and write the shards and manifest into ``directory``."""
    enc = get_encoding()
    tokens, lengths = encode_batch(docs, enc)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    val_set = val_indices(len(docs))
    val = ShardWriter(directory, CORPUS_NAME, "val", 0, SHARD_TOKENS)
    train = ShardWriter(directory, CORPUS_NAME, "train", 1, SHARD_TOKENS)
    for i in range(len(docs)):
        (val if i in val_set else train).add(tokens[offsets[i] : offsets[i + 1]])
    val.flush()
    train.flush()
    info = CorpusInfo(
        directory=directory,
        key=key,
        train_paths=train.paths,
        val_paths=val.paths,
        train_tokens=train.tokens,
        val_tokens=val.tokens,
        train_documents=len(docs) - len(val_set),
        val_documents=len(val_set),
    )
    manifest = {
        "key": key,
        "format": CORPUS_FORMAT,
        "train": [p.name for p in info.train_paths],
        "val": [p.name for p in info.val_paths],
        "train_tokens": info.train_tokens,
        "val_tokens": info.val_tokens,
        "train_documents": info.train_documents,
        "val_documents": info.val_documents,
    }
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return info


def build_corpus(
    root: Optional[os.PathLike] = None,
    force: bool = False,
    progress: bool = False,
    sources: Optional[list[tuple[str, bytes]]] = None,
) -> CorpusInfo:
    """The quickstart corpus: built on first use (atomically), then reused from the cache.

    Args:
        root: the cache directory holding one folder per corpus key (default :func:`cache_root`).
        force: rebuild even when a complete copy exists.
        progress: print a line while building.
        sources: (relative path, bytes) of the ``.py`` files to read docstrings from; default
            the whole standard library (:func:`stdlib_sources`). The key covers them.
    """
    root = Path(root) if root is not None else cache_root()
    sources = stdlib_sources() if sources is None else sources
    key = corpus_key(sources)
    target = root / key
    if not force:
        info = _load(target)
        if info is not None:
            return info
    if progress:
        version = sys.version.split()[0]
        print(f"building the quickstart corpus from Python {version}'s documentation...", file=sys.stderr)
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=root))
    try:
        write_corpus(tmp, corpus_documents(sources), key)
        if target.exists():
            # a stale or incomplete copy (or a forced rebuild): move it aside, then swap in
            stale = Path(tempfile.mkdtemp(prefix=f".{key}.old.", dir=root))
            try:
                os.replace(target, stale / key)
            except FileNotFoundError:
                pass
            shutil.rmtree(stale, ignore_errors=True)
        try:
            os.rename(tmp, target)
        except OSError:
            # another process finished first; its copy is identical
            if _load(target) is None:
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    info = _load(target)
    assert info is not None
    return info
