"""``nanogpt-pl data prepare``: text, jsonl and parquet files to BOS-prefixed GPT-2 shards."""

from __future__ import annotations

import gzip
import json
import stat

import numpy as np
import pytest
from data_fixtures import BOS, read_tokens

from nanogpt_pl.data.prepare import DEFAULT_TXT_DOCUMENT_CHARS, prepare
from nanogpt_pl.data.shards import list_shards
from nanogpt_pl.data.tokenizer import get_encoding

WORDS = ["the", "model", "attention", "λ", "naïve", "données", "<|endoftext|>", "3.28", "\n", "def", "(x)", "🙂", "  "]


def random_texts(seed: int, n: int) -> list[str]:
    rng = np.random.default_rng(seed)
    texts = []
    for _ in range(n):
        k = int(rng.integers(1, 60))
        texts.append(" ".join(WORDS[i] for i in rng.integers(0, len(WORDS), size=k)) + f" #{int(rng.integers(1e6))}")
    return texts


def expected_stream(texts: list[str]) -> np.ndarray:
    enc = get_encoding()
    return np.concatenate([np.asarray([BOS] + enc.encode_ordinary(t), dtype=np.uint16) for t in texts if t.strip()])


def split_stream(paths) -> np.ndarray:
    return np.concatenate([read_tokens(p) for p in paths]) if paths else np.zeros(0, np.uint16)


@pytest.mark.parametrize("seed", [0, 1])
def test_jsonl_with_val_documents_and_small_shards(tmp_path, seed):
    texts = random_texts(seed, 120)
    texts[5] = "   "  # empty documents are skipped
    src = tmp_path / "in" / "a.jsonl"
    src.parent.mkdir()
    src.write_text("".join(json.dumps({"id": i, "body": t}) + "\n" for i, t in enumerate(texts)))
    res = prepare([str(src)], str(tmp_path / "out"), name="x", shard_tokens=500, val_documents=10,
                  text_field="body", workers=1, progress=False)
    kept = [t for t in texts if t.strip()]
    assert res.skipped_empty == 1 and res.val_documents == 10 and res.train_documents == len(kept) - 10
    np.testing.assert_array_equal(split_stream(res.val_paths), expected_stream(kept[:10]))
    np.testing.assert_array_equal(split_stream(res.train_paths), expected_stream(kept[10:]))
    assert [p.name for p in res.train_paths][:2] == ["x_train_000001.bin", "x_train_000002.bin"]
    assert res.val_paths[0].name == "x_val_000000.bin"
    assert all(read_tokens(p).size == 500 for p in res.train_paths[:-1])  # documents run across shards
    assert res.train_tokens == sum(read_tokens(p).size for p in res.train_paths)
    # the literal text "<|endoftext|>" is ordinary text: BOS only at document starts
    assert int((split_stream(res.train_paths) == BOS).sum()) == res.train_documents
    assert list_shards(str(tmp_path / "out" / "x_train_*.bin")) == res.train_paths


def test_txt_files_and_separator_with_workers(tmp_path):
    texts = random_texts(7, 40)
    d = tmp_path / "txt"
    d.mkdir()
    for i in range(4):
        (d / f"part{i}.txt").write_text("\n\n\n".join(texts[i * 10 : (i + 1) * 10]))
    with gzip.open(d / "part9.txt.gz", "wt", encoding="utf-8") as f:
        f.write(texts[0])
    # one document per file
    whole = prepare([str(d)], str(tmp_path / "o1"), name="w", val_documents=1, txt_document_chars=0, workers=1,
                    progress=False)
    files = [(d / f"part{i}.txt").read_text() for i in range(4)] + [texts[0]]
    np.testing.assert_array_equal(
        np.concatenate([split_stream(whole.val_paths), split_stream(whole.train_paths)]), expected_stream(files)
    )
    # split on a separator, tokenized by two worker processes
    res = prepare([str(d / "part*.txt")], str(tmp_path / "o2"), name="s", val_fraction=0.1,
                  txt_separator="\n\n\n", workers=2, progress=False)
    val_idx = [i for i in range(40) if (i + 1) // 10 > i // 10]  # floor((i+1)/10) > floor(i/10)
    assert val_idx == [9, 19, 29, 39] and res.val_documents == 4
    np.testing.assert_array_equal(split_stream(res.val_paths), expected_stream([texts[i] for i in val_idx]))
    np.testing.assert_array_equal(
        split_stream(res.train_paths), expected_stream([t for i, t in enumerate(texts) if i not in val_idx])
    )


def test_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    texts = random_texts(11, 50)
    pq.write_table(pa.table({"text": texts, "n": list(range(50))}), tmp_path / "d.parquet")
    res = prepare([str(tmp_path / "d.parquet")], str(tmp_path / "out"), val_documents=5, workers=1, progress=False)
    np.testing.assert_array_equal(split_stream(res.val_paths), expected_stream(texts[:5]))
    np.testing.assert_array_equal(split_stream(res.train_paths), expected_stream(texts[5:]))
    with pytest.raises(ValueError, match=r"no column 'body' \(columns: \['text', 'n'\]\).*--text-field"):
        prepare([str(tmp_path / "d.parquet")], str(tmp_path / "o2"), text_field="body", workers=1, progress=False)


def test_errors(tmp_path):
    src = tmp_path / "a.jsonl"
    src.write_text(json.dumps({"text": "hello"}) + "\n" + json.dumps({"content": "x"}) + "\n")
    msg = r"a.jsonl:2: no 'text' field \(found \['content'\]\); choose the field with --text-field"
    with pytest.raises(ValueError, match=msg):
        prepare([str(src)], str(tmp_path / "o"), workers=1, progress=False)
    assert not list((tmp_path / "o").glob("*.bin"))  # nothing half-written is left behind
    with pytest.raises(FileNotFoundError, match="matches no"):
        prepare([str(tmp_path / "nothing*.jsonl")], str(tmp_path / "o"), workers=1, progress=False)
    good = tmp_path / "g.jsonl"
    good.write_text("".join(json.dumps({"text": t}) + "\n" for t in random_texts(3, 30)))
    prepare([str(good)], str(tmp_path / "o"), val_documents=3, workers=1, progress=False)
    with pytest.raises(FileExistsError, match="--overwrite"):
        prepare([str(good)], str(tmp_path / "o"), val_documents=3, workers=1, progress=False)
    prepare([str(good)], str(tmp_path / "o"), val_documents=3, workers=1, progress=False, overwrite=True)
    with pytest.raises(ValueError, match="validation split is empty"):
        prepare([str(good)], str(tmp_path / "o3"), val_fraction=0.001, workers=1, progress=False)
    with pytest.raises(ValueError, match="no training documents"):
        prepare([str(good)], str(tmp_path / "o4"), val_documents=100, workers=1, progress=False)


def _paragraphs(seed: int, n: int) -> tuple[list[str], list[str]]:
    """Paragraphs without blank lines, and the blank-line runs that follow each."""
    rng = np.random.default_rng(seed)
    words = [w for w in WORDS if w.strip()]
    paras = []
    for i in range(n):
        lines = [" ".join(words[j] for j in rng.integers(0, len(words), size=int(rng.integers(3, 30))))
                 for _ in range(int(rng.integers(1, 6)))]
        paras.append(f"§{i} " + "\n".join(lines))
    seps = [["\n\n", "\n\n\n", "\n \t\n", "\r\n\r\n"][int(k)] for k in rng.integers(0, 4, size=n - 1)] + [""]
    return paras, seps


def _greedy_documents(paras: list[str], seps: list[str], min_chars: int) -> list[str]:
    """The rule stated in ``prepare --help``: a document closes at the first blank line once it
    holds ``min_chars`` characters; the blank lines at a cut belong to neither document."""
    docs, doc = [], ""
    for p, s in zip(paras, seps):
        doc += p
        if len(doc) >= min_chars or not s:
            docs.append(doc)
            doc = ""
        else:
            doc += s
    return docs


def _decode_documents(paths) -> list[str]:
    stream = split_stream(paths)
    starts = np.flatnonzero(stream == BOS).tolist() + [stream.size]
    enc = get_encoding()
    return [enc.decode(stream[a + 1 : b].tolist()) for a, b in zip(starts[:-1], starts[1:])]


@pytest.mark.parametrize("seed", [0, 1])
def test_single_txt_file_is_cut_at_blank_lines(tmp_path, seed):
    paras, seps = _paragraphs(seed, 300)
    src = tmp_path / "mytext.txt"
    src.write_bytes("".join(p + s for p, s in zip(paras, seps)).encode())
    res = prepare([str(src)], str(tmp_path / "out"), workers=1, progress=False)  # all defaults
    want = _greedy_documents(paras, [s.replace("\r\n", "\n") for s in seps], DEFAULT_TXT_DOCUMENT_CHARS)
    assert len(want) > 2
    got = _decode_documents(res.val_paths) + _decode_documents(res.train_paths)
    # the default split: document 0 and every 100th after it go to validation
    val_idx = list(range(0, len(want), 100))
    assert got == [want[i] for i in val_idx] + [d for i, d in enumerate(want) if i not in val_idx]
    assert res.val_documents == len(val_idx) and res.train_documents == len(want) - len(val_idx)
    assert all(len(d) >= DEFAULT_TXT_DOCUMENT_CHARS for d in want[:-1])
    assert f"cut at blank lines into documents of at least {DEFAULT_TXT_DOCUMENT_CHARS:,} characters" in res.summary()


def test_txt_without_blank_lines_is_cut_at_line_ends(tmp_path):
    lines = [f"line {i} " + "w" * (i % 37) for i in range(400)]
    src = tmp_path / "lines.txt"
    src.write_text("\n".join(lines))
    res = prepare([str(src)], str(tmp_path / "out"), txt_document_chars=500, val_documents=1, workers=1,
                  progress=False)
    want = _greedy_documents(lines, ["\n"] * (len(lines) - 1) + [""], 500)
    assert _decode_documents(res.val_paths) + _decode_documents(res.train_paths) == want
    assert "line ends" in res.summary()


def test_failed_prepare_leaves_nothing_and_its_advice_works(tmp_path):
    src = tmp_path / "tiny.txt"
    src.write_text("A first short paragraph.\n\nA second one.\n\nAnd a third.\n")
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=r"tiny.txt.* 1 document.*--txt-document-chars") as err:
        prepare([str(src)], str(out), workers=1, progress=False)
    assert "\n" not in str(err.value)
    assert sorted(out.iterdir()) == []  # no shard, no temporary file: the next try is not blocked
    with pytest.raises(ValueError, match=r"no training documents.*lower --val-documents below 3"):
        prepare([str(src)], str(out), val_documents=5, txt_document_chars=10, workers=1, progress=False)
    assert sorted(out.iterdir()) == []
    res = prepare([str(src)], str(out), txt_document_chars=10, workers=1, progress=False)
    assert (res.val_documents, res.train_documents) == (1, 2)
    assert sorted(p.name for p in out.iterdir()) == ["data_train_000001.bin", "data_val_000000.bin"]
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o644 for p in out.iterdir())


def test_interrupted_prepare_leaves_nothing(tmp_path, monkeypatch):
    src = tmp_path / "a.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in random_texts(5, 200)))
    out = tmp_path / "out"
    import nanogpt_pl.data.prepare as prepare_mod

    real, calls = prepare_mod.write_shard, []

    def write_then_stop(path, tokens):
        calls.append(path)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(path, tokens)

    monkeypatch.setattr(prepare_mod, "write_shard", write_then_stop)
    with pytest.raises(KeyboardInterrupt):
        prepare([str(src)], str(out), shard_tokens=300, val_documents=20, workers=1, progress=False)
    assert len(calls) == 3 and sorted(out.iterdir()) == []
