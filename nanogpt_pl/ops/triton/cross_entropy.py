"""Triton kernel: softcapped cross-entropy loss and logit gradient for a chunk of rows.

One program handles one row of a ``[R, P]`` logit chunk (``P`` = the vocabulary or the
sampled candidate count). It

1. applies the softcap ``z = A·σ((ℓ + B)/C)`` to every logit,
2. forms the log-sum-exp with the fixed maximum ``A`` the softcap allows:
   ``LSE = A + log Σ_j exp(z_j − A)`` (every term lies in ``(e^-A, 1]``, so the sum
   cannot overflow or vanish in fp32 and no running maximum is needed; RECORD §6),
3. adds the weighted loss of up to ``TERMS`` targets of the row (multi-token prediction
   and prefix-token terms; a position of -1 means "no term"),
4. writes ``dL/dℓ_j = (A/C)·σ_j(1 − σ_j)·(S_w·p_j − Σ{w_k : target_k = j})·grad_scale``
   (``S_w`` = total weight of the row's live terms, ``p = softmax(z)``) into ``grad``,
   which may be the logit buffer itself (in place) or a separate buffer, e.g. fp8.

The logits may be bf16/fp16/fp32 or float8_e4m3fn bytes with a dequantization factor
(the FP8 lm_head of RECORD §7 writes raw logits saturating at ±448). The plain PyTorch
twin of this kernel is ``nanogpt_pl.ops.cross_entropy.softcap_ce_rows_reference``.

The sum needs the whole row before any gradient can be formed, so the kernel makes two
passes over the row. It runs far below the copy bandwidth (0.75 TB/s at stage 1 on an H100):
its instructions bound it (about 28 a logit a pass, three of them MUFU operations). Where
the row fits (``hold``: every sampled P) the first pass can keep each column's factor
``exp(z − A)·σ(1 − σ)`` in registers and the second only scales and stores it; P is then a
compile-time block count (one compile per sampled P). Elsewhere (the full vocabulary) the
second pass reads the logits again (mostly from L2) and recomputes the factor with the same
operations, so both ways give the same bits at the same warp count (held rows of 14,336 and
24,576 columns take 16 warps by default, where the row sum's cross-thread reduction runs in
another order: their loss and gradients can differ from the streamed ones in the last bits).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Columns per inner-loop step on the GPU: 2048 bf16 logits = 4 KiB, 8 per thread at 8
# warps (one 16-byte vector load each). Every sampled P is a multiple of 2048 (RECORD §6),
# so sampled rows have no masked tail; the full 50,304 wastes 1.7 % in its last step.
# `benchmarks/lm_head_loss.py --block-sweep` times the alternatives.
DEFAULT_BLOCK_P = 2048
DEFAULT_NUM_WARPS = 8
# Rows of at most this many blocks keep their gradient factors in registers between the passes
# (``hold``): 12 x 2048 = 24,576 is the largest sampled P (RECORD §6). Compiled for sm_90 by
# triton 3.6, 40 held values a thread take 64 registers (P = 10,240 at 8 warps) and 48 take
# 128 (24,576 at 16 warps); 96 a thread (24,576 at 8 warps) spill, so the default warp count
# doubles until a thread holds at most HOLD_PER_THREAD values.
HOLD_MAX_BLOCKS = 12
HOLD_PER_THREAD = 48


@triton.jit
def _softcap_terms(ell, logit_scale, CAP: tl.constexpr, SHIFT: tl.constexpr, WIDTH: tl.constexpr):
    """(σ, exp(z − CAP), σ(1−σ)) of raw logits: z = CAP·σ(a), a = (ℓ·logit_scale + SHIFT)/WIDTH.

    σ is formed from exp(−|a|), so it stays exact at both tails and finite for any input, ±inf
    included; σ(1−σ) = e·r² avoids the cancellation of 1 − σ near σ = 1. What a caller does not
    use is not computed (the compiler drops it).
    """
    a = (ell * logit_scale + SHIFT) * (1.0 / WIDTH)
    e = tl.exp(-tl.abs(a))
    r = 1.0 / (1.0 + e)
    s = tl.where(a >= 0, r, e * r)
    return s, tl.exp(CAP * s - CAP), e * r * r


@triton.jit
def _store_grad(ptrs, g, grad_max, mask, CLAMP_GRAD: tl.constexpr):
    """Store fp32 gradients in the buffer's dtype, saturated at ±grad_max for an fp8 buffer."""
    if CLAMP_GRAD:
        g = tl.minimum(tl.maximum(g, -grad_max), grad_max)
    tl.store(ptrs, g.to(ptrs.dtype.element_ty), mask=mask)


@triton.jit
def _streamed_terms(row_logits, c, P, logit_scale, CAP: tl.constexpr, SHIFT: tl.constexpr, WIDTH: tl.constexpr):
    """A streamed row's block at columns ``c``: (in range, exp(z − CAP), σ(1−σ)), columns past P
    read as 0 and masked."""
    m = c < P
    ell = tl.load(row_logits + c, mask=m, other=0.0).to(tl.float32)
    _, t, ds = _softcap_terms(ell, logit_scale, CAP, SHIFT, WIDTH)
    return m, t, ds


@triton.jit(do_not_specialize=["P"])
def _softcap_ce_rows_kernel(
    logits_ptr,
    stride_logits,
    grad_ptr,
    stride_grad,
    tpos_ptr,
    stride_tpos,
    tw_ptr,
    loss_ptr,
    P,
    logit_scale,
    grad_scale,
    grad_max,
    CAP: tl.constexpr,
    SHIFT: tl.constexpr,
    WIDTH: tl.constexpr,
    TERMS: tl.constexpr,
    BLOCK_P: tl.constexpr,
    WRITE_GRAD: tl.constexpr,
    CLAMP_GRAD: tl.constexpr,
    HELD: tl.constexpr,
):
    # int64: a chunk of 49,152 rows x 50,304 columns has more elements than int32 holds.
    row = tl.program_id(0).to(tl.int64)
    row_logits = logits_ptr + row * stride_logits
    row_grad = grad_ptr + row * stride_grad
    cols = tl.arange(0, BLOCK_P)

    # The row's terms, gathered before pass 2 overwrites the logits when grad aliases them.
    t_offs = tl.arange(0, TERMS)
    tpos = tl.load(tpos_ptr + row * stride_tpos + t_offs)
    tw = tl.load(tw_ptr + t_offs)
    live = tpos >= 0
    tw_live = tl.where(live, tw, 0.0)
    l_t = tl.load(row_logits + tl.where(live, tpos, 0), mask=live, other=0.0).to(tl.float32)
    s_t, t_t, ds_t = _softcap_terms(l_t, logit_scale, CAP, SHIFT, WIDTH)
    z_t = CAP * s_t

    # Pass 1: Σ exp(z − CAP). With HELD blocks (P = HELD·BLOCK_P) each column's gradient
    # factor exp(z − CAP)·σ(1−σ) is kept in registers for pass 2; else pass 2 reads the row
    # again and recomputes it (three MUFU operations a logit: the kernel is instruction-bound).
    acc = tl.zeros([BLOCK_P], dtype=tl.float32)
    held = ()
    if HELD > 0:
        for b in tl.static_range(HELD):
            ell = tl.load(row_logits + b * BLOCK_P + cols).to(tl.float32)
            _, t, ds = _softcap_terms(ell, logit_scale, CAP, SHIFT, WIDTH)
            acc += t
            if WRITE_GRAD:
                held = held + (t * ds,)
    else:
        for start in range(0, P, BLOCK_P):
            m, t, _ = _streamed_terms(row_logits, start + cols, P, logit_scale, CAP, SHIFT, WIDTH)
            acc += tl.where(m, t, 0.0)
    total = tl.sum(acc, axis=0)
    lse = CAP + tl.log(total)
    s_w = tl.sum(tw_live, axis=0)
    loss = tl.sum(tw_live * (lse - z_t), axis=0)
    tl.store(loss_ptr + row, loss)

    if WRITE_GRAD:
        inv_total = 1.0 / total
        # dz/dℓ = (CAP/WIDTH)·σ(1−σ); grad_scale folds in the 1/N of the mean and the
        # divisor of the gradient's storage format.
        coef = (CAP / WIDTH) * grad_scale
        # Pass 2 writes the softmax part, coef·σ(1−σ)·S_w·p, to every column; the columns
        # that are some term's target are rewritten after it (a handful per row, where a
        # per-column match against every term would cost 3·TERMS operations per logit).
        # Both branches form (coef·S_w/Σ)·(exp(z − CAP)·σ(1−σ)) with the same operations.
        k = coef * s_w * inv_total
        if HELD > 0:
            for b in tl.static_range(HELD):
                _store_grad(row_grad + b * BLOCK_P + cols, k * held[b], grad_max, None, CLAMP_GRAD)
        else:
            for start in range(0, P, BLOCK_P):
                c = start + cols
                m, t, ds = _streamed_terms(row_logits, c, P, logit_scale, CAP, SHIFT, WIDTH)
                _store_grad(row_grad + c, k * (t * ds), grad_max, m, CLAMP_GRAD)
        # Target columns: the same formula with the weights of every term on that column
        # subtracted. The barrier orders these stores after pass 2's stores of the same
        # columns by other threads of the program.
        tl.debug_barrier()
        same = (tpos[:, None] == tpos[None, :]) & live[None, :]
        hit_t = tl.sum(tl.where(same, tw_live[None, :], 0.0), axis=1)
        g_t = coef * ds_t * (s_w * (t_t * inv_total) - hit_t)
        _store_grad(row_grad + tl.where(live, tpos, 0), g_t, grad_max, live, CLAMP_GRAD)


def held_num_warps(held_blocks: int, block_p: int = DEFAULT_BLOCK_P) -> int:
    """The default warps of a launch that holds ``held_blocks`` blocks of ``block_p`` columns (0:
    a streamed row): ``DEFAULT_NUM_WARPS``, doubled until a thread holds at most
    ``HOLD_PER_THREAD`` values (more spill: triton 3.6, sm_90)."""
    warps = DEFAULT_NUM_WARPS
    while held_blocks * block_p > HOLD_PER_THREAD * 32 * warps:
        warps *= 2
    return warps


def softcap_ce_rows(
    logits: torch.Tensor,
    logit_scale: float,
    grad: torch.Tensor | None,
    grad_scale: float,
    tpos: torch.Tensor,
    term_weights: torch.Tensor,
    loss_out: torch.Tensor,
    *,
    cap: float,
    shift: float,
    width: float,
    block_p: int | None = None,
    num_warps: int | None = None,
    hold: bool = False,
) -> None:
    """Launch the fused softcap + LSE + loss + logit-gradient kernel on a chunk of rows.

    Args:
        logits: ``[R, P]`` bf16/fp16/fp32 or float8_e4m3fn; rows contiguous (stride 1 along P).
        logit_scale: factor that turns the stored values into logits (1.0 unless quantized).
        grad: ``[R, P]`` buffer for ``dL/dℓ`` (may be ``logits`` itself), bf16/fp16/fp32 or
            float8_e5m2/e4m3fn (saturated to the format's maximum); ``None`` skips the gradient.
        grad_scale: factor applied to the gradient before it is stored.
        tpos: ``[R, TERMS]`` int32 column of each term's target in the chunk, -1 = no term;
            ``TERMS`` must be a power of two.
        term_weights: ``[TERMS]`` fp32 weight of each term column.
        loss_out: ``[R]`` fp32, receives each row's weighted loss ``Σ_k w_k (LSE − z_target_k)``.
        cap, shift, width: the softcap constants ``z = cap·σ((ℓ + shift)/width)``.
        block_p: columns per inner-loop step (a power of two); defaults to ``DEFAULT_BLOCK_P``.
        num_warps: warps per program; defaults to :func:`held_num_warps` (16 for held rows of
            14,336 and 24,576 columns, else 8). The row sum's reduction across threads follows the
            warp count, so held and streamed rows give the same bits at the same warp count, and
            may differ in the last bits of the loss and gradient where the defaults differ.
        hold: keep each column's gradient factor in registers between the two passes instead of
            reading the row again and recomputing it, where the row fits: ``P`` a multiple of
            ``block_p`` with at most ``HOLD_MAX_BLOCKS`` blocks (every sampled P of RECORD §6) and a
            gradient written. Other rows (the full 50,304) stream. ``model.backends.loss:
            triton_held`` (what ``auto`` picks on CUDA) turns it on in training.
    """
    R, P = logits.shape
    terms = tpos.shape[1]
    if terms & (terms - 1) or tpos.shape[0] != R or term_weights.numel() != terms:
        raise ValueError(f"tpos {tuple(tpos.shape)} / term_weights {tuple(term_weights.shape)} do not "
                         f"match {R} rows with a power-of-two term count")
    if logits.stride(1) != 1 or (grad is not None and grad.stride(1) != 1) or tpos.stride(1) != 1:
        raise ValueError("softcap_ce_rows needs rows with unit column stride")
    if R == 0:
        return
    write_grad = grad is not None
    if grad is None:
        grad = logits  # never written: WRITE_GRAD is off
    clamp = grad.dtype in (torch.float8_e5m2, torch.float8_e4m3fn)
    grad_max = float(torch.finfo(grad.dtype).max) if clamp else 0.0
    block = block_p or min(DEFAULT_BLOCK_P, triton.next_power_of_2(P))
    fits = P % block == 0 and P // block <= HOLD_MAX_BLOCKS
    held = P // block if hold and fits and write_grad else 0
    warps = num_warps or held_num_warps(held, block)
    _softcap_ce_rows_kernel[(R,)](
        logits, logits.stride(0), grad, grad.stride(0), tpos, tpos.stride(0),
        term_weights, loss_out, P, float(logit_scale), float(grad_scale), grad_max,
        CAP=cap, SHIFT=shift, WIDTH=width, TERMS=terms, BLOCK_P=block,
        WRITE_GRAD=write_grad, CLAMP_GRAD=clamp, HELD=held,
        num_warps=warps,
    )
