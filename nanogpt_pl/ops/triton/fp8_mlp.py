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

The PyTorch reference of exactly these formulas is ``nanogpt_pl.ops.fp8`` (the
emulated backend); the tests compare the two.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanogpt_pl.ops.triton.fp8_quant import round_to_bf16, to_fp8

_GPU_TILE = (128, 128)
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
    tl.atomic_max(amax_ptr, tl.max(tl.max(post, axis=1), axis=0))
    q = to_fp8(post * tl.load(inv_scale_ptr), False)
    tl.store(row_ptr + offs_m[:, None] * n + offs_n[None, :], q, mask=mask)
    t_mask = (offs_n < n)[:, None] & (offs_m < m)[None, :]
    tl.store(t_ptr + offs_n[:, None] * m + offs_m[None, :], tl.trans(q), mask=t_mask)


@triton.jit
def _dpre_quantize_kernel(dpl_ptr, post_ptr, row_ptr, post_scale_ptr, inv_scale_ptr, amax_ptr,
                          m, n, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    offs_m = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_m < m)[:, None] & (offs_n < n)[None, :]
    idx = offs_m[:, None] * n + offs_n[None, :]
    dpl = tl.load(dpl_ptr + idx, mask=mask, other=0.0).to(tl.float32)
    post = tl.load(post_ptr + idx, mask=mask, other=0.0).to(tl.float32)
    dpre = 2.0 * dpl * tl.sqrt_rn(post * tl.load(post_scale_ptr))
    tl.atomic_max(amax_ptr, tl.max(tl.max(tl.abs(dpre), axis=1), axis=0))
    q = to_fp8(dpre * tl.load(inv_scale_ptr), True)
    tl.store(row_ptr + idx, q, mask=mask)


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
                  block: tuple[int, int] = _GPU_TILE) -> tuple[torch.Tensor, torch.Tensor]:
    """2 * dpl * sqrt(post * post_scale) quantized to e5m2 (row-major and transposed).

    Args:
        dpl: contiguous [M, N] bf16, the dequantized g @ W2^T.
        post: contiguous [M, N] e4m3, the forward's stored post activation.
        post_scale: 1-element fp32 dequantization scale of ``post``.
        inv_dpre_scale: 1-element fp32, 1 / dpre_scale.
        dpre_amax: 1-element fp32 accumulator of max |dpre|, updated in place.
    """
    assert dpl.is_contiguous() and post.is_contiguous() and dpl.shape == post.shape
    m, n = dpl.shape
    row = torch.empty((m, n), device=dpl.device, dtype=torch.float8_e5m2)
    bm, bn = block
    _dpre_quantize_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
        dpl, post, row, post_scale, inv_dpre_scale, dpre_amax, m, n, BLOCK_M=bm, BLOCK_N=bn,
        num_warps=8 if bm * bn >= 128 * 128 else 4)
    return row, _transpose_e5m2(row)


def _transpose_e5m2(row: torch.Tensor) -> torch.Tensor:
    """The transposed copy of an e5m2 tile, made by PyTorch.

    On the H200 (triton 3.6) the kernels' own transposed e5m2 stores wrote wrong bytes (the
    row-major copies were right; tests/test_fp8_layouts.py), so the e5m2 outputs are
    transposed here, at the cost of one extra read and write of the tile.
    """
    return row.t().contiguous()


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
    # would have written, so both MLP kernels and the emulation share one formula.
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
    tl.atomic_max(amax_ptr, tile_max)
    tl.store(row_ptr + offs_m[:, None] * N + offs_n[None, :], q, mask=mask)
    if not BACKWARD:  # the e5m2 (backward) transpose is made by PyTorch, see _transpose_e5m2
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
    return (row, _transpose_e5m2(row)) if backward else (row, t)


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
