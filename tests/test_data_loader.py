"""BOS-aligned training batches, the rank/micro-batch partition, resume, and the validation set."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from data_fixtures import (
    BOS,
    random_documents,
    read_tokens,
    reference_slices,
    small_schedule,
    write_random_shards,
)
from seeds import fresh_seed

from nanogpt_pl.data import stream as stream_mod
from nanogpt_pl.data.planning import (
    DataExhaustedError,
    DocumentTooLongError,
    distinct_tokens,
    max_num_docs,
    pack_cu_seqlens,
    slice_tokens,
)
from nanogpt_pl.data.shards import ShardError, write_shard
from nanogpt_pl.data.stream import TrainStream, iter_steps
from nanogpt_pl.data.validation import ValidationSet


def _stream(paths, schedule, **kw):
    kw.setdefault("pin_memory", False)
    return TrainStream([str(p) for p in paths], schedule, **kw)


def _take(stream, n):
    try:
        return iter_steps(stream, n)
    finally:
        stream.close()


def _real_segments(cu: torch.Tensor, T: int) -> np.ndarray:
    """Segment lengths before the padding (padding repeats T)."""
    c = cu.numpy().astype(np.int64)
    n = int(np.argmax(c == T)) + 1  # first T ends the real segments
    return np.diff(c[:n])


def _check_micro_batch(mb, T, cap, attention_split=None):
    inputs, targets, cu = mb["inputs"], mb["targets"], mb["cu_seqlens"]
    assert inputs.dtype == torch.int32 and inputs.shape == (T,)
    assert targets.dtype == torch.int64 and targets.shape == (T,)
    assert cu.dtype == torch.int32
    assert inputs[0].item() == BOS
    torch.testing.assert_close(targets[:-1], inputs[1:].long())
    c = cu.numpy()
    assert c[0] == 0 and np.all(np.diff(c) >= 0) and c[-1] == T
    assert len(c) >= max_num_docs(T) and (len(c) == max_num_docs(T) or len(c) % 128 == 0)
    seg = _real_segments(cu, T)
    assert seg.sum() == T and mb["max_seqlen"] == seg.max()
    starts = np.concatenate([[0], np.cumsum(seg)[:-1]])
    x = inputs.numpy()
    bos_pos = set(np.flatnonzero(x == BOS).tolist())
    if attention_split is None:
        # every segment is one document piece: it starts at a BOS, holds no other BOS, fits the cap
        assert set(starts.tolist()) == bos_pos
        assert seg.max() <= cap
    else:
        assert seg.max() <= attention_split
        assert bos_pos <= set(starts.tolist())


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_bos_alignment_matches_reference(tmp_path, seed):
    T, W = 64, 2
    sched = small_schedule([(20, 4 * T, T, 48)])
    paths = write_random_shards(tmp_path, seed, n_shards=3, docs_per_shard=150, mean_len=30)
    shard_tokens = [read_tokens(p) for p in paths]
    ref = reference_slices(shard_tokens, sched, 20)
    per_rank = [_take(_stream(paths, sched, world_size=W, rank=r), 20) for r in range(W)]
    for step in range(20):
        A = 4 // W
        for r in range(W):
            assert len(per_rank[r][step]) == A
            for a in range(A):
                mb = per_rank[r][step][a]
                assert mb["step"] == step
                _check_micro_batch(mb, T, 48)
                toks, lens = ref[step][a * W + r]
                np.testing.assert_array_equal(mb["inputs"].numpy(), toks[:-1].astype(np.int32))
                np.testing.assert_array_equal(mb["targets"].numpy(), toks[1:].astype(np.int64))
                seg = list(lens)
                seg[-1] -= 1
                seg = [s for s in seg if s > 0]
                np.testing.assert_array_equal(_real_segments(mb["cu_seqlens"], T), seg)


def test_partition_independent_of_world_size(tmp_path):
    T = 32
    sched = small_schedule([(12, 4 * T, T, 40)])
    paths = write_random_shards(tmp_path, 11, n_shards=2, docs_per_shard=80, mean_len=20)

    def slices(W):
        per_rank = [_take(_stream(paths, sched, world_size=W, rank=r), 12) for r in range(W)]
        out = []
        for step in range(12):
            A = 4 // W
            out.append([per_rank[i % W][step][i // W]["inputs"].numpy() for i in range(W * A)])
        return out

    one, two, four = slices(1), slices(2), slices(4)
    for s in range(12):
        for a, b, c in zip(one[s], two[s], four[s]):
            np.testing.assert_array_equal(a, b)
            np.testing.assert_array_equal(a, c)


def test_batch_and_seq_len_change_between_steps(tmp_path):
    stages = [(3, 128, 32, 24), (2, 384, 64, 100), (3, 256, 128, 300), (2, 64, 32, 24)]
    sched = small_schedule(stages)
    paths = write_random_shards(tmp_path, 21, n_shards=2, docs_per_shard=150, mean_len=40)
    ref = reference_slices([read_tokens(p) for p in paths], sched, 10)
    W = 2
    got = [_take(_stream(paths, sched, world_size=W, rank=r), 10) for r in range(W)]
    for step in range(10):
        T = sched.seq_len(step)
        A = sched.batch_tokens(step) // (W * T)
        for r in range(W):
            assert len(got[r][step]) == A
            for a, mb in enumerate(got[r][step]):
                _check_micro_batch(mb, T, sched.max_doc_len(step))
                np.testing.assert_array_equal(mb["inputs"].numpy(), ref[step][a * W + r][0][:-1])


def test_attention_split(tmp_path):
    T, cap, split = 256, 200, 48
    sched = small_schedule([(6, 2 * T, T, cap)], attention_cap=split)
    assert sched.attention_split(0) == split
    paths = write_random_shards(tmp_path, 31, n_shards=1, docs_per_shard=120, mean_len=150)
    ref = reference_slices([read_tokens(p) for p in paths], sched, 6)
    steps = _take(_stream(paths, sched), 6)
    for step, item in enumerate(steps):
        for a, mb in enumerate(item):
            _check_micro_batch(mb, T, cap, attention_split=split)
            toks, lens = ref[step][a]
            np.testing.assert_array_equal(mb["inputs"].numpy(), toks[:-1])
            seg = list(lens)
            seg[-1] -= 1
            expected = []
            for n in seg:
                expected += [split] * (n // split) + ([n % split] if n % split else [])
            np.testing.assert_array_equal(_real_segments(mb["cu_seqlens"], T), expected)
            assert mb["max_seqlen"] == max(expected)


def test_cu_seqlens_padding_rule():
    # RECORD.md §1 table, and the T/300 rule elsewhere
    assert [max_num_docs(t) for t in (16384, 32768, 40960, 49152)] == [64, 96, 128, 128]
    assert max_num_docs(262_144) == 896
    assert max_num_docs(1000) == 128
    b = np.arange(0, 1001, 5)  # 201 boundaries: more than the 128 bucket
    cu = pack_cu_seqlens(b, 1000)
    assert len(cu) == 256 and cu[200] == 1000 and np.all(cu[201:] == 1000)


def test_shard_switch_drops_partial_step(tmp_path):
    # shard 1 holds one step and a bit: the partial second step is dropped and served from shard 2
    T = 32
    sched = small_schedule([(3, 2 * T, T, 1000)])
    rng = np.random.default_rng(41)
    # three 40-token documents: step 0 takes two, step 1 finds one and must move on
    a = rng.integers(0, BOS, size=120).astype(np.uint16)
    a[[0, 40, 80]] = BOS
    b = np.concatenate(random_documents(rng, 20, 25))
    pa = write_shard(tmp_path / "s_000001.bin", a)
    pb = write_shard(tmp_path / "s_000002.bin", b)
    ref = reference_slices([a, b], sched, 3)
    steps = _take(_stream([pa, pb], sched), 3)
    for s in range(3):
        for i, mb in enumerate(steps[s]):
            np.testing.assert_array_equal(mb["inputs"].numpy(), ref[s][i][0][:-1])
    np.testing.assert_array_equal(steps[0][1]["inputs"].numpy(), a[40 : 40 + T])
    np.testing.assert_array_equal(steps[1][0]["inputs"].numpy()[:5], b[:5])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_long_documents_truncated_and_counted(tmp_path, seed):
    """Documents over max_doc_len keep their first max_doc_len tokens (the record's rule); each
    micro-batch counts the tokens its documents lost, matching a plain recount."""
    T, cap = 64, 24
    sched = small_schedule([(4, 2 * T, T, cap)])
    rng = np.random.default_rng(seed)
    docs = random_documents(rng, 60, 30)  # geometric lengths around 30: many exceed the cap
    path = write_shard(tmp_path / f"long_{seed}_000001.bin", np.concatenate(docs))
    steps = _take(_stream([path], sched), 4)
    # recount: walk the documents as the loader does (whole pieces, then the slice boundary)
    lengths = [len(d) for d in docs]
    k, expected = 0, []
    for _ in range(4 * 2):
        need, cut = T + 1, 0
        while need > 0:
            take = min(lengths[k], cap)
            cut += lengths[k] - take
            need -= take
            k += 1
        expected.append(cut)
    got = [mb["doc_tokens_cut"] for step in steps for mb in step]
    assert got == expected and sum(got) > 0
    for step in steps:
        for mb in step:
            _check_micro_batch(mb, T, cap)


def test_long_documents_error_names_the_shard(tmp_path):
    T, cap = 32, 24
    sched = small_schedule([(2, T, T, cap)])
    docs = [np.concatenate([[BOS], np.full(10, 7)]), np.concatenate([[BOS], np.full(40, 9)]),
            np.concatenate([[BOS], np.full(30, 5)])]
    path = write_shard(tmp_path / "long_000001.bin", np.concatenate(docs).astype(np.uint16))
    with pytest.raises(DocumentTooLongError, match=r"long_000001\.bin: the document at token 11 has 41 tokens, "
                                                   r"more than the schedule's max_doc_len of 24 at step 0.*"
                                                   r"data\.long_documents: truncate"):
        _take(_stream([path], sched, long_documents="error"), 1)
    with pytest.raises(ValueError, match=r"data\.long_documents='cut'"):
        _stream([path], sched, long_documents="cut")
    # the default keeps the record's rule
    (mb,), = _take(_stream([path], sched), 1)
    assert mb["doc_tokens_cut"] == 41 - 24


def test_data_exhausted(tmp_path):
    T = 32
    sched = small_schedule([(50, 2 * T, T, 64)])
    paths = write_random_shards(tmp_path, 51, n_shards=1, docs_per_shard=20, mean_len=20)
    stream = _stream(paths, sched)
    it = iter(stream)
    served = 0
    with pytest.raises(DataExhaustedError) as err:
        for _ in it:
            served += 1
    stream.close()
    msg = str(err.value)
    assert f"ran out at step {served}" in msg and f"steps 0..{served - 1} were served" in msg
    assert "fewer steps" in msg and "nanogpt-pl data fineweb" in msg
    assert 0 < served < 50


def test_explicit_epochs_repeat_the_shards(tmp_path):
    T = 32
    sched = small_schedule([(200, 2 * T, T, 64)])
    paths = write_random_shards(tmp_path, 52, n_shards=2, docs_per_shard=60, mean_len=20)
    tokens = [read_tokens(p) for p in paths]
    with pytest.raises(DataExhaustedError, match="data.epochs"):
        _take(_stream(paths, sched), 200)
    ref = reference_slices(tokens * 3, sched, 41)  # three passes, in the same order
    stream = _stream(paths, sched, epochs=3)
    got = _take(stream, 40)
    for step in range(40):
        for i, mb in enumerate(got[step]):
            np.testing.assert_array_equal(mb["inputs"].numpy(), ref[step][i][0][:-1])
    state = stream.state_dict()
    assert state["step"] == 40 and state["shard"] >= 2  # into the second pass
    resumed = _stream(paths, sched, epochs=3)
    resumed.load_state_dict(state)
    np.testing.assert_array_equal(_take(resumed, 1)[0][0]["inputs"].numpy(), ref[40][0][0][:-1])
    with pytest.raises(DataExhaustedError, match=r"in 3 passes \(data.epochs\)"):
        _take(_stream(paths, sched, epochs=3), 200)


def test_token_above_vocab_raised_from_thread(tmp_path):
    T = 32
    sched = small_schedule([(40, 2 * T, T, 64)])
    paths = write_random_shards(tmp_path, 61, n_shards=2, docs_per_shard=40, mean_len=20)
    tokens = read_tokens(paths[1]).copy()
    tokens[len(tokens) // 2] = 50300
    write_shard(paths[1], tokens)
    stream = _stream(paths, sched, prefetch=2)
    served = 0
    with pytest.raises(ShardError, match=r"rand_train_000002.bin: token id 50300 is >= the vocabulary size 50257"):
        for item in stream:
            served += 1
    stream.close()
    assert served > 0  # the first shard was served before the error surfaced


def test_prefetch_thread_error_propagates(tmp_path, monkeypatch):
    T = 32
    sched = small_schedule([(20, 2 * T, T, 64)])
    paths = write_random_shards(tmp_path, 71, n_shards=1, docs_per_shard=200, mean_len=20)
    real = stream_mod.build_micro_batch
    threads = set()

    def failing(shard, starts, lengths, seq_len, step, *a, **k):
        threads.add(threading.current_thread().name)
        if step == 5:
            raise RuntimeError("boom at step 5")
        return real(shard, starts, lengths, seq_len, step, *a, **k)

    monkeypatch.setattr(stream_mod, "build_micro_batch", failing)
    stream = _stream(paths, sched, prefetch=3)
    got = []
    with pytest.raises(RuntimeError, match="boom at step 5"):
        for item in stream:
            got.append(item[0]["step"])
    stream.close()
    assert got == [0, 1, 2, 3, 4]
    assert threads == {"train-stream"}  # built on the background thread


def test_stops_at_stop_step(tmp_path):
    T = 32
    sched = small_schedule([(6, T, T, 64)])
    paths = write_random_shards(tmp_path, 81, n_shards=1, docs_per_shard=200, mean_len=20)
    assert len(_take(_stream(paths, sched), 100)) == 6
    assert len(_take(_stream(paths, sched, stop_step=4), 100)) == 4


def _flat(steps):
    return [np.concatenate([mb["inputs"].numpy() for mb in item]) for item in steps]


@pytest.mark.parametrize("seed", [0, 1])
def test_resume_from_state_dict_equals_straight_run(tmp_path, seed):
    T = 32
    stages = [(5, 2 * T, T, 40), (5, 4 * 64, 64, 90), (10, 2 * T, T, 40)]
    sched = small_schedule(stages)
    paths = write_random_shards(tmp_path, 90 + seed, n_shards=3, docs_per_shard=60, mean_len=30)
    straight = _flat(_take(_stream(paths, sched, world_size=2, rank=1), 20))

    rng = np.random.default_rng(seed)
    k = int(rng.integers(3, 15))
    trained = [0]
    first = _stream(paths, sched, world_size=2, rank=1, prefetch=4, consumed_steps=lambda: trained[0])
    it = iter(first)
    # the consumer fetches ahead of training, as Lightning's fetcher does
    for _ in range(k + 1):
        next(it)
    trained[0] = k
    state = first.state_dict()
    first.close()
    assert state["step"] == k

    resumed = _stream(paths, sched, world_size=2, rank=1)
    resumed.load_state_dict(state)
    rest = _flat(_take(resumed, 20 - k))
    assert len(rest) == 20 - k
    for a, b in zip(straight[k:], rest):
        np.testing.assert_array_equal(a, b)

    # the saved cursor is world-size independent: resume on 1 rank with 4 micro-batches
    solo = _stream(paths, sched, world_size=1, rank=0)
    solo.load_state_dict(state)
    solo_items = _take(solo, 1)[0]
    two = _take(_stream(paths, sched, world_size=2, rank=1, start_step=k), 1)[0]
    np.testing.assert_array_equal(solo_items[1]["inputs"].numpy(), two[0]["inputs"].numpy())


def test_start_step_and_seek_reproduce_straight_run(tmp_path):
    T = 32
    sched = small_schedule([(4, 2 * T, T, 40), (8, 3 * T, T, 70)])
    paths = write_random_shards(tmp_path, 101, n_shards=2, docs_per_shard=60, mean_len=25)
    straight = _flat(_take(_stream(paths, sched), 12))
    late = _flat(_take(_stream(paths, sched, start_step=7), 5))
    for a, b in zip(straight[7:], late):
        np.testing.assert_array_equal(a, b)

    stream = _stream(paths, sched, prefetch=3)
    it = iter(stream)
    for _ in range(6):
        next(it)
    stream.seek(2)  # rewinds the live iterator in place
    again = [next(it) for _ in range(3)]
    stream.close()
    for a, b in zip(straight[2:5], _flat(again)):
        np.testing.assert_array_equal(a, b)
    assert [item[0]["step"] for item in again] == [2, 3, 4]


def test_state_dict_rejects_other_files(tmp_path):
    T = 32
    sched = small_schedule([(10, 2 * T, T, 40)])
    a = write_random_shards(tmp_path / "a", 111, n_shards=2, docs_per_shard=30, mean_len=20, name="a")
    b = write_random_shards(tmp_path / "b", 112, n_shards=2, docs_per_shard=30, mean_len=20, name="b")
    s = _stream(a, sched)
    _take(s, 3)
    state = s.state_dict()
    with pytest.raises(ShardError, match="resume with the same training files"):
        _stream(b, sched).load_state_dict(state)


def test_indivisible_batch_is_rejected(tmp_path):
    sched = small_schedule([(4, 96, 32, 40)])
    paths = write_random_shards(tmp_path, 121, n_shards=1, docs_per_shard=10, mean_len=20)
    with pytest.raises(ValueError, match="not divisible by world_size 2 x seq_len 32"):
        _stream(paths, sched, world_size=2)


# ---------------------------------------------------------------------------------------
# validation


def _val_shard(tmp_path, seed, n_docs=200):
    rng = np.random.default_rng(seed)
    tokens = np.concatenate(random_documents(rng, n_docs, 40))
    return write_shard(tmp_path / "v_val_000000.bin", tokens), tokens


@pytest.mark.parametrize("seed", [0, 1])
def test_validation_set_fixed_and_split_over_ranks(tmp_path, seed):
    path, tokens = _val_shard(tmp_path, 200 + seed)
    S, W, n_tok = 128, 4, 1024
    runs = [[list(ValidationSet(str(path), n_tok, S, W, r, pin_memory=False)) for r in range(W)] for _ in range(2)]
    assert all(len(r) == n_tok // (W * S) for r in runs[0])
    for r in range(W):
        for a, b in zip(runs[0][r], runs[1][r]):
            for key in ("inputs", "targets", "cu_seqlens"):
                assert torch.equal(a[key], b[key])
    for b_idx in range(n_tok // (W * S)):
        inputs = np.concatenate([runs[0][r][b_idx]["inputs"].numpy() for r in range(W)])
        targets = np.concatenate([runs[0][r][b_idx]["targets"].numpy() for r in range(W)])
        lo = b_idx * W * S
        np.testing.assert_array_equal(inputs, tokens[lo : lo + W * S])
        np.testing.assert_array_equal(targets, tokens[lo + 1 : lo + W * S + 1])
        for r in range(W):
            mb = runs[0][r][b_idx]
            x = mb["inputs"].numpy()
            expect = sorted(set([0, S] + np.flatnonzero(x == BOS).tolist()))
            c = mb["cu_seqlens"].numpy()
            assert c[: len(expect)].tolist() == expect and np.all(c[len(expect) :] == S)
            assert mb["max_seqlen"] == max(np.diff(expect))


def test_validation_spans_shards(tmp_path):
    rng = np.random.default_rng(7)
    a = np.concatenate(random_documents(rng, 10, 20))[:100]
    b = np.concatenate(random_documents(rng, 30, 20))
    write_shard(tmp_path / "v_val_000000.bin", a)
    write_shard(tmp_path / "v_val_000001.bin", b)
    vs = ValidationSet(str(tmp_path / "v_val_*.bin"), 256, 64, 2, 1, pin_memory=False)
    both = np.concatenate([a, b])
    np.testing.assert_array_equal(vs.batch(1)["inputs"].numpy(), both[192:256])
    np.testing.assert_array_equal(vs.batch(1)["targets"].numpy(), both[193:257])


def test_validation_errors(tmp_path):
    path, tokens = _val_shard(tmp_path, 300, n_docs=20)
    msg = r"data.val_tokens=1000 is not a multiple of world_size 2 x data.val_seq_len 128"
    with pytest.raises(ValueError, match=msg):
        ValidationSet(str(path), 1000, 128, 2, 0)
    big = (len(tokens) // 256 + 2) * 256
    with pytest.raises(ShardError, match=r"holds only \d+; lower data.val_tokens to \d+"):
        ValidationSet(str(path), big, 128, 2, 0)
    with pytest.raises(ShardError, match="data.val_files=.*matches no files"):
        ValidationSet(str(tmp_path / "missing_*.bin"), 256, 128, 2, 0)
    bad = tokens.copy()
    bad[10] = 60000
    write_shard(path, bad)
    with pytest.raises(ShardError, match="token id 60000"):
        ValidationSet(str(path), 256, 128, 1, 0)


@pytest.mark.parametrize("run", [0, 1])
def test_slice_tokens_and_distinct_tokens_equal_their_plain_references(run):
    """The one-gather slice equals concatenating its pieces, and the host-side distinct count equals
    ``torch.unique``'s, on random pieces of a random shard (short and long pieces, repeats)."""
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 50257, 200_000, dtype=np.uint16)
    tokens[rng.integers(0, tokens.size, 5000)] = 7  # one frequent id
    shard = SimpleNamespace(tokens=tokens)
    for pieces in (1, 3, 400):
        lengths = rng.integers(1, 300, pieces)
        starts = rng.integers(0, tokens.size - 300, pieces)
        want = np.concatenate([tokens[s : s + n] for s, n in zip(starts, lengths)])
        got = slice_tokens(shard, starts, lengths)
        assert got.dtype == tokens.dtype and np.array_equal(got, want), (seed, pieces)
        assert distinct_tokens(got) == torch.unique(torch.from_numpy(want.astype(np.int64))).numel(), seed
