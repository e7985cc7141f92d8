"""Triton kernels of the FP8 ReLU^2 MLP: the up-projection epilogue and its backward twin.

Two ways to run each of the MLP's two "GEMM + nonlinearity" steps, chosen by
``Fp8MLPState(relu2_kernel=...)`` and compared in ``benchmarks/fp8_mlp.py``:

* ``"gemm_epilogue"``: one Triton FP8 GEMM whose epilogue does the nonlinearity and
  the FP8 quantization (``fp8_gemm_relu2`` / ``fp8_gemm_dpre``). The bf16 [N, H]
  intermediate never reaches memory.
* ``"elementwise"``: ``torch._scaled_mm`` (cuBLAS) writes the bf16 [N, H] product and
  one fused Triton pass (``relu2_quantize`` / ``dpre_quantize``) does the rest.

Forward step (up-projection), per element of the [N, H] product:
    pre  = bf16(acc * x_scale * w1_scale)
    post = relu(pre)^2                           (fp32)
    amax = max(amax, post)                       (feeds the delayed post scale)
    out  = e4m3(post / post_scale), row-major and transposed

Backward step, per element of g @ W2^T:
    dpl  = bf16(acc * g_scale * w2_scale)
    dpre = 2 * dpl * sqrt(post_e4m3 * post_scale)   (relu(pre) rebuilt from the stored fp8 post)
    amax = max(amax, |dpre|)                     (feeds the delayed dpre scale)
    out  = e5m2(dpre / dpre_scale), row-major and transposed

The PyTorch reference of exactly these formulas is the reference backend of
``nanogpt_pl.ops.fp8`` (``backends.py``); the tests compare the two.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from nanogpt_pl.ops.triton.fp8_quant import round_to_bf16, to_fp8

# The ReLU² pass (bf16 in, e4m3 row-major and transposed out) at 16,384 / 49,152 x 2,816 on the
# H200: 56.4 / 157.7 us with 32 x 128 tiles, 4 warps, against 67.7 / 188.0 us with the 64 x 128
# tiles and the ordered (acq_rel) amax atomic it had before (BENCHMARKS.md "The amax atomics").
_GPU_TILE = (32, 128)
# The dpre pass runs as a grid-stride loop over flat blocks of this many elements, _PROGRAMS_PER_SM
# programs per SM, each folding its running max into the amax with one atomic at its end: 54.0 /
# 142.4 us at 16,384 / 49,152 x 2,816 on the H200, against 67.3 / 183.4 us for one program (and
# one atomic) per 32 x 128 tile (BENCHMARKS.md "The amax atomics").
_DPRE_BLOCK = 2048
_PROGRAMS_PER_SM = 8
# GEMM tiles for H100/H200 FP8 (K-major operands, wgmma): 3 stages of 32 KiB fit in
# shared memory twice over, so two CTAs per SM overlap one's epilogue with the other's loads.
GEMM_CONFIG = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 128, "GROUP_M": 8,
               "num_warps": 8, "num_stages": 3}


@triton.jit
def _relu2_quantize_kernel(pre_ptr, row_ptr, t_ptr, inv_scale_ptr, amax_ptr, m, n,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    offs_m = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_m < m)[:, None] & (offs_n < n)[None, :]
    pre = tl.load(pre_ptr + offs_m[:, None] * n + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
    r = tl.maximum(pre, 0.0, propagate_nan=tl.PropagateNan.ALL)
    post = r * r
    tl.atomic_max(amax_ptr, tl.max(tl.max(post, axis=1), axis=0), sem="relaxed")
    q = to_fp8(post * tl.load(inv_scale_ptr), False)
    tl.store(row_ptr + offs_m[:, None] * n + offs_n[None, :], q, mask=mask)
    t_mask = (offs_n < n)[:, None] & (offs_m < m)[None, :]
    tl.store(t_ptr + offs_n[:, None] * m + offs_m[None, :], tl.trans(q), mask=t_mask)


@triton.jit
def _dpre_quantize_kernel(dpl_ptr, post_ptr, row_ptr, post_scale_ptr, inv_scale_ptr, amax_ptr,
                          total, BLOCK: tl.constexpr):
    # A grid-stride loop over flat blocks: the pass is elementwise (its transpose is made by
    # transpose_bytes), and a few programs per SM, each with one atomic at its end, keep the
    # many per-tile atomics on one address off the memory system.
    post_scale = tl.load(post_scale_ptr)
    inv_scale = tl.load(inv_scale_ptr)
    running = tl.zeros((BLOCK,), dtype=tl.float32)
    for b in range(tl.program_id(0), tl.cdiv(total, BLOCK), tl.num_programs(0)):
        offs = b * BLOCK + tl.arange(0, BLOCK)  # int32: dpre_quantize checks total + BLOCK < 2**31
        mask = offs < total
        dpl = tl.load(dpl_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        post = tl.load(post_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        dpre = 2.0 * dpl * tl.sqrt_rn(post * post_scale)
        running = tl.maximum(running, tl.abs(dpre))
        tl.store(row_ptr + offs, to_fp8(dpre * inv_scale, True), mask=mask)
    # relaxed: the amax is read by a later kernel, after this one has finished
    tl.atomic_max(amax_ptr, tl.max(running, axis=0), sem="relaxed")


def _programs(device: torch.device) -> int:
    """Programs for a grid-stride pass: _PROGRAMS_PER_SM per SM on a GPU, 3 elsewhere (the
    interpreter, where a few programs make every program loop)."""
    if device.type != "cuda":
        return 3
    return _PROGRAMS_PER_SM * _sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def relu2_quantize(pre: torch.Tensor, inv_post_scale: torch.Tensor, post_amax: torch.Tensor,
                   block: tuple[int, int] = _GPU_TILE) -> tuple[torch.Tensor, torch.Tensor]:
    """relu(pre)^2 quantized to e4m3 (row-major and transposed); folds max(post) into ``post_amax``.

    Args:
        pre: contiguous [M, N] bf16, the dequantized up-projection.
        inv_post_scale: 1-element fp32, 1 / post_scale.
        post_amax: 1-element fp32 accumulator, updated in place with atomic max.
    """
    assert pre.is_contiguous() and pre.ndim == 2
    m, n = pre.shape
    row = torch.empty((m, n), device=pre.device, dtype=torch.float8_e4m3fn)
    t = torch.empty((n, m), device=pre.device, dtype=torch.float8_e4m3fn)
    bm, bn = block
    _relu2_quantize_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
        pre, row, t, inv_post_scale, post_amax, m, n, BLOCK_M=bm, BLOCK_N=bn,
        num_warps=8 if bm * bn >= 128 * 128 else 4)
    return row, t


def dpre_quantize(dpl: torch.Tensor, post: torch.Tensor, post_scale: torch.Tensor,
                  inv_dpre_scale: torch.Tensor, dpre_amax: torch.Tensor,
                  block: int = _DPRE_BLOCK, programs: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """2 * dpl * sqrt(post * post_scale) quantized to e5m2 (row-major and transposed).

    Args:
        dpl: contiguous [M, N] bf16, the dequantized g @ W2^T.
        post: contiguous [M, N] e4m3, the forward's stored post activation.
        post_scale: 1-element fp32 dequantization scale of ``post``.
        inv_dpre_scale: 1-element fp32, 1 / dpre_scale.
        dpre_amax: 1-element fp32 accumulator of max |dpre|, updated in place.
        block: elements per loop step of a program (a power of two).
        programs: how many programs share the blocks; by default a few per SM.
    """
    assert dpl.is_contiguous() and post.is_contiguous() and dpl.shape == post.shape
    m, n = dpl.shape
    row = torch.empty((m, n), device=dpl.device, dtype=torch.float8_e5m2)
    total = m * n
    assert total + block < 2**31, f"dpre_quantize: {m} x {n} elements overflow the kernel's int32 offsets"
    grid = (max(1, min(programs or _programs(dpl.device), triton.cdiv(total, block))),)
    _dpre_quantize_kernel[grid](dpl, post, row, post_scale, inv_dpre_scale, dpre_amax, total, BLOCK=block,
                                num_warps=8 if block >= 2048 else 4)
    return row, transpose_bytes(row)


@triton.jit
def _fold(amax_ptr, scale_ptr, inv_ptr, GAIN: tl.constexpr, FLOOR: tl.constexpr, CEIL: tl.constexpr):
    """Delayed scale: scale <- max(a·GAIN, FLOOR) if a > 0 (a = amax with inf/NaN as 0, capped); amax <- 0."""
    a = tl.load(amax_ptr)
    a = tl.where(a == a, a, 0.0)
    a = tl.where(tl.abs(a) == float("inf"), 0.0, a)
    a = tl.minimum(a, CEIL)
    scale = tl.where(a > 0, tl.maximum(a * GAIN, FLOOR), tl.load(scale_ptr))
    tl.store(scale_ptr, scale)
    tl.store(amax_ptr, 0.0)
    tl.store(inv_ptr, tl.div_rn(1.0, scale))


@triton.jit
def _weight_scale(amax_ptr, scale_ptr, inv_ptr, GAIN: tl.constexpr, FLOOR: tl.constexpr, FMT_MAX: tl.constexpr):
    scale = tl.div_rn(tl.maximum(tl.load(amax_ptr) * GAIN, FLOOR), FMT_MAX)
    tl.store(scale_ptr, scale)
    tl.store(inv_ptr, tl.div_rn(1.0, scale))
    tl.store(amax_ptr, 0.0)


@triton.jit
def _mlp_refresh_kernel(w1_amax, w1_scale, w1_inv, w2_amax, w2_scale, w2_inv,
                        post_amax, post_scale, post_inv, dpre_amax, dpre_scale, dpre_inv,
                        x_scale, x_inv, grad_scale, grad_inv, count_ptr,
                        W_GAIN: tl.constexpr, W_FLOOR: tl.constexpr, W_MAX: tl.constexpr,
                        POST_GAIN: tl.constexpr, POST_FLOOR: tl.constexpr,
                        DPRE_GAIN: tl.constexpr, DPRE_FLOOR: tl.constexpr, CEIL: tl.constexpr):
    # weights: scale = max(amax·W_GAIN, W_FLOOR) / W_MAX from the amax of the last refresh
    # (or of now, in the exact phase); the amax is zeroed for the quantize pass to refill
    _weight_scale(w1_amax, w1_scale, w1_inv, W_GAIN, W_FLOOR, W_MAX)
    _weight_scale(w2_amax, w2_scale, w2_inv, W_GAIN, W_FLOOR, W_MAX)
    _fold(post_amax, post_scale, post_inv, POST_GAIN, POST_FLOOR, CEIL)
    _fold(dpre_amax, dpre_scale, dpre_inv, DPRE_GAIN, DPRE_FLOOR, CEIL)
    tl.store(x_inv, tl.div_rn(1.0, tl.load(x_scale)))
    tl.store(grad_inv, tl.div_rn(1.0, tl.load(grad_scale)))
    tl.store(count_ptr, tl.load(count_ptr) + 1)


def mlp_refresh_scales(state, exact: bool, constants: dict) -> None:
    """Every scale update of an FP8 MLP weight refresh in one launch (``Fp8MLPState.caches_for``).

    The PyTorch reference is the non-fused branch of ``caches_for``: weight scales from the
    amax buffers (times the lag headroom unless ``exact``), their reciprocals, the two
    delayed-scale folds, the reciprocals of the static scales and the refresh count. The weight
    amax buffers are left at zero; the weights' quantize passes refill them (``amax_into``).
    ``constants`` holds the headroom, floor and ceiling values (from ``nanogpt_pl.ops.fp8.formats``).
    """
    c = constants
    _mlp_refresh_kernel[(1,)](
        state.w1_amax, state.w1_scale, state._w1_inv, state.w2_amax, state.w2_scale, state._w2_inv,
        state.post_amax, state.post_scale, state._post_inv, state.dpre_amax, state.dpre_scale, state._dpre_inv,
        state.x_scale, state._x_inv, state.grad_scale, state._grad_inv, state.refresh_count,
        W_GAIN=1.0 if exact else c["w_gain"], W_FLOOR=c["w_floor"], W_MAX=c["w_max"],
        POST_GAIN=c["post_gain"], POST_FLOOR=c["post_floor"], DPRE_GAIN=c["dpre_gain"],
        DPRE_FLOOR=c["dpre_floor"], CEIL=c["ceil"], num_warps=1)


@triton.jit
def _transpose_bytes_kernel(src_ptr, dst_ptr, m, n, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    offs_m = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    v = tl.load(src_ptr + offs_m[:, None] * n + offs_n[None, :],
                mask=(offs_m < m)[:, None] & (offs_n < n)[None, :], other=0)
    tl.store(dst_ptr + offs_n[:, None] * m + offs_m[None, :], tl.trans(v),
             mask=(offs_n < n)[:, None] & (offs_m < m)[None, :])


# (64, 128) tiles, 4 warps: 0.086 ms for a 49,152 x 2,816 byte tile on the H200, against 0.91 ms
# for PyTorch's row.t().contiguous() (BENCHMARKS.md "FP8").
_TRANSPOSE_TILE = (64, 128)


def transpose_bytes(row: torch.Tensor, block: tuple[int, int] = _TRANSPOSE_TILE) -> torch.Tensor:
    """The contiguous transpose of a 2-D 1-byte tensor (an FP8 tile), by a separate Triton kernel.

    The e5m2 (backward) tiles are transposed here rather than in the kernels that compute
    them: on the H200 (triton 3.6) the dpre kernels' own transposed stores wrote wrong bytes,
    whether the tile was stored as e5m2 or as its uint8 bit pattern and for every tile shape
    tried (BENCHMARKS.md "FP8", tests/test_fp8_layouts.py); a kernel that only moves bytes
    writes them right. On an H100 the fault followed the hardware fp32 -> e5m2 conversion: a
    transposed copy of its output was wrong even when packed four bytes to a 32-bit word, and
    right when the bytes were built with integer arithmetic; those correct fused passes were
    0.90-0.99x the speed of this pass plus the byte transpose (BENCHMARKS.md, session 11).
    """
    assert row.ndim == 2 and row.is_contiguous() and row.element_size() == 1
    m, n = row.shape
    out = torch.empty((n, m), device=row.device, dtype=row.dtype)
    bm, bn = block
    _transpose_bytes_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
        row.view(torch.uint8), out.view(torch.uint8), m, n, BLOCK_M=bm, BLOCK_N=bn, num_warps=4)
    return out


@triton.jit
def _fp8_gemm_epilogue_kernel(a_ptr, b_ptr, row_ptr, t_ptr, aux_ptr,
                              scale_a_ptr, scale_b_ptr, aux_scale_ptr, inv_out_scale_ptr, amax_ptr,
                              M, N, K,
                              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                              GROUP_M: tl.constexpr, BACKWARD: tl.constexpr, EVEN_K: tl.constexpr):
    """C = A @ B^T with A [M, K] and B [N, K] both K-contiguous FP8, then the MLP epilogue.

    BACKWARD = False: the ReLU^2 + e4m3 epilogue (forward, fast accumulation).
    BACKWARD = True: the dpre + e5m2 epilogue (aux = stored e4m3 post); the accumulator
    is promoted to fp32 once per K block, the Triton analogue of use_fast_accum=False.
    """
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    # Grouped ordering: GROUP_M row-blocks share each B column-block while it is in L2.
    num_in_group = GROUP_M * num_pid_n
    group_id = pid // num_in_group
    first_m = group_id * GROUP_M
    group_size = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + ((pid % num_in_group) % group_size)
    pid_n = (pid % num_in_group) // group_size

    offs_m = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    # Out-of-range rows/columns load a wrapped in-range row instead of a masked one, which
    # keeps the main-loop loads unpredicated; their results are never stored.
    offs_am = offs_m % M
    offs_bn = offs_n % N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_am[:, None] * K + offs_k[None, :]
    b_ptrs = b_ptr + offs_bn[:, None] * K + offs_k[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            k_left = K - kb * BLOCK_K
            a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
            b = tl.load(b_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
        if BACKWARD:
            acc = tl.dot(a, tl.trans(b), acc, max_num_imprecise_acc=BLOCK_K)
        else:
            acc = tl.dot(a, tl.trans(b), acc)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K

    dequant = tl.load(scale_a_ptr) * tl.load(scale_b_ptr)
    # bf16 rounding of the dequantized product: the value _scaled_mm(out_dtype=bf16)
    # would have written, so both MLP kernels and the reference share one formula.
    lin = round_to_bf16(acc * dequant)
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    if BACKWARD:
        post = tl.load(aux_ptr + offs_m[:, None] * N + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
        val = 2.0 * lin * tl.sqrt_rn(post * tl.load(aux_scale_ptr))
        tile_max = tl.max(tl.max(tl.abs(val), axis=1), axis=0)
        q = to_fp8(val * tl.load(inv_out_scale_ptr), True)
    else:
        r = tl.maximum(lin, 0.0, propagate_nan=tl.PropagateNan.ALL)
        val = r * r
        tile_max = tl.max(tl.max(tl.where(mask, val, 0.0), axis=1), axis=0)
        q = to_fp8(val * tl.load(inv_out_scale_ptr), False)
    tl.atomic_max(amax_ptr, tile_max, sem="relaxed")
    tl.store(row_ptr + offs_m[:, None] * N + offs_n[None, :], q, mask=mask)
    if not BACKWARD:  # the e5m2 (backward) transpose is made by transpose_bytes
        t_mask = (offs_n < N)[:, None] & (offs_m < M)[None, :]
        tl.store(t_ptr + offs_n[:, None] * M + offs_m[None, :], tl.trans(q), mask=t_mask)


def _gemm_launch(a, b, aux, scale_a, scale_b, aux_scale, inv_out_scale, amax, out_dtype, backward, config):
    assert a.is_contiguous() and b.is_contiguous() and a.shape[1] == b.shape[1]
    cfg = dict(GEMM_CONFIG if config is None else config)
    m, k = a.shape
    n = b.shape[0]
    row = torch.empty((m, n), device=a.device, dtype=out_dtype)
    t = row if backward else torch.empty((n, m), device=a.device, dtype=out_dtype)
    grid = (triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]),)
    _fp8_gemm_epilogue_kernel[grid](
        a, b, row, t, aux, scale_a, scale_b, aux_scale, inv_out_scale, amax, m, n, k,
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], GROUP_M=cfg["GROUP_M"],
        BACKWARD=backward, EVEN_K=k % cfg["BLOCK_K"] == 0,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return (row, transpose_bytes(row)) if backward else (row, t)


def fp8_gemm_relu2(x_f8: torch.Tensor, w_f8: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor,
                   inv_post_scale: torch.Tensor, post_amax: torch.Tensor,
                   config: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused up-projection: e4m3(relu(x @ w^T)^2 / post_scale), row-major [M, N] and transposed [N, M].

    Args:
        x_f8: [M, K] e4m3, contiguous.  w_f8: [N, K] e4m3, contiguous (the weight's row cache).
        x_scale, w_scale: 1-element fp32 dequantization scales.
        inv_post_scale: 1-element fp32, 1 / post_scale.  post_amax: accumulator, updated in place.
        config: tile overrides (tests use small tiles under TRITON_INTERPRET=1).
    """
    return _gemm_launch(x_f8, w_f8, post_amax, x_scale, w_scale, x_scale, inv_post_scale, post_amax,
                        torch.float8_e4m3fn, False, config)


def fp8_gemm_dpre(g_f8: torch.Tensor, w_f8: torch.Tensor, g_scale: torch.Tensor, w_scale: torch.Tensor,
                  post: torch.Tensor, post_scale: torch.Tensor, inv_dpre_scale: torch.Tensor,
                  dpre_amax: torch.Tensor, config: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused dpre: e5m2(2 (g @ w^T) sqrt(post * post_scale) / dpre_scale), row-major and transposed.

    Args:
        g_f8: [M, K] e5m2 gradient, contiguous.  w_f8: [N, K] e4m3 (the down-projection's row cache).
        g_scale, w_scale: 1-element fp32 dequantization scales.
        post: [M, N] e4m3 forward activation.  post_scale: its dequantization scale.
        inv_dpre_scale: 1-element fp32, 1 / dpre_scale.  dpre_amax: accumulator, updated in place.
    """
    assert post.is_contiguous() and post.shape == (g_f8.shape[0], w_f8.shape[0])
    return _gemm_launch(g_f8, w_f8, post, g_scale, w_scale, post_scale, inv_dpre_scale, dpre_amax,
                        torch.float8_e5m2, True, config)
