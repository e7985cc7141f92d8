"""The lm_head loss: softcapped cross-entropy, full or sampled, fused or plain.

The record (RECORD §6) trains most steps with a *sampled* softmax: one candidate set ``C``
of ``P`` classes per micro-batch (every target plus duplicate-free negatives, built by
:class:`nanogpt_pl.ops.sampling.CandidateSampler`), logits are computed only for the rows
of the lm_head weight in ``C`` (forward and backward), and a fused kernel computes the
softcap, the log-sum-exp, the loss and the logit gradient in one pass. Validation always
uses the full 50,304-way softmax.

Pieces, each with a plain PyTorch reference next to the fast path:

- :func:`softcap` — ``z = 23·σ((ℓ + 5)/7.5)`` (RECORD §2), which equals
  ``11.5·(1 + tanh((ℓ + 5)/15))``: a tanh softcap shifted by 5 and lifted into ``(0, 23)``.
- :func:`lm_head_loss` — the training loss, backends ``"reference"`` (autograd on fp32
  logits), ``"chunked"`` (the fused algorithm with the row math in PyTorch, any device),
  ``"triton"`` (the fused algorithm with the Triton row kernel) and ``"triton_held"`` (the same,
  the kernel keeping a sampled row's gradient factors in registers between its passes).
- :func:`softcap_ce_rows_reference` — the PyTorch twin of the Triton row kernel.
- :func:`full_cross_entropy` — validation loss, full vocabulary, row-chunked.

The fused path's chunked GEMMs, and the :class:`~nanogpt_pl.ops.lm_head.HeadMatmul` hook
the FP8 lm_head (RECORD §7) plugs into, are in :mod:`nanogpt_pl.ops.lm_head`.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence, Union

import torch
import torch.nn.functional as F

from .lm_head import FusedLinearLoss, HeadMatmul, TorchHeadMatmul, default_chunk_rows
from .triton import interpret_mode

__all__ = [
    "SOFTCAP_MAX",
    "SOFTCAP_SHIFT",
    "SOFTCAP_WIDTH",
    "BACKENDS",
    "TRITON_BACKENDS",
    "auto_backend",
    "check_backend",
    "softcap",
    "softcap_ce_rows_reference",
    "lm_head_loss",
    "full_cross_entropy",
]

# RECORD §2 "Head and loss": z = 23·σ((ℓ + 5)/7.5). SOFTCAP_MAX is also the fixed maximum
# of the log-sum-exp (RECORD §6), since z < 23 for every logit.
SOFTCAP_MAX = 23.0
SOFTCAP_SHIFT = 5.0
SOFTCAP_WIDTH = 7.5

# The choices of `model.backends.loss`; "reference" is the plain-PyTorch path.
BACKENDS = ("auto", "reference", "chunked", "triton", "triton_held")
# The choices that run the Triton row kernel (CUDA, or the interpreter on the CPU).
TRITON_BACKENDS = ("triton", "triton_held")

_DEFAULT_HEAD = TorchHeadMatmul()


def softcap(logits: torch.Tensor) -> torch.Tensor:
    """The record's logit softcap ``z = 23·σ((ℓ + 5)/7.5)`` in the input's dtype (RECORD §2).

    Maps every logit into ``(0, 23)``; equal to ``11.5·(1 + tanh((ℓ + 5)/15))``.
    """
    return SOFTCAP_MAX * torch.sigmoid((logits + SOFTCAP_SHIFT) * (1.0 / SOFTCAP_WIDTH))


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


def _triton_rows(logits, logit_scale, grad, grad_scale, tpos, term_weights, loss_out, hold: bool = False) -> None:
    from .triton.cross_entropy import softcap_ce_rows  # imports triton: the fast path only

    softcap_ce_rows(logits, logit_scale, grad, grad_scale, tpos, term_weights, loss_out,
                    cap=SOFTCAP_MAX, shift=SOFTCAP_SHIFT, width=SOFTCAP_WIDTH, hold=hold)


def _triton_held_rows(logits, logit_scale, grad, grad_scale, tpos, term_weights, loss_out) -> None:
    """The ``"triton_held"`` backend: rows that fit keep their gradient factors in registers."""
    _triton_rows(logits, logit_scale, grad, grad_scale, tpos, term_weights, loss_out, hold=True)


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
    weights = [] if isinstance(mtp_weights, torch.Tensor) else [float(w) for w in mtp_weights]
    if use_prefix:
        pf = prefix_targets
        bad = bad | (pf >= n_classes).any()
        pf_ok = (pf >= 0) & (pf < n_classes)
        pf_c = pf.clamp(0, n_classes - 1)
        pf_pos = pf_c.to(torch.int32) if pos_map is None else pos_map[pf_c]
        # RECORD §6: a prefix target absent from the candidates has its term skipped.
        tpos[:, k_mtp] = torch.where(pf_ok, pf_pos, -1)
        weights.append(float(prefix_weight))
    if isinstance(mtp_weights, torch.Tensor):
        # MTP weights as a device tensor (a CUDA graph's input, nanogpt_pl/capture.py): no host
        # copy; the prefix weight is a fill (its value is part of the graph's key)
        tail = torch.zeros(width - k_mtp, dtype=torch.float32, device=device)
        if use_prefix:
            tail[:1].fill_(float(prefix_weight))
        return tpos, torch.cat([mtp_weights.to(device=device, dtype=torch.float32), tail]), n_terms, bad
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
# The loss: fused (chunked GEMMs, nanogpt_pl.ops.lm_head) and reference
# ---------------------------------------------------------------------------------------


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
        loss = FusedLinearLoss.apply(hidden, weight, candidates, tpos, tw, head, rows_fn,
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


def check_backend(backend: str) -> None:
    """Raise a one-line error naming ``model.backends.loss`` unless ``backend`` is one of ``BACKENDS``."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r} of the lm_head loss: model.backends.loss (lm_head_loss's "
                         f"backend) takes one of {', '.join(BACKENDS)}")


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
      :func:`nanogpt_pl.data.tokenizer.build_prefix_table`) = -1 means no term; on the
      sampled path a prefix target that is not among the candidates has its term skipped
      (RECORD §6).
    - The denominator is N whatever terms were dropped. The gradient is the exact
      gradient of this loss: the softmax weight ``S_w`` of a row counts only its live
      terms (the record's kernel also counts MTP weights past the batch end, RECORD §15.6;
      that touches only the last K−1 rows of a micro-batch).

    Sampled softmax (``candidates`` given): sorted, duplicate-free int64 class ids that
    include every target (:class:`~nanogpt_pl.ops.sampling.CandidateSampler` builds them).
    Logits are computed only for those rows of ``weight``, forward and backward; the
    gradient returned for ``weight`` is dense ``[V, D]`` and zero off the candidate rows,
    so ordinary optimizers work.

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
        mtp_weights: weight of the next-token term and of each further MTP term (schedule); a
            1-D tensor (on the device) is read there, without a host round trip.
        prefix_targets: ``[N]`` int64 prefix-token target of each row, -1 = none.
        prefix_weight: weight of the prefix term (0 switches it off).
        backend: ``"reference"`` (plain PyTorch autograd, fp32 softmax over the gathered
            logits; memory grows with N·P), ``"chunked"`` (the fused algorithm, row math in
            PyTorch; any device), ``"triton"`` (the fused Triton kernel; CUDA, or the CPU
            interpreter with ``TRITON_INTERPRET=1``), ``"triton_held"`` (the same kernel keeping
            a sampled row's gradient factors in registers between its two passes: 1.8x faster
            alone at 10,240 candidates on an H100), ``"auto"`` (:func:`auto_backend`: triton_held on
            CUDA, chunked otherwise: on a CPU the chunked path's cache-sized chunks ran the
            quickstart's step 1.12x faster than the reference, BENCHMARKS.md "Quickstart (CPU)").
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
        if mtp_weights.dim() != 1:
            raise ValueError(f"lm_head_loss: mtp_weights must be 1-D; got shape {tuple(mtp_weights.shape)}")
        mtp_weights = mtp_weights.detach()  # read on the device: no host sync
    if len(mtp_weights) == 0:
        raise ValueError("lm_head_loss: mtp_weights needs at least the next-token weight, e.g. (1.0,)")
    check_backend(backend)
    if candidates is not None:
        candidates = _to_device(_check_candidates(candidates, n_classes), hidden.device)
    targets = _to_device(targets, hidden.device).long()
    if prefix_targets is not None:
        prefix_targets = _to_device(prefix_targets, hidden.device).long()

    if backend == "auto":
        backend = auto_backend(hidden.device)
    if backend == "reference":
        return _reference_loss(hidden, weight, targets, candidates, mtp_weights, prefix_targets,
                               prefix_weight)
    if backend in TRITON_BACKENDS:
        if not hidden.is_cuda and not interpret_mode():
            raise RuntimeError(
                f"lm_head_loss: backend={backend!r} needs a CUDA device (hidden is on "
                f"{hidden.device}); use backend='reference' or 'chunked' on the CPU, or set "
                "TRITON_INTERPRET=1 before importing triton to run the kernel in the interpreter")
        rows_fn: Callable = _triton_held_rows if backend == "triton_held" else _triton_rows
    else:
        rows_fn = _torch_rows
    return _fused_loss(hidden, weight, targets, candidates, mtp_weights, prefix_targets,
                       prefix_weight, rows_fn, head or _DEFAULT_HEAD, chunk_rows)


def auto_backend(device: Union[torch.device, str]) -> str:
    """What ``backend="auto"`` runs on ``device``: ``"triton_held"`` on CUDA (1.012x / 1.019x the
    streamed kernel's stage-1 / stage-2 step on an H100, BENCHMARKS.md session 11), ``"chunked"``
    elsewhere (the CPU's fastest, BENCHMARKS.md "Quickstart (CPU)")."""
    return "triton_held" if torch.device(device).type == "cuda" else "chunked"


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
    used slabs of 32,768 rows; the default here keeps about ``lm_head.GPU_CHUNK_ELEMENTS`` logits at
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
