"""Triton kernels that quantize tensors to FP8 in the two layouts ``torch._scaled_mm`` needs.

Hopper FP8 tensor cores only run "TN" GEMMs: both operands contiguous along the
reduction dimension. A weight-gradient GEMM reduces over tokens, so it needs the
token-contiguous (transposed) copy of each activation and gradient; the forward
and data-gradient GEMMs need the row-major copy. One pass here reads the source
once and writes both.

Rounding: round-to-nearest-even, saturating at the format maximum. On the GPU the
kernels clamp and let the hardware conversion (``cvt.rn.satfinite``) round, one
instruction per pair of values. Under ``TRITON_INTERPRET=1`` they round to the FP8 grid
in fp32 arithmetic first (:func:`round_to_fp8_grid`, about a dozen operations per
value), so the cast only ever sees representable values: the interpreter's float->fp8
conversion mis-rounds values whose mantissa carries into the next binade (1.98 became
1.0 instead of 2.0 in our checks), and the CPU tests compare real kernel arithmetic
against PyTorch. On an H200 the hardware rounding gave torch's cast bit for bit, and the
grid rounding the same values, but for the sign of zero (+0 where a negative value rounds
to zero); a GPU test checks both.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanogpt_pl.ops.triton import interpret_mode

# Format constants (OCP FP8: e4m3 "fn" has no infinities, max 448; e5m2 max 57344).
E4M3_MAX = 448.0
E5M2_MAX = 57344.0

# The hardware conversion rounds on the GPU; the interpreter's does not round right (above).
# Fixed when this module is imported, as Triton reads TRITON_INTERPRET (interpret_mode).
_HARDWARE_ROUNDING = tl.constexpr(not interpret_mode())
_ROUND_BEFORE_CAST = tl.constexpr(interpret_mode())

# 1.5 * 2**23: adding and subtracting it rounds an fp32 value of magnitude < 2**22 to the
# nearest integer, ties to even, using the FPU's own round-to-nearest-even.
_RNE_MAGIC = tl.constexpr(12582912.0)

# 64 x 128 tiles, 4 warps: 0.088 ms for a 49,152 x 768 bf16 -> e4m3/e5m2 dual pass on the H200,
# against 0.093 / 0.110 ms with 128 x 128 (`benchmarks/fp8_mlp.py --tile-sweep`).
_GPU_TILE = (64, 128)


@triton.jit
def round_to_fp8_grid(v, MANT_BITS: tl.constexpr, MIN_EXP: tl.constexpr, FMT_MAX: tl.constexpr):
    """Round fp32 ``v`` to the nearest value of an FP8 grid (ties to even), saturating at +-FMT_MAX.

    The grid spacing at ``v`` is 2**(max(e, MIN_EXP) - MANT_BITS) where e = floor(log2|v|)
    (read off the fp32 exponent bits); below 2**MIN_EXP the spacing is the subnormal one.
    Scaling by a power of two is exact, so the only rounding is the integer rounding.
    NaN stays NaN.
    """
    v = tl.minimum(tl.maximum(v, -FMT_MAX, propagate_nan=tl.PropagateNan.ALL), FMT_MAX,
                   propagate_nan=tl.PropagateNan.ALL)
    bits = v.to(tl.int32, bitcast=True)
    exp = ((bits >> 23) & 0xFF) - 127
    ulp_exp = tl.maximum(exp, MIN_EXP) - MANT_BITS
    inv_ulp = ((127 - ulp_exp) << 23).to(tl.float32, bitcast=True)
    ulp = ((127 + ulp_exp) << 23).to(tl.float32, bitcast=True)
    y = v * inv_ulp
    y = (y + _RNE_MAGIC) - _RNE_MAGIC
    return y * ulp


@triton.jit
def round_to_bf16(v):
    """fp32 -> nearest bf16 value (ties to even), returned as fp32.

    Bit arithmetic rather than ``.to(tl.bfloat16)``: the same result as the GPU's
    ``cvt.rn.bf16.f32``, and the interpreter's conversion truncates instead of rounding.
    """
    bits = v.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def store_rounded(ptrs, v, mask):
    """Store fp32 ``v`` at ``ptrs`` in their dtype, rounded to nearest even as the GPU's cast does.

    The interpreter's fp32 -> bf16 cast truncates, so there a bf16 destination gets ``v`` rounded
    first (:func:`round_to_bf16`) and the cast sees bf16 values.
    """
    if _ROUND_BEFORE_CAST and ptrs.dtype.element_ty == tl.bfloat16:
        v = round_to_bf16(v)
    tl.store(ptrs, v.to(ptrs.dtype.element_ty), mask=mask)


@triton.jit
def to_fp8(v, E5M2: tl.constexpr, HARDWARE: tl.constexpr = _HARDWARE_ROUNDING):
    """Saturating round-to-nearest-even cast of fp32 ``v`` to e5m2 (E5M2) or e4m3fn.

    ``HARDWARE`` (the default on the GPU): clamp, then the conversion instruction rounds;
    else round on the grid in fp32 first (:func:`round_to_fp8_grid`; the same values, with +0
    for a negative value that rounds to zero).
    """
    if HARDWARE:
        if E5M2:
            v = tl.minimum(tl.maximum(v, -57344.0, propagate_nan=tl.PropagateNan.ALL), 57344.0,
                           propagate_nan=tl.PropagateNan.ALL)
            out = v.to(tl.float8e5, fp_downcast_rounding="rtne")
        else:
            v = tl.minimum(tl.maximum(v, -448.0, propagate_nan=tl.PropagateNan.ALL), 448.0,
                           propagate_nan=tl.PropagateNan.ALL)
            out = v.to(tl.float8e4nv, fp_downcast_rounding="rtne")
    else:
        if E5M2:
            out = round_to_fp8_grid(v, 2, -14, 57344.0).to(tl.float8e5)
        else:
            out = round_to_fp8_grid(v, 3, -6, 448.0).to(tl.float8e4nv)
    return out


@triton.jit
def _quantize_dual_kernel(src_ptr, row_ptr, t_ptr, inv_scale_ptr, tile_amax_ptr, clear_ptr,
                          m_src, m_out, k, stride_sm, stride_sk,
                          BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, E5M2: tl.constexpr,
                          WRITE_ROW: tl.constexpr, WRITE_T: tl.constexpr, TILE_AMAX: tl.constexpr,
                          AMAX_ATOMIC: tl.constexpr, CLEAR: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    if CLEAR:  # the next kernel's running max starts here, instead of in a fill launch of its own
        tl.store(clear_ptr, 0.0, mask=(pid_m == 0) & (pid_k == 0))
    offs_m = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = pid_k.to(tl.int64) * BLOCK_K + tl.arange(0, BLOCK_K)
    in_k = offs_k < k
    # Rows past m_src (padding up to m_out) read as zeros and are written as zeros.
    src_mask = (offs_m < m_src)[:, None] & in_k[None, :]
    v = tl.load(src_ptr + offs_m[:, None] * stride_sm + offs_k[None, :] * stride_sk,
                mask=src_mask, other=0.0).to(tl.float32)
    q = to_fp8(v * tl.load(inv_scale_ptr), E5M2)
    if WRITE_ROW:
        out_mask = (offs_m < m_out)[:, None] & in_k[None, :]
        tl.store(row_ptr + offs_m[:, None] * k + offs_k[None, :], q, mask=out_mask)
    if WRITE_T:
        t_mask = in_k[:, None] & (offs_m < m_out)[None, :]
        tl.store(t_ptr + offs_k[:, None] * m_out + offs_m[None, :], tl.trans(q), mask=t_mask)
    if TILE_AMAX:
        tile_max = tl.max(tl.max(tl.abs(v), axis=1), axis=0)
        if AMAX_ATOMIC:  # one running max for the whole tensor
            # relaxed: the amax is read by a later kernel, after this one has finished
            tl.atomic_max(tile_amax_ptr, tile_max, sem="relaxed")
        else:
            tl.store(tile_amax_ptr + pid_m * tl.num_programs(1) + pid_k, tile_max)


def _dummy(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(1, device=device, dtype=dtype)


def quantize_dual(src: torch.Tensor, inv_scale: torch.Tensor, fp8_dtype: torch.dtype, *,
                  rows_out: int | None = None, write_row: bool = True, write_t: bool = True,
                  tile_amax: bool = False, amax_into: torch.Tensor | None = None,
                  clear: torch.Tensor | None = None, block: tuple[int, int] = _GPU_TILE,
                  ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Quantize a 2-D ``src`` [M, K] to ``fp8_dtype`` as ``clamp(src * inv_scale)``.

    Args:
        src: any float dtype, any strides.
        inv_scale: 1-element fp32 tensor, the reciprocal of the dequantization scale.
        fp8_dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.
        rows_out: pad the outputs to this many rows with zeros (``_scaled_mm`` wants
            dimensions that are multiples of 16).
        write_row / write_t: emit the row-major [rows_out, K] and/or the transposed
            contiguous [K, rows_out] copy.
        tile_amax: also return the per-tile max |src| (one fp32 per tile), used for the
            lagged weight scales.
        amax_into: a 1-element fp32 tensor that instead receives max(itself, max |src|) by
            atomic max (no per-tile buffer, no reduction launch); returned in the third slot.
        clear: a 1-element fp32 tensor this launch sets to 0, for a later kernel's atomic max
            (a kernel that runs anyway, where a fill would be a launch of its own).
        block: (BLOCK_M, BLOCK_K) tile.

    Returns:
        (row, t, tile_amax), None where not requested.
    """
    if fp8_dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise ValueError(f"quantize_dual: unsupported fp8 dtype {fp8_dtype}")
    m, k = src.shape
    m_out = m if rows_out is None else rows_out
    dev = src.device
    row = torch.empty((m_out, k), device=dev, dtype=fp8_dtype) if write_row else None
    t = torch.empty((k, m_out), device=dev, dtype=fp8_dtype) if write_t else None
    bm, bk = block
    grid = (triton.cdiv(m_out, bm), triton.cdiv(k, bk))
    if amax_into is not None:
        amax = amax_into
    else:
        amax = torch.empty(grid[0] * grid[1], device=dev, dtype=torch.float32) if tile_amax else None
    _quantize_dual_kernel[grid](
        src, row if row is not None else _dummy(dev, fp8_dtype),
        t if t is not None else _dummy(dev, fp8_dtype), inv_scale,
        amax if amax is not None else _dummy(dev, torch.float32),
        clear if clear is not None else _dummy(dev, torch.float32),
        m, m_out, k, src.stride(0), src.stride(1),
        BLOCK_M=bm, BLOCK_K=bk, E5M2=fp8_dtype == torch.float8_e5m2,
        WRITE_ROW=write_row, WRITE_T=write_t, TILE_AMAX=tile_amax or amax_into is not None,
        AMAX_ATOMIC=amax_into is not None, CLEAR=clear is not None,
        num_warps=8 if bm * bk >= 128 * 128 else 4)
    return row, t, amax
