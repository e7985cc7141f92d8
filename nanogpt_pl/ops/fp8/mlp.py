"""FP8 ReLU² MLP ``relu(x @ w_fcᵀ)² @ w_proj`` with exact, lagged and delayed scales (RECORD §7)."""

from __future__ import annotations

import weakref
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .backends import check_aligned
from .cache import Fp8State, WeightCache, fold_delayed, keep_addresses, keys_match, scalar_buffer, weight_key
from .formats import (
    DPRE_HEADROOM,
    DPRE_SCALE_BOOTSTRAP,
    DPRE_SCALE_FLOOR,
    E4M3_MAX,
    E5M2_MAX,
    EXACT_WEIGHT_REFRESHES,
    MLP_GRAD_SCALE,
    NORMED_X_SCALE,
    POST_HEADROOM,
    POST_SCALE_BOOTSTRAP,
    POST_SCALE_FLOOR,
    WEIGHT_AMAX_FLOOR,
    WEIGHT_LAG_HEADROOM,
)
from .ops import amax_probe, fp8_mlp_call, kernel_id

RELU2_KERNELS = ("elementwise", "gemm_epilogue")
# Which MLP kernel pair "auto" picks: set from benchmarks/fp8_mlp.py on an H200.
DEFAULT_RELU2_KERNEL = "elementwise"


class Fp8MLPState(Fp8State):
    """Scales, amax history and weight caches of one FP8 ReLU² MLP (RECORD §7).

    Buffers (checkpointed): ``x_scale`` (static 2⁻⁴), ``w1_scale``/``w2_scale`` and the
    weight amaxes of the last refresh ``w1_amax``/``w2_amax`` (lagged scales),
    ``post_scale``/``post_amax`` and ``dpre_scale``/``dpre_amax`` (delayed scales and the
    running maxima since the last refresh), ``grad_scale`` (static 2⁻⁶) and
    ``refresh_count``.

    Args:
        backend: ``"auto"``, ``"reference"`` or ``"scaled_mm"``.
        relu2_kernel: how the two GEMM+nonlinearity steps run on the fast path:
            ``"elementwise"`` (cuBLAS GEMM, then one fused Triton pass) or
            ``"gemm_epilogue"`` (one Triton GEMM with the nonlinearity and quantization in
            its epilogue); ``"auto"`` = ``DEFAULT_RELU2_KERNEL``. The reference path computes
            the same values either way.
        grad_scale: static scale of the incoming gradient (see "Loss normalization" in ``fp8.md``).
        exact_weight_refreshes: refreshes that use exact weight scales before lagging.
        config_key: the config option that switched this MLP to FP8, named in errors.
    """

    def __init__(self, backend: str = "auto", relu2_kernel: str = "auto", grad_scale: float = MLP_GRAD_SCALE,
                 exact_weight_refreshes: int = EXACT_WEIGHT_REFRESHES,
                 config_key: str = "model.gpt.fp8_mlp") -> None:
        super().__init__(backend, config_key)
        if relu2_kernel == "auto":
            relu2_kernel = DEFAULT_RELU2_KERNEL
        if relu2_kernel not in RELU2_KERNELS:
            raise ValueError(f"{config_key}: relu2_kernel must be 'auto' or one of {RELU2_KERNELS}, "
                             f"got {relu2_kernel!r}")
        self.relu2_kernel = relu2_kernel
        self.exact_weight_refreshes = exact_weight_refreshes
        self.register_buffer("x_scale", scalar_buffer(NORMED_X_SCALE))
        self.register_buffer("w1_scale", scalar_buffer(1.0))
        self.register_buffer("w2_scale", scalar_buffer(1.0))
        self.register_buffer("w1_amax", scalar_buffer(0.0))
        self.register_buffer("w2_amax", scalar_buffer(0.0))
        self.register_buffer("post_scale", scalar_buffer(POST_SCALE_BOOTSTRAP))
        self.register_buffer("post_amax", scalar_buffer(0.0))
        self.register_buffer("dpre_scale", scalar_buffer(DPRE_SCALE_BOOTSTRAP))
        self.register_buffer("dpre_amax", scalar_buffer(0.0))
        self.register_buffer("grad_scale", scalar_buffer(grad_scale))
        for name in ("x", "w1", "w2", "post", "dpre", "grad"):
            self.register_buffer(f"_{name}_inv", scalar_buffer(1.0), persistent=False)
        self._w1: Optional[WeightCache] = None
        self._w2: Optional[WeightCache] = None
        self._kern_id = -1  # the backend's index in ops._KERNELS, set at each refresh
        # max |dpre| leaves the backward as this leaf's gradient (ops.amax_probe), made at the first refresh
        self._dpre_probe: Optional[Tensor] = None
        self._probe_target: Optional[weakref.ref] = None

    def refresh(self, w_fc: Tensor, w_proj: Tensor) -> tuple[WeightCache, WeightCache]:
        """Both weights' caches, refreshed (with every delayed scale) if either is stale (eager)."""
        kern = self._kernels(w_fc.device)
        check_aligned(kern, self.config_key, *w_fc.shape)
        return self.caches_for(w_fc, w_proj, kern)

    def current_caches(self) -> tuple[WeightCache, WeightCache]:
        """The weight caches as the last refresh left them (inside a compiled forward, which cannot
        run the staleness check)."""
        if self._w1 is None or self._dpre_probe is None:
            raise RuntimeError(f"{self.config_key}: the FP8 MLP ran inside torch.compile before its weight cache "
                               "was built; call the model's refresh_fp8() (or state.refresh) before the "
                               "compiled forward")
        return self._w1, self._w2

    def operator_args(self, w_fc: Tensor, w_proj: Tensor, c1: WeightCache, c2: WeightCache) -> tuple:
        """The arguments of ``ops.fp8_mlp_call`` after ``x``: the weights, the dpre probe, both
        caches, every scale and reciprocal, the backend and the ReLU² kernel choice."""
        return (w_fc, w_proj, self._dpre_probe, c1.row, c1.col, c2.row, c2.col, self.x_scale, self._x_inv,
                self.w1_scale, self.w2_scale, self.post_scale, self._post_inv, self.grad_scale, self._grad_inv,
                self.dpre_scale, self._dpre_inv, self._kern_id, self.relu2_kernel == "gemm_epilogue")

    @torch.no_grad()
    def caches_for(self, w_fc: Tensor, w_proj: Tensor, kern: Any) -> tuple[WeightCache, WeightCache]:
        """FP8 copies of both weights, rebuilt (with every delayed scale) when either changed."""
        key = (weight_key(w_fc), weight_key(w_proj))
        self._kern_id = kernel_id(kern)
        if self._w1 is not None and self._cache_kern == kern.name and keys_match(self._cache_key, key):
            self._ensure_probe()
            return self._w1, self._w2
        self._before_refresh((w_fc, w_proj), kern)
        self._check_recomputed(w_fc)
        self._check_recomputed(w_proj)
        self._follow_device(w_fc.device)
        exact = self._refreshes < self.exact_weight_refreshes
        if kern.fused_refresh:
            caches = self._refresh_fused(w_fc.detach(), w_proj.detach(), exact, kern)
        else:
            caches = []
            for w, scale, amax, inv in ((w_fc, self.w1_scale, self.w1_amax, self._w1_inv),
                                        (w_proj, self.w2_scale, self.w2_amax, self._w2_inv)):
                w = w.detach()
                if exact:
                    scale.copy_(w.abs().amax().float().clamp(min=WEIGHT_AMAX_FLOOR) / E4M3_MAX)
                else:
                    # Lagged: the amax measured by the previous refresh's quantize pass.
                    scale.copy_((amax * WEIGHT_LAG_HEADROOM).clamp(min=WEIGHT_AMAX_FLOOR) / E4M3_MAX)
                torch.reciprocal(scale, out=inv)
                row, col, new_amax = kern.quant_weight(w, inv)
                amax.copy_(new_amax)
                caches.append(WeightCache(row, col))
            fold_delayed(self.post_amax, self.post_scale, POST_HEADROOM / E4M3_MAX, POST_SCALE_FLOOR)
            fold_delayed(self.dpre_amax, self.dpre_scale, DPRE_HEADROOM / E5M2_MAX, DPRE_SCALE_FLOOR)
            for name in ("x", "post", "dpre", "grad"):
                torch.reciprocal(getattr(self, f"{name}_scale"), out=getattr(self, f"_{name}_inv"))
            self.refresh_count.add_(1)
        if self._hold:
            caches = [keep_addresses(self._w1, caches[0]), keep_addresses(self._w2, caches[1])]
        self._w1, self._w2 = caches
        self._cache_key, self._cache_kern = key, kern.name
        self._refreshes += 1
        self._ensure_probe()  # after _follow_device, which may have moved the buffers
        return self._w1, self._w2

    def _ensure_probe(self) -> None:
        """The dpre probe of ``dpre_amax`` as it is now: (re)made when the buffer moved (a device
        move replaces it), or in a copy of this state (whose weakref still names the original's)."""
        if self._probe_target is None or self._probe_target() is not self.dpre_amax:
            self._dpre_probe, self._probe_target = amax_probe(self.dpre_amax), weakref.ref(self.dpre_amax)

    def _refresh_with(self, weights: tuple, kern: Any) -> None:
        self.caches_for(weights[0], weights[1], kern)

    def refresh_variant(self) -> tuple:
        return (self._refreshes < self.exact_weight_refreshes,)  # the exact-scale bootstrap, or lagged

    def cache_tensors(self) -> list[Tensor]:
        return [t for c in (self._w1, self._w2) if c is not None for t in (c.row, c.col)]

    def _refresh_fused(self, w_fc: Tensor, w_proj: Tensor, exact: bool, kern: Any) -> list[WeightCache]:
        """The same refresh as the PyTorch branch of :meth:`caches_for` in three launches (plus
        two amax passes in the exact phase): one kernel for every scale, one quantize pass per
        weight that also measures its amax for the next refresh. ~30 small launches fewer."""
        if exact:
            for w, amax in ((w_fc, self.w1_amax), (w_proj, self.w2_amax)):
                amax.copy_(w.abs().amax())
        kern.refresh_scales(self, exact)
        return [WeightCache(*kern.quant_weight_into(w, inv, amax))
                for w, inv, amax in ((w_fc, self._w1_inv, self.w1_amax), (w_proj, self._w2_inv, self.w2_amax))]


def fp8_mlp(x: Tensor, w_fc: Tensor, w_proj: Tensor, state: Fp8MLPState) -> Tensor:
    """The ReLU² MLP ``relu(x @ w_fcᵀ)² @ w_proj`` in FP8 (RECORD §7).

    Args:
        x: ``[..., D]`` RMSNorm output (the static 2⁻⁴ input scale relies on
            ``|x| <= sqrt(D)``; larger values are clamped, never inf).
        w_fc: ``[H, D]`` up-projection; w_proj: ``[H, D]`` down-projection (the record's
            bank layout). Pass the parameters (or views of them) so the caches persist.
        state: the layer's :class:`Fp8MLPState`; in eval mode this is the plain bf16 MLP.

    Returns:
        ``[..., D]`` in ``x.dtype``. Backward gives ``dx``, ``dw_fc = dpreᵀx`` and
        ``dw_proj = postᵀg`` in the dtypes of ``x`` and the weights.

    The matmuls run as the custom operator ``nanogpt_pl::fp8_mlp`` (``ops.py``), which
    ``torch.compile`` traces as one call. Inside a compiled region the weight caches are not
    checked: refresh them eagerly first (``state.refresh``; ``GPT.refresh_fp8`` does every
    layer's, and the training module calls it before each compiled forward).
    """
    if w_fc.dim() != 2 or w_fc.shape != w_proj.shape or x.shape[-1] != w_fc.shape[1]:
        raise ValueError(f"fp8_mlp: expected x [..., D] and w_fc, w_proj both [H, D]; got {tuple(x.shape)}, "
                         f"{tuple(w_fc.shape)}, {tuple(w_proj.shape)}")
    if not state.training:
        h = F.relu(x @ w_fc.to(x.dtype).t()).square()
        return h @ w_proj.to(x.dtype)
    if state.graph_break and torch.compiler.is_compiling():
        return _fp8_mlp_outside_graph(x, w_fc, w_proj, state)
    c1, c2 = state.current_caches() if torch.compiler.is_compiling() else state.refresh(w_fc, w_proj)
    lead = x.shape[:-1]
    y, _, _, _, post_amax = fp8_mlp_call(x.reshape(-1, x.shape[-1]), *state.operator_args(w_fc, w_proj, c1, c2))
    with torch.no_grad():
        state.post_amax.copy_(torch.maximum(state.post_amax, post_amax))
    return y.reshape(*lead, y.shape[-1])


# ``state.graph_break``: the same function, run by dynamo as a graph break (eagerly)
_fp8_mlp_outside_graph = torch.compiler.disable(fp8_mlp)
