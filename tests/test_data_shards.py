"""The .bin shard format: round trip and every malformed-file error."""

from __future__ import annotations

import os
import stat

import numpy as np
import pytest

from nanogpt_pl.data.shards import (
    HEADER_BYTES,
    SHARD_MAGIC,
    ShardError,
    list_shards,
    max_token,
    open_shard,
    read_header,
    write_shard,
)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_round_trip(tmp_path, seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 50_000))
    tokens = rng.integers(0, 65536, size=n, dtype=np.int64)
    path = write_shard(tmp_path / "a.bin", tokens)
    assert path.stat().st_size == HEADER_BYTES + 2 * n
    assert read_header(path) == n
    got = open_shard(path)
    assert got.dtype == np.uint16
    np.testing.assert_array_equal(np.asarray(got, dtype=np.int64), tokens)
    header = np.fromfile(path, dtype="<i4", count=3)
    assert header.tolist() == [SHARD_MAGIC, 1, n]
    assert not list(tmp_path.glob(".*tmp"))  # the temporary file was renamed away


def test_empty_shard(tmp_path):
    path = write_shard(tmp_path / "e.bin", np.zeros(0, dtype=np.uint16))
    assert read_header(path) == 0
    assert open_shard(path, vocab_size=10).size == 0


def test_write_rejects_out_of_range_ids(tmp_path):
    with pytest.raises(ShardError, match="65535"):
        write_shard(tmp_path / "x.bin", np.array([1, 70000]))
    with pytest.raises(ShardError, match="65535"):
        write_shard(tmp_path / "x.bin", np.array([-1, 3]))
    assert not (tmp_path / "x.bin").exists()


def test_missing_file_and_empty_glob(tmp_path):
    with pytest.raises(ShardError, match="does not exist.*nanogpt-pl data"):
        read_header(tmp_path / "nope.bin")
    with pytest.raises(ShardError, match=r"data.train_files=.*matches no files.*nanogpt-pl data prepare"):
        list_shards(str(tmp_path / "*.bin"), "data.train_files")


def test_wrong_magic(tmp_path):
    rng = np.random.default_rng(3)
    path = write_shard(tmp_path / "m.bin", rng.integers(0, 50257, 100))
    raw = bytearray(path.read_bytes())
    raw[0:4] = np.array([12345], dtype="<i4").tobytes()
    path.write_bytes(bytes(raw))
    with pytest.raises(ShardError, match="magic number 12345"):
        open_shard(path)
    with pytest.raises(ShardError, match="m.bin"):
        list_shards(str(tmp_path / "*.bin"))


def test_wrong_version(tmp_path):
    path = write_shard(tmp_path / "v.bin", np.random.default_rng(4).integers(0, 50257, 10))
    raw = bytearray(path.read_bytes())
    raw[4:8] = np.array([7], dtype="<i4").tobytes()
    path.write_bytes(bytes(raw))
    with pytest.raises(ShardError, match="version 7"):
        read_header(path)


@pytest.mark.parametrize("cut", [1, 999, 2000])
def test_truncated(tmp_path, cut):
    path = write_shard(tmp_path / "t.bin", np.random.default_rng(cut).integers(0, 50257, 1000))
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) - cut])
    msg = "shorter than the 1024-byte" if len(raw) - cut < HEADER_BYTES else "promises 1000 tokens"
    with pytest.raises(ShardError, match=msg):
        open_shard(path)


def test_token_id_above_vocab(tmp_path):
    rng = np.random.default_rng(5)
    tokens = rng.integers(0, 50257, 5000)
    tokens[4321] = 50300
    path = write_shard(tmp_path / "big.bin", tokens)
    open_shard(path)  # fine without a vocabulary
    with pytest.raises(ShardError, match=r"big.bin: token id 50300 is >= the vocabulary size 50257.*token 4321"):
        open_shard(path, vocab_size=50257)
    assert max_token(path) == 50300
    open_shard(path, vocab_size=50304)


def test_max_token_cache_follows_rewrites(tmp_path):
    path = write_shard(tmp_path / "c.bin", np.array([1, 2, 3]))
    assert max_token(path) == 3
    write_shard(path, np.array([1, 2, 3, 9000]))
    assert max_token(path) == 9000


def test_list_shards_sorted(tmp_path):
    rng = np.random.default_rng(6)
    for name in ["b_000002.bin", "b_000010.bin", "b_000001.bin"]:
        write_shard(tmp_path / name, rng.integers(0, 100, 10))
    assert [p.name for p in list_shards(str(tmp_path / "b_*.bin"))] == ["b_000001.bin", "b_000002.bin", "b_000010.bin"]


def test_written_shards_are_0644_and_leave_no_temporary(tmp_path, monkeypatch):
    path = write_shard(tmp_path / "a.bin", np.arange(10, dtype=np.uint16))
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    monkeypatch.setattr(os, "fsync", lambda fd: (_ for _ in ()).throw(OSError("disk full")))
    with pytest.raises(OSError, match="disk full"):
        write_shard(tmp_path / "b.bin", np.arange(10, dtype=np.uint16))
    assert [p.name for p in tmp_path.iterdir()] == ["a.bin"]
