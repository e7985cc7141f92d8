"""The sparse channels' row gather as one Triton kernel: table rows at padded ids, cast, zeros at the padding.

A micro-batch's compact leaves (the value-embedding planes at its unique token ids, the
n-gram rows it reads on one rank) are table rows at a sentinel-padded id list, in fp32. In
PyTorch that is a gather, a mask, a stack and a cast, each a full pass over the leaf; here it
is one pass that reads each real row once and writes the fp32 leaf once.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

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
    return out
