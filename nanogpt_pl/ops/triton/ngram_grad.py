"""The gradient of the n-gram channel's compact leaf, as sorted row sums stored once per row.

The model reads a micro-batch's n-gram rows as ``x0_ngram = W[b]·S[sb] + W[c]·S[sc]``
(``nanogpt_pl.model.embeddings.HashedNgramEmbedding``): ``W`` is the compact fp32 leaf
``[R, D]`` (the micro-batch's distinct table rows, then padding), ``index`` ``[2, T]`` the
bigram and trigram row of every token, ``S`` the fixed ±1 sign table and ``sign_rows``
``[2, T]`` its rows. The leaf's gradient sums, for every row ``r``,
``g[t] ⊙ S[sign_rows[k, t]]`` over the ``(k, t)`` with ``index[k, t] = r``.

Autograd (and inductor) do that as a zero fill of the whole ``[R, D]`` gradient and an atomic
add of all ``2·T·D`` products. The hashed rows are mostly distinct, so the atomics rarely
collide: what costs is that every element is written twice (the fill, then the atomic's
read-modify-write). Here every row of the gradient is written exactly once, with a store:

* the ``2T`` entries are sorted by row (one int32 device sort, no host sync);
* a *sum program* takes a chunk of :data:`CHUNK` sorted entries and a block of columns,
  loads their products as one tile, and sums each run of equal rows that *starts* in the
  chunk with one small matrix product (an indicator of 0 and 1, exact; fp32 sums). The
  chunk's last run may go on into the next chunks: its program reads on until the row
  changes. Each run's sum is stored at its row;
* a *zero program* takes a block of rows, finds by binary search in the sorted rows which
  of them no entry reads (the leaf's padding), and stores zeros there.

The signs are ±1, so a bf16 gradient times its sign is exact in bf16 and the product runs on
bf16 tensor cores; fp32 gradients (and any under ``TRITON_INTERPRET=1``, whose ``tl.dot``
mishandles bf16 operands) take the exact fp32 product. :func:`ngram_grad_reference` is the
plain PyTorch definition (``index_add_``) the tests compare with.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ...distributed.row_exchange import sort_values
from . import interpret_mode, lastdim_contiguous

CHUNK = 64  # sorted entries a sum program sums (the matrix product's inner size)
BLOCK_D = 128  # columns a sum program sums
ZERO_ROWS = 64  # rows a zero program checks


@triton.jit
def _signed_rows(grad_ptr, signs_ptr, sign_rows_ptr, order_ptr, i, live, c, cols, T, stride_grad, stride_signs):
    """The products ``g[t] * S[sign_rows[k, t]]`` of sorted entries ``i`` (entry ``k·T + t``), fp32."""
    entry = tl.load(order_ptr + i, mask=live, other=0).to(tl.int64)
    token = entry % T
    srow = tl.load(sign_rows_ptr + entry, mask=live, other=0).to(tl.int64)
    m = live[:, None] & cols[None, :]
    g = tl.load(grad_ptr + token[:, None] * stride_grad + c[None, :], mask=m, other=0.0)
    s = tl.load(signs_ptr + srow[:, None] * stride_signs + c[None, :], mask=m, other=0.0)
    return g.to(tl.float32) * s.to(tl.float32)


@triton.jit
def _ngram_grad_kernel(grad_ptr, signs_ptr, sign_rows_ptr, order_ptr, rows_ptr, out_ptr,
                       n, T, D, n_rows, n_sum, search_steps, stride_grad, stride_signs, stride_out,
                       CHUNK: tl.constexpr, BLOCK_D: tl.constexpr, ZERO_ROWS: tl.constexpr,
                       FP32_DOT: tl.constexpr):
    pid = tl.program_id(0)
    if pid < n_sum:
        d_blocks = tl.cdiv(D, BLOCK_D)
        first = (pid // d_blocks) * CHUNK
        i = first + tl.arange(0, CHUNK)
        c = (pid % d_blocks) * BLOCK_D + tl.arange(0, BLOCK_D)
        live = i < n
        cols = c < D
        rows = tl.load(rows_ptr + i, mask=live, other=-1)
        before = tl.load(rows_ptr + i - 1, mask=live & (i > 0), other=-1)
        starts = live & (rows != before)  # a run's first entry, in the whole sorted list
        v = _signed_rows(grad_ptr, signs_ptr, sign_rows_ptr, order_ptr, i, live, c, cols, T, stride_grad, stride_signs)
        same = (rows[:, None] == rows[None, :]) & starts[:, None]
        if FP32_DOT:
            sums = tl.dot(same.to(tl.float32), v, input_precision="ieee")
        else:  # ±1 times a bf16 value is that value or its negation: exact in bf16
            g_dtype = grad_ptr.dtype.element_ty
            sums = tl.dot(same.to(g_dtype), v.to(g_dtype))
        # the chunk's last run, if it starts here, may go on into the next chunks: read on to its
        # end, the first sorted entry past its row (a binary search; a while loop over the rows
        # fails triton 3.6's layout pass)
        last = tl.load(rows_ptr + tl.minimum(first + CHUNK, n) - 1)
        owns_last = tl.max((starts & (rows == last)).to(tl.int32), axis=0) > 0
        end = first + CHUNK
        bound = tl.where(owns_last, n, end)
        for _ in range(search_steps):
            mid = (end + bound) // 2
            step = end < bound
            within = step & (tl.load(rows_ptr + mid, mask=step, other=0) <= last)
            end = tl.where(within, mid + 1, end)
            bound = tl.where(step & ~within, mid, bound)
        tail = tl.zeros([BLOCK_D], tl.float32)
        for j0 in range(first + CHUNK, end, CHUNK):
            j = j0 + tl.arange(0, CHUNK)
            w = _signed_rows(grad_ptr, signs_ptr, sign_rows_ptr, order_ptr, j, j < end, c, cols, T,
                             stride_grad, stride_signs)
            tail += tl.sum(w, axis=0)
        sums += tl.where((starts & (rows == last))[:, None], tail[None, :], 0.0)
        dst = out_ptr + rows.to(tl.int64)[:, None] * stride_out + c[None, :]
        tl.store(dst, sums, mask=starts[:, None] & cols[None, :])
    else:
        # the rows no entry reads get zeros: a binary search (lower bound) of each in the sorted rows
        r = (pid - n_sum) * ZERO_ROWS + tl.arange(0, ZERO_ROWS)
        lo = tl.zeros([ZERO_ROWS], tl.int32)
        hi = tl.zeros([ZERO_ROWS], tl.int32) + n
        for _ in range(search_steps):
            mid = (lo + hi) // 2
            below = tl.load(rows_ptr + mid, mask=mid < hi, other=0) < r
            lo = tl.where((mid < hi) & below, mid + 1, lo)
            hi = tl.where((mid < hi) & ~below, mid, hi)
        found = tl.load(rows_ptr + lo, mask=lo < n, other=-1) == r
        unread = (r < n_rows) & ~found
        for d0 in range(0, D, BLOCK_D):
            c = d0 + tl.arange(0, BLOCK_D)
            dst = out_ptr + r.to(tl.int64)[:, None] * stride_out + c[None, :]
            tl.store(dst, tl.zeros([ZERO_ROWS, BLOCK_D], tl.float32), mask=unread[:, None] & (c < D)[None, :])


def _check(grad: Tensor, index: Tensor, sign_rows: Tensor, signs: Tensor) -> None:
    if grad.dim() != 2 or index.shape != (2, grad.shape[0]) or sign_rows.shape != index.shape \
            or signs.dim() != 2 or signs.shape[1] != grad.shape[1]:
        raise ValueError(
            f"ngram_grad: gradient {tuple(grad.shape)}, index {tuple(index.shape)}, sign rows "
            f"{tuple(sign_rows.shape)}, sign table {tuple(signs.shape)}; give [T, D], [2, T], [2, T] and [S, D]")


def ngram_grad_into(out: Tensor, grad: Tensor, index: Tensor, sign_rows: Tensor, signs: Tensor) -> Tensor:
    """:func:`ngram_grad` written into ``out`` ``[rows, D]`` fp32, whatever it held: every row is stored."""
    _check(grad, index, sign_rows, signs)
    t, d = grad.shape
    n, rows = 2 * t, out.shape[0]
    if out.shape != (rows, d) or out.dtype != torch.float32 or out.stride(-1) != 1:
        raise ValueError(f"ngram_grad: out {tuple(out.shape)} {out.dtype}; give a [rows, {d}] fp32 row-major tensor")
    if n == 0 or rows == 0:
        return out.zero_()
    sorted_rows, order = sort_values(index.reshape(-1), rows - 1)
    grad, signs = lastdim_contiguous(grad), lastdim_contiguous(signs)
    block_d = min(BLOCK_D, max(16, triton.next_power_of_2(d)))
    n_sum = triton.cdiv(n, CHUNK) * triton.cdiv(d, block_d)
    grid = (n_sum + triton.cdiv(rows, ZERO_ROWS),)
    fp32_dot = interpret_mode() or grad.dtype == torch.float32
    _ngram_grad_kernel[grid](grad, signs, sign_rows.reshape(-1), order, sorted_rows, out, n, t, d, rows, n_sum,
                             n.bit_length(), grad.stride(0), signs.stride(0), out.stride(0),
                             CHUNK=CHUNK, BLOCK_D=block_d, ZERO_ROWS=ZERO_ROWS, FP32_DOT=fp32_dot, num_warps=4)
    return out


@torch.library.custom_op("nanogpt_pl::ngram_grad", mutates_args=())
def ngram_grad(grad: Tensor, index: Tensor, sign_rows: Tensor, signs: Tensor, rows: int) -> Tensor:
    """``out[r] = Σ_{(k, t): index[k, t] = r} grad[t] · signs[sign_rows[k, t]]``: ``[rows, D]`` fp32.

    ``grad`` ``[T, D]`` (bf16 or fp32), ``index`` and ``sign_rows`` ``[2, T]`` integers (rows in
    ``[0, rows)``), ``signs`` ``[S, D]`` of ±1. Every output row is stored once: a sum or a zero.
    Runs as a custom op, so ``torch.compile`` calls it as it is.
    """
    out = torch.empty(rows, grad.shape[-1], device=grad.device, dtype=torch.float32)
    return ngram_grad_into(out, grad, index, sign_rows, signs)


@ngram_grad.register_fake
def _(grad, index, sign_rows, signs, rows):
    _check(grad, index, sign_rows, signs)
    return grad.new_empty((rows, grad.shape[1]), dtype=torch.float32)


def ngram_grad_reference(grad: Tensor, index: Tensor, sign_rows: Tensor, signs: Tensor, rows: int) -> Tensor:
    """:func:`ngram_grad` in plain PyTorch: the signed gradient rows added with ``index_add_`` in fp32."""
    _check(grad, index, sign_rows, signs)
    terms = grad.float().unsqueeze(0) * signs.float()[sign_rows]  # [2, T, D]
    out = torch.zeros(rows, grad.shape[1], device=grad.device, dtype=torch.float32)
    return out.index_add_(0, index.reshape(-1), terms.reshape(-1, grad.shape[1]))
