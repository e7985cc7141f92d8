"""Data errors a user can cause: each names the real cause and a fix that works."""

from __future__ import annotations

import re

import numpy as np
import pytest
from data_fixtures import BOS, random_documents, small_schedule

from nanogpt_pl.data.planning import DataExhaustedError
from nanogpt_pl.data.shards import ShardError, write_shard
from nanogpt_pl.data.stream import TrainStream, iter_steps
from nanogpt_pl.data.validation import ValidationSet


def _first_step_error(paths, schedule) -> str:
    stream = TrainStream([str(p) for p in paths], schedule, pin_memory=False)
    try:
        with pytest.raises(ShardError) as err:
            iter_steps(stream, 1)
    finally:
        stream.close()
    msg = str(err.value)
    assert "\n" not in msg
    return msg


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_validation_too_small_advice_works(tmp_path, seed):
    rng = np.random.default_rng(seed)
    tokens = np.concatenate(random_documents(rng, 30, 20))[: int(rng.integers(40, 400))]
    path = write_shard(tmp_path / f"v{seed}_val_000000.bin", tokens)
    world = int(rng.integers(1, 4))
    for seq_len in (16, 1024):  # the second is longer than the whole validation split
        val_tokens = world * seq_len * 32  # more than the shard holds
        with pytest.raises(ShardError) as err:
            ValidationSet(str(path), val_tokens, seq_len, world, 0, pin_memory=False)
        msg = str(err.value)
        assert "\n" not in msg and str(path) in msg
        got = re.search(r"lower data\.val_tokens to (\d+)(?: and data\.val_seq_len to (\d+))?", msg)
        assert got, msg
        fixed_tokens = int(got.group(1))
        fixed_seq = int(got.group(2)) if got.group(2) else seq_len
        assert fixed_tokens > 0 and (got.group(2) is None) == (seq_len == 16)
        vs = ValidationSet(str(path), fixed_tokens, fixed_seq, world, world - 1, pin_memory=False)
        assert len(vs) >= 1 and vs.batch(len(vs) - 1)["inputs"].numel() == fixed_seq


def test_validation_with_fewer_tokens_than_ranks_says_add_data(tmp_path):
    path = write_shard(tmp_path / "tiny_val_000000.bin", np.array([BOS, 5, 6], dtype=np.uint16))
    with pytest.raises(ShardError, match=r"tiny_val_000000.bin.*add validation data") as err:
        ValidationSet(str(path), 64, 16, 4, 0, pin_memory=False)
    assert "data.val_tokens to 0" not in str(err.value)


def test_shard_without_bos_names_the_shard_not_epochs(tmp_path):
    T = 32
    rng = np.random.default_rng(4)
    tokens = rng.integers(0, BOS, size=5000).astype(np.uint16)  # ids only, no document separators
    path = write_shard(tmp_path / "raw_train_000001.bin", tokens)
    msg = _first_step_error([path], small_schedule([(10, 2 * T, T, 64)]))
    assert "raw_train_000001.bin" in msg and "no BOS token 50256" in msg and "nanogpt-pl data prepare" in msg
    assert "data.epochs" not in msg and "ran out" not in msg


@pytest.mark.parametrize("n_shards", [1, 3])
def test_step_larger_than_the_data_names_the_sizes(tmp_path, n_shards):
    T = 256
    rng = np.random.default_rng(5)
    paths = [write_shard(tmp_path / f"s_train_{i + 1:06d}.bin", np.concatenate(random_documents(rng, 40, 20))[:200])
             for i in range(n_shards)]
    total = 200 * n_shards
    msg = _first_step_error(paths, small_schedule([(10, 2 * T, T, 512)]))
    assert f"step 0 needs {2 * (T + 1):,} tokens" in msg, msg
    assert "data.epochs" not in msg and "ran out" not in msg
    if n_shards == 1:
        assert f"the whole training set (data.train_files, 1 shard(s)) has {total:,} tokens" in msg
    else:  # enough tokens in all, but a step never spans shards
        assert "the largest shard of data.train_files has 200 tokens" in msg and "--shard-tokens" in msg
    assert "batch_tokens" in msg and "seq_len" in msg


def test_step_too_large_is_still_an_exhausted_data_error(tmp_path):
    T = 256
    rng = np.random.default_rng(6)
    path = write_shard(tmp_path / "s_train_000001.bin", np.concatenate(random_documents(rng, 40, 20))[:200])
    stream = TrainStream([str(path)], small_schedule([(10, 2 * T, T, 512)]), pin_memory=False)
    with pytest.raises(DataExhaustedError):
        iter_steps(stream, 1)
    stream.close()
