"""FP8 lm_head GEMMs for the fused softcapped cross-entropy (RECORD §7 "lm_head", §6)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Optional

import torch
from torch import Tensor, nn

from .backends import check_aligned, round_up
from .formats import E4M3, E5M2, HEAD_GRAD_SCALE, HEAD_W_SCALE, HEAD_X_SCALE
from .linear import Fp8LinearState


@dataclass
class _HeadOperands:
    rows: Tensor  # [P, D] e4m3: the candidate rows of the weight cache (all V rows when full)
    cols: Tensor  # [D, P] e4m3: the same rows transposed (the dgrad GEMM's operand)


class Fp8Head(nn.Module):
    """FP8 lm_head GEMMs for ``lm_head_loss(..., head=...)`` (the ``HeadMatmul`` protocol of
    ``nanogpt_pl.ops.cross_entropy``), RECORD §7 "lm_head" and §6.

    Per chunk of rows ``x`` [R, D]: ``x`` is quantized to e4m3 at the static scale 100/448
    (clip-free for RMSNorm outputs, |x| <= 27.7) in both layouts; the logits GEMM runs
    against the e4m3 weight cache (static scale 2/448, rebuilt only when the weight changed,
    i.e. after the lm_head's Adam steps) gathered to the candidate rows, with fast
    accumulation, and writes raw logits as e4m3 (saturating at ±448, as the record) or
    bf16; the loss kernel writes ``dL/dℓ`` as e5m2 at the divisor ``grad_div``; then
    ``dx = G·W_C`` and ``dW_C = Gᵀ·x`` run in FP8 with ``use_fast_accum=False``.

    Gradient scale: the record's ``(0.75/8)/448`` is calibrated for a loss that *sums* the
    rows (RECORD §1), where |dL/dℓ| <= 23/7.5·¼·S_w. A loss that averages over N rows
    (``lm_head_loss`` does) makes each gradient N times smaller: set ``loss_rows = N``
    before the loss call (or pass ``n_rows=N`` to ``prepare``) and the divisor shrinks by N,
    so the stored e5m2 values keep the record's range. Left at None, most of a mean loss's
    logit gradients underflow.

    Args:
        backend: ``"auto"``, ``"reference"`` or ``"scaled_mm"``.
        logits_dtype: ``"e4m3"`` (the record) or ``"bf16"``.
        x_scale, weight_scale, grad_scale: the static scales (defaults: RECORD §7).
        loss_rows: rows the loss averages over (None: the loss sums its rows); may be
            reassigned before every loss call.
        config_key: the config option that switched the head to FP8, named in errors.
    """

    def __init__(self, backend: str = "auto", logits_dtype: Literal["e4m3", "bf16"] = "e4m3",
                 x_scale: float = HEAD_X_SCALE, weight_scale: float = HEAD_W_SCALE,
                 grad_scale: float = HEAD_GRAD_SCALE, loss_rows: Optional[int] = None,
                 config_key: str = "model.gpt.fp8_head") -> None:
        super().__init__()
        if logits_dtype not in ("e4m3", "bf16"):
            raise ValueError(f"{config_key}: logits_dtype must be 'e4m3' or 'bf16', got {logits_dtype!r}")
        self.state = Fp8LinearState(x_scale=x_scale, weight_scale=weight_scale, grad_dtype="e5m2",
                                    grad_scale=grad_scale, backend=backend, config_key=config_key)
        self.logits_dtype = E4M3 if logits_dtype == "e4m3" else torch.bfloat16
        # Host copy of the gradient scale: the protocol hands the divisor out as a float,
        # and reading the buffer would synchronize with the GPU every micro-batch.
        self.grad_s = float(grad_scale)
        self.loss_rows = loss_rows
        self._grad_div = self.grad_s
        self._kern: Any = None
        self._g_scale: Optional[Tensor] = None  # device copy of the gradient's dequantization scale
        self._chunk: Optional[tuple] = None  # (x, xt, grad view, padded grad) of the current chunk
        self._one: Optional[Tensor] = None

    def prepare(self, weight: Tensor, candidates: Optional[Tensor], dtype: torch.dtype,
                n_rows: Optional[int] = None) -> _HeadOperands:
        """The e4m3 weight rows of this step (all, or the ``candidates``) in both layouts.

        ``n_rows``: the N a mean-reduced loss divides by (default: ``self.loss_rows``).
        """
        st = self.state
        kern = st._kernels(weight.device)
        check_aligned(kern, st.config_key, *weight.shape)
        if candidates is not None and candidates.numel() % kern.row_align:
            raise ValueError(f"{st.config_key}: the candidate count {candidates.numel()} must be a multiple "
                             f"of {kern.row_align} for FP8 GEMMs")
        cache = st.cache_for((weight,), kern)
        self._kern = kern
        self._chunk = None  # the last chunk of the previous call, if its weight gradient was not asked for
        n_rows = n_rows if n_rows is not None else self.loss_rows
        self._grad_div = self.grad_s / n_rows if n_rows else self.grad_s
        self._g_scale = st.grad_scale / n_rows if n_rows else st.grad_scale
        if candidates is None:
            return _HeadOperands(cache.row, cache.col)
        idx = candidates.to(weight.device)
        rows = cache.row.view(torch.uint8).index_select(0, idx).view(E4M3)
        cols = rows.t() if kern.name == "reference" else self._transpose(rows)
        return _HeadOperands(rows, cols)

    def _transpose(self, q: Tensor) -> Tensor:
        """Contiguous transpose of an fp8 matrix (exact: a scale-1 requantization)."""
        from ..triton.fp8_quant import quantize_dual  # imports triton: the fast path only

        if self._one is None or self._one.device != q.device:
            self._one = torch.ones((), dtype=torch.float32, device=q.device)
        _, t, _ = quantize_dual(q, self._one, q.dtype, write_row=False, write_t=True)
        return t

    def logits(self, x: Tensor, w: _HeadOperands) -> tuple[Tensor, float]:
        st, kern = self.state, self._kern
        r = x.shape[0]
        rows = round_up(r, kern.row_align)
        with torch.autocast(x.device.type, enabled=False):
            xq, xt = kern.quant(x, st._x_inv, E4M3, rows)
            logits = kern.mm(xq, w.rows, st.x_scale, st.w_scale, self.logits_dtype, True)
        self._chunk = (x, xt, None, None)
        return (logits[:r] if rows != r else logits), 1.0

    def grad_buffer(self, logits: Tensor) -> tuple[Tensor, float]:
        r, p = logits.shape
        rows = round_up(r, self._kern.row_align)
        full = torch.empty((rows, p), dtype=E5M2, device=logits.device)
        if rows != r:
            full[r:].view(torch.uint8).zero_()  # padding rows must not add to dW
        view = full[:r]
        x, xt = self._chunk[:2]
        self._chunk = (x, xt, view, full)
        return view, self._grad_div

    def _padded(self, grad: Tensor) -> Tensor:
        _, _, view, full = self._chunk
        if view is None or grad.data_ptr() != view.data_ptr() or grad.shape != view.shape:
            raise RuntimeError("Fp8Head: the gradient must be the buffer grad_buffer() returned for this chunk")
        return full

    def grad_input(self, grad: Tensor, grad_div: float, w: _HeadOperands, out: Tensor) -> None:
        kern = self._kern
        with torch.autocast(out.device.type, enabled=False):
            dx = kern.mm(self._padded(grad), w.cols, self._g_scale, self.state.w_scale, out.dtype, False)
        out.copy_(dx[:out.shape[0]])

    def grad_weight(self, grad: Tensor, grad_div: float, x: Tensor, acc: Optional[Tensor]) -> Tensor:
        st, kern = self.state, self._kern
        full = self._padded(grad)
        cx, xt = self._chunk[:2]
        if cx is not x:
            raise RuntimeError("Fp8Head: grad_weight must follow logits() of the same chunk")
        with torch.autocast(x.device.type, enabled=False):
            gt = full.t() if kern.name == "reference" else self._transpose(full)
            part = kern.mm(gt, xt, self._g_scale, st.x_scale, torch.float32, False)
        self._chunk = None
        if acc is None:
            return part
        return acc.add_(part)
