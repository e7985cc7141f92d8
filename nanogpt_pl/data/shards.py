"""The speedrun's ``.bin`` token shard format.

A shard is a 1024-byte header of 256 little-endian int32 (``[0]`` = magic 20240520,
``[1]`` = version 1, ``[2]`` = token count N, the rest zero) followed by N uint16
token ids (RECORD.md §1). The FineWeb cache on the Hugging Face hub and the files
``nanogpt-pl data prepare`` writes share it.
"""

from __future__ import annotations

import glob
import os
import tempfile
import threading
from pathlib import Path
from typing import Optional, Sequence, Union

import numpy as np

# RECORD.md §1: header of 256 int32, magic 20240520, version 1, token count at index 2.
SHARD_MAGIC = 20240520
SHARD_VERSION = 1
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
TOKEN_DTYPE = np.dtype("<u2")
MAX_TOKEN_ID = int(np.iinfo(np.uint16).max)
SHARD_FILE_MODE = 0o644

MAKE_DATA_HINT = (
    "make data with `nanogpt-pl data fineweb` (the FineWeb cache), `nanogpt-pl data prepare` "
    "(your own text), or set data.corpus=quickstart (the embedded corpus)"
)

PathLike = Union[str, os.PathLike]


class ShardError(ValueError):
    """A token shard is missing, malformed, or does not fit the run (user-fixable)."""


def write_shard(path: PathLike, tokens: np.ndarray | Sequence[int]) -> Path:
    """Write ``tokens`` as a shard, atomically (a temporary file in the same folder renamed into place), mode 0644.

    Args:
        path: destination file; its directory is created if needed.
        tokens: 1-D token ids, each in ``[0, 65535]``.

    Returns:
        The path written.

    Raises:
        ShardError: an id does not fit uint16, or ``tokens`` is not 1-D.
    """
    path = Path(path)
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ShardError(f"{path}: tokens must be 1-D, got shape {arr.shape}")
    if arr.size and arr.dtype != TOKEN_DTYPE:
        if not np.issubdtype(arr.dtype, np.integer):
            raise ShardError(f"{path}: tokens must be integers, got dtype {arr.dtype}")
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi > MAX_TOKEN_ID:
            raise ShardError(
                f"{path}: token ids must lie in [0, {MAX_TOKEN_ID}] (uint16 shards), got [{lo}, {hi}]; "
                f"a vocabulary of more than 65,536 ids does not fit this format"
            )
    arr = arr.astype(TOKEN_DTYPE, copy=False)
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[0], header[1], header[2] = SHARD_MAGIC, SHARD_VERSION, arr.size
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(header.tobytes())
            f.write(arr.tobytes())
            f.flush()
            os.fsync(f.fileno())
        # mkstemp creates 0600; shards are data others on the machine read (a shared cache)
        os.chmod(tmp, SHARD_FILE_MODE)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def read_header(path: PathLike) -> int:
    """Validate a shard's header and size; return its token count.

    Raises:
        ShardError: the file is missing, is not a shard (magic), has another version, or its
            size does not match the header (truncated or padded).
    """
    path = Path(path)
    if not path.is_file():
        raise ShardError(f"shard {path} does not exist; {MAKE_DATA_HINT}")
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(HEADER_BYTES)
    if len(raw) < HEADER_BYTES:
        raise ShardError(
            f"{path}: {size} bytes is shorter than the {HEADER_BYTES}-byte shard header; the file is "
            f"truncated or not a token shard. Delete it and download or prepare it again."
        )
    header = np.frombuffer(raw, dtype="<i4")
    if int(header[0]) != SHARD_MAGIC:
        raise ShardError(
            f"{path}: magic number {int(header[0])} is not {SHARD_MAGIC}; this is not a token shard "
            f"(.bin files from `nanogpt-pl data prepare` or the kjj0/fineweb10B-gpt2 cache are)"
        )
    if int(header[1]) != SHARD_VERSION:
        raise ShardError(
            f"{path}: shard version {int(header[1])} is not supported (expected {SHARD_VERSION}); "
            f"re-create it with `nanogpt-pl data prepare`"
        )
    n = int(header[2])
    expected = HEADER_BYTES + 2 * n
    if n < 0 or size != expected:
        raise ShardError(
            f"{path}: the header promises {n} tokens ({expected} bytes) but the file has {size} bytes; "
            f"it is truncated or corrupt. Delete it and download or prepare it again."
        )
    return n


def open_shard(path: PathLike, vocab_size: Optional[int] = None) -> np.ndarray:
    """Memory-map a shard's tokens (uint16, read-only) after validating its header.

    Args:
        path: the shard.
        vocab_size: when given, every id must be below it (checked once per file version and
            cached, so reopening costs nothing).

    Raises:
        ShardError: see :func:`read_header`; or an id ``>= vocab_size``.
    """
    path = Path(path)
    n = read_header(path)
    if n == 0:
        tokens: np.ndarray = np.zeros(0, dtype=TOKEN_DTYPE)
    else:
        tokens = np.memmap(path, dtype=TOKEN_DTYPE, mode="r", offset=HEADER_BYTES, shape=(n,))
    if vocab_size is not None:
        check_vocab(path, tokens, vocab_size)
    return tokens


_max_cache: dict[tuple[str, int, int], int] = {}
_max_lock = threading.Lock()


def max_token(path: PathLike, tokens: Optional[np.ndarray] = None) -> int:
    """The largest id in a shard (-1 when empty), cached per (file, size, mtime)."""
    path = Path(path)
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    with _max_lock:
        if key in _max_cache:
            return _max_cache[key]
    if tokens is None:
        tokens = open_shard(path)
    value = int(tokens.max()) if tokens.size else -1
    with _max_lock:
        _max_cache[key] = value
    return value


def check_vocab(path: PathLike, tokens: np.ndarray, vocab_size: int, limit: Optional[int] = None) -> None:
    """Raise :class:`ShardError` if an id in ``tokens`` (its first ``limit``) is ``>= vocab_size``."""
    if vocab_size > MAX_TOKEN_ID:
        return  # every uint16 fits
    if limit is None:
        top = max_token(path, tokens)
        view = tokens
    else:
        view = tokens[:limit]
        top = int(view.max()) if view.size else -1
    if top >= vocab_size:
        first = int(np.argmax(np.asarray(view) >= vocab_size))
        raise ShardError(
            f"{path}: token id {top} is >= the vocabulary size {vocab_size} (first bad id at token "
            f"{first}); the shard was tokenized with another tokenizer, or data.vocab_size / the model's "
            f"vocab_size is too small"
        )


def list_shards(pattern: PathLike, option: str = "pattern") -> list[Path]:
    """Sorted files matching a glob (``~`` expanded), each validated by its header.

    Args:
        pattern: a glob such as ``data/fineweb10B/fineweb_train_*.bin``, or one file.
        option: the config option the pattern came from, named in errors.

    Raises:
        ShardError: nothing matches, or a matching file is not a valid shard.
    """
    text = os.path.expanduser(str(pattern))
    paths = sorted(Path(p) for p in glob.glob(text) if Path(p).is_file())
    if not paths:
        raise ShardError(f"{option}={str(pattern)!r} matches no files; {MAKE_DATA_HINT}")
    for p in paths:
        read_header(p)
    return paths
