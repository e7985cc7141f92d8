"""Triton kernels for the polynomial cascade of ANVIL (``nanogpt_pl.optim.polar``).

One map of the cascade is ``X ← a·X + (b·A + c·A²)·X`` with ``A = X·Xᵀ`` (or the tall
form ``X ← a·X + X·(b·A + c·A²)`` with ``A = Xᵀ·X``). Three kernels cover it:

* :func:`gram`: ``A = X·Xᵀ`` or ``Xᵀ·X``. ``A`` is symmetric, so only the tiles on or
  above the diagonal are computed; each off-diagonal tile is also stored transposed
  below the diagonal. That halves the matmul work of the Gram product.
* :func:`poly_square`: ``B = b·A + c·A·A`` for a symmetric ``A``; ``B`` is symmetric
  too, so the same upper-tile-and-mirror scheme applies.
* :func:`matmul_add`: ``C = a·X + L·R``, a tiled matmul whose epilogue adds ``a·X``
  (``L·R`` is ``B·X`` for wide matrices and ``X·B`` for tall ones). Fusing the ``a·X``
  term avoids a separate pass over ``X``.

All three take a batch of matrices (``[batch, rows, cols]`` or 2-D), accumulate in fp32
and store in the output's dtype (bf16 in the optimizer). The plain PyTorch twins are
``nanogpt_pl.optim.polar.gram_reference`` etc.

Under ``TRITON_INTERPRET=1`` (CPU debugging) the interpreter's ``tl.dot`` mishandles
bf16 operands, so the kernels upcast tiles to fp32 before the dot there; on the GPU the
tiles go to the tensor cores as they are.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from . import interpret_mode

Tensor = torch.Tensor

INTERPRET = interpret_mode()  # read once: triton itself reads the variable at import


def _configs(kind: str) -> list[triton.Config]:
    """Tile configurations tried by the autotuner (one tiny tile under the interpreter)."""
    if INTERPRET:
        if kind == "sym":
            return [triton.Config({"BLOCK": 16, "BLOCK_K": 16}, num_warps=1, num_stages=1)]
        return [triton.Config({"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 2}, num_warps=1,
                              num_stages=1)]
    if kind == "sym":
        return [
            triton.Config({"BLOCK": 128, "BLOCK_K": 64}, num_warps=8, num_stages=3),
            triton.Config({"BLOCK": 128, "BLOCK_K": 64}, num_warps=8, num_stages=4),
            triton.Config({"BLOCK": 64, "BLOCK_K": 64}, num_warps=4, num_stages=4),
            triton.Config({"BLOCK": 64, "BLOCK_K": 128}, num_warps=4, num_stages=3),
        ]
    return [
        triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8}, num_warps=8, num_stages=3),
        triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8}, num_warps=8, num_stages=4),
        triton.Config({"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8}, num_warps=4, num_stages=4),
        triton.Config({"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8}, num_warps=4, num_stages=4),
        triton.Config({"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "GROUP_M": 8}, num_warps=8, num_stages=3),
    ]


# ---------------------------------------------------------------------------------------
# A = X·Xᵀ (TRANS=False) or A = Xᵀ·X (TRANS=True), upper tiles computed and mirrored.
@triton.autotune(configs=_configs("sym"), key=["N", "R", "TRANS"])
@triton.jit
def _gram_kernel(
    x_ptr, a_ptr,
    N, R,
    sx_b, sx_r, sx_c,
    sa_b, sa_r, sa_c,
    TRANS: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    ti = tl.program_id(0)
    tj = tl.program_id(1)
    if ti > tj:  # lower tiles are written by their mirror
        return
    b = tl.program_id(2).to(tl.int64)
    x_ptr += b * sx_b
    a_ptr += b * sa_b
    offs_i = ti * BLOCK + tl.arange(0, BLOCK)
    offs_j = tj * BLOCK + tl.arange(0, BLOCK)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK, BLOCK), dtype=tl.float32)
    for k0 in range(0, R, BLOCK_K):
        kk = k0 + offs_k
        if TRANS:
            # tiles X[k, i] and X[k, j] (BLOCK_K x BLOCK), contiguous along the output index
            xi = tl.load(x_ptr + kk[:, None] * sx_r + offs_i[None, :] * sx_c,
                         mask=(kk[:, None] < R) & (offs_i[None, :] < N), other=0.0)
            xj = tl.load(x_ptr + kk[:, None] * sx_r + offs_j[None, :] * sx_c,
                         mask=(kk[:, None] < R) & (offs_j[None, :] < N), other=0.0)
            if UPCAST:
                xi = xi.to(tl.float32)
                xj = xj.to(tl.float32)
            acc = tl.dot(tl.trans(xi), xj, acc)
        else:
            # tiles X[i, k] and X[j, k] (BLOCK x BLOCK_K), contiguous along the reduction
            xi = tl.load(x_ptr + offs_i[:, None] * sx_r + kk[None, :] * sx_c,
                         mask=(offs_i[:, None] < N) & (kk[None, :] < R), other=0.0)
            xj = tl.load(x_ptr + offs_j[:, None] * sx_r + kk[None, :] * sx_c,
                         mask=(offs_j[:, None] < N) & (kk[None, :] < R), other=0.0)
            if UPCAST:
                xi = xi.to(tl.float32)
                xj = xj.to(tl.float32)
            acc = tl.dot(xi, tl.trans(xj), acc)
    out = acc.to(a_ptr.dtype.element_ty)
    mask = (offs_i[:, None] < N) & (offs_j[None, :] < N)
    tl.store(a_ptr + offs_i[:, None] * sa_r + offs_j[None, :] * sa_c, out, mask=mask)
    if ti != tj:
        tl.store(a_ptr + offs_j[:, None] * sa_r + offs_i[None, :] * sa_c, tl.trans(out),
                 mask=(offs_j[:, None] < N) & (offs_i[None, :] < N))


# ---------------------------------------------------------------------------------------
# B = b·A + c·A·A for symmetric A, upper tiles computed and mirrored.
@triton.autotune(configs=_configs("sym"), key=["N"])
@triton.jit
def _poly_square_kernel(
    a_ptr, b_ptr,
    N,
    coef_b, coef_c,
    sa_b, sa_r, sa_c,
    sb_b, sb_r, sb_c,
    UPCAST: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    ti = tl.program_id(0)
    tj = tl.program_id(1)
    if ti > tj:
        return
    bi = tl.program_id(2).to(tl.int64)
    a_ptr += bi * sa_b
    b_ptr += bi * sb_b
    offs_i = ti * BLOCK + tl.arange(0, BLOCK)
    offs_j = tj * BLOCK + tl.arange(0, BLOCK)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK, BLOCK), dtype=tl.float32)
    for k0 in range(0, N, BLOCK_K):
        kk = k0 + offs_k
        left = tl.load(a_ptr + offs_i[:, None] * sa_r + kk[None, :] * sa_c,
                       mask=(offs_i[:, None] < N) & (kk[None, :] < N), other=0.0)
        right = tl.load(a_ptr + kk[:, None] * sa_r + offs_j[None, :] * sa_c,
                        mask=(kk[:, None] < N) & (offs_j[None, :] < N), other=0.0)
        if UPCAST:
            left = left.to(tl.float32)
            right = right.to(tl.float32)
        acc = tl.dot(left, right, acc)
    mask = (offs_i[:, None] < N) & (offs_j[None, :] < N)
    a_ij = tl.load(a_ptr + offs_i[:, None] * sa_r + offs_j[None, :] * sa_c, mask=mask, other=0.0)
    out = (coef_c * acc + coef_b * a_ij.to(tl.float32)).to(b_ptr.dtype.element_ty)
    tl.store(b_ptr + offs_i[:, None] * sb_r + offs_j[None, :] * sb_c, out, mask=mask)
    if ti != tj:
        tl.store(b_ptr + offs_j[:, None] * sb_r + offs_i[None, :] * sb_c, tl.trans(out),
                 mask=(offs_j[:, None] < N) & (offs_i[None, :] < N))


# ---------------------------------------------------------------------------------------
# C = a·X + L·R, with L [M, K], R [K, N], X and C [M, N].
@triton.autotune(configs=_configs("mm"), key=["M", "N", "K"])
@triton.jit
def _matmul_add_kernel(
    l_ptr, r_ptr, x_ptr, c_ptr,
    M, N, K,
    coef_a,
    sl_b, sl_r, sl_c,
    sr_b, sr_r, sr_c,
    sx_b, sx_r, sx_c,
    sc_b, sc_r, sc_c,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    pid = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    # grouped ordering: neighbouring programs share rows of L in L2
    pm, pn = tl.swizzle2d(pid // num_n, pid % num_n, num_m, num_n, GROUP_M)
    l_ptr += b * sl_b
    r_ptr += b * sr_b
    x_ptr += b * sx_b
    c_ptr += b * sc_b
    offs_m = pm * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pn * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        lt = tl.load(l_ptr + offs_m[:, None] * sl_r + kk[None, :] * sl_c,
                     mask=(offs_m[:, None] < M) & (kk[None, :] < K), other=0.0)
        rt = tl.load(r_ptr + kk[:, None] * sr_r + offs_n[None, :] * sr_c,
                     mask=(kk[:, None] < K) & (offs_n[None, :] < N), other=0.0)
        if UPCAST:
            lt = lt.to(tl.float32)
            rt = rt.to(tl.float32)
        acc = tl.dot(lt, rt, acc)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    xt = tl.load(x_ptr + offs_m[:, None] * sx_r + offs_n[None, :] * sx_c, mask=mask, other=0.0)
    out = (acc + coef_a * xt.to(tl.float32)).to(c_ptr.dtype.element_ty)
    tl.store(c_ptr + offs_m[:, None] * sc_r + offs_n[None, :] * sc_c, out, mask=mask)


# ---------------------------------------------------------------------------------------
def _as_batch(t: Tensor) -> Tensor:
    if t.dim() == 2:
        return t.unsqueeze(0)
    if t.dim() == 3:
        return t
    raise ValueError(f"expected a matrix or a batch of matrices, got shape {tuple(t.shape)}")


Tensor = torch.Tensor


def _check(*ts: Tensor) -> None:
    dev = ts[0].device
    if dev.type != "cuda" and not INTERPRET:
        raise RuntimeError(
            "the Triton polar kernels need a CUDA tensor (or TRITON_INTERPRET=1 for debugging on CPU); "
            "use backend='reference' on CPU"
        )
    for t in ts:
        if t.device != dev:
            raise ValueError(f"all operands must be on one device, got {t.device} and {dev}")


def gram(x: Tensor, transpose: bool = False, out: Optional[Tensor] = None) -> Tensor:
    """``x·xᵀ`` (``transpose=False``) or ``xᵀ·x`` for a matrix or a batch of matrices.

    Args:
        x: ``[rows, cols]`` or ``[batch, rows, cols]``.
        transpose: compute ``xᵀ·x`` (``[cols, cols]``) instead of ``x·xᵀ`` (``[rows, rows]``).
        out: optional output of the right shape; defaults to a new tensor of ``x``'s dtype.
    """
    _check(x)
    xb = _as_batch(x)
    batch, rows, cols = xb.shape
    n, r = (cols, rows) if transpose else (rows, cols)
    if out is None:
        out = torch.empty((*x.shape[:-2], n, n), device=x.device, dtype=x.dtype)
    ob = _as_batch(out)
    if tuple(ob.shape) != (batch, n, n):
        raise ValueError(f"gram: out has shape {tuple(out.shape)}, expected {(batch, n, n)}")
    if batch == 0 or n == 0:
        return out
    grid = lambda meta: (triton.cdiv(n, meta["BLOCK"]), triton.cdiv(n, meta["BLOCK"]), batch)  # noqa: E731
    _gram_kernel[grid](
        xb, ob, n, r, *xb.stride(), *ob.stride(), TRANS=transpose, UPCAST=INTERPRET,
    )
    return out


def poly_square(a: Tensor, coef_b: float, coef_c: float, out: Optional[Tensor] = None) -> Tensor:
    """``coef_b·a + coef_c·a·a`` for a symmetric matrix (or batch) ``a``.

    Only the upper tiles are computed; the result is exactly symmetric off the diagonal
    tiles. ``a`` must be symmetric: the kernel reads ``a``'s rows where ``a·a`` needs columns.
    """
    _check(a)
    ab = _as_batch(a)
    batch, n, n2 = ab.shape
    if n != n2:
        raise ValueError(f"poly_square needs square matrices, got {tuple(a.shape)}")
    if out is None:
        out = torch.empty_like(a)
    ob = _as_batch(out)
    if ob.shape != ab.shape:
        raise ValueError(f"poly_square: out has shape {tuple(out.shape)}, expected {tuple(a.shape)}")
    if out.data_ptr() == a.data_ptr():
        raise ValueError("poly_square cannot run in place: out must not alias a")
    if batch == 0 or n == 0:
        return out
    grid = lambda meta: (triton.cdiv(n, meta["BLOCK"]), triton.cdiv(n, meta["BLOCK"]), batch)  # noqa: E731
    _poly_square_kernel[grid](
        ab, ob, n, float(coef_b), float(coef_c), *ab.stride(), *ob.stride(), UPCAST=INTERPRET,
    )
    return out


def matmul_add(left: Tensor, right: Tensor, x: Tensor, coef_a: float, out: Optional[Tensor] = None) -> Tensor:
    """``coef_a·x + left·right`` for matrices or batches of matrices.

    Args:
        left: ``[M, K]`` (or batched).
        right: ``[K, N]`` (or batched).
        x: ``[M, N]`` (or batched); may be the same tensor as ``left`` or ``right``.
        coef_a: scale of ``x``.
        out: output ``[M, N]``; must not alias any input.
    """
    _check(left, right, x)
    lb, rb, xb = _as_batch(left), _as_batch(right), _as_batch(x)
    batch, m, k = lb.shape
    if rb.shape[0] != batch or xb.shape[0] != batch or rb.shape[1] != k:
        raise ValueError(
            f"matmul_add: incompatible shapes left {tuple(left.shape)}, right {tuple(right.shape)}, x {tuple(x.shape)}"
        )
    n = rb.shape[2]
    if tuple(xb.shape) != (batch, m, n):
        raise ValueError(f"matmul_add: x has shape {tuple(x.shape)}, expected {(batch, m, n)}")
    if out is None:
        out = torch.empty_like(x)
    ob = _as_batch(out)
    if tuple(ob.shape) != (batch, m, n):
        raise ValueError(f"matmul_add: out has shape {tuple(out.shape)}, expected {(batch, m, n)}")
    if any(out.data_ptr() == t.data_ptr() for t in (left, right, x)):
        raise ValueError("matmul_add cannot run in place: out must not alias left, right or x")
    if batch == 0 or m == 0 or n == 0:
        return out
    grid = lambda meta: (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]), batch)  # noqa: E731
    _matmul_add_kernel[grid](
        lb, rb, xb, ob, m, n, k, float(coef_a),
        *lb.stride(), *rb.stride(), *xb.stride(), *ob.stride(), UPCAST=INTERPRET,
    )
    return out
