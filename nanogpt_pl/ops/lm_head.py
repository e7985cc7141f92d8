"""The lm_head's GEMMs, chunk by chunk: the fused path of the lm_head loss.

The vocabulary projection is about a third of the model's flops, and its ``[N, P]`` logits
would be the largest tensor of a step. :class:`FusedLinearLoss` runs it in chunks of rows
and forms both gradients in the forward; :class:`HeadMatmul` is how its GEMMs run, so the
FP8 lm_head (RECORD §7) plugs in beside the default :class:`TorchHeadMatmul`. The row loss
itself (the softcapped cross-entropy) lives in :mod:`nanogpt_pl.ops.cross_entropy`.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Protocol, runtime_checkable

import torch

from ..data.tokenizer import PADDED_VOCAB

__all__ = ["HeadMatmul", "TorchHeadMatmul", "FusedLinearLoss", "default_chunk_rows", "GPU_CHUNK_ELEMENTS"]

# Logits held at once by the fused path: ~8192 rows of the full vocabulary (0.82 GB in
# bf16). On an H200 a 8192 × 768 × 50,304 GEMM already fills all 132 SMs many times over,
# so larger chunks buy no GEMM efficiency, only memory; smaller ones add launches and
# re-read the weight once more per chunk. The chunk count is rounded up, then rows are
# spread evenly (49,152 rows: 6 chunks of 8,192 at P = 50,304, 2 of 24,576 at P = 10,240).
GPU_CHUNK_ELEMENTS = 8192 * PADDED_VOCAB
# On the CPU (fp32): 1 Mi logits = 4 MiB per chunk, which stays in the caches across the row
# math's passes. On a 2-core CPU the quickstart's training step (2,048 rows x 4,096 candidates a
# micro-batch, 256-row chunks) ran 1.12x faster than with the reference backend (same run), and in a
# single-round sweep 1,144 ms at this size against 1,258 / 1,344 ms at 2 / 4 Mi logits; its
# validation loss over 8,192 rows of the full vocabulary
# took 1.5-1.6 s in 128-row chunks against 3.7-3.9 s in the 1,280-row chunks of a 64 Mi budget
# (BENCHMARKS.md "Quickstart (CPU)").
CPU_CHUNK_ELEMENTS = 1 << 20
# Chunk rows are rounded to this multiple so GEMM row tiles stay whole.
CHUNK_ROW_MULTIPLE = 128


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


def default_chunk_rows(n_rows: int, n_cols: int, device: torch.device | str = "cuda") -> int:
    """Rows per chunk of the fused path: about ``GPU_CHUNK_ELEMENTS`` logits (CPU: fewer)
    at once, spread evenly over the chunks and rounded up to ``CHUNK_ROW_MULTIPLE``."""
    budget = GPU_CHUNK_ELEMENTS if torch.device(device).type != "cpu" else CPU_CHUNK_ELEMENTS
    n_chunks = max(1, math.ceil(n_rows * max(n_cols, 1) / budget))
    rows = math.ceil(n_rows / n_chunks)
    rows = math.ceil(rows / CHUNK_ROW_MULTIPLE) * CHUNK_ROW_MULTIPLE
    return max(1, min(rows, n_rows))


class FusedLinearLoss(torch.autograd.Function):
    """A linear layer fused with a row-wise loss: the gradients are formed in the forward,
    chunk by chunk, so no ``[N, P]`` logit tensor ever exists; backward only scales them by
    grad_output.

    ``rows_fn(logits, logit_scale, grad, grad_scale, tpos, term_weights, loss_out)`` is the
    loss of one chunk of rows: it writes each row's loss into ``loss_out`` and, when ``grad``
    is not None, ``grad_scale·dloss/dℓ`` into ``grad``. The result is the mean row loss.
    """

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
