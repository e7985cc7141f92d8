"""The sparse channels' row traffic as Triton kernels: the leaves' gather, the gradient's scatter-add.

**Gather** (:func:`gather_rows_triton_`). A micro-batch's compact leaves (the value-embedding
planes at its unique token ids, the n-gram rows it reads on one rank) are table rows at a
sentinel-padded id list, in fp32. In PyTorch that is a gather, a mask, a stack and a cast,
each a full pass over the leaf; here it is one pass that reads each real row once and writes
the fp32 leaf once.

**Scatter-add** (:func:`scatter_add_rows_triton_`). The value embeddings' cycle buffer takes
each micro-batch's compact gradient ``[P, U (+ padding), D]`` at its ids. The real ids of one
micro-batch are unique, so each buffer row gets one term: a plain read-add-write, no atomics,
and the padding rows are skipped instead of added somewhere (``index_add_`` on a GPU does a
50M-element atomic pass a stage-0 micro-batch). One term per element in one call, so the
result equals ``index_add_``'s bit for bit.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor
from torch.autograd.graph import increment_version

_BLOCK_ROWS = 16


@triton.jit
def _gather_rows_kernel(table_ptr, ids_ptr, out_ptr, n, D, limit, stride_table, stride_out,
                        BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    in_rows = r < n
    cols = c < D
    ids = tl.load(ids_ptr + r, mask=in_rows, other=limit).to(tl.int64)
    real = (ids >= 0) & (ids < limit)
    values = tl.load(table_ptr + ids[:, None] * stride_table + c[None, :], mask=real[:, None] & cols[None, :],
                     other=0.0)
    out = out_ptr + r.to(tl.int64)[:, None] * stride_out + c[None, :]
    tl.store(out, values.to(out_ptr.dtype.element_ty), mask=in_rows[:, None] & cols[None, :])


def gather_rows_triton_(out: Tensor, table: Tensor, ids: Tensor, limit: int) -> Tensor:
    """``out[i] = table[ids[i]]`` where ``0 <= ids[i] < limit``, else 0, in ``out``'s dtype; returns ``out``."""
    n, d = ids.numel(), table.shape[-1]
    if out.shape != (n, d) or table.stride(-1) != 1 or out.stride(-1) != 1:
        raise ValueError(f"gather_rows: out {tuple(out.shape)} for {n} ids of width {d}, rows contiguous")
    if n:
        block_d = min(256, triton.next_power_of_2(d))
        grid = (triton.cdiv(n, _BLOCK_ROWS), triton.cdiv(d, block_d))
        _gather_rows_kernel[grid](table, ids, out, n, d, limit, table.stride(0), out.stride(0),
                                  BLOCK_R=_BLOCK_ROWS, BLOCK_D=block_d, num_warps=4)
    increment_version(out)  # the kernel's writes, visible to autograd's version counters
    return out


@triton.jit
def _scatter_add_rows_kernel(buf_ptr, src_ptr, ids_ptr, n, D, limit, stride_buf_plane, stride_buf_row,
                             stride_src_plane, stride_src_row, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    plane = tl.program_id(2).to(tl.int64)
    ids = tl.load(ids_ptr + r, mask=r < n, other=limit).to(tl.int64)
    mask = ((ids >= 0) & (ids < limit))[:, None] & (c < D)[None, :]
    dst = buf_ptr + plane * stride_buf_plane + ids[:, None] * stride_buf_row + c[None, :]
    src = src_ptr + plane * stride_src_plane + r.to(tl.int64)[:, None] * stride_src_row + c[None, :]
    total = tl.load(dst, mask=mask, other=0.0) + tl.load(src, mask=mask, other=0.0).to(tl.float32)
    tl.store(dst, total, mask=mask)


def scatter_add_rows_triton_(buf: Tensor, ids: Tensor, src: Tensor, limit: int) -> Tensor:
    """``buf[:, ids[i]] += src[:, i]`` for ``0 <= ids[i] < limit`` (real ids unique); others skipped.

    ``buf``: ``[P, R, D]`` fp32; ``src``: ``[P, n, D]``; rows contiguous. Returns ``buf``.
    """
    planes, n, d = src.shape
    if buf.shape[0] != planes or buf.shape[-1] != d or ids.numel() != n or buf.stride(-1) != 1 \
            or src.stride(-1) != 1:
        raise ValueError(f"scatter_add_rows: {tuple(src.shape)} rows into {tuple(buf.shape)} at {ids.numel()} ids")
    if n:
        block_d = min(256, triton.next_power_of_2(d))
        grid = (triton.cdiv(n, _BLOCK_ROWS), triton.cdiv(d, block_d), planes)
        _scatter_add_rows_kernel[grid](buf, src, ids, n, d, limit, buf.stride(0), buf.stride(1), src.stride(0),
                                       src.stride(1), BLOCK_R=_BLOCK_ROWS, BLOCK_D=block_d, num_warps=4)
    increment_version(buf)
    return buf
