"""CPU tests of the lm_head loss: reference and chunked fused path, full and sampled.

The Triton kernel itself is tested in test_cross_entropy_triton.py (CPU interpreter) and
test_cross_entropy_gpu.py (real sizes); the candidate sampler in test_sampling.py and the
prefix table in test_tokenizer.py.
"""

from __future__ import annotations

import os

import pytest
import torch
from seeds import fresh_seed

import nanogpt_pl.ops.cross_entropy as ce
from nanogpt_pl.backends import Backends
from nanogpt_pl.data.tokenizer import PADDED_VOCAB
from nanogpt_pl.module import SpeedrunModule
from nanogpt_pl.ops.cross_entropy import (
    SOFTCAP_MAX,
    SOFTCAP_SHIFT,
    SOFTCAP_WIDTH,
    full_cross_entropy,
    lm_head_loss,
    softcap,
    softcap_ce_rows_reference,
)
from nanogpt_pl.ops.lm_head import HeadMatmul, TorchHeadMatmul, default_chunk_rows
from nanogpt_pl.ops.sampling import CandidateSampler

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


def test_auto_is_the_held_triton_kernel_on_cuda_and_chunked_elsewhere():
    """``auto`` picks the held row kernel on CUDA (timed faster in the step on an H100,
    BENCHMARKS.md session 11) and the chunked PyTorch path elsewhere."""
    assert ce.auto_backend("cuda") == "triton_held" and ce.auto_backend(torch.device("cuda", 1)) == "triton_held"
    assert ce.auto_backend("cpu") == "chunked" and ce.auto_backend("meta") == "chunked"
    assert ce.auto_backend("cuda") in ce.TRITON_BACKENDS


def test_held_launch_warps_keep_a_thread_at_48_held_values():
    """8 warps, doubled while a thread would hold more than 48 factors: RECORD §6's sampled P of
    10,240 / 14,336 / 24,576 (5, 7 and 12 blocks of 2,048) take 8 / 16 / 16 warps."""
    from nanogpt_pl.ops.triton.cross_entropy import held_num_warps

    assert [held_num_warps(b) for b in (0, 5, 6, 7, 12)] == [8, 8, 8, 16, 16]
    assert held_num_warps(13) == 32 and held_num_warps(25) == 64


def test_auto_on_the_cpu_is_the_chunked_path(monkeypatch):
    """``auto`` runs the fused chunked path on a CPU (its row math), with the oracle's loss and gradients."""
    calls = []
    rows_fn = ce._torch_rows
    monkeypatch.setattr(ce, "_torch_rows", lambda logits, *a: (calls.append(logits.shape[0]), rows_fn(logits, *a)))
    monkeypatch.setattr(ce, "_reference_loss", None)  # a call would fail
    seed = fresh_seed()
    x, w, t, pf = make_problem(seed, n=300)
    kw = dict(mtp_weights=(1.0, 0.5), prefix_targets=pf, prefix_weight=0.2)
    want = loss_and_grads(lambda a, b: oracle_loss(a, b, t, (1.0, 0.5), pf, 0.2), x.double(), w.double())
    got = loss_and_grads(lambda a, b: lm_head_loss(a, b, t, backend="auto", chunk_rows=128, **kw), x, w)
    assert calls == [128, 128, 44], seed
    assert abs(got[0].item() - want[0].item()) <= 1e-5 * abs(want[0].item()), seed
    assert rel(got[1], want[1]) < 1e-5 and rel(got[2], want[2]) < 1e-5, seed


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
    # One line naming the config option and every valid choice; the plain path is "reference".
    with pytest.raises(ValueError, match=r"model\.backends\.loss .* auto, reference, chunked, triton, triton_held$"):
        lm_head_loss(x, w, t, backend="torch")
    with pytest.raises(ValueError, match="same D"):
        lm_head_loss(x[:, :5], w, t)
    with pytest.raises(ValueError, match="mtp_weights"):
        lm_head_loss(x, w, t, mtp_weights=())
    if os.environ.get("TRITON_INTERPRET") != "1":
        for backend in ("triton", "triton_held"):
            with pytest.raises(RuntimeError, match=f"backend='{backend}' needs a CUDA device.*TRITON_INTERPRET"):
                lm_head_loss(x, w, t, backend=backend)



@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="the interpreter runs Triton on the CPU")
@pytest.mark.parametrize("backend", ["triton", "triton_held"])
def test_module_rejects_a_triton_loss_on_cpu_in_one_line(backend):
    module = SpeedrunModule(backends=Backends(loss=backend))
    with pytest.raises(RuntimeError, match=rf"^model\.backends\.loss='{backend}' needs a CUDA GPU .* auto or"):
        module._check_device_options(torch.device("cpu"))


def test_module_rejects_an_unknown_loss_backend_at_construction():
    with pytest.raises(ValueError, match=r"^unknown backend 'torch' .*model\.backends\.loss .* auto, reference"):
        SpeedrunModule(backends=Backends(loss="torch"))

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
    # CPU chunks hold about 1 Mi fp32 logits (4 MiB, cache-sized): 256 rows of the quickstart's
    # 4,096 candidates, 128 rows (the row multiple) of the full vocabulary
    assert default_chunk_rows(2048, 4096, "cpu") == 256
    assert default_chunk_rows(8192, PADDED_VOCAB, "cpu") == 128
    for n, p in [(1000, 50304), (49152, 24576), (777, 3)]:
        rows = default_chunk_rows(n, p, "cpu")
        assert 1 <= rows <= n and (rows == n or rows % 128 == 0)



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
