"""The n-gram row and sign hashes: exact int32 semantics, ranges, boundary behaviour, collisions."""

from __future__ import annotations

import math

import pytest
import torch

from nanogpt_pl.model.embeddings import (
    RECORD_NGRAM_ROWS,
    SIGN_ROWS,
    check_ngram_rows,
    make_sign_table,
    ngram_row_ids,
    ngram_sign_rows,
    wrap_int32,
)


def i32(v: int) -> int:
    v &= 0xFFFFFFFF
    return v - (1 << 32) if v >= 1 << 31 else v


def reference_rows(x: list[int], ngram_rows: int) -> tuple[list[int], list[int], list[int], list[int]]:
    """RECORD §3 in plain Python: int32 products, XOR, floor modulo (Python's %), & 8191."""
    h = ngram_rows // 2
    m = h - 1
    big, tri, sb, st = [], [], [], []
    for t in range(len(x)):
        big.append(m if t == 0 else (i32(36313 * x[t]) ^ i32(27191 * x[t - 1])) % m)
        tri.append(ngram_rows - 1 if t < 2 else
                   h + ((i32(17351 * x[t]) ^ i32(60961 * x[t - 1]) ^ i32(45259 * x[t - 2])) % m))
        sb.append(0 if t == 0 else (i32(30011 * x[t - 1]) ^ i32(48271 * x[t])) & 8191)
        st.append(0 if t < 2 else (i32(26801 * x[t - 2]) ^ i32(39779 * x[t - 1]) ^ i32(58699 * x[t])) & 8191)
    return big, tri, sb, st


@pytest.mark.parametrize("seed", [3, 17, 29])
@pytest.mark.parametrize("ngram_rows", [RECORD_NGRAM_ROWS, 2 * 4099, 1000])
@pytest.mark.parametrize("high", [50304, 1 << 16, (1 << 31) - 1])
def test_hashes_match_plain_python_int32(seed, ngram_rows, high):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, high, (257,), generator=gen)
    rows, signs = ngram_row_ids(ids, ngram_rows), ngram_sign_rows(ids)
    big, tri, sb, st = reference_rows(ids.tolist(), ngram_rows)
    assert rows[0].tolist() == big and rows[1].tolist() == tri
    assert signs[0].tolist() == sb and signs[1].tolist() == st


def test_wrap_int32_is_twos_complement():
    vals = [0, 1, -1, 2**31 - 1, 2**31, 2**32 + 5, -(2**31) - 1, 36313 * 50303, 60961 * 65535]
    assert wrap_int32(torch.tensor(vals)).tolist() == [i32(v) for v in vals]


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("ngram_rows", [RECORD_NGRAM_ROWS, 6, 1 << 20])
def test_rows_always_in_range(seed, ngram_rows):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.cat([torch.randint(0, 50304, (5000,), generator=gen),
                     torch.randint(0, 2**31 - 1, (5000,), generator=gen),
                     torch.tensor([0, 50303, 65535, 2**31 - 1, 2**31 - 1, 0])])
    rows, signs = ngram_row_ids(ids, ngram_rows), ngram_sign_rows(ids)
    h = ngram_rows // 2
    assert 0 <= rows[0].min() and rows[0].max() <= h - 1  # hashed rows [0, M) and the reserved row M
    assert h <= rows[1].min() and rows[1].max() <= ngram_rows - 1
    assert (rows[0, 1:] < h - 1).all() and (rows[1, 2:] < ngram_rows - 1).all()  # reserved rows only at the start
    assert rows[0, 0] == h - 1 and (rows[1, :2] == ngram_rows - 1).all()
    assert 0 <= signs.min() and signs.max() < SIGN_ROWS
    assert (signs[0, :1] == 0).all() and (signs[1, :2] == 0).all()


def test_hashes_cross_document_boundaries_like_the_record():
    """A token's rows depend on the previous tokens of the packed stream, BOS or not."""
    gen = torch.Generator().manual_seed(5)
    seq = torch.randint(0, 50256, (64,), generator=gen)
    seq[[0, 20, 41]] = 50256  # three documents
    rows, signs = ngram_row_ids(seq, 1 << 12), ngram_sign_rows(seq)
    for t in range(2, 64):
        window = seq[t - 2 : t + 1]
        assert torch.equal(rows[:, t], ngram_row_ids(window, 1 << 12)[:, 2])
        assert torch.equal(signs[:, t], ngram_sign_rows(window)[:, 2])
    # the BOS at 20 reads the bigram (last token of document 0, BOS), not the reserved row
    assert rows[0, 20] != (1 << 11) - 1


@pytest.mark.parametrize("bad", [0, 2, 7, 84_602_881])
def test_bad_table_size_names_the_option(bad):
    with pytest.raises(ValueError, match="ngram_rows"):
        check_ngram_rows(bad)


def test_sign_table_is_fixed_and_balanced():
    a, b = make_sign_table(96), make_sign_table(96)
    assert torch.equal(a, b) and set(a.unique().tolist()) == {-1.0, 1.0}
    assert abs(a.mean().item()) < 0.01


def collision_fraction(keys: torch.Tensor, rows: torch.Tensor) -> float:
    """Fraction of distinct n-grams (keys) that share their row with another distinct n-gram."""
    unique_keys, inverse = torch.unique(keys, return_inverse=True)
    row_of_key = torch.zeros(unique_keys.numel(), dtype=rows.dtype).scatter_(0, inverse, rows)
    return 1 - torch.unique(row_of_key).numel() / unique_keys.numel()


def uniform_expectation(n: int, bins: int) -> float:
    """1 - E[occupied bins]/n for n keys hashed uniformly into ``bins`` rows."""
    return 1 - bins * -math.expm1(n * math.log1p(-1 / bins)) / n


def ngram_keys(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = ids.long()
    return x[1:] * 65536 + x[:-1], (x[2:] * 65536 + x[1:-1]) * 65536 + x[:-2]


def check_collisions(ids: torch.Tensor, ngram_rows: int) -> dict[str, tuple[float, float]]:
    rows = ngram_row_ids(ids, ngram_rows)
    big_keys, tri_keys = ngram_keys(ids)
    out = {}
    for name, keys, r in (("bigram", big_keys, rows[0, 1:]), ("trigram", tri_keys, rows[1, 2:])):
        measured = collision_fraction(keys, r)
        expected = uniform_expectation(torch.unique(keys).numel(), ngram_rows // 2 - 1)
        out[name] = (measured, expected)
        # XOR-multiply hashing behaves like uniform hashing on these inputs (measured values:
        # see the module docstring of nanogpt_pl.model.embeddings and the benchmark's output)
        assert abs(measured - expected) <= 0.1 * expected + 5e-4, (name, ngram_rows, measured, expected)
    return out


@pytest.mark.parametrize("ngram_rows", [RECORD_NGRAM_ROWS, 1 << 20, 1 << 16])
def test_collision_rate_on_random_tokens_is_that_of_uniform_hashing(ngram_rows):
    gen = torch.Generator().manual_seed(11)
    ids = torch.randint(0, 50304, (60_000,), generator=gen)
    check_collisions(ids, ngram_rows)


@pytest.fixture(scope="module")
def real_tokens() -> torch.Tensor:
    """GPT-2 tokens of Python's interactive-help topics (real English/technical text, ~139k tokens)."""
    pydoc_topics = pytest.importorskip("pydoc_data.topics")
    from nanogpt_pl.data.tokenizer import get_encoding

    try:
        enc = get_encoding()
    except Exception as e:  # the offline tokenizer cache is not seeded on this machine
        pytest.skip(f"tokenizer unavailable: {e}")
    text = "\n".join(pydoc_topics.topics[k] for k in sorted(pydoc_topics.topics))
    return torch.tensor(enc.encode_ordinary(text))


@pytest.mark.parametrize("ngram_rows", [RECORD_NGRAM_ROWS, 1 << 20, 1 << 16])
def test_collision_rate_on_real_text(real_tokens, ngram_rows):
    stats = check_collisions(real_tokens, ngram_rows)
    if ngram_rows == RECORD_NGRAM_ROWS:
        # at the record's size, well under 0.2% of the distinct n-grams of this text share a row
        assert stats["bigram"][0] < 2e-3 and stats["trigram"][0] < 2e-3
