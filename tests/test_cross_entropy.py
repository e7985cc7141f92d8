"""CPU tests of the lm_head loss: reference, chunked fused path, sampling, prefix table.

The Triton kernel itself is tested in test_cross_entropy_triton.py (CPU interpreter) and
test_cross_entropy_gpu.py (real sizes).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from nanogpt_pl.data.tokenizer import PADDED_VOCAB
from nanogpt_pl.ops.cross_entropy import (
    CANDIDATE_MULTIPLE,
    SOFTCAP_MAX,
    SOFTCAP_SHIFT,
    SOFTCAP_WIDTH,
    CandidateSampler,
    HeadMatmul,
    TorchHeadMatmul,
    build_prefix_table,
    default_chunk_rows,
    full_cross_entropy,
    lm_head_loss,
    softcap,
    softcap_ce_rows_reference,
)

SEEDS = (0, 1, 2)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()


def make_problem(seed, n=96, d=24, v=640, w_std=0.4, prefix=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    w = torch.randn(v, d, generator=g) * w_std
    # Zipf-like targets so the sampled tests see repeated classes, as real text does.
    ranks = torch.arange(1, v + 1, dtype=torch.float64)
    t = torch.multinomial(1.0 / ranks, n, replacement=True, generator=g)
    pf = torch.randint(-1, v, (n,), generator=g) if prefix else None
    return x, w, t, pf


def oracle_loss(x, w, t, mtp, pf=None, wp=0.0, cand=None):
    """Row-by-row float64 oracle written independently of the module's term table."""
    x, w = x.double(), w.double()
    v = w.shape[0]
    cls = torch.arange(v) if cand is None else cand
    pos = {int(c): i for i, c in enumerate(cls.tolist())}
    z = SOFTCAP_MAX * torch.sigmoid((x @ w[cls].t() + SOFTCAP_SHIFT) / SOFTCAP_WIDTH)
    ce = torch.logsumexp(z, dim=1, keepdim=True) - z
    n = x.shape[0]
    total = x.new_zeros(())
    for k, wk in enumerate(mtp):
        rows = [r for r in range(n) if r + k < n]
        cols = [pos[int(t[r + k])] for r in rows]
        total = total + wk * ce[rows, cols].sum()
    if pf is not None and wp != 0.0:
        rows = [r for r in range(n) if int(pf[r]) >= 0 and int(pf[r]) in pos]
        total = total + wp * ce[rows, [pos[int(pf[r])] for r in rows]].sum()
    return total / n


def loss_and_grads(fn, x, w):
    x = x.detach().clone().requires_grad_()
    w = w.detach().clone().requires_grad_()
    loss = fn(x, w)
    loss.backward()
    return loss.detach(), x.grad, w.grad


# ---------------------------------------------------------------------------------------
# softcap
# ---------------------------------------------------------------------------------------


def test_softcap_is_the_shifted_tanh_cap():
    for seed in SEEDS:
        ell = torch.randn(4096, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 30
        z = softcap(ell)
        tanh_form = 0.5 * SOFTCAP_MAX * (1 + torch.tanh((ell + SOFTCAP_SHIFT) / (2 * SOFTCAP_WIDTH)))
        torch.testing.assert_close(z, tanh_form, rtol=1e-12, atol=1e-12)
        assert (z > 0).all() and (z < SOFTCAP_MAX).all()
    assert (SOFTCAP_MAX, SOFTCAP_SHIFT, SOFTCAP_WIDTH) == (23.0, 5.0, 7.5)


# ---------------------------------------------------------------------------------------
# Full vocabulary: reference and chunked fused path vs the oracle
# ---------------------------------------------------------------------------------------

TERM_CASES = [
    dict(mtp=(1.0,), wp=0.0),
    dict(mtp=(1.0, 0.5, 0.25), wp=0.0),
    dict(mtp=(1.0, 0.5), wp=0.2),
    dict(mtp=(1.0, 0.375, 0.125), wp=0.25),
]


@pytest.mark.parametrize("case", TERM_CASES)
@pytest.mark.parametrize("seed", SEEDS)
def test_full_reference_and_chunked_match_oracle(case, seed):
    x, w, t, pf = make_problem(seed)
    mtp, wp = case["mtp"], case["wp"]
    want = loss_and_grads(lambda a, b: oracle_loss(a, b, t, mtp, pf, wp), x.double(), w.double())
    kw = dict(mtp_weights=mtp, prefix_targets=pf, prefix_weight=wp)
    ref = loss_and_grads(lambda a, b: lm_head_loss(a, b, t, backend="reference", **kw), x, w)
    # 40 rows per chunk: chunks end inside MTP windows, and 96 is not a multiple of 40.
    fused = loss_and_grads(lambda a, b: lm_head_loss(a, b, t, backend="chunked", chunk_rows=40, **kw), x, w)
    for got in (ref, fused):
        assert abs(got[0].item() - want[0].item()) <= 1e-5 * abs(want[0].item())
        assert rel(got[1], want[1]) < 1e-5
        assert rel(got[2], want[2]) < 1e-5


def test_chunk_size_does_not_change_result():
    x, w, t, pf = make_problem(5, n=130)
    kw = dict(mtp_weights=(1.0, 0.5, 0.25), prefix_targets=pf, prefix_weight=0.15, backend="chunked")
    base = loss_and_grads(lambda a, b: lm_head_loss(a, b, t, chunk_rows=130, **kw), x, w)
    for rows in (1, 7, 64, 129):
        got = loss_and_grads(lambda a, b: lm_head_loss(a, b, t, chunk_rows=rows, **kw), x, w)
        assert abs(got[0].item() - base[0].item()) < 1e-5 * base[0].item()
        assert rel(got[1], base[1]) < 1e-5 and rel(got[2], base[2]) < 1e-5


def test_mtp_terms_stop_only_at_batch_end():
    # The loss knows nothing of documents (RECORD §2: MTP terms cross document ends); only
    # the micro-batch end drops terms. Checked on a tiny case by hand.
    x, w, _, _ = make_problem(3, n=4, v=64)
    t = torch.tensor([5, 63, 7, 9])
    mtp = (1.0, 0.5, 0.25)
    got = lm_head_loss(x, w, t, mtp_weights=mtp, backend="reference")
    z = softcap(x.double() @ w.double().t())
    ce = torch.logsumexp(z, 1)[:, None] - z
    want = sum(mtp[k] * ce[r, t[r + k]] for r in range(4) for k in range(3) if r + k < 4) / 4
    assert abs(got.item() - want.item()) < 1e-5 * want.item()


def test_loss_without_grad_and_hidden_only_grad():
    x, w, t, pf = make_problem(4)
    with torch.no_grad():
        a = lm_head_loss(x, w, t, backend="chunked", chunk_rows=32)
    b = lm_head_loss(x, w, t, backend="reference")
    assert abs(a.item() - b.item()) < 1e-5 * b.item()
    xg = x.clone().requires_grad_()
    loss = lm_head_loss(xg, w, t, backend="chunked", chunk_rows=32)
    loss.backward()
    want = loss_and_grads(lambda p, q: lm_head_loss(p, q, t, backend="reference"), x, w)
    assert rel(xg.grad, want[1]) < 1e-5


def test_grad_output_scaling():
    x, w, t, _ = make_problem(6)
    base = loss_and_grads(lambda a, b: lm_head_loss(a, b, t, backend="chunked"), x, w)
    got = loss_and_grads(lambda a, b: 3.5 * lm_head_loss(a, b, t, backend="chunked"), x, w)
    assert rel(got[1], 3.5 * base[1]) < 1e-6 and rel(got[2], 3.5 * base[2]) < 1e-6


# ---------------------------------------------------------------------------------------
# Sampled softmax
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("backend", ["reference", "chunked"])
def test_sampled_matches_oracle_on_gathered_rows(seed, backend):
    x, w, t, pf = make_problem(seed)
    sampler = CandidateSampler(w.shape[0], multiple=64, rank=seed % 2, world_size=2)
    cand = sampler.build(t, 256)
    mtp, wp = (1.0, 0.5), 0.25
    assert not torch.isin(pf[pf >= 0], cand).all(), "the test needs prefixes outside C"
    want = loss_and_grads(lambda a, b: oracle_loss(a, b, t, mtp, pf, wp, cand=cand), x.double(), w.double())
    got = loss_and_grads(lambda a, b: lm_head_loss(a, b, t, candidates=cand, mtp_weights=mtp,
                                                   prefix_targets=pf, prefix_weight=wp,
                                                   backend=backend, chunk_rows=33), x, w)
    assert abs(got[0].item() - want[0].item()) <= 1e-5 * want[0].item()
    assert rel(got[1], want[1]) < 1e-5
    assert rel(got[2], want[2]) < 1e-5
    # Dense [V, D] weight gradient, zero off the candidate rows.
    assert got[2].shape == w.shape
    off = torch.ones(w.shape[0], dtype=torch.bool)
    off[cand] = False
    assert (got[2][off] == 0).all() and (got[2][cand].abs().sum(1) > 0).all()


def test_all_candidates_equals_full_softmax():
    x, w, t, pf = make_problem(7)
    kw = dict(mtp_weights=(1.0, 0.5), prefix_targets=pf, prefix_weight=0.2, backend="chunked")
    full = loss_and_grads(lambda a, b: lm_head_loss(a, b, t, **kw), x, w)
    every = loss_and_grads(lambda a, b: lm_head_loss(a, b, t, candidates=torch.arange(w.shape[0]), **kw), x, w)
    for a, b in zip(full, every):
        assert rel(a, b) < 1e-6


def test_switching_candidate_count_between_calls():
    x, w, t, pf = make_problem(8, v=1024)
    sampler = CandidateSampler(1024, multiple=128)
    for p in (256, 384, 768, 384, 1024, 256):
        cand = sampler.build(t, p)
        assert cand.numel() == p
        kw = dict(candidates=cand, mtp_weights=(1.0, 0.5), prefix_targets=pf, prefix_weight=0.1)
        ref = loss_and_grads(lambda a, b: lm_head_loss(a, b, t, backend="reference", **kw), x, w)
        got = loss_and_grads(lambda a, b: lm_head_loss(a, b, t, backend="chunked", chunk_rows=48, **kw), x, w)
        assert rel(got[0], ref[0]) < 1e-6 and rel(got[1], ref[1]) < 1e-5 and rel(got[2], ref[2]) < 1e-5


def test_missing_target_and_bad_inputs_raise():
    x, w, t, _ = make_problem(9)
    cand = torch.arange(0, w.shape[0], 2)
    t_odd = t.clone()
    t_odd[3] = 1
    for backend in ("reference", "chunked"):
        with pytest.raises(ValueError, match="missing from `candidates`"):
            lm_head_loss(x, w, t_odd, candidates=cand, backend=backend)
        bad = t.clone()
        bad[0] = w.shape[0]
        with pytest.raises(ValueError, match="outside"):
            lm_head_loss(x, w, bad, backend=backend)
    with pytest.raises(ValueError, match="sorted"):
        lm_head_loss(x, w, t, candidates=torch.tensor([3, 1, 2]))
    with pytest.raises(ValueError, match="unknown backend"):
        lm_head_loss(x, w, t, backend="cuda")
    with pytest.raises(ValueError, match="same D"):
        lm_head_loss(x[:, :5], w, t)
    with pytest.raises(ValueError, match="mtp_weights"):
        lm_head_loss(x, w, t, mtp_weights=())
    if os.environ.get("TRITON_INTERPRET") != "1":
        with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
            lm_head_loss(x, w, t, backend="triton")


# ---------------------------------------------------------------------------------------
# Numerics
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("scale", [1e4, 3e38])
def test_extreme_logits_are_nan_free(scale):
    for seed in SEEDS:
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(64, 8, generator=g)
        w = torch.randn(512, 8, generator=g)
        x = x / x.abs().amax(1, keepdim=True)
        w = w / w.abs().amax(1, keepdim=True) * (scale / 8)
        t = torch.randint(0, 512, (64,), generator=g)
        for backend in ("reference", "chunked"):
            loss, gx, gw = loss_and_grads(
                lambda a, b: lm_head_loss(a, b, t, mtp_weights=(1.0, 0.5), backend=backend), x, w)
            assert torch.isfinite(loss) and torch.isfinite(gx).all() and torch.isfinite(gw).all()
    # Infinite logits in the row math: σ saturates, nothing becomes NaN.
    ell = torch.tensor([[float("inf"), -float("inf"), 3e38, -3e38, 0.0, 1e4]])
    loss, grad = softcap_ce_rows_reference(ell, 1.0, torch.tensor([[0, 1]], dtype=torch.int32),
                                           torch.tensor([1.0, 0.5]), 1.0)
    assert torch.isfinite(loss).all() and torch.isfinite(grad).all()


def test_row_reference_gradient_is_autograd_gradient():
    for seed in SEEDS:
        g = torch.Generator().manual_seed(seed)
        ell = (torch.randn(6, 50, generator=g, dtype=torch.float64) * 8).requires_grad_()
        tpos = torch.randint(-1, 50, (6, 4), generator=g, dtype=torch.int32)
        tw = torch.rand(4, generator=g, dtype=torch.float64)
        loss, grad = softcap_ce_rows_reference(ell.detach(), 1.0, tpos, tw, 0.5)
        z = softcap(ell)
        lse = torch.logsumexp(z, 1)
        want = sum(tw[k] * (lse[r] - z[r, tpos[r, k]]) for r in range(6) for k in range(4) if tpos[r, k] >= 0)
        want.backward()
        assert abs(loss.sum().item() - want.item()) < 1e-4 * abs(want.item())
        assert rel(grad, 0.5 * ell.grad) < 1e-5


class _EmulatedFp8Head(TorchHeadMatmul):
    """A head in the FP8 engineer's shape: e4m3 logits with a scale, a separate gradient
    buffer stored at a divisor. Used to check the hook, not as the FP8 implementation."""

    logit_scale = 0.25
    grad_div = 2.0 ** -12

    def logits(self, x, w):
        ell = torch.mm(x, w.t())
        q = (ell / self.logit_scale).clamp(-448, 448).to(torch.float8_e4m3fn)
        return q, self.logit_scale

    def grad_buffer(self, logits):
        return torch.empty(logits.shape, dtype=torch.float32, device=logits.device), self.grad_div


def test_head_hook_with_quantized_logits():
    head = _EmulatedFp8Head()
    assert isinstance(head, HeadMatmul) and isinstance(TorchHeadMatmul(), HeadMatmul)
    x, w, t, pf = make_problem(11, w_std=1.0)
    kw = dict(mtp_weights=(1.0, 0.5), prefix_targets=pf, prefix_weight=0.2)
    got = loss_and_grads(lambda a, b: lm_head_loss(a, b, t, backend="chunked", head=head, chunk_rows=50, **kw), x, w)
    # Expected: the same loss on the dequantized logits, by autograd through the row math.
    xq, wq = x.clone().requires_grad_(), w.clone().requires_grad_()
    ell = xq @ wq.t()
    deq = (ell / head.logit_scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * head.logit_scale
    ell_st = ell + (deq - ell).detach()  # straight-through: quantized value, linear gradient
    z = softcap(ell_st)
    lse = torch.logsumexp(z, 1)
    n = x.shape[0]
    want = sum(wk * (lse[: n - k] - z[torch.arange(n - k), t[k:]]).sum() for k, wk in enumerate(kw["mtp_weights"]))
    ok = pf >= 0
    want = (want + 0.2 * (lse[ok] - z[ok.nonzero()[:, 0], pf[ok]]).sum()) / n
    want.backward()
    assert abs(got[0].item() - want.item()) < 1e-5 * want.item()
    assert rel(got[1], xq.grad) < 1e-5 and rel(got[2], wq.grad) < 1e-5


# ---------------------------------------------------------------------------------------
# Validation loss
# ---------------------------------------------------------------------------------------


def test_validation_loss_is_full_softmax_whatever_the_candidates():
    for seed in SEEDS:
        x, w, t, _ = make_problem(seed, n=200)
        val = full_cross_entropy(x, w, t)
        z = softcap(x.double() @ w.double().t())
        want = (torch.logsumexp(z, 1) - z[torch.arange(200), t]).mean()
        assert abs(val.item() - want.item()) < 1e-5 * want.item()
        for rows in (1, 64, 199):
            assert abs(full_cross_entropy(x, w, t, chunk_rows=rows).item() - val.item()) < 1e-5 * val.item()
        # Training losses with any candidate count leave validation untouched; the sampled
        # training loss is a lower bound of it (LSE over a subset).
        sampler = CandidateSampler(w.shape[0], multiple=64)
        for p in (128, 256, 576):
            train = lm_head_loss(x, w, t, candidates=sampler.build(t, p), backend="chunked")
            assert train.item() <= val.item() + 1e-5
            assert full_cross_entropy(x, w, t).item() == val.item()
        assert abs(lm_head_loss(x, w, t, backend="chunked").item() - val.item()) < 1e-5 * val.item()


def test_default_chunk_rows():
    # RECORD shapes: 49,152 rows of the full vocabulary in 6 chunks of 8,192 on the GPU.
    assert default_chunk_rows(49152, PADDED_VOCAB, "cuda") == 8192
    assert default_chunk_rows(49152, 10240, "cuda") == 24576
    assert default_chunk_rows(262144, PADDED_VOCAB, "cuda") == 8192
    assert default_chunk_rows(10, PADDED_VOCAB, "cpu") == 10
    for n, p in [(1000, 50304), (49152, 24576), (777, 3)]:
        rows = default_chunk_rows(n, p, "cpu")
        assert 1 <= rows <= n and (rows == n or rows % 128 == 0)


# ---------------------------------------------------------------------------------------
# Candidate sampler
# ---------------------------------------------------------------------------------------


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


def test_record_batch_fits_record_candidate_count():
    # RECORD §6: logged headroom 34-61 % at P = 10,240; a Zipf(1.1) stand-in for text.
    t = zipf_targets(0, 49152)
    assert np.unique(t).size < 10240


# ---------------------------------------------------------------------------------------
# Prefix table
# ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def encoding():
    from nanogpt_pl.data.tokenizer import get_encoding

    try:
        return get_encoding()
    except RuntimeError as e:
        pytest.skip(f"tokenizer cache not seeded: {e}")


def test_prefix_table_known_tokens(encoding):
    table = build_prefix_table(encoding)
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
    table = build_prefix_table(encoding)
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


def test_prefix_table_without_private_ranks(encoding):
    class Public:
        """An encoding exposing only tiktoken's public API."""

        n_vocab = encoding.n_vocab
        special_tokens_set = encoding.special_tokens_set
        encode_single_token = staticmethod(encoding.encode_single_token)
        decode_single_token_bytes = staticmethod(encoding.decode_single_token_bytes)

    assert torch.equal(build_prefix_table(Public()), build_prefix_table(encoding))


def test_autocast_runs_the_gemms_in_its_dtype():
    x, w, t, pf = make_problem(12)
    want = loss_and_grads(lambda a, b: lm_head_loss(a, b, t, backend="reference"),
                          x.bfloat16().float(), w.bfloat16().float())

    def under_autocast(a, b):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return lm_head_loss(a, b, t, backend="chunked", chunk_rows=40)

    got = loss_and_grads(under_autocast, x, w)
    assert got[1].dtype == torch.float32 and got[2].dtype == torch.float32
    # bf16 logits and a bf16 gradient: ~3e-3 of difference, where fp32 GEMMs would give ~1e-7.
    assert 1e-5 < rel(got[1], want[1]) < 2e-2 and rel(got[2], want[2]) < 2e-2
    assert abs(got[0].item() - want[0].item()) < 1e-3 * want[0].item()
