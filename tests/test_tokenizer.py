"""GPT-2's tokenizer as the project reads it: tiktoken's merge ranks and the prefix table.

Needs the real ``r50k_base`` encoding (seeded offline with ``nanogpt-pl data tokenizer``).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nanogpt_pl.data.tokenizer import PADDED_VOCAB, build_prefix_table, get_encoding, mergeable_ranks


@pytest.fixture(scope="module")
def encoding():
    # No skip: without the real r50k_base encoding these tests must fail (the error says
    # how to seed the offline cache: `nanogpt-pl data tokenizer`).
    return get_encoding()


def test_prefix_table_known_tokens(encoding):
    table = build_prefix_table(PADDED_VOCAB, encoding)
    assert table.shape == (PADDED_VOCAB,) and table.dtype == torch.int64

    def tok(s: str) -> int:
        ids = encoding.encode(s)
        assert len(ids) == 1, s
        return ids[0]

    for word, prefix in [(" the", " th"), (" th", " t"), ("ing", "in"), (" Paris", " Par"), ("hello", "hell")]:
        assert int(table[tok(word)]) == tok(prefix), word
    assert int(table[tok(".")]) == -1 and int(table[tok("a")]) == -1
    assert int(table[50256]) == -1 and (table[50257:] == -1).all()


def test_prefix_table_is_longest_strict_byte_prefix(encoding):
    table = build_prefix_table(PADDED_VOCAB, encoding)
    tb = {i: encoding.decode_single_token_bytes(i) for i in range(50256)}
    by_bytes = {b: i for i, b in tb.items()}
    for i, b in tb.items():
        j = int(table[i])
        if len(b) == 1:
            assert j == -1
            continue
        # Byte-level BPE: every single byte is a token, so every longer token has a prefix.
        assert j >= 0, i
        pb = tb[j]
        assert len(pb) < len(b) and b.startswith(pb)
    rng = np.random.default_rng(0)
    for i in rng.choice(50256, 2000, replace=False).tolist():
        b = tb[i]
        longest = max((c for c in range(1, len(b)) if b[:c] in by_bytes), default=0)
        assert (int(table[i]) == -1) if longest == 0 else (len(tb[int(table[i])]) == longest)


def test_mergeable_ranks_of_the_real_encoding(encoding):
    # tiktoken's private Encoding._mergeable_ranks, read in one place (mergeable_ranks): if a
    # release drops it or changes its shape, this fails here rather than in a training run.
    ranks = encoding._mergeable_ranks
    assert isinstance(ranks, dict)
    assert mergeable_ranks(encoding) is ranks
    # r50k_base: 50,256 ordinary tokens with ids 0..50255, then <|endoftext|> = 50256 (RECORD §1).
    assert sorted(ranks.values()) == list(range(50256))
    assert all(type(b) is bytes for b in ranks)
    assert encoding.n_vocab == 50257 and encoding.eot_token == 50256
    for b, i in ranks.items():
        assert encoding.decode_single_token_bytes(i) == b


def test_mergeable_ranks_missing_or_reshaped_raises(encoding):
    class Public:
        """An encoding exposing only tiktoken's public API."""

        n_vocab = encoding.n_vocab
        decode_single_token_bytes = staticmethod(encoding.decode_single_token_bytes)

    class Reshaped(Public):
        _mergeable_ranks = {i: b for b, i in encoding._mergeable_ranks.items()}

    for enc in (Public(), Reshaped()):
        with pytest.raises(RuntimeError, match=r"_mergeable_ranks .*nanogpt_pl/data/tokenizer\.py mergeable_ranks"):
            build_prefix_table(PADDED_VOCAB, enc)


def test_prefix_table_vocab_too_small(encoding):
    with pytest.raises(ValueError, match="vocab_size 50000"):
        build_prefix_table(50000, encoding)
