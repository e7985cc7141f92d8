"""The embedded quickstart corpus: deterministic, cached, usable by the data module."""

from __future__ import annotations

import filecmp
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from data_fixtures import BOS, read_tokens

from nanogpt_pl.data import corpus
from nanogpt_pl.data.datamodule import SpeedrunDataModule
from nanogpt_pl.data.tokenizer import cache_dir as tiktoken_cache_dir

REPO = Path(__file__).resolve().parents[1]
BUILD = "import sys; from nanogpt_pl.data.corpus import build_corpus; print(build_corpus(sys.argv[1]).directory)"


@pytest.fixture(scope="module")
def two_builds(tmp_path_factory):
    """The corpus built by two processes at once, with different hash seeds, into two caches."""
    roots = [tmp_path_factory.mktemp(f"corpus{i}") for i in range(2)]
    procs = []
    for i, root in enumerate(roots):
        env = dict(os.environ, PYTHONHASHSEED=str(17 + i), TIKTOKEN_CACHE_DIR=str(tiktoken_cache_dir()))
        procs.append(subprocess.Popen([sys.executable, "-c", BUILD, str(root / "nanogpt-pl" / "corpus")],
                                      cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    dirs = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
        dirs.append(Path(out.strip()))
    return roots, dirs


def test_corpus_is_deterministic(two_builds):
    _, (a, b) = two_builds
    assert a.name == b.name  # same key: same Python, same sources
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    assert "manifest.json" in names and "quickstart_val_000000.bin" in names and "quickstart_train_000001.bin" in names
    match, mismatch, errors = filecmp.cmpfiles(a, b, names, shallow=False)
    assert not mismatch and not errors


def test_corpus_contents(two_builds):
    roots, (a, _) = two_builds
    info = corpus.build_corpus(roots[0] / "nanogpt-pl" / "corpus")  # reused, not rebuilt
    assert info.directory == a
    assert info.train_tokens > 500_000 and info.val_tokens > 65_536
    assert info.val_documents == corpus.VAL_DOCUMENTS
    train = np.concatenate([read_tokens(p) for p in info.train_paths])
    val = np.concatenate([read_tokens(p) for p in info.val_paths])
    assert train.size == info.train_tokens and val.size == info.val_tokens
    assert train[0] == BOS and val[0] == BOS
    assert int((train == BOS).sum()) == info.train_documents
    assert int((val == BOS).sum()) == info.val_documents
    assert int(train.max()) < 50257


def test_documents_come_from_the_docs():
    topics = corpus.help_topics()
    sources = [s for s in corpus.stdlib_sources() if s[0] in ("json/__init__.py", "textwrap.py")]
    docs = corpus.corpus_documents(sources)
    assert docs[0] == topics[0][1].strip()
    assert any(d.startswith("json\n\nJSON (JavaScript Object Notation)") for d in docs)
    assert any(d.startswith("def json.dumps(obj, *, skipkeys=False") for d in docs)
    assert any(d.startswith("class textwrap.TextWrapper:") for d in docs)
    assert not any("site-packages" in rel or rel.startswith("test/") for rel, _ in corpus.stdlib_sources())


def test_reuse_and_rebuild_of_a_broken_copy(tmp_path):
    # a corpus from a few stdlib modules (the same code path as the full one, in a fraction of the time)
    sources = [s for s in corpus.stdlib_sources() if s[0].startswith(("json/", "textwrap", "email/"))]
    root = tmp_path / "cache"
    info = corpus.build_corpus(root, sources=sources)
    assert info.key != corpus.corpus_key(corpus.stdlib_sources())  # the key covers the sources
    first = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in info.directory.iterdir()}
    again = corpus.build_corpus(root, sources=sources)
    assert {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in again.directory.iterdir()} == first
    # a copy with a missing shard does not count as built
    (info.directory / "quickstart_val_000000.bin").unlink()
    rebuilt = corpus.build_corpus(root, sources=sources)
    assert {p.name: p.read_bytes() for p in rebuilt.directory.iterdir()} == {k: v[0] for k, v in first.items()}
    assert [p.name for p in root.iterdir()] == [info.key]  # no temporary folders left behind
    forced = corpus.build_corpus(root, sources=sources, force=True)
    assert forced.val_tokens == info.val_tokens and forced.directory == info.directory


def test_datamodule_uses_the_corpus(two_builds, monkeypatch):
    roots, (a, _) = two_builds
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tiktoken_cache_dir()))
    monkeypatch.setenv("XDG_CACHE_HOME", str(roots[0]))
    from data_fixtures import small_schedule

    dm = SpeedrunDataModule(corpus="quickstart", val_tokens=65_536, val_seq_len=8192, prefetch=2,
                            schedule=small_schedule([(10, 4096, 1024, 512)]))
    dm.prepare_data()
    dm.setup("fit")
    train, val = dm.data_paths()
    assert [p.parent for p in train + val] == [a] * (len(train) + len(val))
    stream = dm.train_dataloader()
    first = next(iter(stream))
    stream.close()
    assert len(first) == 4 and first[0]["inputs"].shape == (1024,) and first[0]["inputs"][0] == BOS
    batches = list(dm.val_dataloader())
    assert len(batches) == 8 and batches[0]["inputs"].shape == (8192,)


def test_corpus_command(two_builds, capsys):
    from nanogpt_pl.data.commands import main

    roots, (a, _) = two_builds
    assert main(["corpus", "--cache-dir", str(roots[0] / "nanogpt-pl" / "corpus")]) == 0
    out = capsys.readouterr().out
    info = corpus.build_corpus(roots[0] / "nanogpt-pl" / "corpus")
    assert str(a / "quickstart_train_*.bin") in out and f"{info.train_tokens:,} tokens" in out
    assert f"{info.val_tokens:,} tokens" in out
