"""FP8 training matmuls: the ReLU² MLP, the QKV projection and the lm_head (RECORD §7).

The design (formats, scales, caches, backends) is in ``fp8.md`` beside this file.
"""

# The backend singletons stay reachable here for tests that run the fast path on the CPU
# (``state._kernels_override = fp8._FAST`` under TRITON_INTERPRET=1).
from .backends import (  # noqa: F401
    _FAST,
    _REFERENCE,
    BACKEND_KEY,
    BACKENDS,
    _Fast,
    _Reference,
    check_backend,
    fp8_available,
)
from .formats import (
    AMAX_CEILING,
    DPRE_HEADROOM,
    DPRE_SCALE_BOOTSTRAP,
    DPRE_SCALE_FLOOR,
    E4M3,
    E4M3_MAX,
    E5M2,
    E5M2_MAX,
    EXACT_WEIGHT_REFRESHES,
    FP8_MAX,
    HEAD_GRAD_SCALE,
    HEAD_W_SCALE,
    HEAD_X_SCALE,
    MLP_GRAD_SCALE,
    NORMED_X_SCALE,
    POST_HEADROOM,
    POST_SCALE_BOOTSTRAP,
    POST_SCALE_FLOOR,
    QKV_GRAD_SCALE,
    RECORD_QKV_X_SCALE,
    SCALED_MM_ALIGN,
    WEIGHT_AMAX_FLOOR,
    WEIGHT_LAG_HEADROOM,
    quantize,
)
from .head import Fp8Head
from .linear import Fp8LinearState, QuantizedInput, fp8_linear
from .mlp import DEFAULT_RELU2_KERNEL, RELU2_KERNELS, Fp8MLPState, fp8_mlp

__all__ = [
    "AMAX_CEILING",
    "BACKEND_KEY",
    "BACKENDS",
    "DEFAULT_RELU2_KERNEL",
    "DPRE_HEADROOM",
    "DPRE_SCALE_BOOTSTRAP",
    "DPRE_SCALE_FLOOR",
    "E4M3",
    "E4M3_MAX",
    "E5M2",
    "E5M2_MAX",
    "EXACT_WEIGHT_REFRESHES",
    "FP8_MAX",
    "HEAD_GRAD_SCALE",
    "HEAD_W_SCALE",
    "HEAD_X_SCALE",
    "MLP_GRAD_SCALE",
    "NORMED_X_SCALE",
    "POST_HEADROOM",
    "POST_SCALE_BOOTSTRAP",
    "POST_SCALE_FLOOR",
    "QKV_GRAD_SCALE",
    "RECORD_QKV_X_SCALE",
    "RELU2_KERNELS",
    "SCALED_MM_ALIGN",
    "WEIGHT_AMAX_FLOOR",
    "WEIGHT_LAG_HEADROOM",
    "Fp8Head",
    "Fp8LinearState",
    "Fp8MLPState",
    "QuantizedInput",
    "check_backend",
    "fp8_available",
    "fp8_linear",
    "fp8_mlp",
    "quantize",
]
