"""The sparse channels' Adam events as Triton kernels: the n-gram rows, the value-embedding block.

**n-gram rows** (:func:`lazy_row_adam_`).

``nanogpt_pl.optim.sparse_adam.LazyRowAdam.update_`` in PyTorch runs a dozen full passes
over the event's rows (gather, cast, square, mean, divide, decay mask, update, scatter,
for the table row, its second moment and its stamp). Here one program takes one output
row: it sums that row's gradient terms (a segment of the sorted queue, so the merge needs
no buffer and no atomics), replays the second-moment decay of the events the row slept
through (a table indexed by its last event), updates the moment and the bf16 table row
in place and stamps the row. Padding rows (the shard's scratch row) do nothing.

A row's terms are added in the order ``order`` lists them (the queue order, as the
reference merge adds them), from one source or from two without concatenating them (at an
owner of a multi-rank table: its own request at full precision, then the peers' rows in the
wire dtype), and the sum is scaled (the mean over ranks); the row mean of ``g²`` is a tree
sum, so the second moment can differ from PyTorch's in the last bits.

**Value-embedding block** (:func:`dense_adam_`). With the fixed exchange the owner holds its
block's whole cycle gradient, so its Adam (``ShardAdam.update_dense_``: moments, update,
cautious decay) is elementwise: one pass reads the gradient, both moments and the bf16 table
and writes them back, and zeroes the gradient for the next cycle, where PyTorch makes about
fifteen passes and a separate zeroing.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.autograd.graph import increment_version

from nanogpt_pl.ops.triton.fp8_quant import store_rounded


# Triton compiles a variant per value class of an integer argument (1, a multiple of 16, other):
# ``event`` grows by one an event and ``split`` follows the queue, so specialized, new variants
# compiled mid-run, on the clock (a 234 ms stall in an H100 profile at event 2, BENCHMARKS.md
# "The launch queues ..."); neither value gains from specializing, nor does the fixed ``scratch``.
@triton.jit(do_not_specialize=["split", "scratch", "event"])
def _lazy_row_adam_kernel(table_ptr, v_ptr, last_ptr, rows_ptr, src_ptr, src2_ptr, order_ptr, offsets_ptr, decay_ptr,
                          D, stride_table, stride_src, stride_src2, split, scratch, event, beta2, one_minus_beta2,
                          step_size, eps, decay_wd, grad_scale, HAS_SRC2: tl.constexpr, BLOCK_D: tl.constexpr):
    slot = tl.program_id(0)
    row = tl.load(rows_ptr + slot)
    if row != scratch:
        cols = tl.arange(0, BLOCK_D)
        mask = cols < D
        start = tl.load(offsets_ptr + slot)
        stop = tl.load(offsets_ptr + slot + 1)
        g = tl.zeros([BLOCK_D], dtype=tl.float32)
        for j in range(start, stop):
            s = tl.load(order_ptr + j).to(tl.int64)
            if HAS_SRC2:
                # entries past ``split`` are rows of the second source (one term each, as in the first)
                if s < split:
                    g += tl.load(src_ptr + s * stride_src + cols, mask=mask, other=0.0).to(tl.float32)
                else:
                    g += tl.load(src2_ptr + (s - split) * stride_src2 + cols, mask=mask, other=0.0).to(tl.float32)
            else:
                g += tl.load(src_ptr + s * stride_src + cols, mask=mask, other=0.0).to(tl.float32)
        g = g * grad_scale
        row64 = row.to(tl.int64)
        slept = tl.load(last_ptr + row64)
        v = tl.load(v_ptr + row64) * tl.load(decay_ptr + slept)
        v = beta2 * v + one_minus_beta2 * (tl.sum(g * g, axis=0) / D)
        u = g / (tl.sqrt(v) + eps) * step_size
        p_ptrs = table_ptr + row64 * stride_table + cols
        p = tl.load(p_ptrs, mask=mask, other=0.0).to(tl.float32)
        u += tl.where(u * p > 0, p * decay_wd, 0.0)
        p = p - u
        store_rounded(p_ptrs, p, mask)
        tl.store(v_ptr + row64, v)
        tl.store(last_ptr + row64, event)


def lazy_row_adam_(table: Tensor, v: Tensor, last_event: Tensor, rows: Tensor, src: Tensor, order: Tensor,
                   offsets: Tensor, decay: Tensor, scratch: int, event: int, beta2: float, step_size: float,
                   eps: float, decay_wd: float, src2: Optional[Tensor] = None, grad_scale: float = 1.0) -> None:
    """One lazy row-Adam event over ``rows`` (see the module docstring); updates in place.

    Args:
        table: ``[R (+1), D]`` the shard (bf16 or fp32), rows contiguous.
        v: ``[R (+1)]`` fp32 second moments; ``last_event``: ``[R (+1)]`` int32 stamps.
        rows: ``[N]`` unique local rows, ``scratch`` for padding.
        src: ``[M, D]`` gradient terms (fp32 or bf16); ``order``: ``[M']`` indices into ``src``;
            ``offsets``: ``[N + 1]``: row ``rows[i]`` sums ``src[order[offsets[i]:offsets[i+1]]]``.
        decay: ``[event]`` fp32, the second-moment decay of a row last stamped at each event.
        step_size: lr·√(1 - β₂ʲ); ``decay_wd``: lr²·λ (0 for none).
        src2: ``[M2, D]`` more terms, of any float dtype: ``order`` then indexes the concatenation
            ``src ++ src2`` (no concatenated copy is made).
        grad_scale: each row's sum is multiplied by it before the update (``1/W``: the mean over
            W ranks; exact for a power of two).
    """
    n, d = rows.numel(), table.shape[-1]
    if n == 0:
        return
    second = src if src2 is None else src2
    if table.stride(-1) != 1 or src.stride(-1) != 1 or second.stride(-1) != 1 or src.shape[-1] != d \
            or second.shape[-1] != d:
        raise ValueError(f"lazy_row_adam_: rows must be contiguous and of width {d}")
    if v.dtype != torch.float32 or last_event.dtype != torch.int32 or decay.dtype != torch.float32:
        raise ValueError("lazy_row_adam_: fp32 second moments and decay, int32 stamps")
    _lazy_row_adam_kernel[(n,)](
        table, v, last_event, rows, src, second, order, offsets, decay, d, table.stride(0), src.stride(0),
        second.stride(0), src.shape[0], scratch, event, beta2, 1.0 - beta2, step_size, eps, decay_wd, grad_scale,
        HAS_SRC2=src2 is not None, BLOCK_D=triton.next_power_of_2(d), num_warps=4,
    )
    increment_version([table, v, last_event])  # the kernel's writes, visible to autograd's version counters


@triton.jit
def _dense_adam_kernel(p_ptr, m_ptr, v_ptr, g_ptr, n, beta1, one_minus_beta1, beta2, one_minus_beta2, step_size,
                       eps, decay_wd, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(g_ptr + offs, mask=mask, other=0.0)
    m = tl.load(m_ptr + offs, mask=mask, other=0.0) * beta1 + one_minus_beta1 * g
    v = tl.load(v_ptr + offs, mask=mask, other=0.0) * beta2 + one_minus_beta2 * (g * g)
    p = tl.load(p_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = m / (tl.sqrt(v) + eps) * step_size
    u += tl.where(u * p > 0, p * decay_wd, 0.0)
    p = p - u
    store_rounded(p_ptr + offs, p, mask)
    tl.store(m_ptr + offs, m, mask=mask)
    tl.store(v_ptr + offs, v, mask=mask)
    tl.store(g_ptr + offs, tl.zeros_like(g), mask=mask)


def dense_adam_(param: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, grad: Tensor, beta1: float, beta2: float,
                step_size: float, eps: float, decay_wd: float) -> None:
    """Adam over every element of ``param`` with ``grad``, then ``grad`` zeroed; all contiguous, same shape.

    ``step_size`` = lr·√(1-β₂ᵗ)/(1-β₁ᵗ); ``decay_wd`` = lr²·λ (cautious: only where the update and the
    parameter agree in sign).
    """
    n = param.numel()
    for t in (exp_avg, exp_avg_sq, grad):
        if t.shape != param.shape or t.dtype != torch.float32 or not t.is_contiguous():
            raise ValueError("dense_adam_: fp32 moments and gradient, contiguous, of the parameter's shape")
    if not param.is_contiguous():
        raise ValueError("dense_adam_: the parameter must be contiguous")
    if n:
        block = 1024
        _dense_adam_kernel[(triton.cdiv(n, block),)](param, exp_avg, exp_avg_sq, grad, n, beta1, 1.0 - beta1, beta2,
                                                      1.0 - beta2, step_size, eps, decay_wd, BLOCK=block,
                                                      num_warps=4)
    increment_version([param, exp_avg, exp_avg_sq, grad])  # the kernel's writes, visible to version counters
