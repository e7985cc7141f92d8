"""The sampled softmax's candidate sets (RECORD §6): contents, the stride sweep, resume."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from seeds import fresh_seed

from nanogpt_pl.data.tokenizer import PADDED_VOCAB
from nanogpt_pl.ops.sampling import CANDIDATE_MULTIPLE, CandidateSampler

SEEDS = (0, 1, 2)


def zipf_targets(seed, n, v=50257, a=1.1):
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, v + 1) ** a
    return rng.choice(v, size=n, p=p / p.sum())


@pytest.mark.parametrize("world_size", [1, 2, 8])
def test_candidate_set_contains_targets_unique_exact_size(world_size):
    for seed in SEEDS:
        for rank in range(world_size):
            s = CandidateSampler(rank=rank, world_size=world_size)
            for p in (10240, 14336, 24576):
                t = zipf_targets(seed * 100 + rank, 16384)
                extra = np.where(np.arange(t.size) % 3 == 0, -1, (t * 7) % 50257)
                c = s.build(torch.from_numpy(t), p, extra=torch.from_numpy(extra))
                assert c.dtype == torch.int64 and c.numel() == p
                assert (c[1:] > c[:-1]).all(), "sorted and duplicate-free"
                assert 0 <= int(c[0]) and int(c[-1]) < PADDED_VOCAB
                assert torch.isin(torch.from_numpy(t), c).all()
                assert torch.isin(torch.from_numpy(extra[extra >= 0]), c).all()


def test_sampler_sweep_offsets_and_resume():
    t = zipf_targets(0, 8192)
    starts = [CandidateSampler(rank=r, world_size=8).offset for r in range(8)]
    assert starts == [PADDED_VOCAB * r // 8 for r in range(8)]
    a = CandidateSampler(rank=3, world_size=8)
    first = a.build(t, 10240)
    unique = np.unique(t).size
    draw = min(PADDED_VOCAB, int((10240 - unique) * 1.7) + 256)
    assert a.offset == (starts[3] + draw) % PADDED_VOCAB
    # Negatives are the sweep's window, in order: perm[k] = 20011·k mod V.
    window = (20011 * np.arange(starts[3], starts[3] + draw)) % PADDED_VOCAB
    negs = np.setdiff1d(first.numpy(), np.unique(t))
    fresh = window[~np.isin(window, t)][: 10240 - unique]
    assert set(negs.tolist()) == set(fresh.tolist())
    state = a.state_dict()
    nxt = [a.build(zipf_targets(s, 8192), 14336) for s in (1, 2)]
    b = CandidateSampler(rank=3, world_size=8)
    b.load_state_dict([CandidateSampler(rank=r, world_size=8).state_dict() if r != 3 else state for r in range(8)])
    assert all(torch.equal(x, b.build(zipf_targets(s, 8192), 14336)) for x, s in zip(nxt, (1, 2)))
    with pytest.raises(ValueError, match="world_size"):
        b.load_state_dict([state])


def test_sampler_fills_when_window_runs_short():
    # Nearly every class is a target: the sweep window holds too few free classes, so the
    # gap is filled with evenly spaced free ones.
    v = 4096
    t = np.random.default_rng(0).permutation(v)[: v - 300]
    s = CandidateSampler(v, stride=1001, multiple=128)
    c = s.build(t, v - 256)
    assert c.numel() == v - 256 and (c[1:] > c[:-1]).all() and torch.isin(torch.from_numpy(t), c).all()


def test_sampler_errors_name_the_schedule_option():
    s = CandidateSampler()
    t = zipf_targets(0, 1000)
    with pytest.raises(ValueError, match=r"schedule\.stages\[\*\]\.candidates"):
        s.build(t, 10000)
    many = np.arange(0, 50257, 4)[:12000]
    with pytest.raises(ValueError, match=r"12000 distinct targets.*schedule\.stages\[\*\]\.candidates"):
        s.build(many, 10240)
    assert torch.equal(s.build(t, PADDED_VOCAB), torch.arange(PADDED_VOCAB))
    with pytest.raises(ValueError, match="coprime"):
        CandidateSampler(stride=2)
    assert CANDIDATE_MULTIPLE == 2048


# RECORD §9 and §6: (tokens per rank, P) of the sampled stages in step order: stages 0 and 1
# at 10,240, then stage 2 by thirds at 14,336, 14,336, 24,576; the taper is full softmax.
RECORD_SAMPLED_STAGES = ((16384, 10240), (32768, 10240), (49152, 14336), (49152, 14336), (49152, 24576))


def test_sampler_follows_the_record_sweep_at_record_shapes():
    # Each of the 8 ranks, over the record's stage shapes in order, against the candidate set
    # rebuilt here from RECORD §6's literals: perm[k] = 20011·k mod 50304, rank r starting at
    # 50304·r/8, each call taking the next min(50304, ⌊1.7·need⌋ + 256) entries and keeping
    # the first `need` that are not targets; padded ids (50,257..50,303) are ordinary negatives.
    padded_negatives = 0
    for rank in range(8):
        s = CandidateSampler(rank=rank, world_size=8)
        offset = 50304 * rank // 8
        for step, (tokens, p) in enumerate(RECORD_SAMPLED_STAGES):
            t = zipf_targets(1000 * rank + step, tokens)
            targets = np.unique(t)
            assert targets.size <= p
            need = p - targets.size
            draw = min(50304, int(1.7 * need) + 256)
            window = (20011 * np.arange(offset, offset + draw)) % 50304
            negatives = window[~np.isin(window, targets)][:need]
            assert negatives.size == need, "a record-shaped micro-batch is served by its window alone"
            want = np.sort(np.concatenate((targets, negatives)))
            got = s.build(torch.from_numpy(t), p)
            assert got.numel() == p and np.array_equal(got.numpy(), want), (rank, step)
            offset = (offset + draw) % 50304
            assert s.offset == offset
            padded_negatives += int((negatives >= 50257).sum())
        # The taper's full softmax: every class, and the sweep does not move.
        assert torch.equal(s.build(torch.from_numpy(t), 50304), torch.arange(50304))
        assert s.offset == offset
    assert padded_negatives > 0


def test_prepare_batch_adds_candidates_and_the_tokenizers_prefix_targets():
    """``SpeedrunModule.prepare_batch`` (host side, before the transfer): each micro-batch gets a
    candidate set holding its targets and, while the schedule's prefix weight is on, prefix targets
    equal to the tokenizer's prefix table (RECORD §2) indexed by its targets in torch."""
    from test_capture import every_technique_schedule, packed_micro_batch
    from train_helpers import tiny_gpt

    from nanogpt_pl.data.tokenizer import build_prefix_table
    from nanogpt_pl.module import SpeedrunModule

    module = SpeedrunModule(gpt=tiny_gpt(), schedule=every_technique_schedule(seq_len=512, micro_batches=3))
    module.prepare_for_training(torch.device("cpu"))
    seed = fresh_seed()
    batch = [packed_micro_batch(seed + a, 512, 0, vocab=PADDED_VOCAB - 47) for a in range(3)]
    targets = [mb["targets"].clone() for mb in batch]
    out = module.prepare_batch(batch, 0)
    table = build_prefix_table(PADDED_VOCAB)
    for mb, t in zip(out, targets):
        want = table[t]
        assert mb["prefix_targets"].dtype == torch.int64 and torch.equal(mb["prefix_targets"], want)
        assert (want >= 0).any() and (want == -1).any()  # real prefixes and tokens without one
        c = mb["candidates"]
        assert c.numel() == 2048 and torch.isin(t, c).all()
