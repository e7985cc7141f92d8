"""``nanogpt-pl data fineweb`` against a local fake of the Hugging Face hub (data_fixtures.FakeHub)."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import numpy as np
import pytest
from data_fixtures import FakeHub, random_documents

from nanogpt_pl.data import fineweb
from nanogpt_pl.data.shards import ShardError, read_header, write_shard


def _shard_bytes(tmp: Path, name: str, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    path = write_shard(tmp / "src" / name, np.concatenate(random_documents(rng, 40, 30)))
    return path.read_bytes()


@pytest.fixture
def hub_files(tmp_path):
    names = fineweb.shard_names(3)
    return {name: _shard_bytes(tmp_path, name, i + 1) for i, name in enumerate(names)}


@pytest.fixture(autouse=True)
def _local_network(monkeypatch, tmp_path):
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_ENDPOINT", raising=False)


def test_shard_names_and_range():
    names = fineweb.shard_names(2)
    assert names == ["fineweb_val_000000.bin", "fineweb_train_000001.bin", "fineweb_train_000002.bin"]
    assert fineweb.shard_names(103)[-1] == "fineweb_train_000103.bin"
    for bad in (0, 104, -3):
        with pytest.raises(ValueError, match=r"--train-shards must lie in 1..103"):
            fineweb.shard_names(bad)


def test_download_resume_and_skip(tmp_path, hub_files):
    out = tmp_path / "fw"
    out.mkdir()
    val, t1, t2 = fineweb.shard_names(2)
    (out / val).write_bytes(hub_files[val])  # already complete: skipped
    (out / t1).write_bytes(hub_files[t1][: len(hub_files[t1]) // 2])  # interrupted: fetched again
    with FakeHub(hub_files) as hub:
        paths = fineweb.download(2, str(out), endpoint=hub.endpoint, progress=False)
        assert [p.name for p in paths] == [val, t1, t2]
        for p in paths:
            assert p.read_bytes() == hub_files[p.name]
            read_header(p)
        assert hub.gets() == sorted([t1, t2])
        hub.requests.clear()
        fineweb.download(2, str(out), endpoint=hub.endpoint, progress=False)
        assert hub.requests == []  # everything complete: not even a metadata request


def test_download_honours_hf_endpoint_variable(tmp_path, hub_files, monkeypatch):
    with FakeHub(hub_files) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
        paths = fineweb.download(1, str(tmp_path / "fw"), progress=False)
        assert [p.read_bytes() for p in paths] == [hub_files[p.name] for p in paths]


def test_corrupt_download_is_deleted(tmp_path, hub_files):
    bad = bytearray(hub_files["fineweb_train_000001.bin"])
    bad[0:4] = b"\x00\x00\x00\x00"  # wrong magic, right size
    hub_files["fineweb_train_000001.bin"] = bytes(bad)
    out = tmp_path / "fw"
    with FakeHub(hub_files) as hub:
        with pytest.raises(ShardError, match=r"fineweb_train_000001.bin downloaded from .* failed verification"):
            fineweb.download(1, str(out), endpoint=hub.endpoint, progress=False)
    assert not (out / "fineweb_train_000001.bin").exists()
    assert (out / "fineweb_val_000000.bin").exists()


def test_missing_file_on_hub(tmp_path, hub_files):
    del hub_files["fineweb_train_000002.bin"]
    with FakeHub(hub_files) as hub:
        with pytest.raises(RuntimeError, match=r"could not download fineweb_train_000002.bin .* from http://127.0.0.1"):
            fineweb.download(2, str(tmp_path / "fw"), endpoint=hub.endpoint, progress=False)


def test_unreachable_endpoint_fails_fast(tmp_path):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there
    endpoint = f"http://127.0.0.1:{port}"
    t0 = time.monotonic()
    with pytest.raises(RuntimeError) as err:
        fineweb.download(1, str(tmp_path / "fw"), endpoint=endpoint, progress=False)
    msg = str(err.value)
    assert endpoint in msg and "HF_ENDPOINT" in msg and "HF_HUB_OFFLINE is not set" in msg
    assert time.monotonic() - t0 < 15


def test_offline_mode(tmp_path, hub_files, monkeypatch):
    out = tmp_path / "fw"
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(RuntimeError, match="HF_HUB_OFFLINE is set"):
        fineweb.download(1, str(out), endpoint="http://127.0.0.1:9", progress=False)
    out.mkdir()
    for name in fineweb.shard_names(1):
        (out / name).write_bytes(hub_files[name])
    assert len(fineweb.download(1, str(out), progress=False)) == 2  # complete local copy: fine offline
