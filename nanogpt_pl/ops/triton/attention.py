"""Triton kernels: causal sliding-window attention over packed documents, forward and backward.

The function is the one of ``nanogpt_pl.model.attention`` (its plain PyTorch twin is
``attention_sdpa``; ``dense_reference`` is the float64 oracle): query ``i`` attends to keys
``j`` of its own segment with ``i - window <= j <= i``. Inputs are packed ``[N, H, D]``
(``q``, ``k``: ``D = d_qk``; ``v``: ``D = d_v``; the two widths are independent, as the
record's narrow layers need d_qk 64 with d_v 128, RECORD §2).

Segment boundaries never reach the host. Two int32 arrays are built on the device from
``cu_seqlens`` with ``searchsorted``:

- ``row_lo[i] = max(start of i's segment, i - window)``: the first key query ``i`` sees;
- ``col_hi[j] = min(end of j's segment, j + window + 1)``: one past the last query that
  sees key ``j``.

Both are non-decreasing, so a tile of queries (or keys) reads its whole reachable range
from its first and last rows, and every kernel loops only over tiles that hold at least one
visible pair. Inside that range the tiles split into ones that need the mask (the diagonal
and the window's or segment's lower edge) and ones every pair of which is visible; the
latter skip the mask arithmetic.

Kernels (FlashAttention-2 layout, fp32 accumulation, exp2 with the scale folded in):

1. forward: one program per (query tile, head); online softmax; writes the output and the
   log-sum-exp (base 2) per row;
2. dQ: one program per (query tile, head), looping over the same keys as the forward; it
   first computes ``delta = rowsum(dO * O)`` of its rows (it loads their dO anyway) and
   stores it for the next kernel;
3. dK/dV: one program per (key tile, head), looping over the query tiles that see it.

Splitting dQ from dK/dV recomputes ``QKᵀ`` and ``dO·Vᵀ`` once more but needs no atomics,
so the gradients are deterministic.

Under ``TRITON_INTERPRET=1`` (CPU debugging) the interpreter's ``tl.dot`` mishandles bf16
operands; the tests run it in float32 there and in bf16 on the GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import ATTENTION_HEAD_DIMS, interpret_mode, lastdim_contiguous

Tensor = torch.Tensor

INTERPRET = interpret_mode()  # read once: triton itself reads the variable at import
LOG2E = 1.4426950408889634
HEAD_DIMS = ATTENTION_HEAD_DIMS  # the record uses 64 and 128 (RECORD §2)

# Tile sizes per kernel and head width: (kind, wide) -> (block_m, block_n, num_warps,
# num_stages), where block_m is the query tile, block_n the key tile and wide means a head
# dimension above 64. Fixed rather than autotuned so the first step compiles each kernel
# once; ``benchmarks/attention.py --sweep`` times the alternatives on the GPU from CUDA-graph
# replay, and ``benchmarks/kernel_build.py`` reports a tile's registers and spills without one.
# Chosen from that sweep on an H100 (triton 3.6) at 49,152 tokens (BENCHMARKS.md, session 16).
# The wide dK/dV tile spills a few registers and was still the fastest there; larger tiles (128
# keys in dK/dV, 128x128 anywhere) spill more or run out of shared memory at d = 128. The wide
# entries also serve the (64, 128) narrow layers.
TILES = {
    ("fwd", True): (64, 64, 4, 3),
    ("fwd", False): (64, 64, 4, 3),
    ("dkdv", True): (64, 64, 4, 2),
    ("dkdv", False): (32, 64, 4, 2),
    ("dq", True): (64, 64, 4, 2),
    ("dq", False): (128, 32, 8, 3),
}
# The interpreter gets small tiles so that the CPU tests cross many tile edges at a few
# hundred tokens.
_INTERP_TILES = {"fwd": (32, 16, 1, 1), "dkdv": (16, 32, 1, 1), "dq": (32, 16, 1, 1)}


def _tiles(kind: str, d_qk: int, d_v: int) -> tuple[int, int, int, int]:
    if INTERPRET:
        return _INTERP_TILES[kind]
    wide = max(d_qk, d_v) > 64
    tile = TILES[(kind, wide)]
    # the forward and dQ kernels step over keys from query-tile starts in key tiles: a key tile
    # that does not divide the query tile would overrun the diagonal and count keys twice
    if kind in ("fwd", "dq") and tile[0] % tile[1]:
        raise ValueError(f"attention TILES[({kind!r}, {wide})] = {tile}: block_m must be a multiple of block_n "
                         f"for the {kind} kernel (e.g. (64, 64) or (128, 32))")
    return tile


# ---------------------------------------------------------------- forward


@triton.jit
def _fwd_tile(acc, m_i, l_i, q, k_base, v_base, stride_kn, stride_vn, offs_m, lo_row, n_lo, n_hi, N,
              qk_scale, D_QK: tl.constexpr, D_V: tl.constexpr, BLOCK_N: tl.constexpr, MASK: tl.constexpr):
    dk = tl.arange(0, D_QK)
    dv = tl.arange(0, D_V)
    for n0 in range(n_lo, n_hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        in_n = offs_n < N
        kt = tl.load(k_base + offs_n[None, :] * stride_kn + dk[:, None], mask=in_n[None, :], other=0.0)
        v = tl.load(v_base + offs_n[:, None] * stride_vn + dv[None, :], mask=in_n[:, None], other=0.0)
        s = tl.dot(q, kt) * qk_scale
        if MASK:
            vis = (offs_n[None, :] >= lo_row[:, None]) & (offs_n[None, :] <= offs_m[:, None])
            s = tl.where(vis, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # a row none of whose keys in this tile is visible keeps m = -inf; shift by 0 instead
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _key_range(ROW_LO, m0, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Keys of the query block at ``m0``: [k_lo, k_hi) holds every visible pair, and
    [full_lo, m0) is visible to every row of the block (the forward and dQ kernels)."""
    lo_first = tl.load(ROW_LO + m0)
    lo_last = tl.load(ROW_LO + tl.minimum(m0 + BLOCK_M, N) - 1)
    k_lo = lo_first // BLOCK_N * BLOCK_N
    full_lo = tl.cdiv(lo_last, BLOCK_N) * BLOCK_N
    k_hi = tl.minimum(m0 + BLOCK_M, N)
    return k_lo, full_lo, k_hi


@triton.jit
def _fwd_kernel(Q, K, V, OUT, LSE, ROW_LO, N,
                stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_on, stride_oh,
                qk_scale, D_QK: tl.constexpr, D_V: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    m0 = tl.program_id(0) * BLOCK_M
    h = tl.program_id(1)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    in_m = offs_m < N
    dk = tl.arange(0, D_QK)
    dv = tl.arange(0, D_V)
    lo_row = tl.load(ROW_LO + offs_m, mask=in_m, other=N)
    q = tl.load(Q + h * stride_qh + offs_m[:, None] * stride_qn + dk[None, :], mask=in_m[:, None], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_V], tl.float32)
    k_base = K + h * stride_kh
    v_base = V + h * stride_vh

    k_lo, full_lo, k_hi = _key_range(ROW_LO, m0, N, BLOCK_M, BLOCK_N)
    acc, m_i, l_i = _fwd_tile(acc, m_i, l_i, q, k_base, v_base, stride_kn, stride_vn, offs_m, lo_row,
                              k_lo, tl.minimum(full_lo, m0), N, qk_scale, D_QK, D_V, BLOCK_N, True)
    acc, m_i, l_i = _fwd_tile(acc, m_i, l_i, q, k_base, v_base, stride_kn, stride_vn, offs_m, lo_row,
                              full_lo, m0, N, qk_scale, D_QK, D_V, BLOCK_N, False)
    acc, m_i, l_i = _fwd_tile(acc, m_i, l_i, q, k_base, v_base, stride_kn, stride_vn, offs_m, lo_row,
                              m0, k_hi, N, qk_scale, D_QK, D_V, BLOCK_N, True)

    # every real row sees at least itself, so l_i > 0 there; padded rows are not stored
    l_safe = tl.where(in_m, l_i, 1.0)
    out = acc / l_safe[:, None]
    tl.store(OUT + h * stride_oh + offs_m[:, None] * stride_on + dv[None, :], out.to(OUT.dtype.element_ty),
             mask=in_m[:, None])
    tl.store(LSE + h * N + offs_m, m_i + tl.log2(l_safe), mask=in_m)


# ---------------------------------------------------------------- backward


@triton.jit
def _dkdv_tile(dk_acc, dv_acc, k, v, q_base, do_base, lse_base, delta_base, ROW_LO, stride_qn, stride_dn,
               offs_n, m_lo, m_hi, N, qk_scale,
               D_QK: tl.constexpr, D_V: tl.constexpr, BLOCK_M: tl.constexpr, MASK: tl.constexpr):
    dk = tl.arange(0, D_QK)
    dv = tl.arange(0, D_V)
    for m0 in range(m_lo, m_hi, BLOCK_M):
        offs_m = m0 + tl.arange(0, BLOCK_M)
        in_m = offs_m < N
        # q and dO are read row-major, as stored, and transposed in the dots (free for the MMA's
        # shared-memory operand); the products accumulate in place
        q = tl.load(q_base + offs_m[:, None] * stride_qn + dk[None, :], mask=in_m[:, None], other=0.0)
        do = tl.load(do_base + offs_m[:, None] * stride_dn + dv[None, :], mask=in_m[:, None], other=0.0)
        # padded rows: lse = +inf makes their probabilities 0
        lse = tl.load(lse_base + offs_m, mask=in_m, other=float("inf"))
        delta = tl.load(delta_base + offs_m, mask=in_m, other=0.0)
        pt = tl.exp2(tl.dot(k, q.T) * qk_scale - lse[None, :])
        if MASK:
            lo_row = tl.load(ROW_LO + offs_m, mask=in_m, other=N)
            vis = (offs_n[:, None] >= lo_row[None, :]) & (offs_n[:, None] <= offs_m[None, :])
            pt = tl.where(vis, pt, 0.0)
        dv_acc = tl.dot(pt.to(do.dtype), do, dv_acc)
        dpt = tl.dot(v, do.T)
        dst = pt * (dpt - delta[None, :])
        dk_acc = tl.dot(dst.to(q.dtype), q, dk_acc)
    return dk_acc, dv_acc


@triton.jit
def _dkdv_kernel(Q, K, V, DO, DK, DV, LSE, DELTA, ROW_LO, COL_HI, N,
                 stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_dn, stride_dh,
                 stride_dkn, stride_dkh, stride_dvn, stride_dvh, qk_scale, sm_scale,
                 D_QK: tl.constexpr, D_V: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    n0 = tl.program_id(0) * BLOCK_N
    h = tl.program_id(1)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    in_n = offs_n < N
    dk = tl.arange(0, D_QK)
    dv = tl.arange(0, D_V)
    k = tl.load(K + h * stride_kh + offs_n[:, None] * stride_kn + dk[None, :], mask=in_n[:, None], other=0.0)
    v = tl.load(V + h * stride_vh + offs_n[:, None] * stride_vn + dv[None, :], mask=in_n[:, None], other=0.0)
    dk_acc = tl.zeros([BLOCK_N, D_QK], tl.float32)
    dv_acc = tl.zeros([BLOCK_N, D_V], tl.float32)

    # queries [n0, q_hi) see this tile; query tiles starting at or after diag_hi lie wholly
    # below the diagonal, and those ending by full_hi see every key of the tile
    n_last = tl.minimum(n0 + BLOCK_N, N) - 1
    q_hi = tl.load(COL_HI + n_last)
    first_hi = tl.load(COL_HI + n0)
    diag_hi = n0 + tl.cdiv(BLOCK_N, BLOCK_M) * BLOCK_M
    full_hi = diag_hi + tl.maximum(first_hi - diag_hi, 0) // BLOCK_M * BLOCK_M
    q_base = Q + h * stride_qh
    do_base = DO + h * stride_dh
    lse_base = LSE + h * N
    delta_base = DELTA + h * N
    dk_acc, dv_acc = _dkdv_tile(dk_acc, dv_acc, k, v, q_base, do_base, lse_base, delta_base, ROW_LO, stride_qn,
                                stride_dn, offs_n, n0, tl.minimum(diag_hi, q_hi), N, qk_scale,
                                D_QK, D_V, BLOCK_M, True)
    dk_acc, dv_acc = _dkdv_tile(dk_acc, dv_acc, k, v, q_base, do_base, lse_base, delta_base, ROW_LO, stride_qn,
                                stride_dn, offs_n, diag_hi, full_hi, N, qk_scale, D_QK, D_V, BLOCK_M, False)
    dk_acc, dv_acc = _dkdv_tile(dk_acc, dv_acc, k, v, q_base, do_base, lse_base, delta_base, ROW_LO, stride_qn,
                                stride_dn, offs_n, tl.maximum(full_hi, diag_hi), q_hi, N, qk_scale,
                                D_QK, D_V, BLOCK_M, True)

    tl.store(DK + h * stride_dkh + offs_n[:, None] * stride_dkn + dk[None, :],
             (dk_acc * sm_scale).to(DK.dtype.element_ty), mask=in_n[:, None])
    tl.store(DV + h * stride_dvh + offs_n[:, None] * stride_dvn + dv[None, :],
             dv_acc.to(DV.dtype.element_ty), mask=in_n[:, None])


@triton.jit
def _dq_tile(dq_acc, q, do, lse, delta, k_base, v_base, stride_kn, stride_vn, offs_m, lo_row, n_lo, n_hi, N,
             qk_scale, D_QK: tl.constexpr, D_V: tl.constexpr, BLOCK_N: tl.constexpr, MASK: tl.constexpr):
    dk = tl.arange(0, D_QK)
    dv = tl.arange(0, D_V)
    for n0 in range(n_lo, n_hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        in_n = offs_n < N
        k = tl.load(k_base + offs_n[:, None] * stride_kn + dk[None, :], mask=in_n[:, None], other=0.0)
        v = tl.load(v_base + offs_n[:, None] * stride_vn + dv[None, :], mask=in_n[:, None], other=0.0)
        p = tl.exp2(tl.dot(q, k.T) * qk_scale - lse[:, None])
        if MASK:
            vis = (offs_n[None, :] >= lo_row[:, None]) & (offs_n[None, :] <= offs_m[:, None])
            p = tl.where(vis, p, 0.0)
        dp = tl.dot(do, v.T)
        ds = p * (dp - delta[:, None])
        dq_acc = tl.dot(ds.to(k.dtype), k, dq_acc)
    return dq_acc


@triton.jit
def _dq_kernel(Q, K, V, DO, OUT, DQ, LSE, DELTA, ROW_LO, N,
               stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_dn, stride_dh,
               stride_on, stride_oh, stride_dqn, stride_dqh, qk_scale, sm_scale,
               D_QK: tl.constexpr, D_V: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    m0 = tl.program_id(0) * BLOCK_M
    h = tl.program_id(1)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    in_m = offs_m < N
    dk = tl.arange(0, D_QK)
    dv = tl.arange(0, D_V)
    lo_row = tl.load(ROW_LO + offs_m, mask=in_m, other=N)
    q = tl.load(Q + h * stride_qh + offs_m[:, None] * stride_qn + dk[None, :], mask=in_m[:, None], other=0.0)
    do = tl.load(DO + h * stride_dh + offs_m[:, None] * stride_dn + dv[None, :], mask=in_m[:, None], other=0.0)
    lse = tl.load(LSE + h * N + offs_m, mask=in_m, other=float("inf"))
    # delta = rowsum(dO * O) of these rows, here and for the dK/dV kernel that runs next
    o = tl.load(OUT + h * stride_oh + offs_m[:, None] * stride_on + dv[None, :], mask=in_m[:, None], other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(DELTA + h * N + offs_m, delta, mask=in_m)
    dq_acc = tl.zeros([BLOCK_M, D_QK], tl.float32)
    k_base = K + h * stride_kh
    v_base = V + h * stride_vh

    k_lo, full_lo, k_hi = _key_range(ROW_LO, m0, N, BLOCK_M, BLOCK_N)
    dq_acc = _dq_tile(dq_acc, q, do, lse, delta, k_base, v_base, stride_kn, stride_vn, offs_m, lo_row,
                      k_lo, tl.minimum(full_lo, m0), N, qk_scale, D_QK, D_V, BLOCK_N, True)
    dq_acc = _dq_tile(dq_acc, q, do, lse, delta, k_base, v_base, stride_kn, stride_vn, offs_m, lo_row,
                      full_lo, m0, N, qk_scale, D_QK, D_V, BLOCK_N, False)
    dq_acc = _dq_tile(dq_acc, q, do, lse, delta, k_base, v_base, stride_kn, stride_vn, offs_m, lo_row,
                      m0, k_hi, N, qk_scale, D_QK, D_V, BLOCK_N, True)
    tl.store(DQ + h * stride_dqh + offs_m[:, None] * stride_dqn + dk[None, :],
             (dq_acc * sm_scale).to(DQ.dtype.element_ty), mask=in_m[:, None])


# ---------------------------------------------------------------- host side


def visible_ranges(cu_seqlens: Tensor, n: int, window: int) -> tuple[Tensor, Tensor]:
    """``row_lo`` (first key each query sees) and ``col_hi`` (one past the last query each key
    is seen by), int32 [n], computed on ``cu_seqlens``' device without a host sync."""
    cu = cu_seqlens.to(torch.int64)
    pos = torch.arange(n, device=cu.device, dtype=torch.int64)
    seg = torch.searchsorted(cu, pos, right=True) - 1
    start = cu[seg]
    # cu_seqlens ends with n (padded with repeats of n), so seg + 1 is always in range
    end = cu[seg + 1]
    row_lo = torch.maximum(start, pos - window)
    col_hi = torch.minimum(end, pos + window + 1)
    return row_lo.to(torch.int32), col_hi.to(torch.int32)


def _check(q: Tensor, k: Tensor, v: Tensor) -> None:
    if q.shape[0] == 0:
        raise ValueError("triton attention: empty micro-batch (N = 0)")
    if q.dim() != 3 or k.shape != q.shape or v.dim() != 3 or v.shape[:2] != q.shape[:2]:
        raise ValueError(f"triton attention: want q, k [N, H, Dqk] and v [N, H, Dv]; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    for name, d in (("d_qk", q.shape[-1]), ("d_v", v.shape[-1])):
        if d not in HEAD_DIMS:
            raise ValueError(f"triton attention: {name}={d} unsupported; use one of {HEAD_DIMS} or the 'flex' backend")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"triton attention: q, k, v dtypes differ ({q.dtype}, {k.dtype}, {v.dtype})")
    if q.shape[0] * max(x.stride(0) for x in (q, k, v)) >= 2**31:
        raise ValueError(f"triton attention: {q.shape[0]} tokens overflow int32 offsets; split the micro-batch")


# The kernels run inside two custom ops, so ``torch.compile`` treats them as opaque calls (as it
# does torch's varlen op) instead of tracing the launches: inductor, recompiling a traced user
# kernel, passed the float scale as fp64 and Triton refused the loop's fp32 accumulator.
@torch.library.custom_op("nanogpt_pl::packed_attention_fwd", mutates_args=())
def _attention_fwd(q: Tensor, k: Tensor, v: Tensor, row_lo: Tensor, col_hi: Tensor, scale: float
                   ) -> tuple[Tensor, Tensor]:
    """(out [N, H, Dv], log2-sum-exp [H, N] float32). ``col_hi`` is only kept for the backward."""
    q, k, v = (lastdim_contiguous(x) for x in (q, k, v))
    n, h, d_qk = q.shape
    d_v = v.shape[-1]
    o = torch.empty(n, h, d_v, device=q.device, dtype=q.dtype)
    lse = torch.empty(h, n, device=q.device, dtype=torch.float32)
    bm, bn, warps, stages = _tiles("fwd", d_qk, d_v)
    _fwd_kernel[(triton.cdiv(n, bm), h)](
        q, k, v, o, lse, row_lo, n, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        o.stride(0), o.stride(1), scale * LOG2E, D_QK=d_qk, D_V=d_v, BLOCK_M=bm, BLOCK_N=bn,
        num_warps=warps, num_stages=stages,
    )
    return o, lse


@_attention_fwd.register_fake
def _(q, k, v, row_lo, col_hi, scale):
    n, h, _ = q.shape
    return q.new_empty(n, h, v.shape[-1]), q.new_empty(h, n, dtype=torch.float32)


@torch.library.custom_op("nanogpt_pl::packed_attention_bwd", mutates_args=())
def _attention_bwd(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, row_lo: Tensor,
                   col_hi: Tensor, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of :func:`_attention_fwd`'s output."""
    q, k, v, do = (lastdim_contiguous(x) for x in (q, k, v, do))
    n, h, d_qk = q.shape
    d_v = v.shape[-1]
    delta = torch.empty(h, n, device=q.device, dtype=torch.float32)  # written by the dQ kernel, read by dK/dV
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    qk_scale = scale * LOG2E
    bm, bn, warps, stages = _tiles("dq", d_qk, d_v)
    _dq_kernel[(triton.cdiv(n, bm), h)](
        q, k, v, do, o, dq, lse, delta, row_lo, n,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), do.stride(0), do.stride(1),
        o.stride(0), o.stride(1), dq.stride(0), dq.stride(1), qk_scale, scale,
        D_QK=d_qk, D_V=d_v, BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages,
    )
    bm, bn, warps, stages = _tiles("dkdv", d_qk, d_v)
    _dkdv_kernel[(triton.cdiv(n, bn), h)](
        q, k, v, do, dk, dv, lse, delta, row_lo, col_hi, n,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), do.stride(0), do.stride(1),
        dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1), qk_scale, scale,
        D_QK=d_qk, D_V=d_v, BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages,
    )
    return dq, dk, dv


@_attention_bwd.register_fake
def _(do, q, k, v, o, lse, row_lo, col_hi, scale):
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape))


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, row_lo, col_hi, scale = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, row_lo, col_hi)
    ctx.scale = scale


def _backward(ctx, do: Tensor, dlse: Tensor):
    q, k, v, o, lse, row_lo, col_hi = ctx.saved_tensors
    dq, dk, dv = _attention_bwd(do, q, k, v, o, lse, row_lo, col_hi, ctx.scale)
    return dq, dk, dv, None, None, None


_attention_fwd.register_autograd(_backward, setup_context=_setup_context)


def triton_packed_attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int, window: int,
                            scale: float) -> Tensor:
    """Causal attention with a left window inside the segments of ``cu_seqlens``.

    q, k [N, H, Dqk], v [N, H, Dv] -> [N, H, Dv] in the inputs' dtype; differentiable in
    q, k and v. ``max_seqlen`` is accepted for the signature the other backends share; the
    kernels find each tile's reach from ``cu_seqlens`` on the device instead.
    """
    del max_seqlen
    _check(q, k, v)
    row_lo, col_hi = visible_ranges(cu_seqlens, q.shape[0], int(window))
    return _attention_fwd(q, k, v, row_lo, col_hi, float(scale))[0]

