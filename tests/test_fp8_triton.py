"""The FP8 Triton kernels and the whole fast FP8 path on the CPU, through ``TRITON_INTERPRET=1``.

Triton chooses the interpreter when a kernel is defined, so the variable must be set before
the kernel modules are imported: ``test_fp8_kernels_under_interpreter`` re-runs this file in
a child pytest process with it set, and only there do the ``interp`` tests run.

On the CPU, ``torch._scaled_mm`` exists too, so the child also runs the complete fast
backend (Triton quantize/epilogue kernels + ``_scaled_mm``, padding, the dual layouts) and
compares it with the reference backend. The kernels round to the FP8 and bf16 grids with
their own arithmetic (the interpreter's float conversions truncate), so the comparisons
are exact wherever the arithmetic is the same.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from interpreter import INTERPRETED, interp, run_module_under_interpreter  # noqa: E402

SEEDS = (0, 1, 2)
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
SMALL_GEMM = dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, GROUP_M=2, num_warps=4, num_stages=1)


@pytest.mark.skipif(INTERPRETED, reason="already inside the interpreter run")
def test_fp8_kernels_under_interpreter():
    run_module_under_interpreter(__file__)


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()


def same_values(a, b):
    """Equal as numbers (+0 == -0); NaN positions must match."""
    a, b = a.float(), b.float()
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(torch.nan_to_num(a), torch.nan_to_num(b))


def wide_range(shape, gen, lo=-12, hi=12):
    """Values spread over many binades (both signs), so every FP8 rounding case shows up."""
    mag = torch.exp2(torch.empty(shape).uniform_(lo, hi, generator=gen))
    return mag * torch.randn(shape, generator=gen).sign()


# ---------------------------------------------------------------------------------------
# Quantization kernels
# ---------------------------------------------------------------------------------------


@interp
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_quantize_dual_equals_reference(seed, dtype):
    from nanogpt_pl.ops.fp8 import quantize
    from nanogpt_pl.ops.triton.fp8_quant import quantize_dual

    gen = torch.Generator().manual_seed(seed)
    m, k = 70, 48
    src = wide_range((k, m), gen).t()  # non-contiguous source
    src[0, :4] = torch.tensor([1e30, -1e30, 1e-30, 0.0])
    inv = torch.tensor(2.0 ** (seed - 1))
    clear = torch.full((), float("nan") if seed % 2 else 1e30)  # a later kernel's running max
    row, t, tiles = quantize_dual(src, inv, dtype, rows_out=80, tile_amax=True, block=(32, 16), clear=clear)
    assert clear.item() == 0.0
    want = quantize(src, inv, dtype)
    assert same_values(row[:m], want) and same_values(t[:, :m], want.t())
    assert (row[m:].float() == 0).all() and (t[:, m:].float() == 0).all()
    assert row.float().isfinite().all()
    # One amax per (32, 16) tile of the output grid, of |src| before scaling.
    padded = F.pad(src.abs(), (0, 0, 0, 96 - m))  # 3 row tiles of 32 cover the 80 output rows
    want_tiles = padded.view(3, 32, 3, 16).amax(dim=(1, 3)).flatten()
    assert torch.equal(tiles, want_tiles)


if INTERPRETED or torch.cuda.is_available():
    import triton
    import triton.language as tl

    from nanogpt_pl.ops.triton.fp8_quant import round_to_bf16, to_fp8

    @triton.jit
    def _rounding_kernel(x_ptr, bf_ptr, e4_ptr, e5_ptr, n, BLOCK: tl.constexpr, HARDWARE: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(x_ptr + offs, mask=mask, other=0.0)
        tl.store(bf_ptr + offs, round_to_bf16(x), mask=mask)
        tl.store(e4_ptr + offs, to_fp8(x, False, HARDWARE), mask=mask)
        tl.store(e5_ptr + offs, to_fp8(x, True, HARDWARE), mask=mask)


def _round_with_kernel(x, hardware):
    """(bf16, e4m3, e5m2) roundings of fp32 ``x`` by ``to_fp8`` / ``round_to_bf16`` in one kernel."""
    n = x.numel()
    bf = torch.empty(n, device=x.device)
    e4, e5 = torch.empty(n, dtype=E4M3, device=x.device), torch.empty(n, dtype=E5M2, device=x.device)
    _rounding_kernel[(triton.cdiv(n, 1024),)](x, bf, e4, e5, n, BLOCK=1024, HARDWARE=hardware)
    return bf, e4, e5


@interp
@pytest.mark.parametrize("seed", SEEDS)
def test_rounding_helpers_equal_torch_casts(seed):
    gen = torch.Generator().manual_seed(seed)
    every_e4 = torch.arange(256, dtype=torch.uint8).view(E4M3).float()
    every_e5 = torch.arange(256, dtype=torch.uint8).view(E5M2).float()
    # The exact FP8 grid points, the midpoints between neighbours (ties), and random values.
    grid = torch.cat([every_e4[every_e4.isfinite()], every_e5[every_e5.isfinite()]]).unique()
    mids = (grid[1:] + grid[:-1]) / 2
    # (No NaN here: the interpreter's own cast of NaN to e4m3 yields a number.)
    x = torch.cat([grid, mids, wide_range((4000,), gen, -20, 17)])
    bf, e4, e5 = _round_with_kernel(x, hardware=False)  # the interpreter's rounding (above)
    assert same_values(bf, x.bfloat16().float())
    assert same_values(e4, x.clamp(-448, 448).to(E4M3))
    assert same_values(e5, x.clamp(-57344, 57344).to(E5M2))


@pytest.mark.cuda
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_hardware_rounding_equals_grid_rounding_on_the_gpu(seed, dtype):
    """The GPU kernels let the conversion instruction round (``to_fp8``'s default there): at a real
    size, ties and overflow included, it must give the bits of torch's saturated cast, and the
    values of the grid rounding the interpreter runs (which returns +0 where a negative value
    rounds to zero; the cast keeps -0)."""
    gen = torch.Generator().manual_seed(seed)
    every = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    grid = every[every.isfinite()].unique()
    mids = (grid[1:] + grid[:-1]) / 2
    special = torch.tensor([float("inf"), -float("inf"), float("nan"), 1e30, -1e30, 0.0, -0.0])
    x = torch.cat([grid, mids, special, wide_range((1 << 24,), gen, -30, 20)]).cuda()
    slot = 1 if dtype == E4M3 else 2  # _round_with_kernel's (bf16, e4m3, e5m2)
    hw = _round_with_kernel(x, hardware=True)[slot]
    sw = _round_with_kernel(x, hardware=False)[slot]
    limit = 448.0 if dtype == E4M3 else 57344.0
    ref = x.clamp(-limit, limit).to(dtype)
    number = ~x.isnan()
    assert torch.equal(hw[number].view(torch.uint8), ref[number].view(torch.uint8))
    assert hw.float()[~number].isnan().all()
    assert same_values(hw, sw)


@interp
@pytest.mark.parametrize("seed", SEEDS)
def test_elementwise_epilogues_equal_reference(seed):
    from nanogpt_pl.ops.fp8 import quantize
    from nanogpt_pl.ops.triton.fp8_mlp import dpre_quantize, relu2_quantize

    gen = torch.Generator().manual_seed(seed)
    m, n = 50, 72
    pre = (3 * torch.randn(m, n, generator=gen)).bfloat16()
    inv_ps = torch.tensor(0.37)
    amax = torch.tensor(1e9)  # a larger running max survives
    row, t = relu2_quantize(pre, inv_ps, amax, block=(32, 32))
    post = F.relu(pre.float()).square()
    assert same_values(row, quantize(post, inv_ps, E4M3)) and same_values(t, row.t())
    assert float(amax) == 1e9
    amax.zero_()
    relu2_quantize(pre, inv_ps, amax, block=(32, 32))
    assert torch.equal(amax, post.max())

    dpl = (0.01 * torch.randn(m, n, generator=gen)).bfloat16()
    ps, inv_ds, damax = torch.tensor(0.02), torch.tensor(3000.0), torch.zeros(())
    # 3,600 elements in blocks of 256 over 3 programs: each program loops, the last block is partial
    drow, dt = dpre_quantize(dpl, row, ps, inv_ds, damax, block=256, programs=3)
    dpre = 2.0 * dpl.float() * torch.sqrt((row.float() * ps).double()).float()  # correctly rounded
    assert same_values(drow, quantize(dpre, inv_ds, E5M2)) and same_values(dt, drow.t())
    assert torch.equal(damax, dpre.abs().max())


@interp
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("k", [64, 80])
def test_fused_gemm_epilogues_equal_reference(seed, k):
    from nanogpt_pl.ops.fp8 import _REFERENCE
    from nanogpt_pl.ops.triton.fp8_mlp import fp8_gemm_dpre, fp8_gemm_relu2

    gen = torch.Generator().manual_seed(seed)
    m, n = 96, 80  # several tiles, a partial K block when k = 80
    # Small integers are exact in e4m3/e5m2 and their dot products are exact in fp32 in
    # any order, so the kernel and the reference must agree bit for bit.
    x = torch.randint(-8, 9, (m, k), generator=gen).float().to(E4M3)
    w = torch.randint(-8, 9, (n, k), generator=gen).float().to(E4M3)
    xs, ws, inv_ps = torch.tensor(0.0625), torch.tensor(0.01), torch.tensor(1 / 0.03)
    amax_k, amax_e = torch.zeros(()), torch.zeros(())
    row, t = fp8_gemm_relu2(x, w, xs, ws, inv_ps, amax_k, config=SMALL_GEMM)
    erow, et = _REFERENCE.up_relu2(x, w, xs, ws, inv_ps, amax_e, False)
    assert same_values(row, erow) and same_values(t, et) and torch.equal(amax_k, amax_e)

    g = torch.randint(-6, 7, (m, 64), generator=gen).float().to(E5M2)
    w2 = torch.randint(-8, 9, (n, 64), generator=gen).float().to(E4M3)
    gs, w2s, ps, inv_ds = torch.tensor(2.0**-6), torch.tensor(0.004), torch.tensor(0.03), torch.tensor(5e4)
    d_k, d_e = torch.zeros(()), torch.zeros(())
    drow, dt = fp8_gemm_dpre(g, w2, gs, w2s, row, ps, inv_ds, d_k, config=SMALL_GEMM)
    erow2, et2 = _REFERENCE.dpre(g, w2, gs, w2s, row, ps, inv_ds, d_e, False)
    assert same_values(drow, erow2) and same_values(dt, et2) and torch.equal(d_k, d_e)

    # Random values: fp32 sums in another order may flip a bf16 rounding now and then.
    xr = (4 * torch.randn(m, k, generator=gen)).to(E4M3)
    wr = (4 * torch.randn(n, k, generator=gen)).to(E4M3)
    a1, a2 = torch.zeros(()), torch.zeros(())
    r1, _ = fp8_gemm_relu2(xr, wr, xs, ws, inv_ps, a1, config=SMALL_GEMM)
    r2, _ = _REFERENCE.up_relu2(xr, wr, xs, ws, inv_ps, a2, False)
    assert (r1.float() != r2.float()).float().mean() < 0.005
    assert rel(r1.float(), r2.float()) < 0.01


# ---------------------------------------------------------------------------------------
# The whole fast path (Triton + torch._scaled_mm on the CPU) against the reference backend
# ---------------------------------------------------------------------------------------


# Bytes that fill fresh buffers: 0x7B decodes to a large finite value in every dtype the
# fast path allocates (e4m3 352, e5m2 57344, bf16/fp32 about 1.3e36), so it shows in an
# amax; 0xFF is NaN in all of them, so it survives a multiplication by a zero padding row.
STALE_BYTES = (0x7B, 0xFF)


@pytest.fixture(params=STALE_BYTES, ids=lambda b: f"stale{b:02x}")
def stale_memory(request, monkeypatch):
    """``torch.empty`` hands out memory filled with a stale byte, as a GPU caching allocator
    hands out the previous tensor's bytes (a fresh CPU allocation is often zero-filled, which
    would hide a read of an unwritten padding row)."""
    real_empty = torch.empty
    byte = request.param

    def empty(*args, **kwargs):
        out = real_empty(*args, **kwargs)
        if out.is_contiguous() and out.numel():
            out.reshape(-1).view(torch.uint8).fill_(byte)  # reshape: a 0-dim tensor has no byte view
        return out

    monkeypatch.setattr(torch, "empty", empty)


def _mlp_steps(fast, relu2_kernel, x0, w10, w20, gs):
    from nanogpt_pl.ops import fp8 as f8

    w1, w2 = torch.nn.Parameter(w10.clone()), torch.nn.Parameter(w20.clone())
    state = f8.Fp8MLPState(backend="reference", relu2_kernel=relu2_kernel)
    if fast:
        state._kernels_override = f8._FAST
    out = []
    for g in gs:
        x = x0.clone().requires_grad_()
        y = f8.fp8_mlp(x, w1, w2, state)
        y.backward(g)
        # The amaxes a step measured become the next step's delayed scales.
        out.append((y.detach(), x.grad, w1.grad.clone(), w2.grad.clone(), state.post_scale.clone(),
                    state.dpre_scale.clone(), state.w1_scale.clone(), state.w2_amax.clone(),
                    state.post_amax.clone(), state.dpre_amax.clone()))
        w1.grad = w2.grad = None
        with torch.no_grad():
            w1.mul_(1.02)
            w2.mul_(0.98)
    return out


@interp
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("relu2_kernel", ["elementwise", "gemm_epilogue"])
@pytest.mark.parametrize("n", [72, 40])
def test_fast_mlp_equals_reference_mlp(seed, relu2_kernel, n, stale_memory):
    gen = torch.Generator().manual_seed(seed)
    d, h = 64, 96  # n is not a multiple of 16: the fast path pads to 80 / 48 rows and slices
    x0 = F.rms_norm(torch.randn(n, d, generator=gen), (d,)).bfloat16()
    w10 = (0.1 * torch.randn(h, d, generator=gen)).bfloat16()
    w20 = (0.1 * torch.randn(h, d, generator=gen)).bfloat16()
    gs = [torch.randn(n, d, generator=gen).bfloat16() for _ in range(2)]
    fast = _mlp_steps(True, relu2_kernel, x0, w10, w20, gs)
    ref = _mlp_steps(False, relu2_kernel, x0, w10, w20, gs)
    # Same quantization and epilogue arithmetic; the GEMMs sum in another order, which can
    # flip a bf16 rounding (2^-8 relative) here and there, and with it an FP8 rounding.
    # Step 1 runs on the delayed scales measured in step 0.
    for step, (a, b) in enumerate(zip(fast, ref)):
        for u, v in zip(a[:4], b[:4]):
            assert u.isfinite().all() and rel(u, v) < 5e-3, step
        for u, v in zip(a[4:], b[4:]):  # scales and amaxes
            assert torch.allclose(u, v, rtol=1e-2, atol=0), step


@interp
@pytest.mark.parametrize("seed", SEEDS)
def test_fast_linear_equals_reference_linear(seed, stale_memory):
    from nanogpt_pl.ops import fp8 as f8

    gen = torch.Generator().manual_seed(seed)
    n, d = 40, 64
    x0 = F.rms_norm(torch.randn(n, d, generator=gen), (d,))
    qk0, v0 = 0.1 * torch.randn(2, 32, d, generator=gen), 0.1 * torch.randn(32, d, generator=gen)
    g = 0.01 * torch.randn(n, 96, generator=gen)
    res = []
    for fast in (True, False):
        qk, v, x = torch.nn.Parameter(qk0.clone()), torch.nn.Parameter(v0.clone()), x0.clone().requires_grad_()
        state = f8.Fp8LinearState(backend="reference")
        if fast:
            state._kernels_override = f8._FAST
        y = f8.fp8_linear(x, (qk.flatten(0, 1), v), state)
        y.backward(g)
        res.append((y.detach(), x.grad, qk.grad, v.grad))
    for u, v in zip(res[0], res[1]):
        assert rel(u, v) < 1e-3


@interp
@pytest.mark.parametrize("seed", SEEDS)
def test_fast_linear_at_the_record_qkv_scale_saturates_like_the_reference(seed, stale_memory):
    # RECORD §7 QKV input scale 8/448: inputs beyond ±8 clamp at ±448 in both backends.
    from nanogpt_pl.ops import fp8 as f8

    gen = torch.Generator().manual_seed(100 + seed)
    n, d = 40, 64
    x0 = 4 * F.rms_norm(torch.randn(n, d, generator=gen), (d,))
    assert (x0.abs() > 8).any()
    w0 = 0.1 * torch.randn(96, d, generator=gen)
    g = 0.01 * torch.randn(n, 96, generator=gen)
    res = []
    for fast in (True, False):
        w, x = torch.nn.Parameter(w0.clone()), x0.clone().requires_grad_()
        state = f8.Fp8LinearState.for_record_qkv(backend="reference")
        if fast:
            state._kernels_override = f8._FAST
        y = f8.fp8_linear(x, w, state)
        y.backward(g)
        res.append((y.detach(), x.grad, w.grad))
    for u, v in zip(res[0], res[1]):
        assert u.isfinite().all() and rel(u, v) < 1e-3


@interp
@pytest.mark.parametrize("sampled", [False, True])
def test_fast_head_equals_reference_head(sampled, stale_memory):
    from nanogpt_pl.ops import fp8 as f8
    from nanogpt_pl.ops.cross_entropy import lm_head_loss

    gen = torch.Generator().manual_seed(int(sampled))
    n, d, v = 50, 64, 256
    hidden = F.rms_norm(torch.randn(n, d, generator=gen), (d,))
    w0 = 0.05 * torch.randn(v, d, generator=gen)
    targets = torch.randint(0, v, (n,), generator=gen)
    candidates = None
    if sampled:
        others = torch.tensor(sorted(set(range(v)) - set(targets.tolist())))
        candidates = torch.sort(torch.cat([targets.unique(), others[: 128 - targets.unique().numel()]]))[0]
    res = []
    for fast in (True, False):
        h, w = hidden.clone().requires_grad_(), torch.nn.Parameter(w0.clone())
        head = f8.Fp8Head(backend="reference")
        if fast:
            head.state._kernels_override = f8._FAST
        loss = lm_head_loss(h, w, targets, candidates=candidates, backend="chunked", head=head, chunk_rows=24)
        loss.backward()
        res.append((loss.detach(), h.grad, w.grad))
    for u, v_ in zip(res[0], res[1]):
        assert rel(u, v_) < 1e-3


@interp
@pytest.mark.parametrize("r", [20, 32])
def test_fast_head_gradient_buffer_pads_with_zero_bytes(r, stale_memory):
    # The loss kernel writes only the chunk's rows; the padding rows meet zero columns of xᵀ
    # in the dW GEMM, where a stale NaN/inf byte would still give NaN (0 · NaN). (The
    # interpreter's fp8 cast turns NaN into a number, so the GEMM result cannot show it here.)
    from nanogpt_pl.ops import fp8 as f8

    gen = torch.Generator().manual_seed(r)
    head = f8.Fp8Head(backend="reference")
    head.state._kernels_override = f8._FAST
    w = torch.nn.Parameter(0.05 * torch.randn(64, 32, generator=gen))
    x = F.rms_norm(torch.randn(r, 32, generator=gen), (32,))
    logits, _ = head.logits(x, head.prepare(w, None, torch.float32))
    grad, _ = head.grad_buffer(logits)
    full = head._padded(grad)
    assert grad.shape == (r, 64) and full.shape == (32, 64)
    assert (full[r:].view(torch.uint8) == 0).all()


@interp
def test_fast_gemm_rejects_wrong_layouts():
    from nanogpt_pl.ops.fp8 import _FAST

    a = torch.zeros(32, 64).to(E4M3)
    b = torch.zeros(48, 64).to(E4M3)
    one = torch.ones(())
    assert _FAST.mm(a, b, one, one, torch.bfloat16, True).shape == (32, 48)
    with pytest.raises(AssertionError, match="K-contiguous"):
        _FAST.mm(a, b.t().contiguous().t(), one, one, torch.bfloat16, True)
    with pytest.raises(AssertionError, match="multiples of 16"):
        _FAST.mm(a[:, :40].contiguous(), b[:, :40].contiguous(), one, one, torch.bfloat16, True)


@interp
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("shape", [(50, 72), (130, 33), (1, 257)])
def test_transpose_bytes_equals_torch(seed, shape):
    """The byte transpose used for the e5m2 tiles: every byte lands at its transposed place,
    also for shapes that are not multiples of the tile."""
    from nanogpt_pl.ops.triton.fp8_mlp import transpose_bytes

    gen = torch.Generator().manual_seed(seed)
    bits = torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)
    for dtype in (torch.uint8, E4M3, E5M2):
        src = bits.view(dtype)
        out = transpose_bytes(src, block=(32, 64))
        assert out.dtype == dtype and out.shape == (shape[1], shape[0]) and out.is_contiguous()
        assert torch.equal(out.view(torch.uint8), bits.t().contiguous())


@interp
@pytest.mark.parametrize("seed", SEEDS)
def test_fused_mlp_refresh_equals_pytorch_refresh(seed):
    """The one-launch scale refresh of the fast path against the PyTorch refresh, exactly: weight
    scales (exact phase, then lagged), delayed folds (including inf/NaN/zero/huge amaxes, which
    must leave or cap the scale), reciprocals, the refresh count and the weight caches' bytes."""
    from nanogpt_pl.ops import fp8 as f8

    gen = torch.Generator().manual_seed(seed)
    w1 = torch.nn.Parameter((0.05 * torch.randn(96, 64, generator=gen)).bfloat16())
    w2 = torch.nn.Parameter((0.05 * torch.randn(96, 64, generator=gen)).bfloat16())
    states = [f8.Fp8MLPState(backend="reference", exact_weight_refreshes=2) for _ in range(2)]
    states[1]._kernels_override = f8._FAST
    amaxes = [(3.7, 1e-3), (float("nan"), 0.0), (float("inf"), 5e13), (0.0, float("-inf")), (123.4, 2.5e-7)]
    for step, (post_amax, dpre_amax) in enumerate(amaxes):
        caches = []
        for st in states:
            st.post_amax.fill_(post_amax)
            st.dpre_amax.fill_(dpre_amax)
            kern = st._kernels(w1.device)
            caches.append(st.caches_for(w1, w2, kern))
        ref, fast = states
        for name, buf in ref.named_buffers():
            other = dict(fast.named_buffers())[name]
            assert torch.equal(buf, other) or (buf.isnan().all() and other.isnan().all()), (step, name, buf, other)
        for c_ref, c_fast in zip(*caches):
            assert torch.equal(c_ref.row.view(torch.uint8), c_fast.row.view(torch.uint8)), step
            assert torch.equal(c_ref.col.contiguous().view(torch.uint8), c_fast.col.view(torch.uint8)), step
        with torch.no_grad():  # an optimizer step: new values, new version
            w1.mul_(1.0 + 0.1 * torch.rand((), generator=gen))
            w2.add_(0.01 * torch.randn(w2.shape, generator=gen).bfloat16())
    assert int(states[1].refresh_count) == len(amaxes) == states[1]._refreshes
