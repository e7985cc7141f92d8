"""The lm_head and its loss: softcapped cross-entropy, full or sampled, fused or plain.

The vocabulary projection is about a third of the model's flops. The record (RECORD §6)
trains most steps with a *sampled* softmax: one candidate set ``C`` of ``P`` classes per
micro-batch (every target plus duplicate-free negatives), logits are computed only for the
rows of the lm_head weight in ``C`` (forward and backward), and a fused kernel computes the
softcap, the log-sum-exp, the loss and the logit gradient in one pass. Validation always
uses the full 50,304-way softmax.

Pieces, each with a plain PyTorch reference next to the fast path:

- :func:`softcap` — ``z = 23·σ((ℓ + 5)/7.5)`` (RECORD §2), which equals
  ``11.5·(1 + tanh((ℓ + 5)/15))``: a tanh softcap shifted by 5 and lifted into ``(0, 23)``.
- :func:`lm_head_loss` — the training loss, backends ``"reference"`` (autograd on fp32
  logits), ``"chunked"`` (the fused algorithm with the row math in PyTorch, any device) and
  ``"triton"`` (the fused algorithm with the Triton row kernel).
- :func:`softcap_ce_rows_reference` — the PyTorch twin of the Triton row kernel.
- :func:`full_cross_entropy` — validation loss, full vocabulary, row-chunked.
- :class:`CandidateSampler` — the candidate set of one micro-batch.
- :func:`build_prefix_table` — the longest proper byte-prefix token of every token.
- :class:`HeadMatmul` / :class:`TorchHeadMatmul` — how the logit and gradient GEMMs run;
  the FP8 lm_head (RECORD §7) plugs in here.
"""

from __future__ import annotations

import math
import os
from typing import Any, Callable, Optional, Protocol, Sequence, Union, runtime_checkable

import numpy as np
import torch
import torch.nn.functional as F

from nanogpt_pl.data.tokenizer import PADDED_VOCAB

__all__ = [
    "SOFTCAP_MAX",
    "SOFTCAP_SHIFT",
    "SOFTCAP_WIDTH",
    "CANDIDATE_MULTIPLE",
    "softcap",
    "HeadMatmul",
    "TorchHeadMatmul",
    "softcap_ce_rows_reference",
    "lm_head_loss",
    "full_cross_entropy",
    "default_chunk_rows",
    "CandidateSampler",
    "build_prefix_table",
]

# RECORD §2 "Head and loss": z = 23·σ((ℓ + 5)/7.5). SOFTCAP_MAX is also the fixed maximum
# of the log-sum-exp (RECORD §6), since z < 23 for every logit.
SOFTCAP_MAX = 23.0
SOFTCAP_SHIFT = 5.0
SOFTCAP_WIDTH = 7.5

# RECORD §6: P must be a multiple of 2048 (the record's CE kernel: block 256 × vector 8).
CANDIDATE_MULTIPLE = 2048
# RECORD §6: negatives come from perm[k] = 20011·k mod V (20011 is coprime to 50,304); each
# call draws a window of min(V, ⌊1.7·need⌋ + 256) entries of it.
SAMPLER_STRIDE = 20011
SAMPLER_DRAW_FACTOR = 1.7
SAMPLER_DRAW_EXTRA = 256

# Logits held at once by the fused path: ~8192 rows of the full vocabulary (0.82 GB in
# bf16). On an H200 a 8192 × 768 × 50,304 GEMM already fills all 132 SMs many times over,
# so larger chunks buy no GEMM efficiency, only memory; smaller ones add launches and
# re-read the weight once more per chunk. The chunk count is rounded up, then rows are
# spread evenly (49,152 rows: 6 chunks of 8,192 at P = 50,304, 2 of 24,576 at P = 10,240).
GPU_CHUNK_ELEMENTS = 8192 * PADDED_VOCAB
# On the CPU (reference-like sizes, fp32): 64 Mi logits = 256 MiB per chunk.
CPU_CHUNK_ELEMENTS = 1 << 26
# Chunk rows are rounded to this multiple so GEMM row tiles stay whole.
CHUNK_ROW_MULTIPLE = 128

BACKENDS = ("auto", "reference", "chunked", "triton")


def softcap(logits: torch.Tensor) -> torch.Tensor:
    """The record's logit softcap ``z = 23·σ((ℓ + 5)/7.5)`` in the input's dtype (RECORD §2).

    Maps every logit into ``(0, 23)``; equal to ``11.5·(1 + tanh((ℓ + 5)/15))``.
    """
    return SOFTCAP_MAX * torch.sigmoid((logits + SOFTCAP_SHIFT) * (1.0 / SOFTCAP_WIDTH))


# ---------------------------------------------------------------------------------------
# How the head's GEMMs run
# ---------------------------------------------------------------------------------------


@runtime_checkable
class HeadMatmul(Protocol):
    """How the lm_head GEMMs of the fused loss run, chunk by chunk.

    The fused loss calls, for one training step: ``prepare`` once, then for each chunk of
    rows ``x`` (``[R, D]``): ``logits`` → the row kernel (which writes ``dL/dℓ`` into
    ``grad_buffer(logits)``) → ``grad_input`` and ``grad_weight``. An FP8 implementation
    (RECORD §7 lm_head) returns e4m3 logits saturating at ±448 with their dequantization
    factor, hands out an e5m2 gradient buffer with its storage divisor, and runs the two
    gradient GEMMs with ``torch._scaled_mm``.
    """

    def prepare(self, weight: torch.Tensor, candidates: Optional[torch.Tensor],
                dtype: torch.dtype) -> Any:
        """The weight rows the GEMMs use (all of ``weight`` [V, D], or the rows listed in
        ``candidates``), in whatever form the head needs; ``dtype`` is the compute dtype."""
        ...

    def logits(self, x: torch.Tensor, w: Any) -> tuple[torch.Tensor, float]:
        """``[R, P]`` logits of ``x`` against ``w`` (rows contiguous) and the factor that turns
        the stored values into logits: bf16/fp16/fp32 with 1.0, or float8_e4m3fn with a scale."""
        ...

    def grad_buffer(self, logits: torch.Tensor) -> tuple[torch.Tensor, float]:
        """Where the row kernel writes ``dL/dℓ`` (``[R, P]``: bf16/fp16/fp32, or float8_e5m2 /
        e4m3fn, saturated) and the divisor it is stored at (true gradient = stored × divisor).
        Returning ``logits`` itself makes the kernel write in place."""
        ...

    def grad_input(self, grad: torch.Tensor, grad_div: float, w: Any, out: torch.Tensor) -> None:
        """``out[R, D] = (grad · grad_div) @ W_C``."""
        ...

    def grad_weight(self, grad: torch.Tensor, grad_div: float, x: torch.Tensor,
                    acc: Optional[torch.Tensor]) -> torch.Tensor:
        """``acc + (grad · grad_div)ᵀ @ x`` as fp32 ``[P, D]`` (``acc`` is None on the first
        chunk; it may be updated in place and returned)."""
        ...


_FP32_OUT_MM_OK: dict[torch.device, bool] = {}


def _fp32_out_mm_supported(device: torch.device) -> bool:
    """Whether ``torch.mm/addmm(..., out_dtype=torch.float32)`` works (and is right) here.

    It lets a bf16 GEMM accumulate straight into the fp32 weight-gradient buffer. It exists
    on CUDA from torch 2.8 on; probed once per device and checked against an fp32 product.
    """
    if device.type != "cuda":
        return False
    ok = _FP32_OUT_MM_OK.get(device)
    if ok is None:
        try:
            gen = torch.Generator(device=device).manual_seed(0)
            a = torch.randn(96, 64, device=device, generator=gen).to(torch.bfloat16)
            b = torch.randn(64, 80, device=device, generator=gen).to(torch.bfloat16)
            acc = torch.randn(96, 80, device=device, generator=gen)
            want = a.float() @ b.float()
            got_mm = torch.mm(a, b, out_dtype=torch.float32)
            got_addmm = torch.addmm(acc, a, b, out_dtype=torch.float32, alpha=0.5)
            ok = bool(got_mm.dtype == torch.float32 and got_addmm.dtype == torch.float32
                      and torch.allclose(got_mm, want, rtol=1e-4, atol=1e-3)
                      and torch.allclose(got_addmm, acc + 0.5 * want, rtol=1e-4, atol=1e-3))
        except (TypeError, RuntimeError, NotImplementedError):
            ok = False
        _FP32_OUT_MM_OK[device] = ok
    return ok


class TorchHeadMatmul:
    """The default head: ordinary ``torch.mm`` in the compute dtype (bf16 on GPU, fp32 on CPU).

    The gradient is written in place over the logits; the weight gradient is accumulated in
    fp32 across chunks.
    """

    def prepare(self, weight: torch.Tensor, candidates: Optional[torch.Tensor],
                dtype: torch.dtype) -> torch.Tensor:
        w = weight if candidates is None else weight.index_select(0, candidates)
        return w.to(dtype)

    def logits(self, x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, float]:
        return torch.mm(x, w.t()), 1.0

    def grad_buffer(self, logits: torch.Tensor) -> tuple[torch.Tensor, float]:
        return logits, 1.0

    def grad_input(self, grad: torch.Tensor, grad_div: float, w: torch.Tensor,
                   out: torch.Tensor) -> None:
        torch.mm(grad, w, out=out)
        if grad_div != 1.0:
            out.mul_(grad_div)

    def grad_weight(self, grad: torch.Tensor, grad_div: float, x: torch.Tensor,
                    acc: Optional[torch.Tensor]) -> torch.Tensor:
        gt = grad.t()
        if grad.dtype == torch.float32:
            if acc is None:
                return torch.mm(gt, x).mul_(grad_div)
            return acc.addmm_(gt, x, alpha=grad_div)
        if _fp32_out_mm_supported(grad.device):
            if acc is None:
                out = torch.mm(gt, x, out_dtype=torch.float32)
                return out.mul_(grad_div) if grad_div != 1.0 else out
            return torch.addmm(acc, gt, x, out_dtype=torch.float32, alpha=grad_div)
        # Fallback: one bf16 rounding of each chunk's product before the fp32 sum.
        part = torch.mm(gt, x).float()
        if acc is None:
            return part.mul_(grad_div) if grad_div != 1.0 else part
        return acc.add_(part, alpha=grad_div)


_DEFAULT_HEAD = TorchHeadMatmul()


# ---------------------------------------------------------------------------------------
# The row math (reference twin of the Triton kernel)
# ---------------------------------------------------------------------------------------


def softcap_ce_rows_reference(
    logits: torch.Tensor,
    logit_scale: float,
    tpos: torch.Tensor,
    term_weights: torch.Tensor,
    grad_scale: float,
    write_grad: bool = True,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Plain PyTorch version of the fused row kernel, in fp32.

    Args:
        logits: ``[R, P]`` stored logits (any float dtype, fp8 included).
        logit_scale: factor that turns the stored values into logits.
        tpos: ``[R, T]`` column of each term's target, -1 = no term.
        term_weights: ``[T]`` weight of each term column.
        grad_scale: factor applied to ``dL/dℓ``.
        write_grad: also return the gradient.

    Returns:
        ``(loss_rows [R], grad [R, P] or None)``, both fp32: ``loss_rows[r] =
        Σ_k w_k·(LSE_r − z_r[tpos_rk])`` over live terms, ``grad = grad_scale·dloss/dℓ``.
    """
    ell = logits.float() * logit_scale
    a = (ell + SOFTCAP_SHIFT) / SOFTCAP_WIDTH
    s = torch.sigmoid(a)
    z = SOFTCAP_MAX * s
    # The fixed maximum of RECORD §6: z − 23 ≤ 0, so no running max is needed.
    total = torch.exp(z - SOFTCAP_MAX).sum(dim=1)
    lse = SOFTCAP_MAX + torch.log(total)
    live = tpos >= 0
    idx = tpos.clamp(min=0).long()
    w = torch.where(live, term_weights.float()[None, :], torch.zeros((), device=logits.device))
    z_t = z.gather(1, idx)
    loss_rows = (w * (lse[:, None] - z_t)).sum(dim=1)
    if not write_grad:
        return loss_rows, None
    p = torch.exp(z - lse[:, None])
    dz = w.sum(dim=1, keepdim=True) * p
    dz.scatter_add_(1, idx, -w)
    ds = torch.sigmoid(a) * torch.sigmoid(-a)
    grad = (SOFTCAP_MAX / SOFTCAP_WIDTH) * ds * dz * grad_scale
    return loss_rows, grad


def _torch_rows(logits, logit_scale, grad, grad_scale, tpos, term_weights, loss_out) -> None:
    """Row math of the ``"chunked"`` backend: the reference twin writing into the buffers."""
    loss_rows, g = softcap_ce_rows_reference(logits, logit_scale, tpos, term_weights, grad_scale,
                                             write_grad=grad is not None)
    loss_out.copy_(loss_rows)
    if grad is not None:
        if grad.dtype in (torch.float8_e5m2, torch.float8_e4m3fn):
            fmax = torch.finfo(grad.dtype).max
            g = g.clamp(-fmax, fmax)
        grad.copy_(g)


def _triton_rows(logits, logit_scale, grad, grad_scale, tpos, term_weights, loss_out) -> None:
    from .triton.cross_entropy import softcap_ce_rows

    softcap_ce_rows(logits, logit_scale, grad, grad_scale, tpos, term_weights, loss_out,
                    cap=SOFTCAP_MAX, shift=SOFTCAP_SHIFT, width=SOFTCAP_WIDTH)


# ---------------------------------------------------------------------------------------
# Targets → kernel term table
# ---------------------------------------------------------------------------------------


def _term_table(
    targets: torch.Tensor,
    n_classes: int,
    candidates: Optional[torch.Tensor],
    mtp_weights: Sequence[float],
    prefix_targets: Optional[torch.Tensor],
    prefix_weight: float,
) -> tuple[torch.Tensor, torch.Tensor, int, torch.Tensor]:
    """Column (in the logit chunk) and weight of every loss term of every row.

    Row t gets one term per MTP weight k, targeting ``targets[t + k]`` when ``t + k < N``,
    and a prefix term targeting ``prefix_targets[t]`` when that is >= 0 and (sampled path)
    among the candidates. Returns ``(tpos [N, T] int32, weights [T] fp32, n_terms, bad)``
    with T a power of two (padding columns are -1 with weight 0) and ``bad`` a 0-d bool
    tensor: some target is outside [0, V) or missing from the candidates.
    """
    device = targets.device
    n = targets.shape[0]
    k_mtp = len(mtp_weights)
    use_prefix = prefix_targets is not None and float(prefix_weight) != 0.0
    n_terms = k_mtp + int(use_prefix)
    width = 1 << max(0, (n_terms - 1).bit_length())
    in_range = (targets >= 0) & (targets < n_classes)
    if candidates is None:
        pos_map = None
        tgt_pos = torch.where(in_range, targets, -1).to(torch.int32)
    else:
        pos_map = torch.full((n_classes,), -1, dtype=torch.int32, device=device)
        pos_map[candidates] = torch.arange(candidates.numel(), dtype=torch.int32, device=device)
        tgt_pos = torch.where(in_range, pos_map[targets.clamp(0, n_classes - 1)], -1)
    bad = (tgt_pos < 0).any()
    tpos = torch.full((n, width), -1, dtype=torch.int32, device=device)
    for k in range(min(k_mtp, n)):
        # RECORD §2: the target k positions ahead in the packed micro-batch; only the
        # batch end masks a term, document ends do not.
        tpos[: n - k, k] = tgt_pos[k:]
    weights = [float(w) for w in mtp_weights]
    if use_prefix:
        pf = prefix_targets
        bad = bad | (pf >= n_classes).any()
        pf_ok = (pf >= 0) & (pf < n_classes)
        pf_c = pf.clamp(0, n_classes - 1)
        pf_pos = pf_c.to(torch.int32) if pos_map is None else pos_map[pf_c]
        # RECORD §6: a prefix target absent from the candidates has its term skipped.
        tpos[:, k_mtp] = torch.where(pf_ok, pf_pos, -1)
        weights.append(float(prefix_weight))
    weights += [0.0] * (width - len(weights))
    tw = _to_device(torch.tensor(weights, dtype=torch.float32), device)
    return tpos, tw, n_terms, bad


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host → device copy that does not stall the host: staged through pinned memory."""
    if t.device == device:
        return t
    if device.type == "cuda" and t.device.type == "cpu" and not t.is_pinned():
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


def _check_bad(bad: torch.Tensor, loss: torch.Tensor, sampled: bool, n_classes: int) -> torch.Tensor:
    """Raise on the CPU; on an accelerator poison the loss with NaN (no host sync)."""
    what = ("a target missing from `candidates` (build them with CandidateSampler, which "
            "includes every target)" if sampled else f"a target outside [0, {n_classes})")
    if bad.device.type == "cpu":
        if bool(bad):
            raise ValueError(f"lm_head_loss: {what}")
        return loss
    return loss + torch.where(bad, float("nan"), 0.0)


# ---------------------------------------------------------------------------------------
# The fused linear + softcapped cross-entropy
# ---------------------------------------------------------------------------------------


def default_chunk_rows(n_rows: int, n_cols: int, device: torch.device | str = "cuda") -> int:
    """Rows per chunk of the fused path: about ``GPU_CHUNK_ELEMENTS`` logits (CPU: fewer)
    at once, spread evenly over the chunks and rounded up to ``CHUNK_ROW_MULTIPLE``."""
    budget = GPU_CHUNK_ELEMENTS if torch.device(device).type != "cpu" else CPU_CHUNK_ELEMENTS
    n_chunks = max(1, math.ceil(n_rows * max(n_cols, 1) / budget))
    rows = math.ceil(n_rows / n_chunks)
    rows = math.ceil(rows / CHUNK_ROW_MULTIPLE) * CHUNK_ROW_MULTIPLE
    return max(1, min(rows, n_rows))


class _FusedLinearSoftcapCE(torch.autograd.Function):
    """Fused linear cross-entropy: the gradients are formed in the forward, chunk by chunk,
    so no ``[N, P]`` logit tensor ever exists; backward only scales them by grad_output."""

    @staticmethod
    def forward(ctx, hidden, weight, candidates, tpos, tw, head, rows_fn, chunk_rows,
                compute_dtype, need_dx, need_dw):
        n, d = hidden.shape
        w = head.prepare(weight, candidates, compute_dtype)
        x_all = hidden.to(compute_dtype)
        write = need_dx or need_dw
        loss_rows = torch.empty(n, dtype=torch.float32, device=hidden.device)
        dx = torch.empty(n, d, dtype=compute_dtype, device=hidden.device) if need_dx else None
        dw = None
        for r0 in range(0, n, chunk_rows):
            r1 = min(n, r0 + chunk_rows)
            x = x_all[r0:r1]
            logits, logit_scale = head.logits(x, w)
            grad, grad_div = head.grad_buffer(logits) if write else (None, 1.0)
            rows_fn(logits, logit_scale, grad, 1.0 / (n * grad_div), tpos[r0:r1], tw, loss_rows[r0:r1])
            if need_dx:
                head.grad_input(grad, grad_div, w, dx[r0:r1])
            if need_dw:
                dw = head.grad_weight(grad, grad_div, x, dw)
            del logits, grad
        ctx.save_for_backward(dx, dw, candidates)
        ctx.hidden_dtype = hidden.dtype
        ctx.weight_meta = (weight.shape, weight.dtype)
        return loss_rows.sum() / n

    @staticmethod
    def backward(ctx, grad_out):
        dx, dw, candidates = ctx.saved_tensors
        g_hidden = g_weight = None
        if dx is not None:
            g_hidden = (dx * grad_out).to(ctx.hidden_dtype)
        if dw is not None:
            shape, dtype = ctx.weight_meta
            dw = (dw * grad_out).to(dtype)
            if candidates is None:
                g_weight = dw
            else:
                # Dense [V, D] with zeros off the candidate rows, so any optimizer takes it.
                g_weight = torch.zeros(shape, dtype=dtype, device=dw.device).index_copy_(0, candidates, dw)
        return g_hidden, g_weight, None, None, None, None, None, None, None, None, None


def _compute_dtype(hidden: torch.Tensor) -> torch.dtype:
    dev = hidden.device.type
    if torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return hidden.dtype


@torch.compiler.disable
def _fused_loss(hidden, weight, targets, candidates, mtp_weights, prefix_targets, prefix_weight,
                rows_fn, head, chunk_rows):
    n_classes = weight.shape[0]
    tpos, tw, _, bad = _term_table(targets, n_classes, candidates, mtp_weights, prefix_targets,
                                   prefix_weight)
    p = n_classes if candidates is None else candidates.numel()
    rows = chunk_rows or default_chunk_rows(hidden.shape[0], p, hidden.device)
    grad_on = torch.is_grad_enabled()
    need_dx = grad_on and hidden.requires_grad
    need_dw = grad_on and weight.requires_grad
    # Under autocast the GEMMs run in its dtype; inside, autocast is off so nothing else recasts.
    compute_dtype = _compute_dtype(hidden)
    with torch.autocast(hidden.device.type, enabled=False):
        loss = _FusedLinearSoftcapCE.apply(hidden, weight, candidates, tpos, tw, head, rows_fn,
                                           rows, compute_dtype, need_dx, need_dw)
    return _check_bad(bad, loss, candidates is not None, n_classes)


def _reference_loss(hidden, weight, targets, candidates, mtp_weights, prefix_targets, prefix_weight):
    n_classes = weight.shape[0]
    tpos, tw, n_terms, bad = _term_table(targets, n_classes, candidates, mtp_weights,
                                         prefix_targets, prefix_weight)
    with torch.autocast(hidden.device.type, enabled=False):
        w = weight if candidates is None else weight.index_select(0, candidates)
        logits = hidden.float() @ w.float().t()
        logp = torch.log_softmax(softcap(logits), dim=-1)
        loss = logits.new_zeros(())
        for j in range(n_terms):
            live = tpos[:, j] >= 0
            nll = -logp.gather(1, tpos[:, j].clamp(min=0).long()[:, None])[:, 0]
            loss = loss + tw[j] * torch.where(live, nll, 0.0).sum()
        loss = loss / hidden.shape[0]
    return _check_bad(bad, loss, candidates is not None, n_classes)


def lm_head_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    candidates: Optional[torch.Tensor] = None,
    mtp_weights: Union[Sequence[float], torch.Tensor] = (1.0,),
    prefix_targets: Optional[torch.Tensor] = None,
    prefix_weight: float = 0.0,
    backend: str = "auto",
    head: Optional[HeadMatmul] = None,
    chunk_rows: Optional[int] = None,
) -> torch.Tensor:
    """Training loss of the lm_head: softcapped cross-entropy, full or sampled (RECORD §2, §6).

    ``loss = (Σ_t Σ_k w_k·CE_t(targets[t+k]) + w_p·Σ_t CE_t(prefix_targets[t])) / N`` with
    ``CE_t(y) = LSE_t − z_t[y]``, ``z = softcap(hidden @ weightᵀ)`` and the LSE taken over
    the candidate classes (all ``V`` when ``candidates`` is None).

    - Multi-token prediction: ``targets[t+k]`` is the target ``k`` positions ahead in the
      packed micro-batch. Terms past the micro-batch end are dropped; document ends are
      *not* masked, as in the record (RECORD §2, §15.6), so near a document end row t also
      predicts the first tokens of the next document.
    - Prefix loss: ``prefix_targets[t]`` (usually ``prefix_table[targets[t]]``, see
      :func:`build_prefix_table`) = -1 means no term; on the sampled path a prefix target
      that is not among the candidates has its term skipped (RECORD §6).
    - The denominator is N whatever terms were dropped. The gradient is the exact
      gradient of this loss: the softmax weight ``S_w`` of a row counts only its live
      terms (the record's kernel also counts MTP weights past the batch end, RECORD §15.6;
      that touches only the last K−1 rows of a micro-batch).

    Sampled softmax (``candidates`` given): sorted, duplicate-free int64 class ids that
    include every target (:class:`CandidateSampler` builds them). Logits are computed only
    for those rows of ``weight``, forward and backward; the gradient returned for ``weight``
    is dense ``[V, D]`` and zero off the candidate rows, so ordinary optimizers work.

    No logQ correction (RECORD §6, as the record): the sampled logits are used raw. The
    classes of C are not sampled with equal probability (every target is in C with
    probability 1, a negative with about ``(P − U)/(V − U)``), so the unbiased estimator
    would add ``log((V − U)/(P − U))`` to each negative's logit. Without it, ``LSE_C`` is
    smaller than the full ``LSE`` (the loss is a lower bound of the full CE) and each step
    pushes down only the classes in C: a class that is not among this batch's targets is
    suppressed at roughly ``(P − U)/(V − U)`` of its full-softmax rate, so rare tokens keep
    too much probability mass. The record accepts this bias: the frequent tokens that
    carry most of the loss are nearly always targets, and the final 87 steps train with
    the full softmax (RECORD §6 P schedule), which recalibrates the tail before the
    full-softmax validation.

    Args:
        hidden: ``[N, D]`` final hidden states (bf16 on GPU, fp32 on CPU).
        weight: ``[V, D]`` lm_head weight, row v = class v.
        targets: ``[N]`` int64 next-token targets.
        candidates: sorted unique class ids ``[P]`` (CPU or device); None = full softmax.
        mtp_weights: weight of the next-token term and of each further MTP term (schedule).
        prefix_targets: ``[N]`` int64 prefix-token target of each row, -1 = none.
        prefix_weight: weight of the prefix term (0 switches it off).
        backend: ``"reference"`` (plain PyTorch autograd, fp32 softmax over the gathered
            logits; memory grows with N·P), ``"chunked"`` (the fused algorithm, row math in
            PyTorch; any device), ``"triton"`` (the fused Triton kernel; CUDA, or the CPU
            interpreter with ``TRITON_INTERPRET=1``), ``"auto"`` (triton on CUDA, reference
            otherwise).
        head: how the fused path runs its GEMMs (:class:`HeadMatmul`); default
            :class:`TorchHeadMatmul`. The reference backend ignores it.
        chunk_rows: rows per chunk of the fused path; default :func:`default_chunk_rows`.

    Returns:
        The scalar loss (fp32). On the CPU a target outside ``[0, V)`` or missing from
        ``candidates`` raises ``ValueError``; on a GPU it makes the loss NaN instead (no
        host synchronization).
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"lm_head_loss: hidden must be [N, D] and weight [V, D] with the same D; "
                         f"got {tuple(hidden.shape)} and {tuple(weight.shape)}")
    n, n_classes = hidden.shape[0], weight.shape[0]
    if targets.shape != (n,) or targets.is_floating_point():
        raise ValueError(f"lm_head_loss: targets must be integer [N] = [{n}]; got "
                         f"{tuple(targets.shape)} {targets.dtype}")
    if n == 0:
        raise ValueError("lm_head_loss: no rows (hidden has N = 0)")
    if prefix_targets is not None and (prefix_targets.shape != (n,) or prefix_targets.is_floating_point()):
        raise ValueError(f"lm_head_loss: prefix_targets must be integer [N] = [{n}]; got "
                         f"{tuple(prefix_targets.shape)} {prefix_targets.dtype}")
    if isinstance(mtp_weights, torch.Tensor):
        mtp_weights = [float(w) for w in mtp_weights.detach().cpu().tolist()]
    if len(mtp_weights) == 0:
        raise ValueError("lm_head_loss: mtp_weights needs at least the next-token weight, e.g. (1.0,)")
    if backend not in BACKENDS:
        raise ValueError(f"lm_head_loss: unknown backend {backend!r}; choose one of {BACKENDS}")
    if candidates is not None:
        candidates = _to_device(_check_candidates(candidates, n_classes), hidden.device)
    targets = _to_device(targets, hidden.device).long()
    if prefix_targets is not None:
        prefix_targets = _to_device(prefix_targets, hidden.device).long()

    if backend == "auto":
        backend = "triton" if hidden.is_cuda else "reference"
    if backend == "reference":
        return _reference_loss(hidden, weight, targets, candidates, mtp_weights, prefix_targets,
                               prefix_weight)
    if backend == "triton":
        if not hidden.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError(
                "lm_head_loss: backend='triton' needs a CUDA device (hidden is on "
                f"{hidden.device}); use backend='reference' or 'chunked' on the CPU, or set "
                "TRITON_INTERPRET=1 before importing triton to run the kernel in the interpreter")
        rows_fn: Callable = _triton_rows
    else:
        rows_fn = _torch_rows
    return _fused_loss(hidden, weight, targets, candidates, mtp_weights, prefix_targets,
                       prefix_weight, rows_fn, head or _DEFAULT_HEAD, chunk_rows)


def _check_candidates(candidates: torch.Tensor, n_classes: int) -> torch.Tensor:
    if candidates.dim() != 1 or candidates.is_floating_point() or candidates.numel() == 0:
        raise ValueError(f"lm_head_loss: candidates must be a non-empty 1-D integer tensor; got "
                         f"{tuple(candidates.shape)} {candidates.dtype}")
    if candidates.numel() > n_classes:
        raise ValueError(f"lm_head_loss: {candidates.numel()} candidates for {n_classes} classes")
    candidates = candidates.long()
    if candidates.device.type == "cpu":
        # Cheap on the host; a device copy is trusted (checking it would need a sync).
        if bool((candidates[1:] <= candidates[:-1]).any()):
            raise ValueError("lm_head_loss: candidates must be sorted ascending without duplicates "
                             "(CandidateSampler.build returns them so)")
        if int(candidates[0]) < 0 or int(candidates[-1]) >= n_classes:
            raise ValueError(f"lm_head_loss: candidate ids must lie in [0, {n_classes})")
    return candidates


# ---------------------------------------------------------------------------------------
# Validation loss
# ---------------------------------------------------------------------------------------


def full_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    chunk_rows: Optional[int] = None,
) -> torch.Tensor:
    """Mean full-vocabulary softcapped cross-entropy, the validation metric (RECORD §12).

    As the record: logits and softcap in the hidden dtype (bf16 on GPU), cross-entropy in
    fp32, no MTP or prefix term, never sampled. Rows are processed in chunks (the record
    used slabs of 32,768 rows; the default here keeps about ``GPU_CHUNK_ELEMENTS`` logits at
    once) so a 262,144-row validation batch stays within a few GB.

    Args:
        hidden: ``[N, D]`` final hidden states.
        weight: ``[V, D]`` lm_head weight.
        targets: ``[N]`` int64 targets.
        chunk_rows: rows per chunk; default from the logit budget of the device.
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"full_cross_entropy: hidden [N, D] and weight [V, D] disagree: "
                         f"{tuple(hidden.shape)} vs {tuple(weight.shape)}")
    n = hidden.shape[0]
    if targets.shape != (n,):
        raise ValueError(f"full_cross_entropy: targets must be [{n}]; got {tuple(targets.shape)}")
    targets = targets.to(hidden.device).long()
    rows = chunk_rows or default_chunk_rows(n, weight.shape[0], hidden.device)
    with torch.autocast(hidden.device.type, enabled=False):
        w = weight.to(hidden.dtype)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for r0 in range(0, n, rows):
            z = softcap(hidden[r0:r0 + rows] @ w.t())
            total = total + F.cross_entropy(z.float(), targets[r0:r0 + rows], reduction="sum")
    return total / n


# ---------------------------------------------------------------------------------------
# Candidate set
# ---------------------------------------------------------------------------------------


class CandidateSampler:
    """Builds the sampled-softmax candidate set of one micro-batch (RECORD §6).

    ``C`` = every class among the targets (and ``extra``), plus duplicate-free negatives
    from the stride sweep ``perm[k] = stride·k mod V`` to exactly ``num_candidates`` classes,
    sorted ascending. Each rank starts the sweep at offset ``V·rank/world_size``; every call
    that needs negatives takes the next window of ``min(V, ⌊1.7·need⌋ + 256)`` entries,
    advances the offset by that length (wrapping), drops the classes already in ``C``, and
    if fewer than ``need`` remain fills the gap with evenly spaced free classes. The padded
    ids (50,257..50,303) are ordinary negatives, as in the record (RECORD §15.6).

    Runs on the host in numpy (about 0.1 ms for 49,152 targets): pass the loader's CPU copy
    of the targets so no device sync is needed, and move the result to the GPU with the batch.

    Args:
        vocab_size: number of classes V (the lm_head rows).
        rank: this process's rank.
        world_size: number of ranks.
        stride: the sweep stride, coprime to ``vocab_size``.
        multiple: ``num_candidates`` must be a multiple of this (RECORD §6: 2048).
    """

    def __init__(self, vocab_size: int = PADDED_VOCAB, rank: int = 0, world_size: int = 1,
                 stride: int = SAMPLER_STRIDE, multiple: int = CANDIDATE_MULTIPLE) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"CandidateSampler: rank {rank} is not in [0, world_size={world_size})")
        if math.gcd(stride, vocab_size) != 1:
            raise ValueError(f"CandidateSampler: stride {stride} must be coprime to vocab_size "
                             f"{vocab_size} for a duplicate-free sweep")
        self.vocab_size = vocab_size
        self.rank = rank
        self.world_size = world_size
        self.stride = stride
        self.multiple = multiple
        one = (stride * np.arange(vocab_size, dtype=np.int64)) % vocab_size
        # Doubled so any window of the sweep is one contiguous slice.
        self._perm = np.concatenate((one, one))
        self._mark = np.zeros(vocab_size, dtype=bool)
        self.offset = (vocab_size * rank) // world_size

    def _check_count(self, num_candidates: int) -> None:
        if num_candidates == self.vocab_size:
            return
        if num_candidates <= 0 or num_candidates % self.multiple or num_candidates > self.vocab_size:
            raise ValueError(
                f"sampled-softmax candidate count {num_candidates} must be a positive multiple of "
                f"{self.multiple} below the vocabulary ({self.vocab_size}), or the full vocabulary; "
                f"fix schedule.stages[*].candidates (RECORD §6 uses 10240, 14336, 24576, then null)")

    def build(self, targets: Union[torch.Tensor, np.ndarray], num_candidates: int,
              extra: Union[torch.Tensor, np.ndarray, None] = None) -> torch.Tensor:
        """The sorted, duplicate-free candidate ids of one micro-batch.

        Args:
            targets: the micro-batch's targets (any shape; a CPU copy avoids a device sync).
                MTP targets are the same array shifted, so they are covered.
            num_candidates: P, a multiple of 2048 (or the full vocabulary).
            extra: further classes to force in (e.g. prefix targets); negatives are ignored.

        Returns:
            CPU int64 tensor of exactly ``num_candidates`` ids, ascending, containing every
            target and every ``extra`` class.
        """
        self._check_count(num_candidates)
        V = self.vocab_size
        if num_candidates == V:
            return torch.arange(V, dtype=torch.int64)
        mark = self._mark
        mark.fill(False)
        t = _as_numpy(targets).reshape(-1)
        if t.size and (t.min() < 0 or t.max() >= V):
            raise ValueError(f"CandidateSampler: targets must lie in [0, {V}); got "
                             f"[{t.min()}, {t.max()}]")
        mark[t] = True
        if extra is not None:
            e = _as_numpy(extra).reshape(-1)
            e = e[(e >= 0) & (e < V)]
            mark[e] = True
        unique = int(np.count_nonzero(mark))
        if unique > num_candidates:
            raise ValueError(
                f"sampled softmax: the micro-batch has {unique} distinct targets, more than the "
                f"{num_candidates} candidates; raise schedule.stages[*].candidates (a multiple of "
                f"{self.multiple}) or shorten the micro-batch")
        need = num_candidates - unique
        if need:
            draw = min(V, int(need * SAMPLER_DRAW_FACTOR) + SAMPLER_DRAW_EXTRA)
            window = self._perm[self.offset:self.offset + draw]
            self.offset = (self.offset + draw) % V
            window = window[~mark[window]]
            if window.size >= need:
                mark[window[:need]] = True
            else:
                free = np.flatnonzero(~mark)
                mark[free[:: max(1, free.size // need)][:need]] = True
        return torch.from_numpy(np.flatnonzero(mark))

    def state_dict(self) -> dict:
        """This rank's sweep position (save one per rank for an exact resume)."""
        return {"offset": int(self.offset), "rank": self.rank, "world_size": self.world_size,
                "vocab_size": self.vocab_size, "stride": self.stride}

    def load_state_dict(self, state: Union[dict, Sequence[dict]]) -> None:
        """Restore the sweep position: one rank's ``state_dict()``, or a list of them (one per
        rank, as gathered for a checkpoint) from which this rank's entry is taken."""
        if not isinstance(state, dict):
            states = list(state)
            if len(states) != self.world_size:
                raise ValueError(f"CandidateSampler: checkpoint holds {len(states)} ranks' states, "
                                 f"this run has world_size {self.world_size}")
            state = states[self.rank]
        if state.get("vocab_size") != self.vocab_size or state.get("stride") != self.stride:
            raise ValueError(f"CandidateSampler: checkpoint was built for vocab_size "
                             f"{state.get('vocab_size')} / stride {state.get('stride')}, this run "
                             f"uses {self.vocab_size} / {self.stride}")
        self.offset = int(state["offset"]) % self.vocab_size


def _as_numpy(x: Union[torch.Tensor, np.ndarray]) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().to("cpu", torch.int64).numpy()
    return np.asarray(x, dtype=np.int64)


# ---------------------------------------------------------------------------------------
# Prefix-token table
# ---------------------------------------------------------------------------------------


def _token_bytes(encoding) -> dict[int, bytes]:
    """Bytes of every ordinary (non-special) token of a tiktoken encoding."""
    ranks = getattr(encoding, "_mergeable_ranks", None)
    if isinstance(ranks, dict) and ranks:
        return {int(i): bytes(b) for b, i in ranks.items()}
    # tiktoken without the private attribute: decode each id, skipping the special ones.
    special = {encoding.encode_single_token(name) for name in getattr(encoding, "special_tokens_set", ())}
    out = {}
    for i in range(encoding.n_vocab):
        if i in special:
            continue
        try:
            out[i] = encoding.decode_single_token_bytes(i)
        except KeyError:
            continue
    return out


def build_prefix_table(encoding=None, vocab_size: int = PADDED_VOCAB) -> torch.Tensor:
    """For every token id, the token whose bytes are its longest proper byte-prefix, else -1.

    The prefix-token auxiliary loss (RECORD §2) predicts ``table[target]``. Single-byte
    tokens, special tokens (50256) and the padded ids up to ``vocab_size`` map to -1.

    Args:
        encoding: a tiktoken ``Encoding``; default GPT-2's (``nanogpt_pl.data.tokenizer``).
        vocab_size: length of the table (the padded vocabulary).

    Returns:
        CPU int64 tensor ``[vocab_size]``.
    """
    if encoding is None:
        from nanogpt_pl.data.tokenizer import get_encoding

        encoding = get_encoding()
    tok_bytes = _token_bytes(encoding)
    if tok_bytes and max(tok_bytes) >= vocab_size:
        raise ValueError(f"build_prefix_table: the encoding has token id {max(tok_bytes)} >= "
                         f"vocab_size {vocab_size}")
    by_bytes = {b: i for i, b in tok_bytes.items()}
    table = np.full(vocab_size, -1, dtype=np.int64)
    for i, b in tok_bytes.items():
        for cut in range(len(b) - 1, 0, -1):
            j = by_bytes.get(b[:cut])
            if j is not None:
                table[i] = j
                break
    return torch.from_numpy(table)
