"""Lazy row-wise Adam against dense Adam, shard Adam against a reference, the SparseAdam part."""

from __future__ import annotations

import math

import pytest
import torch

from nanogpt_pl.optim import sparse_adam
from nanogpt_pl.optim.sparse_adam import (
    NGRAM_BETA2,
    SPARSE_LR_MUL,
    SPARSE_WD_MUL,
    VALUE_EMBED_BETAS,
    LazyRowAdam,
    SparseAdam,
    shard_adam_,
)

F64 = torch.float64
EPS = 1e-10


def dense_row_adam(p: torch.Tensor, v: torch.Tensor, g: torch.Tensor, j: int, lr: float, beta2: float,
                   wd: float) -> None:
    """Reference: Adam over every row, β₁ = 0, one second moment per row (row mean of g²)."""
    v.mul_(beta2).add_((1 - beta2) * g.square().mean(-1))
    u = g / (v.sqrt() + EPS)[:, None] * (lr * math.sqrt(1 - beta2**j))
    u += torch.where(u * p > 0, p * lr * lr * wd, torch.zeros_like(p))
    p.sub_(u)


def random_events(seed: int, rows: int, dim: int, events: int):
    """Per event: touched rows (random density, sometimes none), their gradient, lr, β₂, wd."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for j in range(1, events + 1):
        density = [0.0, 0.05, 0.3, 0.9][int(torch.randint(0, 4, (1,), generator=gen))]
        touched = torch.nonzero(torch.rand(rows, generator=gen) < density).flatten()
        grad = torch.randn(touched.numel(), dim, generator=gen, dtype=F64) * torch.rand(1, generator=gen, dtype=F64)
        engaged = j > events // 2  # the cadence engages half way: β₂ squared, wd doubled (RECORD §5)
        beta2 = NGRAM_BETA2**2 if engaged else NGRAM_BETA2
        wd = 0.005 * SPARSE_WD_MUL * (2 if engaged else 1)
        lr = 0.008 * SPARSE_LR_MUL * (1.0 - 0.5 * j / events) * 0.05
        out.append((touched, grad, lr, beta2, wd))
    return out


@pytest.mark.parametrize("seed, chunk", [(0, None), (7, None), (42, 5)])
def test_lazy_row_adam_equals_dense_adam_in_fp64(seed, chunk, monkeypatch):
    if chunk is not None:  # an event's rows in chunks of 5 (the GPU's are 2**18)
        monkeypatch.setattr("nanogpt_pl.optim.sparse_adam.SPARSE_CHUNK_ROWS", chunk)
    rows, dim, events = 48, 6, 80
    gen = torch.Generator().manual_seed(100 + seed)
    p0 = torch.randn(rows, dim, generator=gen, dtype=F64) * 0.3
    lazy_p, dense_p = p0.clone(), p0.clone()
    lazy, dense_v = LazyRowAdam(rows, dtype=F64), torch.zeros(rows, dtype=F64)
    for j, (touched, grad, lr, beta2, wd) in enumerate(random_events(seed, rows, dim, events), start=1):
        lazy.update_(lazy_p, touched, grad, lr=lr, beta2=beta2, eps=EPS, weight_decay=wd)
        g = torch.zeros(rows, dim, dtype=F64)
        g[touched] = grad
        dense_row_adam(dense_p, dense_v, g, j, lr, beta2, wd)
        torch.testing.assert_close(lazy_p, dense_p, rtol=1e-12, atol=1e-13)
    lazy.replay_all_()
    torch.testing.assert_close(lazy.v, dense_v, rtol=1e-12, atol=1e-300)
    assert not torch.equal(lazy_p, p0)


def test_replay_uses_the_exact_product_of_per_event_beta2():
    gen = torch.Generator().manual_seed(3)
    adam = LazyRowAdam(5, dtype=F64)
    betas = (0.9 + 0.09 * torch.rand(40, generator=gen, dtype=F64)).tolist()
    table = torch.zeros(5, 2, dtype=F64)
    for j, b in enumerate(betas, start=1):  # row j % 5 is touched at event j
        adam.update_(table, torch.tensor([j % 5]), torch.ones(1, 2, dtype=F64), lr=0.0, beta2=b, eps=EPS,
                     weight_decay=0.0)
    last = adam.last_event.clone()
    factor = adam.decay_since(last, len(betas) + 1)
    for r in range(5):
        expected = math.prod(betas[int(last[r]) : len(betas)])  # events last+1 .. current
        assert factor[r].item() == pytest.approx(expected, rel=1e-13)


@pytest.mark.parametrize("seed", [1, 2])
def test_only_touched_rows_are_read_or_written(seed):
    gen = torch.Generator().manual_seed(seed)
    table = torch.randn(30, 4, generator=gen)
    untouched = torch.arange(30) % 3 != 0
    table[untouched] = float("nan")  # a read of any untouched row would poison the result
    adam = LazyRowAdam(30)
    adam.v[untouched] = float("nan")
    rows = torch.arange(0, 30, 3)
    for _ in range(3):
        adam.update_(table, rows, torch.randn(10, 4, generator=gen), lr=0.1, beta2=0.95, eps=EPS, weight_decay=0.05)
    assert torch.isfinite(table[rows]).all() and torch.isfinite(adam.v[rows]).all()
    assert torch.isnan(table[untouched]).all() and torch.isnan(adam.v[untouched]).all()
    assert (adam.last_event[rows] == 3).all() and (adam.last_event[untouched] == 0).all()


def test_lazy_state_round_trip_continues_identically():
    events = random_events(9, 20, 3, 30)
    table = torch.randn(20, 3, generator=torch.Generator().manual_seed(9), dtype=F64)
    a = LazyRowAdam(20, dtype=F64)
    for touched, grad, lr, beta2, wd in events[:15]:
        a.update_(table, touched, grad, lr=lr, beta2=beta2, eps=EPS, weight_decay=wd)
    b = LazyRowAdam(20, dtype=F64)
    b.load_state_dict({k: (v.clone() if torch.is_tensor(v) else v) for k, v in a.state_dict().items()})
    table_b = table.clone()
    for touched, grad, lr, beta2, wd in events[15:]:
        a.update_(table, touched, grad, lr=lr, beta2=beta2, eps=EPS, weight_decay=wd)
        b.update_(table_b, touched, grad, lr=lr, beta2=beta2, eps=EPS, weight_decay=wd)
    assert torch.equal(table, table_b) and torch.equal(a.v, b.v)


def reference_adam(p, m, v, g, t, lr, betas, wd):
    """The record's dense Adam form (RECORD §8): eps on √v, step size lr·√(1-β₂ᵗ)/(1-β₁ᵗ), cautious lr²·wd."""
    b1, b2 = betas
    m.mul_(b1).add_((1 - b1) * g)
    v.mul_(b2).add_((1 - b2) * g * g)
    u = m / (v.sqrt() + EPS) * (lr * math.sqrt(1 - b2**t) / (1 - b1**t))
    u += torch.where(u * p > 0, p * lr * lr * wd, torch.zeros_like(p))
    p.sub_(u)


@pytest.mark.parametrize("seed", [4, 5])
def test_shard_adam_equals_dense_adam_with_zero_gradient_rows(seed, monkeypatch):
    monkeypatch.setattr("nanogpt_pl.optim.sparse_adam.DENSE_CHUNK_ROWS", 7)  # exercise the chunking
    monkeypatch.setattr("nanogpt_pl.optim.sparse_adam.SPARSE_CHUNK_ROWS", 3)
    gen = torch.Generator().manual_seed(seed)
    rows, dim = 23, 5
    p = torch.randn(rows, dim, generator=gen, dtype=F64)
    ref_p, m, v, rm, rv = p.clone(), *(torch.zeros(rows, dim, dtype=F64) for _ in range(4))
    for t in range(1, 25):
        touched = torch.nonzero(torch.rand(rows, generator=gen) < 0.4).flatten()
        grad = torch.randn(touched.numel(), dim, generator=gen, dtype=F64)
        betas = VALUE_EMBED_BETAS if t < 12 else tuple(b * b for b in VALUE_EMBED_BETAS)
        shard_adam_(p, m, v, touched, grad, t, 0.05, betas, EPS, 0.1)
        g = torch.zeros(rows, dim, dtype=F64)
        g[touched] = grad
        reference_adam(ref_p, rm, rv, g, t, 0.05, betas, 0.1)
    torch.testing.assert_close(p, ref_p, rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(m, rm, rtol=1e-12, atol=1e-14)


def spy_on_steps(channel):
    """Record the settings each event of a real channel receives, then run the event."""
    calls, real_step = [], channel.step

    def step(lr, betas, eps, weight_decay):
        calls.append((lr, *betas, eps, weight_decay))
        real_step(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)

    channel.step = step
    return calls


def test_sparse_adam_squares_betas_and_doubles_decay_when_the_cadence_engages():
    from nanogpt_pl.distributed.ngram_shard import NgramShard
    from nanogpt_pl.distributed.value_embed_shard import ValueEmbedShard

    gen = torch.Generator().manual_seed(8)
    ngram = NgramShard(64, 4)
    ve = ValueEmbedShard([torch.nn.Parameter(torch.randn(10, 4, generator=gen)) for _ in range(2)])
    ngram_calls, ve_calls = spy_on_steps(ngram), spy_on_steps(ve)
    opt = SparseAdam({"ngram": ngram, "value_embeds": ve}, lr=0.008, weight_decay=0.005)
    for g in opt.param_groups:
        g["lr"] = g["initial_lr"] * 0.5  # what the schedule's lr scale does
    for engaged in (False, True):
        opt.set_cadence_engaged(engaged)
        ngram.push(torch.tensor([3, 40]), torch.randn(2, 4, generator=gen))
        ve.push(torch.tensor([1, 7]), torch.randn(2, 2, 4, generator=gen))
        opt.step()
    lr = 0.008 * 0.5 * SPARSE_LR_MUL
    assert ngram_calls[0] == pytest.approx((lr, 0.0, 0.95, 1e-10, 0.005 * 5))
    assert ngram_calls[1] == pytest.approx((lr, 0.0, 0.95**2, 1e-10, 0.005 * 10))
    assert ve_calls[0] == pytest.approx((lr, 0.75, 0.95, 1e-10, 0.005 * 5))
    assert ve_calls[1] == pytest.approx((lr, 0.75**2, 0.95**2, 1e-10, 0.005 * 10))
    assert ngram.adam.event == 2 and ve.step_count == 2
    state = opt.state_dict()
    fresh = SparseAdam({"ngram": NgramShard(64, 4), "value_embeds": ValueEmbedShard(ve.params)})
    fresh.load_state_dict(state)
    assert fresh.cadence_engaged and fresh.param_groups[0]["lr"] == pytest.approx(0.004)


def test_ngram_channel_refuses_a_first_moment():
    from nanogpt_pl.distributed.ngram_shard import NgramShard

    opt = SparseAdam({"ngram": NgramShard(64, 4)}, groups={"ngram": {"betas": (0.75, 0.95)}})
    with pytest.raises(ValueError, match="beta1 = 0"):
        opt.step()


@pytest.mark.parametrize("chunk", [None, 7])
def test_segment_update_with_two_sources_sums_each_rows_terms(chunk, monkeypatch):
    """``update_segments_`` unfused: each row's gradient is the mean of its queued terms, drawn
    from ``src ++ src2`` (an owner's own fp32 request and the peers' bf16 rows) in chunks of
    ``chunk`` entries; the same as ``update_`` of the rows' sums formed directly."""
    from seeds import fresh_seed

    from nanogpt_pl.distributed.row_exchange import segments_fixed

    if chunk is not None:
        monkeypatch.setattr(sparse_adam, "SPARSE_CHUNK_ROWS", chunk)
    gen = torch.Generator().manual_seed(fresh_seed())
    rows, dim, n1, n2 = 40, 6, 30, 50
    queued = torch.where(torch.rand(n1 + n2, generator=gen) < 0.2, rows, torch.randint(0, rows, (n1 + n2,),
                                                                                          generator=gen))
    src = torch.randn(n1, dim, generator=gen)
    src2 = torch.randn(n2, dim, generator=gen).to(torch.bfloat16)
    table = torch.randn(rows + 1, dim, generator=gen)  # and the scratch row the padding writes
    seg = segments_fixed(queued, queued.numel(), rows)
    got, want = table.clone(), table.clone()
    fast, ref = LazyRowAdam(rows, torch.device("cpu"), fused=False), LazyRowAdam(rows, torch.device("cpu"), fused=False)
    fast.update_segments_(got, seg.unique, src, seg.order, seg.offsets, seg.slot, 0.1, 0.95, EPS, 0.01,
                          src2=src2, grad_divisor=2)
    terms = torch.cat([src, src2.float()])
    real = queued < rows
    uniq = torch.unique(queued[real])
    sums = torch.zeros(uniq.numel(), dim).index_add_(0, torch.searchsorted(uniq, queued[real]), terms[real]) / 2
    ref.update_(want, uniq, sums, 0.1, 0.95, EPS, 0.01)
    torch.testing.assert_close(got[:rows], want[:rows], rtol=1e-6, atol=1e-7)
    assert not torch.equal(got[:rows], table[:rows])
