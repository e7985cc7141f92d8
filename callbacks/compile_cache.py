"""Carry ``torch.compile``'s caches from one machine to the next.

A speedrun compiles every configuration key before its clock starts (RECORD §11: about 7 minutes
the first time). Inductor keeps what it compiled in a cache directory on the machine, so the
same machine's next run compiles in a fraction of that time, and a fresh machine starts cold.

``CompileCache(path)`` makes that cache portable. At setup, before anything compiles, it loads
the cache artifacts saved in ``path`` (``torch.compiler.load_cache_artifacts``): inductor's
compiled graphs with their Triton kernels, AOTAutograd's graphs, and autotuning results. At the
end of training, global rank 0 writes everything this process compiled or loaded
(``torch.compiler.save_cache_artifacts``) to ``path``, compressed (xz by default); a run that fails
with an exception saves too. It writes to a temporary file first and then renames it, so an interrupted
save leaves the old file whole. Copy the file to the next machine and name it again:

    python main.py fit --config configs/speedrun_1gpu.yaml \\
        --trainer.callbacks+=callbacks.compile_cache.CompileCache --trainer.callbacks.path compile_cache.xz

``compression``: ``xz`` (the default) or ``gzip``. On the artifacts of ``speedrun_1gpu.yaml``'s
warmup xz writes a file less than half gzip's size, in a few seconds more (BENCHMARKS.md,
``benchmarks/compile_cache_compression.py``): the save comes after training, off the speedrun
clock, and the file is what gets copied between machines. Either format is read whatever the
setting, by its leading bytes.

The project's own Triton kernels (FP8, loss, attention, optimizer) are compiled by Triton at
their first launch and cached in ``TRITON_CACHE_DIR`` (default ``~/.triton/cache``), not here.

Loading a file saved under another torch version, or one that is not such a file, warns once,
naming the file, and the run compiles from scratch.
"""

from __future__ import annotations

import gzip
import lzma
import os
import warnings
from pathlib import Path
from typing import Any, Optional

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info

GZIP_MAGIC = b"\x1f\x8b"
XZ_MAGIC = b"\xfd7zXZ\x00"
COMPRESSIONS = ("xz", "gzip")


def check_compression(compression: str) -> None:
    if compression not in COMPRESSIONS:
        raise ValueError(f"CompileCache.compression={compression!r}: use one of {', '.join(COMPRESSIONS)}")


def pack(data: bytes, compression: str = "xz") -> bytes:
    """``data`` compressed as ``CompileCache`` writes it: xz at preset 1, or gzip at level 1."""
    check_compression(compression)
    return lzma.compress(data, preset=1) if compression == "xz" else gzip.compress(data, compresslevel=1)


def unpack(data: bytes) -> bytes:
    """``data`` decompressed by its leading bytes (xz or gzip); anything else as it is."""
    if data[:2] == GZIP_MAGIC:
        return gzip.decompress(data)
    if data[:6] == XZ_MAGIC:
        return lzma.decompress(data)
    return data


def _summary(info: Any) -> str:
    """``CacheInfo`` as "N artifacts (inductor a, aot_autograd b, ...)"."""
    groups = {kind: len(keys) for kind, keys in getattr(info, "artifacts", {}).items() if keys}
    total = sum(groups.values())
    return f"{total} artifacts" + (" (" + ", ".join(f"{k} {n}" for k, n in sorted(groups.items())) + ")" if groups
                                   else "")


def load_artifacts(path: Path) -> Optional[str]:
    """Load the compile-cache artifacts in ``path`` into this process's caches; a summary, or None
    (with one warning naming the file) when it holds nothing this torch can use."""
    data = path.read_bytes()
    try:
        info = torch.compiler.load_cache_artifacts(unpack(data))
    except Exception as err:  # a truncated, foreign or other-version file: compile from scratch instead
        warnings.warn(f"CompileCache: {path} could not be loaded ({type(err).__name__}: {err}); the run compiles "
                      f"from scratch. Delete the file, or point CompileCache.path elsewhere, to stop this warning")
        return None
    if info is None:
        warnings.warn(f"CompileCache: {path} holds no artifacts this torch ({torch.__version__}) can load; the run "
                      "compiles from scratch")
        return None
    return _summary(info)


def save_artifacts(path: Path, compression: str = "xz") -> Optional[str]:
    """Write everything compiled (or loaded) in this process to ``path``, compressed (``xz`` or
    ``gzip``) and atomically; a summary, or None when nothing was compiled."""
    check_compression(compression)  # before the artifacts are gathered
    saved = torch.compiler.save_cache_artifacts()
    if saved is None:
        return None
    data, info = saved
    if info.empty():
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(pack(data, compression))
    os.replace(tmp, path)
    return f"{_summary(info)}, {path.stat().st_size / 2**20:.1f} MiB"


class CompileCache(L.Callback):
    """Load ``torch.compile``'s cache artifacts from ``path`` at setup; save them there at the end of training.

    Args:
        path: the artifacts file. A missing file is written at the end of the first run.
        load: read ``path`` at setup when it exists.
        save: write ``path`` at the end of training (global rank 0).
        compression: ``xz`` (smaller) or ``gzip`` (faster to write) for the saved file.
    """

    def __init__(self, path: str = "compile_cache.xz", load: bool = True, save: bool = True,
                 compression: str = "xz") -> None:
        if not str(path):
            raise ValueError("CompileCache.path is empty: name the artifacts file, e.g. compile_cache.xz")
        check_compression(compression)
        self.compression = compression
        self.path = Path(path)
        self.load = load
        self.save = save
        self.loaded: Optional[str] = None
        self.saved: Optional[str] = None
        self._done_loading = False

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self._done_loading or not self.load:
            return
        self._done_loading = True  # once per process: a later fit or validate finds the caches filled
        if self.path.is_file():
            self.loaded = load_artifacts(self.path)
            if self.loaded is not None:
                rank_zero_info(f"CompileCache: loaded {self.loaded} from {self.path}")
        else:
            rank_zero_info(f"CompileCache: {self.path} does not exist yet; this run compiles from scratch and "
                           + ("writes it at the end of training" if self.save else "does not write it (save=False)"))

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        """A run that fails after compiling (out of memory, a non-finite loss) still keeps its compiles."""
        self.on_train_end(trainer, pl_module)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self.save or not trainer.is_global_zero or self.saved is not None:
            return
        self.saved = save_artifacts(self.path, self.compression)
        if self.saved is not None:
            rank_zero_info(f"CompileCache: saved {self.saved} to {self.path}")
        else:
            rank_zero_info("CompileCache: nothing was compiled (model.compile off?); nothing saved")
