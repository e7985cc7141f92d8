"""ANVIL's polar cascade: six quintic maps that push every singular value of a matrix to ~1.

Given an update direction ``G`` (the momentum blend of ANVIL), the cascade returns a
matrix with the same singular vectors and every singular value near one, i.e. an
approximation of the polar factor ``U·Vᵀ`` of ``G = U·Σ·Vᵀ``, in bf16. Steps
(RECORD.md §8, step 3):

1. Normalize: ``X = G / d`` with ``d = 1.05·‖G‖_F + 1e-6``. Every singular value of ``X``
   is then at most ``1/1.05``.
2. Six maps ``k = 1..6`` with coefficients ``(a, b, c)`` from :data:`ANVIL_MAPS`: with the
   Gram matrix ``A = X·Xᵀ`` (wide or square ``X``) ``X ← a·X + (b·A + c·A²)·X``; for tall ``X``
   the Gram is ``A = Xᵀ·X`` and the product is taken on the right, ``X ← a·X + X·(b·A + c·A²)``,
   so the Gram is always the smaller square. Each map sends every singular value
   ``σ → a·σ + b·σ³ + c·σ⁵``.

The Gram products and matmuls run in bf16 with fp32 accumulation, on Triton kernels
(``nanogpt_pl.ops.triton.polar``) on the GPU or on the PyTorch reference functions below.

One difference from the record's code: the record takes the trace of the bf16 Gram of the
bf16-rounded input to find ``‖X‖_F``; we take ``‖G‖_F`` in fp32 and round ``G/d`` to bf16
once. Both give the same ``d`` up to bf16 rounding, well inside the envelope's margin.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
from torch import Tensor

from ..ops.triton import triton_usable

# RECORD.md §8 step 3, "ANVIL_MAPS (final)" [L360@14k]: the (a, b, c) of each quintic map
# σ → a·σ + b·σ³ + c·σ⁵, applied in this order. The record's code says the schedule was
# re-derived for ANVIL rather than taken from the Polar Express paper (arXiv:2505.16932).
ANVIL_MAPS: tuple[tuple[float, float, float], ...] = (
    (3.923798038567, -6.095026865488, 3.905234618423),
    (3.278126713798, -3.328923386476, 0.989127286973),
    (3.505298394150, -5.137358782410, 1.968325560615),
    (2.815058591845, -3.685181239622, 1.417196497642),
    (2.245503932403, -2.443826979899, 0.963091710461),
    (2.256537145403, -2.166840097229, 0.929501253245),
)
# RECORD.md §8 step 3: d = 1.05·‖X‖_F + 1e-6.
NORM_MARGIN = 1.05
NORM_EPS = 1e-6
# RECORD.md §8 step 3: the composite map sends σ ∈ [3e-3, 1/1.05] into [0.99507, 1.00040],
# and its slope at zero (the "tail gain", ∏a) is 643.13.
ENVELOPE_SIGMA_MIN = 3e-3
ENVELOPE = (0.99507, 1.00040)
TAIL_GAIN = 643.13

# The choices of `model.backends.polar`; "reference" is the plain-PyTorch path.
BACKENDS = ("auto", "reference", "triton")


def composite_map(sigma: Tensor, maps: Sequence[tuple[float, float, float]] = ANVIL_MAPS) -> Tensor:
    """The scalar map σ → p₆(…p₁(σ)) the cascade applies to every singular value (exact arithmetic)."""
    s = sigma.double()
    for a, b, c in maps:
        s2 = s * s
        s = s * (a + s2 * (b + c * s2))
    return s


# -- PyTorch reference of the three kernels ----------------------------------------------
def gram_reference(x: Tensor, transpose: bool = False) -> Tensor:
    """``x·xᵀ`` or ``xᵀ·x`` in ``x``'s dtype (fp32 accumulation)."""
    return x.mT @ x if transpose else x @ x.mT


def poly_square_reference(a: Tensor, coef_b: float, coef_c: float) -> Tensor:
    """``coef_b·a + coef_c·a·a``."""
    if a.dim() == 2:
        return torch.addmm(a, a, a, beta=coef_b, alpha=coef_c)
    return torch.baddbmm(a, a, a, beta=coef_b, alpha=coef_c)


def matmul_add_reference(left: Tensor, right: Tensor, x: Tensor, coef_a: float) -> Tensor:
    """``coef_a·x + left·right``."""
    if x.dim() == 2:
        return torch.addmm(x, left, right, beta=coef_a)
    return torch.baddbmm(x, left, right, beta=coef_a)


def resolve_backend(backend: str, device: torch.device) -> str:
    """``reference`` or ``triton`` for ``backend`` on ``device``; raises for an impossible choice.

    ``auto`` picks PyTorch: on the H200 at the record's shapes the cuBLAS cascade beat the
    Triton kernels for 256x768 and 768x768 banks (0.80 vs 1.24 ms, 0.74 vs 1.46 ms;
    BENCHMARKS.md, benchmarks/optimizer_step.py). ``triton`` selects the kernels explicitly.
    """
    if backend not in BACKENDS:
        hint = " (the plain-PyTorch path is 'reference')" if backend == "torch" else ""
        raise ValueError(f"model.backends.polar={backend!r}{hint}: choose one of {', '.join(BACKENDS)}")
    if backend in ("reference", "auto"):
        return "reference"
    usable = triton_usable(device)
    if backend == "triton" and not usable:
        raise RuntimeError(
            f"model.backends.polar='triton' needs a CUDA device with Triton installed (or TRITON_INTERPRET=1 to "
            f"debug on CPU); the tensors are on {device}: use 'reference' or 'auto'"
        )
    return "triton" if usable else "reference"


def polar_cascade(
    g: Tensor,
    maps: Sequence[tuple[float, float, float]] = ANVIL_MAPS,
    backend: str = "auto",
    dtype: torch.dtype = torch.bfloat16,
) -> Tensor:
    """Normalize ``g`` and apply the cascade of quintic maps; returns a ``dtype`` tensor of ``g``'s shape.

    Args:
        g: a matrix ``[rows, cols]`` or a batch ``[..., rows, cols]``, any float dtype.
        maps: the (a, b, c) coefficients of each map, in order.
        backend: ``auto``, ``reference`` or ``triton`` (Triton needs CUDA, or ``TRITON_INTERPRET=1``).
        dtype: working dtype of the cascade: bf16 (the record) or fp32 (the PyTorch backend only;
            used to measure how much of the error is bf16 rounding).
    """
    if g.dim() < 2:
        raise ValueError(f"polar_cascade needs a matrix or a batch of matrices, got shape {tuple(g.shape)}")
    rows, cols = g.shape[-2:]
    lead = g.shape[:-2]
    x = g.reshape(-1, rows, cols)
    which = resolve_backend(backend, g.device)
    if dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"polar_cascade dtype must be torch.bfloat16 or torch.float32, got {dtype}")
    if which == "triton" and dtype != torch.bfloat16:
        if backend == "triton":
            raise ValueError("the Triton cascade runs in bf16 only; use backend='reference' for dtype=float32")
        which = "reference"
    if which == "triton":
        from ..ops.triton import polar as kernels  # Triton is optional: its kernels load only when chosen

        gram_fn, poly_fn, mm_fn = kernels.gram, kernels.poly_square, kernels.matmul_add
    else:
        gram_fn, poly_fn, mm_fn = gram_reference, poly_square_reference, matmul_add_reference

    xf = x.float()
    d = xf.square().sum(dim=(-2, -1), keepdim=True).sqrt_().mul_(NORM_MARGIN).add_(NORM_EPS)
    x = (xf / d).to(dtype)
    if x.shape[0] == 0:
        return x.reshape(*lead, rows, cols)
    tall = rows > cols
    for a, b, c in maps:
        gram_mat = gram_fn(x, transpose=tall)
        poly = poly_fn(gram_mat, b, c)
        x = mm_fn(x, poly, x, a) if tall else mm_fn(poly, x, x, a)
    return x.reshape(*lead, rows, cols)


def singular_value_range(x: Tensor) -> tuple[float, float]:
    """(min, max) singular value over a matrix or batch, computed in float64."""
    s = torch.linalg.svdvals(x.double())
    return s.min().item(), s.max().item()


def random_with_singular_values(
    rows: int, cols: int, sigma: Tensor, generator: Optional[torch.Generator] = None
) -> Tensor:
    """A ``rows × cols`` float64 matrix with random singular vectors and singular values ``sigma``."""
    k = min(rows, cols)
    if sigma.numel() != k:
        raise ValueError(f"need {k} singular values for a {rows}x{cols} matrix, got {sigma.numel()}")
    u, _ = torch.linalg.qr(torch.randn(rows, k, dtype=torch.float64, generator=generator))
    v, _ = torch.linalg.qr(torch.randn(cols, k, dtype=torch.float64, generator=generator))
    return (u * sigma.double()) @ v.T


def envelope_grid(maps: Sequence[tuple[float, float, float]] = ANVIL_MAPS,
                  points: int = 200_001) -> tuple[float, float]:
    """(min, max) of the composite map on σ ∈ [ENVELOPE_SIGMA_MIN, 1/NORM_MARGIN] (float64 grid)."""
    s = torch.linspace(ENVELOPE_SIGMA_MIN, 1 / NORM_MARGIN, points, dtype=torch.float64)
    out = composite_map(s, maps)
    return out.min().item(), out.max().item()


def tail_gain(maps: Sequence[tuple[float, float, float]] = ANVIL_MAPS) -> float:
    """Slope of the composite map at zero: the product of the linear coefficients."""
    return math.prod(a for a, _, _ in maps)
