"""callbacks.compile_cache.CompileCache: torch.compile's caches carried to a fresh process."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from callbacks.compile_cache import GZIP_MAGIC, XZ_MAGIC, CompileCache, load_artifacts, save_artifacts

ROOT = Path(__file__).resolve().parents[1]

# one compile in a process whose inductor cache directory is its own (a fresh machine's), with the
# callback around it as a training run has it: setup, then the compile, then the end of training.
# The graph is one matmul, which inductor hands to an extern kernel: a graph with a generated C++
# kernel would have g++ build it in both processes (about 8 s each on 2 cores; a CPU kernel is
# rebuilt from the cached source even on a cache hit), and the callback's part, the FX graph and
# AOTAutograd artifacts that make the hit, is the same either way.
CHILD = r"""
import sys
from types import SimpleNamespace

import torch
from torch._dynamo.utils import counters

from callbacks.compile_cache import CompileCache

cache = CompileCache(sys.argv[1])
cache.setup(None, None, "fit")
fn = torch.compile(lambda x: x @ x.T)
fn(torch.randn(8, 16))
hits, misses = counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"]
cache.on_train_end(SimpleNamespace(is_global_zero=True), None)
print("RESULT", hits, misses, cache.loaded is not None, cache.saved is not None)
"""


def _child(path: Path, inductor_dir: Path) -> tuple[int, int, bool, bool]:
    # one compile thread: no pool of compile workers to start for one small kernel
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(inductor_dir), "PYTHONPATH": str(ROOT),
           "TORCHINDUCTOR_COMPILE_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", CHILD, str(path)], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=300)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    _, hits, misses, loaded, saved = lines[-1].split()
    return int(hits), int(misses), loaded == "True", saved == "True"


@pytest.mark.slow
def test_a_fresh_process_loads_what_the_last_one_compiled(tmp_path):
    path = tmp_path / "compile_cache.xz"
    # the first run compiles (a miss in its empty cache directory) and writes the file (xz, the default)
    hits, misses, loaded, saved = _child(path, tmp_path / "inductor_a")
    assert (hits, loaded, saved) == (0, False, True) and misses >= 1 and path.read_bytes()[:6] == XZ_MAGIC
    # a second process with another empty cache directory finds every graph in the loaded artifacts
    hits, misses, loaded, saved = _child(path, tmp_path / "inductor_b")
    assert loaded and saved and hits >= 1 and misses == 0


def test_an_unreadable_file_warns_once_and_the_run_compiles(tmp_path):
    path = tmp_path / "cache.gz"
    path.write_bytes(b"not a cache")
    cache = CompileCache(str(path), save=False)
    # torch's reader rejects it (a checksum) and loads nothing: one warning naming the file
    with pytest.warns(UserWarning, match=f"CompileCache: {path} .*compiles from scratch"):
        cache.setup(None, None, "fit")
    assert cache.loaded is None
    with warnings.catch_warnings(record=True) as again:
        warnings.simplefilter("always")
        cache.setup(None, None, "validate")  # once per process: no second warning, nothing raised
    assert not again


def test_only_global_rank_zero_saves_and_save_false_saves_nothing(tmp_path):
    torch._dynamo.reset()
    torch.compile(lambda x: x * 3 + 1)(torch.randn(4))  # something compiled in this process
    for cache, rank_zero in ((CompileCache(str(tmp_path / "a.gz")), False),
                             (CompileCache(str(tmp_path / "b.gz"), save=False), True)):
        cache.on_train_end(SimpleNamespace(is_global_zero=rank_zero), None)
        assert cache.saved is None and not cache.path.exists()
    cache = CompileCache(str(tmp_path / "sub" / "c.gz"))
    cache.on_exception(SimpleNamespace(is_global_zero=True), None, torch.OutOfMemoryError())  # a failed run saves
    assert cache.saved is not None and cache.path.is_file() and not cache.path.with_name("c.gz.tmp").exists()
    torch._dynamo.reset()


def test_an_empty_path_or_an_unknown_compression_is_one_clear_error():
    with pytest.raises(ValueError, match="CompileCache.path is empty"):
        CompileCache("")
    with pytest.raises(ValueError, match="CompileCache.compression='zstd': use one of xz, gzip"):
        CompileCache("cache.xz", compression="zstd")


def test_both_formats_are_written_and_read_back_by_their_leading_bytes(tmp_path):
    """xz (the default) and gzip files hold the same artifacts, and either loads whatever the
    setting (a file from before xz, gzip, still loads)."""
    torch._dynamo.reset()
    torch.compile(lambda x: x.cos() * 2 - 1)(torch.randn(8))  # something compiled in this process
    try:
        sizes = {}
        for compression, magic in (("xz", XZ_MAGIC), ("gzip", GZIP_MAGIC)):
            path = tmp_path / f"cache.{compression}"
            assert save_artifacts(path, compression) is not None
            data = path.read_bytes()
            assert data.startswith(magic), compression
            sizes[compression] = len(data)
            named_other = tmp_path / f"renamed-{compression}.bin"  # the name says nothing: the bytes decide
            named_other.write_bytes(data)
            assert load_artifacts(named_other) is not None, compression
        assert sizes["xz"] < sizes["gzip"]
    finally:
        torch._dynamo.reset()


def test_the_compression_benchmark_reads_a_stream_cut_short(tmp_path, capsys):
    """``benchmarks/compile_cache_compression.py`` on the first parts of a split gzip file (what a
    transfer limit let through): it decompresses as far as the parts go and compares the formats."""
    import gzip
    import importlib.util

    spec = importlib.util.spec_from_file_location("ccc", ROOT / "benchmarks" / "compile_cache_compression.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    gen = torch.Generator().manual_seed(11)
    raw = (torch.randint(0, 16, (400_000,), generator=gen, dtype=torch.uint8).numpy().tobytes()) * 3
    packed = gzip.compress(raw, compresslevel=1)
    parts = [tmp_path / "part.aa", tmp_path / "part.ab"]
    parts[0].write_bytes(packed[: len(packed) // 3])
    parts[1].write_bytes(packed[len(packed) // 3: 2 * len(packed) // 3])  # the last third never arrived
    got, source = bench.raw_bytes(b"".join(p.read_bytes() for p in parts))
    assert source.startswith("gzip, cut short") and 0 < len(got) < len(raw) and raw.startswith(got)
    assert bench.main([str(p) for p in parts]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[2:]]
    assert [" ".join(r[:2]) for r in rows] == ["gzip 1", "gzip 6", "xz 1"]
    assert float(rows[0][-1]) == 1.0 and all(float(r[2]) > 0 for r in rows)
    assert bench.main([str(tmp_path / "missing")]) == 2
