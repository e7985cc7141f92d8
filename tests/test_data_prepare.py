"""``nanogpt-pl data prepare``: text, jsonl and parquet files to BOS-prefixed GPT-2 shards."""

from __future__ import annotations

import gzip
import json

import numpy as np
import pytest
from data_fixtures import BOS, read_tokens

from nanogpt_pl.data.prepare import prepare
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
    whole = prepare([str(d)], str(tmp_path / "o1"), name="w", val_documents=1, workers=1, progress=False)
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
