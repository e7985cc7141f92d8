"""Triton kernels: the per-head RMS norm of queries and keys, the rotary rotation and the key
offset, forward and backward, one pass each.

The function is the one ``CausalSelfAttention`` writes in PyTorch (RECORD §2 "Attention
sublayer", steps 3 and 4; ``nanogpt_pl.model.attention.qk_norm_rotary`` with ``backend="reference"``):

- ``q̂ = q · rsqrt(mean(q²) + eps)`` per head, the same for ``k``;
- each interleaved pair ``(x₂ᵢ, x₂ᵢ₊₁)`` rotates by the angle whose cos/sin the tables give:
  ``(x₂ᵢ·c + x₂ᵢ₊₁·s, x₂ᵢ₊₁·c − x₂ᵢ·s)``; the tables are ``[N, D/2]`` (one angle per token) or
  ``[N, H, D/2]`` (per token and head: the paired layers);
- with the key offset, the upper half of every rotated key head is the previous token's
  (token 0 keeps its own).

Compiled, that code became one inductor kernel per layer for the forward and two (a reduction
and a pointwise pass) for the backward, and on an H100 at stage 1 they ran at two to four
times their memory traffic (BENCHMARKS.md, "where the inductor kernels' time goes"). Here the
forward reads each row once and writes the rotated row and its ``rsqrt``; the backward reads
the output's gradient and the input row and writes the input's gradient. Both work in float32
and round once, as inductor's kernels do.

Rows are (token, head) pairs: the program grid is (token tiles, 2H): slots ``0..H-1`` are the
query heads and ``H..2H-1`` the key heads, so q and k may be any strided views (the columns of a
packed QKV projection).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import QK_ROTARY_HEAD_DIMS, interpret_mode, lastdim_contiguous

Tensor = torch.Tensor

INTERPRET = interpret_mode()
HEAD_DIMS = QK_ROTARY_HEAD_DIMS  # the record uses 64 and 128 (RECORD §2)
# Rows per program: (head width) -> (block_t, num_warps), so a tile holds 4,096 elements.
TILES = {8: (512, 4), 16: (256, 4), 32: (128, 4), 64: (64, 4), 128: (32, 4)}
_INTERP_BLOCK_T = 8  # the CPU tests cross many tile edges at a few dozen tokens


def _tile(d: int) -> tuple[int, int]:
    return (_INTERP_BLOCK_T, 1) if INTERPRET else TILES[d]


@triton.jit
def _angles(COS, SIN, t, in_t, h, stride_ct, stride_ch, D: tl.constexpr):
    """cos and sin of rows ``t`` of head ``h``, ``[BLOCK_T, D/2]`` float32 (``stride_ch`` 0: one per token)."""
    tab = t[:, None].to(tl.int64) * stride_ct + h * stride_ch + tl.arange(0, D // 2)[None, :]
    c = tl.load(COS + tab, mask=in_t[:, None], other=0.0).to(tl.float32)
    s = tl.load(SIN + tab, mask=in_t[:, None], other=0.0).to(tl.float32)
    return c, s


@triton.jit
def _rotated_row(Q, K, COS, SIN, t, in_t, is_k, h, stride_qt, stride_qh, stride_kt, stride_kh, stride_ct,
                 stride_ch, eps, D: tl.constexpr, BLOCK_T: tl.constexpr):
    """Rows ``t`` of head ``h`` (of k if ``is_k``, else of q): normed, rotated, as (even, odd)
    halves of every pair ``[BLOCK_T, D/2]``, float32, and the rows' ``rsqrt`` ``[BLOCK_T]``."""
    cols = tl.arange(0, D)
    if is_k:
        ptr = K + t[:, None].to(tl.int64) * stride_kt + h * stride_kh + cols[None, :]
    else:
        ptr = Q + t[:, None].to(tl.int64) * stride_qt + h * stride_qh + cols[None, :]
    x = tl.load(ptr, mask=in_t[:, None], other=0.0).to(tl.float32)
    r = tl.math.rsqrt(tl.sum(x * x, 1) / D + eps)
    xe, xo = tl.split(tl.reshape(x, [BLOCK_T, D // 2, 2]))
    c, s = _angles(COS, SIN, t, in_t, h, stride_ct, stride_ch, D)
    ne = xe * r[:, None]
    no = xo * r[:, None]
    return ne * c + no * s, no * c - ne * s, r


@triton.jit
def _fwd_kernel(Q, K, COS, SIN, Q_OUT, K_OUT, RSTD, N, stride_qt, stride_qh, stride_kt, stride_kh,
                stride_ct, stride_ch, eps, H: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr,
                KEY_OFFSET: tl.constexpr):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    slot = tl.program_id(1)
    is_k = slot >= H
    h = slot % H
    in_t = t < N
    ye, yo, r = _rotated_row(Q, K, COS, SIN, t, in_t, is_k, h, stride_qt, stride_qh, stride_kt, stride_kh,
                             stride_ct, stride_ch, eps, D, BLOCK_T)
    if KEY_OFFSET:
        if is_k:
            # the upper half of the key is the previous token's, rotated at its own position;
            # token 0 keeps its own (t - 1 clamps to 0)
            prev = tl.maximum(t - 1, 0)
            pe, po, _ = _rotated_row(Q, K, COS, SIN, prev, in_t, is_k, h, stride_qt, stride_qh, stride_kt,
                                     stride_kh, stride_ct, stride_ch, eps, D, BLOCK_T)
            upper = (tl.arange(0, D // 2) >= D // 4)[None, :]
            ye = tl.where(upper, pe, ye)
            yo = tl.where(upper, po, yo)
    y = tl.reshape(tl.join(ye, yo), [BLOCK_T, D])
    cols = tl.arange(0, D)
    out = t[:, None].to(tl.int64) * (H * D) + h * D + cols[None, :]
    if is_k:
        tl.store(K_OUT + out, y.to(K_OUT.dtype.element_ty), mask=in_t[:, None])
    else:
        tl.store(Q_OUT + out, y.to(Q_OUT.dtype.element_ty), mask=in_t[:, None])
    tl.store(RSTD + t * (2 * H) + slot, r, mask=in_t)


@triton.jit
def _bwd_kernel(GQ, GK, Q, K, COS, SIN, RSTD, DQ, DK, N, stride_gqt, stride_gqh, stride_gkt, stride_gkh,
                stride_qt, stride_qh, stride_kt, stride_kh, stride_ct, stride_ch,
                H: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr, KEY_OFFSET: tl.constexpr):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    slot = tl.program_id(1)
    is_k = slot >= H
    h = slot % H
    in_t = t < N
    cols = tl.arange(0, D)
    t64 = t[:, None].to(tl.int64)
    # the gradient of this row's rotated output
    if is_k:
        g = tl.load(GK + t64 * stride_gkt + h * stride_gkh + cols[None, :], mask=in_t[:, None], other=0.0)
        g = g.to(tl.float32)
        if KEY_OFFSET:
            # the upper half of row t went to the key of token t + 1, and token 0's also to its own
            nxt = tl.load(GK + (t64 + 1) * stride_gkt + h * stride_gkh + cols[None, :],
                          mask=(t < N - 1)[:, None], other=0.0).to(tl.float32)
            up = nxt + tl.where((t == 0)[:, None], g, 0.0)
            g = tl.where((cols >= D // 2)[None, :], up, g)
        x = tl.load(K + t64 * stride_kt + h * stride_kh + cols[None, :], mask=in_t[:, None], other=0.0)
    else:
        g = tl.load(GQ + t64 * stride_gqt + h * stride_gqh + cols[None, :], mask=in_t[:, None], other=0.0)
        g = g.to(tl.float32)
        x = tl.load(Q + t64 * stride_qt + h * stride_qh + cols[None, :], mask=in_t[:, None], other=0.0)
    ge, go = tl.split(tl.reshape(g, [BLOCK_T, D // 2, 2]))
    c, s = _angles(COS, SIN, t, in_t, h, stride_ct, stride_ch, D)
    # the rotation's transpose: the gradient of the normed row
    dne = ge * c - go * s
    dno = ge * s + go * c
    r = tl.load(RSTD + t * (2 * H) + slot, mask=in_t, other=0.0)
    xe, xo = tl.split(tl.reshape(x.to(tl.float32), [BLOCK_T, D // 2, 2]))
    ne = xe * r[:, None]
    no = xo * r[:, None]
    # the norm's: r · (dn − n̂ · mean(dn · n̂))
    dot = (tl.sum(dne * ne, 1) + tl.sum(dno * no, 1)) / D
    dxe = r[:, None] * (dne - ne * dot[:, None])
    dxo = r[:, None] * (dno - no * dot[:, None])
    dx = tl.reshape(tl.join(dxe, dxo), [BLOCK_T, D])
    out = t64 * (H * D) + h * D + cols[None, :]
    if is_k:
        tl.store(DK + out, dx.to(DK.dtype.element_ty), mask=in_t[:, None])
    else:
        tl.store(DQ + out, dx.to(DQ.dtype.element_ty), mask=in_t[:, None])


def _table_strides(table: Tensor) -> tuple[int, int]:
    """(token stride, head stride) of a ``[N, D/2]`` or ``[N, H, D/2]`` table."""
    return (table.stride(0), 0) if table.dim() == 2 else (table.stride(0), table.stride(1))


def _check(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> None:
    if q.dim() != 3 or k.shape != q.shape:
        raise ValueError(f"qk_norm_rotary: want q, k [N, H, D] of one shape; got {tuple(q.shape)}, {tuple(k.shape)}")
    n, h, d = q.shape
    if d not in HEAD_DIMS:
        raise ValueError(f"qk_norm_rotary: head width {d} unsupported; use one of {HEAD_DIMS} or "
                         f"model.backends.qk_rotary=reference")
    for name, tab in (("cos", cos), ("sin", sin)):
        if tab.shape not in ((n, d // 2), (n, h, d // 2)):
            raise ValueError(f"qk_norm_rotary: {name} is {tuple(tab.shape)}; "
                             f"want [{n}, {d // 2}] or [{n}, {h}, {d // 2}]")
    if cos.shape != sin.shape or cos.stride() != sin.stride():
        raise ValueError("qk_norm_rotary: cos and sin must have one shape and layout")


# Two custom ops, opaque to torch.compile (as the attention kernels are): inductor keeps its
# fusions around them and calls the kernels as they are.
@torch.library.custom_op("nanogpt_pl::qk_norm_rotary_fwd", mutates_args=())
def _qk_fwd(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, eps: float, key_offset: bool
            ) -> tuple[Tensor, Tensor, Tensor]:
    """(q̂ rotated, k̂ rotated (offset), rsqrt [N, 2H] float32)."""
    q, k, cos, sin = (lastdim_contiguous(x) for x in (q, k, cos, sin))
    n, h, d = q.shape
    q_out = torch.empty(n, h, d, device=q.device, dtype=q.dtype)
    k_out = torch.empty(n, h, d, device=k.device, dtype=k.dtype)
    rstd = torch.empty(n, 2 * h, device=q.device, dtype=torch.float32)
    block_t, warps = _tile(d)
    _fwd_kernel[(triton.cdiv(n, block_t), 2 * h)](
        q, k, cos, sin, q_out, k_out, rstd, n, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        *_table_strides(cos), eps, H=h, D=d, BLOCK_T=block_t, KEY_OFFSET=key_offset, num_warps=warps,
    )
    return q_out, k_out, rstd


@_qk_fwd.register_fake
def _(q, k, cos, sin, eps, key_offset):
    n, h, d = q.shape
    return q.new_empty(n, h, d), k.new_empty(n, h, d), q.new_empty(n, 2 * h, dtype=torch.float32)


@torch.library.custom_op("nanogpt_pl::qk_norm_rotary_bwd", mutates_args=())
def _qk_bwd(gq: Tensor, gk: Tensor, q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, rstd: Tensor, key_offset: bool
            ) -> tuple[Tensor, Tensor]:
    """(dq, dk) of :func:`_qk_fwd`'s two rotated outputs."""
    gq, gk, q, k, cos, sin = (lastdim_contiguous(x) for x in (gq, gk, q, k, cos, sin))
    n, h, d = q.shape
    dq = torch.empty(n, h, d, device=q.device, dtype=q.dtype)
    dk = torch.empty(n, h, d, device=k.device, dtype=k.dtype)
    block_t, warps = _tile(d)
    _bwd_kernel[(triton.cdiv(n, block_t), 2 * h)](
        gq, gk, q, k, cos, sin, rstd, dq, dk, n, gq.stride(0), gq.stride(1), gk.stride(0), gk.stride(1),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), *_table_strides(cos),
        H=h, D=d, BLOCK_T=block_t, KEY_OFFSET=key_offset, num_warps=warps,
    )
    return dq, dk


@_qk_bwd.register_fake
def _(gq, gk, q, k, cos, sin, rstd, key_offset):
    return q.new_empty(q.shape), k.new_empty(k.shape)


def _setup_context(ctx, inputs, output) -> None:
    q, k, cos, sin, eps, key_offset = inputs
    ctx.save_for_backward(q, k, cos, sin, output[2])
    ctx.key_offset = key_offset


def _backward(ctx, gq, gk, grstd):
    q, k, cos, sin, rstd = ctx.saved_tensors
    gq = torch.zeros_like(q) if gq is None else gq
    gk = torch.zeros_like(k) if gk is None else gk
    dq, dk = _qk_bwd(gq, gk, q, k, cos, sin, rstd, ctx.key_offset)
    return dq, dk, None, None, None, None


_qk_fwd.register_autograd(_backward, setup_context=_setup_context)


def qk_norm_rotary_triton(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, eps: float, key_offset: bool = False
                          ) -> tuple[Tensor, Tensor]:
    """Normed, rotated (and, with ``key_offset``, offset) q and k ``[N, H, D]`` in their dtype;
    differentiable in q and k. The tables are constants (no gradient)."""
    _check(q, k, cos, sin)
    q_out, k_out, _ = _qk_fwd(q, k, cos.detach(), sin.detach(), float(eps), bool(key_offset))
    return q_out, k_out
