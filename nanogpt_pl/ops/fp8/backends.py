"""The operations the FP8 layers are written in, twice: a PyTorch reference and the fast path.

Both backends expose the same methods (``quant``, ``quant_weight``, ``mm``, ``up_relu2``,
``dpre``) and produce the same FP8 values; the layers in ``linear.py``, ``mlp.py`` and
``head.py`` never branch on which one runs.
"""

from __future__ import annotations

from typing import Any, Optional, Union

import torch
from torch import Tensor

from ..triton import triton_usable
from .formats import (
    AMAX_CEILING,
    DPRE_HEADROOM,
    DPRE_SCALE_FLOOR,
    E4M3,
    E4M3_MAX,
    E5M2,
    E5M2_MAX,
    FP8_MAX,
    POST_HEADROOM,
    POST_SCALE_FLOOR,
    SCALED_MM_ALIGN,
    WEIGHT_AMAX_FLOOR,
    WEIGHT_LAG_HEADROOM,
    quantize,
)

# The choices of ``model.backends.fp8`` (and of every FP8 state's ``backend``).
BACKEND_KEY = "model.backends.fp8"
BACKENDS = ("auto", "reference", "scaled_mm")


def check_backend(backend: str) -> None:
    """Raise one clear line for a backend name that is not one of :data:`BACKENDS`."""
    if backend in BACKENDS:
        return
    hint = " (the plain-PyTorch path is 'reference')" if backend == "emulated" else ""
    raise ValueError(f"{BACKEND_KEY}: unknown fp8 backend {backend!r}{hint}; choose one of {', '.join(BACKENDS)}")


class _Reference:
    """PyTorch reference of every FP8 operation: quantize, dequantize, fp32 matmul.

    Transposed copies are views (an fp32 matmul takes any layout), and no padding is needed.
    """

    name = "reference"
    row_align = 1
    fused_refresh = False  # Fp8MLPState refreshes through the PyTorch ops (the reference)

    def quant(self, src: Tensor, inv_scale: Tensor, dtype: torch.dtype, rows_out: int,
              want_row: bool = True, want_t: bool = True, clear: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
        """``src`` quantized, and its transpose; ``clear`` (a 1-element fp32 running max of a
        later call) is set to 0."""
        if clear is not None:
            clear.zero_()
        q = quantize(src, inv_scale, dtype)
        return q, q.t()

    def quant_weight(self, w: Tensor, inv_scale: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        q = quantize(w, inv_scale, E4M3)
        return q, q.t(), w.detach().abs().amax().float()

    def mm(self, a: Tensor, b: Tensor, scale_a: Tensor, scale_b: Tensor, out_dtype: torch.dtype,
           fast_accum: bool) -> Tensor:
        """``(a @ bᵀ) · scale_a · scale_b`` in fp32, then cast (saturating for an fp8 output)."""
        out = (a.float() @ b.float().t()) * (scale_a * scale_b)
        if out_dtype in FP8_MAX:
            fmax = FP8_MAX[out_dtype]
            out = out.clamp(-fmax, fmax)
        return out.to(out_dtype)

    def up_relu2(self, xq: Tensor, w_row: Tensor, x_scale: Tensor, w_scale: Tensor, inv_post_scale: Tensor,
                 post_amax: Tensor, fused: bool) -> tuple[Tensor, Tensor]:
        pre = self.mm(xq, w_row, x_scale, w_scale, torch.bfloat16, True).float()
        post = torch.relu(pre).square()
        torch.maximum(post_amax, post.max(), out=post_amax)
        q = quantize(post, inv_post_scale, E4M3)
        return q, q.t()

    def dpre(self, gq: Tensor, w_row: Tensor, g_scale: Tensor, w_scale: Tensor, post: Tensor,
             post_scale: Tensor, inv_dpre_scale: Tensor, dpre_amax: Tensor, fused: bool) -> tuple[Tensor, Tensor]:
        dpl = self.mm(gq, w_row, g_scale, w_scale, torch.bfloat16, False).float()
        # sqrt through fp64: correctly rounded like the kernels' sqrt_rn (the CPU's vectorized
        # fp32 sqrt is occasionally one ulp off).
        dpre = 2.0 * dpl * torch.sqrt((post.float() * post_scale).double()).float()
        torch.maximum(dpre_amax, dpre.abs().max(), out=dpre_amax)
        q = quantize(dpre, inv_dpre_scale, E5M2)
        return q, q.t()


class _Fast:
    """``torch._scaled_mm`` (cuBLAS) and the Triton kernels of ``ops/triton/fp8_*.py``."""

    name = "scaled_mm"
    row_align = SCALED_MM_ALIGN

    def quant(self, src: Tensor, inv_scale: Tensor, dtype: torch.dtype, rows_out: int,
              want_row: bool = True, want_t: bool = True, clear: Optional[Tensor] = None,
              ) -> tuple[Optional[Tensor], Optional[Tensor]]:
        from ..triton.fp8_quant import quantize_dual  # imports triton: the fast path only

        row, t, _ = quantize_dual(src, inv_scale, dtype, rows_out=rows_out, write_row=want_row, write_t=want_t,
                                  clear=clear)
        return row, t

    def quant_weight(self, w: Tensor, inv_scale: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        from ..triton.fp8_quant import quantize_dual  # imports triton: the fast path only

        row, col, tiles = quantize_dual(w, inv_scale, E4M3, tile_amax=True)
        return row, col, tiles.amax()

    # Fp8MLPState refreshes through the two methods below (see Fp8MLPState._refresh_fused).
    fused_refresh = True

    def quant_weight_into(self, w: Tensor, inv_scale: Tensor, amax: Tensor) -> tuple[Tensor, Tensor]:
        """``quant_weight``'s two copies, with max |w| folded into the 1-element ``amax`` (atomic max)."""
        from ..triton.fp8_quant import quantize_dual  # imports triton: the fast path only

        row, col, _ = quantize_dual(w, inv_scale, E4M3, amax_into=amax)
        return row, col

    def refresh_scales(self, state: Any, exact: bool) -> None:
        from ..triton.fp8_mlp import mlp_refresh_scales  # imports triton: the fast path only

        mlp_refresh_scales(state, exact, _REFRESH_CONSTANTS)

    def mm(self, a: Tensor, b: Tensor, scale_a: Tensor, scale_b: Tensor, out_dtype: torch.dtype,
           fast_accum: bool) -> Tensor:
        """``(a @ bᵀ) · scale_a · scale_b`` with a [M, K] and b [N, K] both K-contiguous."""
        if not (a.is_contiguous() and b.is_contiguous() and a.shape[1] == b.shape[1]):
            raise AssertionError(f"fp8 GEMM operands must be K-contiguous [M, K] x [N, K]; got "
                                 f"{tuple(a.shape)}/{a.stride()} and {tuple(b.shape)}/{b.stride()}")
        if any(d % SCALED_MM_ALIGN for d in (*a.shape, b.shape[0])):
            raise AssertionError(f"fp8 GEMM dims must be multiples of {SCALED_MM_ALIGN}; got "
                                 f"{tuple(a.shape)} x {tuple(b.shape)}")
        # b.t() is the column-major [K, N] operand _scaled_mm wants; keywords keep this
        # call valid across torch 2.11-2.14.
        return torch._scaled_mm(a, b.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype,
                                use_fast_accum=fast_accum)

    def up_relu2(self, xq, w_row, x_scale, w_scale, inv_post_scale, post_amax, fused):
        from ..triton import fp8_mlp as k  # imports triton: the fast path only

        if fused:
            return k.fp8_gemm_relu2(xq, w_row, x_scale, w_scale, inv_post_scale, post_amax)
        pre = self.mm(xq, w_row, x_scale, w_scale, torch.bfloat16, True)
        return k.relu2_quantize(pre, inv_post_scale, post_amax)

    def dpre(self, gq, w_row, g_scale, w_scale, post, post_scale, inv_dpre_scale, dpre_amax, fused):
        from ..triton import fp8_mlp as k  # imports triton: the fast path only

        if fused:
            return k.fp8_gemm_dpre(gq, w_row, g_scale, w_scale, post, post_scale, inv_dpre_scale, dpre_amax)
        dpl = self.mm(gq, w_row, g_scale, w_scale, torch.bfloat16, False)
        return k.dpre_quantize(dpl, post, post_scale, inv_dpre_scale, dpre_amax)


# The numbers of an FP8 MLP refresh, for the fused kernel (the PyTorch branch uses the names).
_REFRESH_CONSTANTS = dict(w_gain=WEIGHT_LAG_HEADROOM, w_floor=WEIGHT_AMAX_FLOOR, w_max=E4M3_MAX,
                          post_gain=POST_HEADROOM / E4M3_MAX, post_floor=POST_SCALE_FLOOR,
                          dpre_gain=DPRE_HEADROOM / E5M2_MAX, dpre_floor=DPRE_SCALE_FLOOR, ceil=AMAX_CEILING)

_REFERENCE = _Reference()
_FAST = _Fast()
_CAPABILITY: dict[int, tuple[int, int]] = {}


def fp8_available(device: Union[torch.device, str]) -> bool:
    """Whether the fast FP8 path can run on ``device``: CUDA, compute capability >= 8.9, Triton."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _CAPABILITY:
        _CAPABILITY[idx] = torch.cuda.get_device_capability(idx)
    return _CAPABILITY[idx] >= (8, 9) and triton_usable(device)


def round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def check_aligned(kern: Any, config_key: str, *dims: int) -> None:
    if kern.row_align > 1 and any(d % kern.row_align for d in dims):
        raise ValueError(f"{config_key}: FP8 GEMMs need feature dimensions that are multiples of "
                         f"{kern.row_align}; got {dims}. Switch {config_key} off for this shape.")
