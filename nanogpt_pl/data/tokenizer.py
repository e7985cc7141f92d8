"""GPT-2's tokenizer (tiktoken ``r50k_base``) with an offline cache, and the prefix table.

tiktoken downloads the BPE ranks file from ``openaipublic.blob.core.windows.net``
the first time it is used and stores it in ``TIKTOKEN_CACHE_DIR`` under the SHA-1
of that URL. Machines without that host (clusters, CI) can seed the cache from the
identical file that ships inside the ``openai-whisper`` source distribution on
PyPI (``whisper/assets/gpt2.tiktoken``): ``nanogpt-pl data tokenizer`` does that.

:func:`build_prefix_table` maps every token to the token of its longest proper byte-prefix,
the target of the prefix-token loss (RECORD §2).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import numpy as np
import torch

ENCODING_NAME = "r50k_base"
RANKS_URL = "https://openaipublic.blob.core.windows.net/encodings/r50k_base.tiktoken"
# sha256 of the r50k_base ranks file; tiktoken checks the same value.
RANKS_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"
# The PyPI sdist that carries an identical copy of the file.
WHISPER_SDIST = "openai-whisper==20250625"
WHISPER_MEMBER = "whisper/assets/gpt2.tiktoken"

EOT_TOKEN = 50256  # <|endoftext|>, the document separator / BOS of every document
TOKENIZER_VOCAB = 50257  # ids the GPT-2 tokenizer can produce (token files hold ids below it)
# RECORD §2: the model's rows (embeddings, lm_head, candidate sweep) are the tokenizer's ids padded
# to a multiple of 128; ids 50,257..50,303 never occur in data.
PADDED_VOCAB = 50304


def cache_dir() -> Path:
    """The directory tiktoken reads cached BPE files from.

    ``TIKTOKEN_CACHE_DIR`` when set, else ``$XDG_CACHE_HOME/nanogpt-pl/tiktoken``
    (``~/.cache/nanogpt-pl/tiktoken``).
    """
    env = os.environ.get("TIKTOKEN_CACHE_DIR")
    if env:
        return Path(env)
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return base / "nanogpt-pl" / "tiktoken"


def cache_file() -> Path:
    """Where tiktoken looks for the ``r50k_base`` ranks in :func:`cache_dir`."""
    return cache_dir() / hashlib.sha1(RANKS_URL.encode()).hexdigest()


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def seed_cache(source: str | os.PathLike | None = None) -> Path:
    """Put the verified ``r50k_base`` ranks file into the tiktoken cache.

    Args:
        source: a local copy of the ranks file (``gpt2.tiktoken`` or ``r50k_base.tiktoken``),
            or an ``openai-whisper`` sdist (``.tar.gz``). When omitted, the sdist is fetched
            from PyPI with ``pip download``.

    Returns:
        The path of the cached file.

    Raises:
        ValueError: the file's sha256 is not that of ``r50k_base``.
        RuntimeError: the sdist could not be downloaded.
    """
    target = cache_file()
    if target.exists() and _sha256(target) == RANKS_SHA256 and source is None:
        return target
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        if source is None:
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                   WHISPER_SDIST, "-d", str(tmp_path), "-q"]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            sdists = sorted(tmp_path.glob("*.tar.gz"))
            if proc.returncode != 0 or not sdists:
                raise RuntimeError(
                    f"could not download {WHISPER_SDIST} from PyPI to seed the tokenizer cache "
                    f"({proc.stderr.strip()[-500:]}). Download it elsewhere and run "
                    f"`nanogpt-pl data tokenizer --source openai_whisper-*.tar.gz`, or copy the "
                    f"r50k_base ranks file and pass it with --source."
                )
            source = sdists[0]
        source = Path(source)
        if not source.exists():
            raise FileNotFoundError(f"tokenizer source {source} does not exist")
        if source.name.endswith((".tar.gz", ".tgz")):
            with tarfile.open(source) as tar:
                members = [m for m in tar.getmembers() if m.name.endswith(WHISPER_MEMBER)]
                if not members:
                    raise ValueError(f"{source} holds no {WHISPER_MEMBER}; is it an openai-whisper sdist?")
                extracted = tar.extractfile(members[0])
                assert extracted is not None
                ranks = tmp_path / "ranks.tiktoken"
                ranks.write_bytes(extracted.read())
        else:
            ranks = source
        digest = _sha256(ranks)
        if digest != RANKS_SHA256:
            raise ValueError(
                f"{source}: sha256 {digest} is not that of GPT-2's r50k_base ranks ({RANKS_SHA256}); "
                f"use whisper/assets/gpt2.tiktoken from the {WHISPER_SDIST} sdist."
            )
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_suffix(".partial")
        shutil.copyfile(ranks, partial)
        os.replace(partial, target)
    return target


def get_encoding():
    """tiktoken's ``r50k_base`` encoding, read from the offline cache when seeded."""
    os.environ.setdefault("TIKTOKEN_CACHE_DIR", str(cache_dir()))
    import tiktoken  # after TIKTOKEN_CACHE_DIR is set; loads only to tokenize

    try:
        return tiktoken.get_encoding(ENCODING_NAME)
    except Exception as e:  # network errors surface as many types
        raise RuntimeError(
            f"could not load the {ENCODING_NAME} tokenizer ({type(e).__name__}: {e}). "
            f"Offline machines: run `nanogpt-pl data tokenizer` once to seed {cache_file()}."
        ) from e


def mergeable_ranks(encoding) -> dict[bytes, int]:
    """The bytes → token id map of an encoding's ordinary (non-special) tokens.

    The one place that reads tiktoken's private ``Encoding._mergeable_ranks``: the public
    API has no bulk form of it (``decode_single_token_bytes`` one id at a time is ~50k calls).
    ``tests/test_tokenizer.py`` checks its shape on the real ``r50k_base`` encoding.

    Raises:
        RuntimeError: the attribute is missing or is no longer a non-empty ``{bytes: int}`` dict.
    """
    ranks = getattr(encoding, "_mergeable_ranks", None)
    if not (isinstance(ranks, dict) and ranks
            and all(isinstance(b, bytes) and isinstance(i, int) for b, i in ranks.items())):
        import tiktoken  # its version, for the error message only

        raise RuntimeError(
            f"tiktoken {getattr(tiktoken, '__version__', '?')}: Encoding._mergeable_ranks is missing or no "
            f"longer a {{bytes: int}} dict (got {type(ranks).__name__}); the prefix table reads it in "
            f"nanogpt_pl/data/tokenizer.py mergeable_ranks: adapt that function, or install a tiktoken "
            f"that has it (tests/test_tokenizer.py checks the installed one)")
    return ranks


def build_prefix_table(vocab_size: int, encoding=None) -> torch.Tensor:
    """For every token id, the token whose bytes are its longest proper byte-prefix, else -1.

    The prefix-token auxiliary loss (RECORD §2) predicts ``table[target]``. Single-byte
    tokens, special tokens (50256) and the padded ids up to ``vocab_size`` map to -1.

    Args:
        vocab_size: length of the table: the model's (padded) vocabulary, its lm_head rows.
        encoding: a tiktoken ``Encoding``; default GPT-2's (:func:`get_encoding`).

    Returns:
        CPU int64 tensor ``[vocab_size]``.
    """
    by_bytes = mergeable_ranks(encoding if encoding is not None else get_encoding())
    if max(by_bytes.values()) >= vocab_size:
        raise ValueError(f"build_prefix_table: the encoding has token id {max(by_bytes.values())} >= "
                         f"vocab_size {vocab_size}")
    table = np.full(vocab_size, -1, dtype=np.int64)
    for b, i in by_bytes.items():
        for cut in range(len(b) - 1, 0, -1):
            j = by_bytes.get(b[:cut])
            if j is not None:
                table[i] = j
                break
    return torch.from_numpy(table)
