"""The gradient of a many-to-one row gather, as a sorted segment sum in Triton.

The value embeddings reach the network as ``planes[p] = values[p, index]``: ``values`` is a
micro-batch's compact leaf ``[P, U, D]`` (one row per distinct token), ``index`` ``[T]`` the
row of every token. The leaf's gradient sums, for every row, the gradient rows of the tokens
that read it. Autograd (and inductor) do that as an atomic scatter of all ``P·T·D`` elements;
on text, frequent tokens send thousands of those atomics to one row, and they queue.

Here the positions are sorted by row first (one device sort, no host sync). A program takes a
chunk of :data:`CHUNK` sorted positions and a block of columns, loads their gradient rows as
one tile, and sums each run of equal rows inside the chunk with one small matrix product: row
``i`` of ``A`` is the indicator of the positions sharing ``i``'s row, kept only where ``i``
starts its run, so ``A @ G`` holds every run's sum at the run's first position. Those sums go
out with one atomic add a run, chunk and column: ``U + T/CHUNK`` row updates instead of ``T``.
The products are exact (``A`` is 0 or 1) and accumulate in fp32; fp32 gradients take the
exact (non-TF32) product, and so do bf16 ones under ``TRITON_INTERPRET=1``, whose ``tl.dot``
mishandles bf16 operands.

:func:`row_sum_reference` is the plain PyTorch definition (``index_add_``) the tests compare with.
On an H100 a stage-2 micro-batch's gather, forward and backward, took 0.741 ms against inductor's
2.281 ms (``benchmarks/value_rows.py``; BENCHMARKS.md, session 6).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import triton
import triton.language as tl
from torch import Tensor

from ...distributed.row_exchange import sort_values
from . import interpret_mode, lastdim_contiguous

CHUNK = 64  # sorted positions a program sums (the matrix product's inner size)
BLOCK_D = 128  # columns a program sums (benchmarks/value_rows.py --tiles times other sizes)


@triton.jit
def _sorted_row_sum_kernel(grad_ptr, order_ptr, rows_ptr, out_ptr, n, D, stride_grad, stride_out,
                           CHUNK: tl.constexpr, BLOCK_D: tl.constexpr, FP32_DOT: tl.constexpr):
    first = tl.program_id(0) * CHUNK
    i = first + tl.arange(0, CHUNK)
    c = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    live = i < n
    cols = c < D
    rows = tl.load(rows_ptr + i, mask=live, other=-1)
    before = tl.load(rows_ptr + i - 1, mask=live & (i > first), other=-1)
    starts = live & ((i == first) | (rows != before))
    token = tl.load(order_ptr + i, mask=live, other=0).to(tl.int64)
    g = tl.load(grad_ptr + token[:, None] * stride_grad + c[None, :], mask=live[:, None] & cols[None, :], other=0.0)
    same = (rows[:, None] == rows[None, :]) & starts[:, None]
    if FP32_DOT:
        sums = tl.dot(same.to(tl.float32), g.to(tl.float32), input_precision="ieee")
    else:
        sums = tl.dot(same.to(g.dtype), g)
    dst = out_ptr + rows.to(tl.int64)[:, None] * stride_out + c[None, :]
    tl.atomic_add(dst, sums, mask=starts[:, None] & cols[None, :], sem="relaxed")


@torch.library.custom_op("nanogpt_pl::sorted_row_sum", mutates_args=())
def sorted_row_sum(grads: list[Optional[Tensor]], index: Tensor, rows: int, dtype: torch.dtype) -> Tensor:
    """``out[p, r] = Σ_{t: index[t] = r} grads[p][t]``: ``[P, rows, D]`` in ``dtype`` (fp32 sums).

    ``grads``: ``P`` tensors ``[T, D]`` (a ``None`` plane sums to zero); ``index``: ``[T]``
    integers in ``[0, rows)``. Runs as a custom op, so ``torch.compile`` calls it as it is.
    """
    like = next(g for g in grads if g is not None)
    n, d = like.shape
    if index.numel() != n or any(g is not None and g.shape != like.shape for g in grads):
        raise ValueError(f"sorted_row_sum: {index.numel()} indices for gradients of shapes "
                         f"{[None if g is None else tuple(g.shape) for g in grads]}; give one [T, D] per plane")
    out = torch.zeros(len(grads), rows, d, device=like.device, dtype=torch.float32)
    if n:
        sorted_rows, order = sort_values(index.reshape(-1), rows - 1)
        chunk, block_d = CHUNK, min(BLOCK_D, max(16, triton.next_power_of_2(d)))
        grid = (triton.cdiv(n, chunk), triton.cdiv(d, block_d))
        fp32_dot = interpret_mode()  # the interpreter's tl.dot mishandles bf16 operands
        for p, g in enumerate(grads):
            if g is None:
                continue
            g = lastdim_contiguous(g)
            _sorted_row_sum_kernel[grid](g, order, sorted_rows, out[p], n, d, g.stride(0), out.stride(1),
                                         CHUNK=chunk, BLOCK_D=block_d, FP32_DOT=fp32_dot or g.dtype == torch.float32,
                                         num_warps=4)
    return out if dtype == torch.float32 else out.to(dtype)


@sorted_row_sum.register_fake
def _(grads, index, rows, dtype):
    like = next(g for g in grads if g is not None)
    return like.new_empty((len(grads), rows, like.shape[-1]), dtype=dtype)


def row_sum_reference(grads: Sequence[Optional[Tensor]], index: Tensor, rows: int, dtype: torch.dtype) -> Tensor:
    """:func:`sorted_row_sum` in plain PyTorch: ``index_add_`` of each plane in fp32."""
    like = next(g for g in grads if g is not None)
    out = torch.zeros(len(grads), rows, like.shape[-1], device=like.device, dtype=torch.float32)
    for p, g in enumerate(grads):
        if g is not None:
            out[p].index_add_(0, index.reshape(-1), g.float())
    return out.to(dtype)
