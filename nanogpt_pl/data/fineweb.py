"""Download the GPT-2-tokenized FineWeb-10B cache from the Hugging Face hub (``nanogpt-pl data fineweb``).

The dataset repo ``kjj0/fineweb10B-gpt2`` holds ``fineweb_val_000000.bin`` and
``fineweb_train_000001.bin`` .. ``fineweb_train_000103.bin``, 100M tokens each in the
speedrun's shard format (RECORD.md §1). Files already present and complete (header
and size verified) are skipped, so an interrupted download resumes where it stopped;
every downloaded file is verified the same way.

``HF_ENDPOINT`` (or ``endpoint=``) points at a mirror; ``HF_HUB_OFFLINE=1`` forbids
downloads, in which case only a complete local copy passes.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Optional

from nanogpt_pl.data.shards import ShardError, read_header

# RECORD.md §1: the record's data cache on the hub, one val shard and 103 train shards.
REPO_ID = "kjj0/fineweb10B-gpt2"
REPO_TYPE = "dataset"
VAL_FILE = "fineweb_val_000000.bin"
TRAIN_FILE = "fineweb_train_{:06d}.bin"
MAX_TRAIN_SHARDS = 103
# RECORD.md §1: the README downloads 9 train shards; the run reads the first 4.
DEFAULT_TRAIN_SHARDS = 9
DEFAULT_LOCAL_DIR = "data/fineweb10B"
DEFAULT_ENDPOINT = "https://huggingface.co"
METADATA_TIMEOUT_S = 10.0


def shard_names(train_shards: int) -> list[str]:
    """The val shard and the first ``train_shards`` train shards."""
    if not 1 <= train_shards <= MAX_TRAIN_SHARDS:
        raise ValueError(
            f"--train-shards must lie in 1..{MAX_TRAIN_SHARDS} (the cache holds {MAX_TRAIN_SHARDS} train shards "
            f"of 100M tokens), got {train_shards}"
        )
    return [VAL_FILE] + [TRAIN_FILE.format(i) for i in range(1, train_shards + 1)]


def is_complete(path: Path) -> bool:
    """Whether ``path`` is a whole shard (valid header, size matching its token count)."""
    try:
        read_header(path)
        return True
    except ShardError:
        return False


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def _network_error(name: str, endpoint: str, error: BaseException) -> RuntimeError:
    return RuntimeError(
        f"could not download {name} of the dataset {REPO_ID} from {endpoint} ({type(error).__name__}: {error}). "
        f"Check the network connection; set HF_ENDPOINT to a reachable hub mirror if {endpoint} is blocked; "
        f"HF_HUB_OFFLINE is {'set, which forbids downloads' if _offline() else 'not set'}."
    )


def download(
    train_shards: int = DEFAULT_TRAIN_SHARDS,
    local_dir: str = DEFAULT_LOCAL_DIR,
    endpoint: Optional[str] = None,
    revision: Optional[str] = None,
    progress: bool = True,
) -> list[Path]:
    """Fetch the val shard and the first ``train_shards`` train shards into ``local_dir``.

    Args:
        train_shards: number of train shards, 1..103 (100M tokens each).
        local_dir: destination directory.
        endpoint: hub URL; default ``HF_ENDPOINT`` or https://huggingface.co.
        revision: a branch, tag or commit of the dataset repo (default: main).
        progress: show download progress.

    Returns:
        The local paths, val shard first.

    Raises:
        ValueError: ``train_shards`` out of range.
        RuntimeError: the hub could not be reached (names the endpoint and the variables).
        ShardError: a downloaded file failed verification (it is deleted).
    """
    names = shard_names(train_shards)
    out = Path(local_dir).expanduser()
    endpoint = (endpoint or os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")
    missing = [n for n in names if not is_complete(out / n)]
    if progress:
        print(
            f"{len(names) - len(missing)} of {len(names)} FineWeb shards already complete in {out}; "
            f"downloading {len(missing)} from {endpoint}",
            file=sys.stderr,
        )
    if not missing:
        return [out / n for n in names]
    if _offline():
        raise RuntimeError(
            f"HF_HUB_OFFLINE is set, so {len(missing)} missing or incomplete shard(s) ({', '.join(missing[:3])}"
            f"{', ...' if len(missing) > 3 else ''}) cannot be downloaded into {out}; unset HF_HUB_OFFLINE or "
            f"copy the files there"
        )

    # huggingface_hub only for downloads
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    out.mkdir(parents=True, exist_ok=True)
    bars_were_off = are_progress_bars_disabled()
    if not progress:
        disable_progress_bars()
    try:
        for name in missing:
            n = _fetch_one(name, out, endpoint, revision)
            if progress:
                print(f"  {name}: {n:,} tokens", file=sys.stderr)
    finally:
        if not progress and not bars_were_off:
            enable_progress_bars()
    return [out / n for n in names]


def _fetch_one(name: str, out: Path, endpoint: str, revision: Optional[str]) -> int:
    """Download one shard into ``out`` and verify it; returns its token count."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_download, hf_hub_url  # huggingface_hub only for downloads

    path = out / name
    url = hf_hub_url(REPO_ID, name, repo_type=REPO_TYPE, revision=revision, endpoint=endpoint)
    try:
        # one quick metadata request without retries, so an unreachable hub fails fast
        meta = get_hf_file_metadata(url=url, timeout=METADATA_TIMEOUT_S)
    except Exception as e:
        raise _network_error(name, endpoint, e) from e
    path.unlink(missing_ok=True)  # an incomplete copy: fetch it again
    try:
        hf_hub_download(REPO_ID, name, repo_type=REPO_TYPE, revision=revision, local_dir=str(out), endpoint=endpoint)
    except Exception as e:
        raise _network_error(name, endpoint, e) from e
    try:
        n = read_header(path)
    except ShardError as e:
        path.unlink(missing_ok=True)
        raise ShardError(
            f"{name} downloaded from {endpoint} failed verification and was deleted: {e}. "
            f"Run the command again; if it fails again the mirror serves a bad file."
        ) from e
    if meta.size is not None and meta.size != path.stat().st_size:
        size = path.stat().st_size
        path.unlink(missing_ok=True)
        raise ShardError(
            f"{name} from {endpoint}: the hub announced {meta.size} bytes but {size} arrived; "
            f"the file was deleted, run the command again"
        )
    return n
