"""FP8 formats, the record's scales (RECORD §7) and the reference quantizer."""

from __future__ import annotations

from typing import Union

import torch
from torch import Tensor

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
E4M3_MAX = 448.0
E5M2_MAX = 57344.0

# --- RECORD §7 "MLP, forward and backward" ---------------------------------------------
# x = RMSNorm output; clip-free because |x| <= sqrt(768) = 27.71 < 448 * 2^-4 = 28.
NORMED_X_SCALE = 2.0**-4
# Static e5m2 scale of the gradient arriving at the MLP output.
MLP_GRAD_SCALE = 2.0**-6
# Weight scales: exact amax/448 for the first 16 refreshes, then last refresh's amax * 1.12 / 448.
EXACT_WEIGHT_REFRESHES = 16
WEIGHT_LAG_HEADROOM = 1.12
# Delayed post-activation scale max(amax_prev * 1.03 / 448, 1e-6), bootstrap 1.
POST_HEADROOM = 1.03
POST_SCALE_FLOOR = 1e-6
POST_SCALE_BOOTSTRAP = 1.0
# Delayed dpre scale max(amax_prev * 1.25 / 57344, 1e-12), bootstrap 2^-6.
DPRE_HEADROOM = 1.25
DPRE_SCALE_FLOOR = 1e-12
DPRE_SCALE_BOOTSTRAP = MLP_GRAD_SCALE
# --- RECORD §7 "Attention QKV" ---------------------------------------------------------
# Static scale of the incoming dQ/dK/dV (e4m3).
QKV_GRAD_SCALE = 1.0 / 448.0
# The record's QKV input scale, 8/448, clips |x| > 8; the default here is the clip-free
# NORMED_X_SCALE (same inputs: RMSNorm outputs). Fp8LinearState.for_record_qkv() matches the record.
RECORD_QKV_X_SCALE = 8.0 / 448.0
# --- RECORD §7 "lm_head" -----------------------------------------------------------------
HEAD_X_SCALE = 100.0 / 448.0
HEAD_W_SCALE = 2.0 / 448.0
# The /8 leaves 3 extra binades of underflow headroom for the e5m2 logit gradient.
HEAD_GRAD_SCALE = (0.75 / 8.0) / 448.0
# --- numerics guards (RECORD §7 / the record's refresh code) ---------------------------
WEIGHT_AMAX_FLOOR = 1e-12  # an all-zero weight (c_proj at init) still gets a finite scale
AMAX_CEILING = 1e12  # delayed scales ignore inf/NaN amaxes and cap finite ones here
# torch._scaled_mm wants every dimension a multiple of 16; token counts are padded to it.
SCALED_MM_ALIGN = 16

FP8_MAX = {E4M3: E4M3_MAX, E5M2: E5M2_MAX}
GRAD_DTYPES = {"e4m3": E4M3, "e5m2": E5M2}


def quantize(x: Tensor, inv_scale: Union[Tensor, float], dtype: torch.dtype) -> Tensor:
    """Reference quantizer: ``clamp(x · inv_scale, ±max).to(dtype)`` (round to nearest even).

    ``inv_scale`` is the reciprocal of the dequantization scale (stored value × scale = x).
    The Triton kernels produce exactly these values.
    """
    fmax = FP8_MAX[dtype]
    return (x.float() * inv_scale).clamp(-fmax, fmax).to(dtype)

