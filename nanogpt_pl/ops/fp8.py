"""FP8 training matmuls: the ReLU² MLP, the QKV projection and the lm_head (RECORD §7).

Formats, and why:

* **e4m3 for weights and activations** (forward operands): 3 mantissa bits are the most
  precision FP8 offers, and these tensors have a known or measured range, so the narrow
  exponent range (2⁻⁹ .. 448) is enough.
* **e5m2 for the gradients of the MLP and the lm_head**: gradients span many binades
  (they scale with the loss and vary token to token), so the 5-bit exponent
  (2⁻¹⁶ .. 57344) matters more than the third mantissa bit.
* **e4m3 for the QKV backward**, as the record ships it: one more mantissa bit for
  dQ/dK/dV at the price of range, which at the static scale 1/448 is 2⁻¹⁸ .. 1 (|g| above 1
  saturates). The record trains with it, so those gradients evidently fit that window;
  ``Fp8LinearState(grad_dtype="e5m2")`` is the wider alternative.

Scales (all per tensor, fp32, held as buffers so checkpoints carry them):

* RMSNorm outputs get a **static, clip-free** scale 2⁻⁴: ``|x| <= sqrt(768) = 27.7 < 448·2⁻⁴ = 28``.
* MLP weights: **exact** amax/448 for the first 16 cache refreshes, then **lagged**: the
  previous refresh's amax × 1.12 / 448 (the amax is measured for free by the quantize pass).
  QKV weights: exact amax/448 at every refresh. lm_head weight: static 2/448.
* The post-activation ``relu(pre)²`` gets a **delayed** scale: at each refresh,
  ``max(amax_prev·1.03/448, 1e-6)`` where amax_prev is the largest post seen since the last
  refresh (bootstrap 1; kept while nothing was seen).
* The MLP's incoming gradient has the **static** scale 2⁻⁶ (e5m2); its ``dpre`` the
  **delayed** scale ``max(amax_prev·1.25/57344, 1e-12)`` (bootstrap 2⁻⁶).

Every quantization clamps to the format's maximum before the cast, so no input (however
large) produces inf or NaN, and tiny inputs flush to zero.

GEMMs (``torch._scaled_mm``): forward GEMMs use fast accumulation, gradient GEMMs
``use_fast_accum=False``. Hopper FP8 GEMMs need both operands contiguous along the
reduction dimension, so the weight caches hold a row-major and a column-major copy, and
activations / gradients are quantized in both layouts by one Triton pass.

The static gradient scales assume the record's loss normalization: the **sum** of the
per-token losses of a rank (RECORD §1). A loss averaged over N tokens makes every gradient
N times smaller (at N = 49,152 that is 15.6 binades, most of e5m2's range): then
backpropagate ``loss·N``, or divide the ``grad_scale`` buffer of each state by N (and set
``Fp8Head.loss_rows``), or most gradients underflow.

Weight caches are rebuilt once per optimizer step, not per micro-batch: a weight's
``_version`` counter (bumped by every in-place update made through autograd-visible ops,
which is how optimizers update parameters) and its storage address decide staleness. An
update made through ``param.data`` does not bump the counter: call ``state.invalidate()``
after one. Delayed scales move at the same moment, so all micro-batches of a step use the
same scales.

Backends (per state): ``"auto"`` runs ``torch._scaled_mm`` + Triton on CUDA devices of
compute capability 8.9 or newer and the emulation elsewhere; ``"emulated"`` quantizes to
the FP8 dtype, dequantizes and multiplies in fp32 (the CPU path, same rounding as the fast
path); ``"scaled_mm"`` insists on the fast path and raises on any other device.

Evaluation is not FP8 (the record evaluates in bf16): a state in eval mode
(``model.eval()``) makes these functions plain matmuls in the input's dtype.
"""

from __future__ import annotations

import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Literal, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "E4M3",
    "E5M2",
    "Fp8LinearState",
    "Fp8MLPState",
    "Fp8Head",
    "fp8_linear",
    "fp8_mlp",
    "quantize",
    "fp8_available",
]

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
# NORMED_X_SCALE (same inputs: RMSNorm outputs). Pass x_scale=RECORD_QKV_X_SCALE to match.
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

_FP8_MAX = {E4M3: E4M3_MAX, E5M2: E5M2_MAX}
_GRAD_DTYPES = {"e4m3": E4M3, "e5m2": E5M2}
BACKENDS = ("auto", "emulated", "scaled_mm")
RELU2_KERNELS = ("elementwise", "gemm_epilogue")
# Which MLP kernel pair "auto" picks: set from benchmarks/fp8_mlp.py on an H200.
DEFAULT_RELU2_KERNEL = "elementwise"


def quantize(x: Tensor, inv_scale: Union[Tensor, float], dtype: torch.dtype) -> Tensor:
    """Reference quantizer: ``clamp(x · inv_scale, ±max).to(dtype)`` (round to nearest even).

    ``inv_scale`` is the reciprocal of the dequantization scale (stored value × scale = x).
    The Triton kernels produce exactly these values.
    """
    fmax = _FP8_MAX[dtype]
    return (x.float() * inv_scale).clamp(-fmax, fmax).to(dtype)


# ---------------------------------------------------------------------------------------
# Backends: the operations the FP8 layers are written in
# ---------------------------------------------------------------------------------------


class _Emulated:
    """PyTorch reference of every FP8 operation: quantize, dequantize, fp32 matmul.

    Transposed copies are views (an fp32 matmul takes any layout), and no padding is needed.
    """

    name = "emulated"
    row_align = 1
    fused_refresh = False  # Fp8MLPState refreshes through the PyTorch ops (the reference)

    def quant(self, src: Tensor, inv_scale: Tensor, dtype: torch.dtype, rows_out: int,
              want_row: bool = True, want_t: bool = True) -> tuple[Tensor, Tensor]:
        q = quantize(src, inv_scale, dtype)
        return q, q.t()

    def quant_weight(self, w: Tensor, inv_scale: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        q = quantize(w, inv_scale, E4M3)
        return q, q.t(), w.detach().abs().amax().float()

    def mm(self, a: Tensor, b: Tensor, scale_a: Tensor, scale_b: Tensor, out_dtype: torch.dtype,
           fast_accum: bool) -> Tensor:
        """``(a @ bᵀ) · scale_a · scale_b`` in fp32, then cast (saturating for an fp8 output)."""
        out = (a.float() @ b.float().t()) * (scale_a * scale_b)
        if out_dtype in _FP8_MAX:
            fmax = _FP8_MAX[out_dtype]
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
              want_row: bool = True, want_t: bool = True) -> tuple[Optional[Tensor], Optional[Tensor]]:
        from .triton.fp8_quant import quantize_dual

        row, t, _ = quantize_dual(src, inv_scale, dtype, rows_out=rows_out, write_row=want_row, write_t=want_t)
        return row, t

    def quant_weight(self, w: Tensor, inv_scale: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        from .triton.fp8_quant import quantize_dual

        row, col, tiles = quantize_dual(w, inv_scale, E4M3, tile_amax=True)
        return row, col, tiles.amax()

    # Fp8MLPState refreshes through the two methods below (see Fp8MLPState._refresh_fused).
    fused_refresh = True

    def quant_weight_into(self, w: Tensor, inv_scale: Tensor, amax: Tensor) -> tuple[Tensor, Tensor]:
        """``quant_weight``'s two copies, with max |w| folded into the 1-element ``amax`` (atomic max)."""
        from .triton.fp8_quant import quantize_dual

        row, col, _ = quantize_dual(w, inv_scale, E4M3, amax_into=amax)
        return row, col

    def refresh_scales(self, state: Any, exact: bool) -> None:
        from .triton.fp8_mlp import mlp_refresh_scales

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
        from .triton import fp8_mlp as k

        if fused:
            return k.fp8_gemm_relu2(xq, w_row, x_scale, w_scale, inv_post_scale, post_amax)
        pre = self.mm(xq, w_row, x_scale, w_scale, torch.bfloat16, True)
        return k.relu2_quantize(pre, inv_post_scale, post_amax)

    def dpre(self, gq, w_row, g_scale, w_scale, post, post_scale, inv_dpre_scale, dpre_amax, fused):
        from .triton import fp8_mlp as k

        if fused:
            return k.fp8_gemm_dpre(gq, w_row, g_scale, w_scale, post, post_scale, inv_dpre_scale, dpre_amax)
        dpl = self.mm(gq, w_row, g_scale, w_scale, torch.bfloat16, False)
        return k.dpre_quantize(dpl, post, post_scale, inv_dpre_scale, dpre_amax)


# The numbers of an FP8 MLP refresh, for the fused kernel (the PyTorch branch uses the names).
_REFRESH_CONSTANTS = dict(w_gain=WEIGHT_LAG_HEADROOM, w_floor=WEIGHT_AMAX_FLOOR, w_max=E4M3_MAX,
                          post_gain=POST_HEADROOM / E4M3_MAX, post_floor=POST_SCALE_FLOOR,
                          dpre_gain=DPRE_HEADROOM / E5M2_MAX, dpre_floor=DPRE_SCALE_FLOOR, ceil=AMAX_CEILING)

_EMULATED = _Emulated()
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
    if _CAPABILITY[idx] < (8, 9):
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


# ---------------------------------------------------------------------------------------
# Weight caches
# ---------------------------------------------------------------------------------------


def _weight_key(w: Tensor) -> tuple:
    """What identifies the values of ``w`` between optimizer steps.

    The root tensor (a view's base) is compared by identity, so a weight recomputed every
    forward (``torch.cat`` of parameters) never matches a freed one that happened to get
    the same address; ``_version`` is shared by a parameter and all its views.
    """
    root = w._base if w._base is not None else w
    return weakref.ref(root), (w.data_ptr(), w._version, tuple(w.shape), w.stride(), w.dtype, w.device)


def _keys_match(old: Optional[tuple], new: tuple) -> bool:
    if old is None or len(old) != len(new):
        return False
    for (ref_a, meta_a), (ref_b, meta_b) in zip(old, new):
        root = ref_a()
        if root is None or root is not ref_b() or meta_a != meta_b:
            return False
    return True


@dataclass
class _WeightCache:
    row: Tensor  # [out, in] e4m3, contiguous
    col: Tensor  # [in, out] e4m3, contiguous (a view of row on the emulated path)


def _fold_delayed(amax: Tensor, scale: Tensor, gain: float, floor: float) -> None:
    """scale <- max(amax·gain, floor) where something was seen (amax > 0); amax <- 0.

    inf/NaN amaxes count as nothing seen, so one bad step cannot poison the scale.
    """
    a = torch.nan_to_num(amax, nan=0.0, posinf=0.0, neginf=0.0).clamp(max=AMAX_CEILING)
    scale.copy_(torch.where(a > 0, (a * gain).clamp(min=floor), scale))
    amax.zero_()


def _scalar(value: float) -> Tensor:
    return torch.tensor(float(value), dtype=torch.float32)


class _Fp8State(nn.Module):
    """Backend choice, device handling and cache invalidation shared by the FP8 states.

    The scale buffers are read through reciprocals computed at each cache refresh: an edit
    to a buffer takes effect at the next refresh (``invalidate()`` forces one).
    """

    def __init__(self, backend: str, config_key: str) -> None:
        super().__init__()
        if backend not in BACKENDS:
            raise ValueError(f"{config_key}: unknown fp8 backend {backend!r}; choose one of {BACKENDS}")
        self.backend = backend
        self.config_key = config_key
        self.register_buffer("refresh_count", torch.zeros((), dtype=torch.int64))
        self._refreshes = 0  # host mirror of refresh_count, so no step syncs on it
        self._cache_key: Optional[tuple] = None
        self._cache_kern: Optional[str] = None
        self._kernels_override: Any = None  # tests run the fast path on CPU under TRITON_INTERPRET=1
        self._warned_recomputed = False

    def invalidate(self) -> None:
        """Force the weight cache (and the delayed scales) to refresh at the next call."""
        self._cache_key = None

    def _kernels(self, device: torch.device) -> Any:
        if self._kernels_override is not None:
            return self._kernels_override
        if self.backend == "emulated":
            return _EMULATED
        fast = fp8_available(device)
        if self.backend == "scaled_mm" and not fast:
            raise RuntimeError(
                f"{self.config_key}: fp8 backend 'scaled_mm' needs a CUDA GPU with compute capability >= 8.9 "
                f"and Triton, but the input is on {device}. Set {self.config_key}: false to run this layer "
                "without FP8, or use fp8 backend 'auto' (emulated off such GPUs) or 'emulated'.")
        return _FAST if fast else _EMULATED

    def _follow_device(self, device: torch.device) -> None:
        if self.refresh_count.device != device:
            self.to(device)

    def _check_recomputed(self, w: Tensor) -> None:
        if w._base is None and not w.is_leaf and not self._warned_recomputed:
            self._warned_recomputed = True
            warnings.warn(
                f"{self.config_key}: the FP8 weight passed here is recomputed every forward (it has a grad_fn "
                "and is not a view of a parameter), so its FP8 cache is rebuilt on every call. Pass the "
                "parameters themselves (fp8_linear accepts a tuple of row blocks).", stacklevel=4)

    def _apply(self, fn, recurse=True):
        # model.bfloat16() / .half() must not round the scales: torch._scaled_mm and the
        # kernels read them as fp32. Device moves still apply.
        saved = {k: b for k, b in self._buffers.items() if b is not None and b.dtype == torch.float32}
        super()._apply(fn, recurse)
        for k, old in saved.items():
            new = self._buffers[k]
            if new is not None and new.dtype != torch.float32:
                self._buffers[k] = old.to(new.device)
        return self

    def _count_refresh(self) -> None:
        self.refresh_count.add_(1)
        self._refreshes += 1

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs) -> None:
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)
        self._refreshes = int(self.refresh_count)
        self.invalidate()


# ---------------------------------------------------------------------------------------
# FP8 linear (QKV projection, lm_head)
# ---------------------------------------------------------------------------------------


class Fp8LinearState(_Fp8State):
    """Scales and weight cache of one FP8 linear layer ``y = x @ Wᵀ``.

    Defaults are the record's QKV projection (RECORD §7): e4m3 input at a static scale,
    exact per-refresh weight scale, e4m3 gradient at the static scale 1/448.
    :meth:`for_lm_head` gives the lm_head's static scales.

    Args:
        x_scale: static dequantization scale of the input. Default 2⁻⁴, clip-free for
            RMSNorm outputs of width <= 784 (the record's QKV used 8/448, which clips |x| > 8).
        weight_scale: static weight scale; None = exact amax/448 at every refresh.
        grad_dtype: ``"e4m3"`` or ``"e5m2"``, format of the incoming gradient.
        grad_scale: static dequantization scale of the incoming gradient (see the module
            docstring on loss normalization).
        backend: ``"auto"``, ``"emulated"`` or ``"scaled_mm"``.
        config_key: the config option that switched this layer to FP8, named in errors.
    """

    def __init__(self, x_scale: float = NORMED_X_SCALE, weight_scale: Optional[float] = None,
                 grad_dtype: Literal["e4m3", "e5m2"] = "e4m3", grad_scale: float = QKV_GRAD_SCALE,
                 backend: str = "auto", config_key: str = "model.gpt.fp8_qkv") -> None:
        super().__init__(backend, config_key)
        if grad_dtype not in _GRAD_DTYPES:
            raise ValueError(f"{config_key}: grad_dtype must be 'e4m3' or 'e5m2', got {grad_dtype!r}")
        self.grad_dtype = _GRAD_DTYPES[grad_dtype]
        self.exact_weight_scale = weight_scale is None
        self.register_buffer("x_scale", _scalar(x_scale))
        self.register_buffer("w_scale", _scalar(1.0 if weight_scale is None else weight_scale))
        self.register_buffer("grad_scale", _scalar(grad_scale))
        self.register_buffer("w_amax", _scalar(0.0))  # amax of the weight at the last refresh
        for name in ("x", "w", "grad"):
            self.register_buffer(f"_{name}_inv", _scalar(1.0), persistent=False)
        self._cache: Optional[_WeightCache] = None

    @classmethod
    def for_lm_head(cls, backend: str = "auto", config_key: str = "model.gpt.fp8_head") -> "Fp8LinearState":
        """The record's lm_head scales (RECORD §7): x 100/448, weight 2/448, e5m2 gradient (0.75/8)/448."""
        return cls(x_scale=HEAD_X_SCALE, weight_scale=HEAD_W_SCALE, grad_dtype="e5m2",
                   grad_scale=HEAD_GRAD_SCALE, backend=backend, config_key=config_key)

    @torch.no_grad()
    def cache_for(self, parts: Sequence[Tensor], kern: Any) -> _WeightCache:
        """The FP8 copies of the row-stacked ``parts``; rebuilt only when a part changed."""
        key = tuple(_weight_key(p) for p in parts)
        if self._cache is not None and self._cache_kern == kern.name and _keys_match(self._cache_key, key):
            return self._cache
        for p in parts:
            self._check_recomputed(p)
        w = parts[0].detach() if len(parts) == 1 else torch.cat([p.detach() for p in parts])
        self._follow_device(w.device)
        if self.exact_weight_scale:
            self.w_scale.copy_(w.abs().amax().float().clamp(min=WEIGHT_AMAX_FLOOR) / E4M3_MAX)
        torch.reciprocal(self.w_scale, out=self._w_inv)
        torch.reciprocal(self.x_scale, out=self._x_inv)
        torch.reciprocal(self.grad_scale, out=self._grad_inv)
        row, col, amax = kern.quant_weight(w, self._w_inv)
        self.w_amax.copy_(amax)
        self._cache = _WeightCache(row, col)
        self._cache_key, self._cache_kern = key, kern.name
        self._count_refresh()
        return self._cache


class _Fp8LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, state: Fp8LinearState, kern: Any, cache: _WeightCache, *parts: Tensor) -> Tensor:
        n = x.shape[0]
        rows = _round_up(n, kern.row_align)
        need_wgrad = any(ctx.needs_input_grad[4:])
        with torch.autocast(x.device.type, enabled=False):
            xq, xt = kern.quant(x, state._x_inv, E4M3, rows, want_row=True, want_t=need_wgrad)
            y = kern.mm(xq, cache.row, state.x_scale, state.w_scale, x.dtype, True)
        ctx.state, ctx.kern, ctx.cache, ctx.xt, ctx.n = state, kern, cache, xt, n
        ctx.part_meta = [(p.shape[0], p.dtype) for p in parts]
        return y[:n] if rows != n else y

    @staticmethod
    def backward(ctx, gy: Tensor):
        state, kern, cache, n = ctx.state, ctx.kern, ctx.cache, ctx.n
        rows = _round_up(n, kern.row_align)
        need_x = ctx.needs_input_grad[0]
        need_w = any(ctx.needs_input_grad[4:])
        dx = None
        dparts: list[Optional[Tensor]] = [None] * len(ctx.part_meta)
        with torch.autocast(gy.device.type, enabled=False):
            gq, gt = kern.quant(gy, state._grad_inv, state.grad_dtype, rows, want_row=need_x, want_t=need_w)
            if need_x:
                dx = kern.mm(gq, cache.col, state.grad_scale, state.w_scale, gy.dtype, False)
                dx = dx[:n] if rows != n else dx
            if need_w:
                dw = kern.mm(gt, ctx.xt, state.grad_scale, state.x_scale, ctx.part_meta[0][1], False)
                start = 0
                for i, (size, dtype) in enumerate(ctx.part_meta):
                    if ctx.needs_input_grad[4 + i]:
                        dparts[i] = dw[start:start + size].to(dtype)
                    start += size
        ctx.xt = ctx.cache = None
        return (dx, None, None, None, *dparts)


def _as_parts(weight: Union[Tensor, Sequence[Tensor]]) -> tuple[Tensor, ...]:
    parts = (weight,) if isinstance(weight, Tensor) else tuple(weight)
    if not parts or any(p.dim() != 2 or p.shape[1] != parts[0].shape[1] for p in parts):
        raise ValueError("fp8_linear: weight must be a 2-D [out, in] tensor or a sequence of them with the "
                         f"same `in`; got shapes {[tuple(p.shape) for p in parts]}")
    return parts


@torch.compiler.disable
def fp8_linear(x: Tensor, weight: Union[Tensor, Sequence[Tensor]], state: Fp8LinearState) -> Tensor:
    """``x @ weightᵀ`` with e4m3 operands forward and the state's gradient format backward.

    Args:
        x: ``[..., in]`` activations (bf16 on GPU).
        weight: ``[out, in]`` (nn.Linear layout), or a sequence of such blocks stacked along
            ``out`` (e.g. ``(qk_w.flatten(0, 1), v_w)``): pass parameters or views of them,
            not a tensor recomputed every forward, or the FP8 cache is rebuilt every call.
        state: the layer's :class:`Fp8LinearState`; in eval mode this is a plain matmul.

    Returns:
        ``[..., out]`` in ``x.dtype``.
    """
    parts = _as_parts(weight)
    if x.shape[-1] != parts[0].shape[1]:
        raise ValueError(f"fp8_linear: x has {x.shape[-1]} features, weight expects {parts[0].shape[1]}")
    if not state.training:
        w = parts[0] if len(parts) == 1 else torch.cat(parts)
        return F.linear(x, w.to(x.dtype))
    kern = state._kernels(x.device)
    _check_aligned(kern, state.config_key, x.shape[-1], sum(p.shape[0] for p in parts))
    cache = state.cache_for(parts, kern)
    lead = x.shape[:-1]
    y = _Fp8LinearFunction.apply(x.reshape(-1, x.shape[-1]), state, kern, cache, *parts)
    return y.reshape(*lead, y.shape[-1])


def _check_aligned(kern: Any, config_key: str, *dims: int) -> None:
    if kern.row_align > 1 and any(d % kern.row_align for d in dims):
        raise ValueError(f"{config_key}: FP8 GEMMs need feature dimensions that are multiples of "
                         f"{kern.row_align}; got {dims}. Switch {config_key} off for this shape.")


# ---------------------------------------------------------------------------------------
# FP8 MLP
# ---------------------------------------------------------------------------------------


class Fp8MLPState(_Fp8State):
    """Scales, amax history and weight caches of one FP8 ReLU² MLP (RECORD §7).

    Buffers (checkpointed): ``x_scale`` (static 2⁻⁴), ``w1_scale``/``w2_scale`` and the
    weight amaxes of the last refresh ``w1_amax``/``w2_amax`` (lagged scales),
    ``post_scale``/``post_amax`` and ``dpre_scale``/``dpre_amax`` (delayed scales and the
    running maxima since the last refresh), ``grad_scale`` (static 2⁻⁶) and
    ``refresh_count``.

    Args:
        backend: ``"auto"``, ``"emulated"`` or ``"scaled_mm"``.
        relu2_kernel: how the two GEMM+nonlinearity steps run on the fast path:
            ``"elementwise"`` (cuBLAS GEMM, then one fused Triton pass) or
            ``"gemm_epilogue"`` (one Triton GEMM with the nonlinearity and quantization in
            its epilogue); ``"auto"`` = ``DEFAULT_RELU2_KERNEL``. The emulated path computes
            the same values either way.
        grad_scale: static scale of the incoming gradient (see the module docstring).
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
        self.register_buffer("x_scale", _scalar(NORMED_X_SCALE))
        self.register_buffer("w1_scale", _scalar(1.0))
        self.register_buffer("w2_scale", _scalar(1.0))
        self.register_buffer("w1_amax", _scalar(0.0))
        self.register_buffer("w2_amax", _scalar(0.0))
        self.register_buffer("post_scale", _scalar(POST_SCALE_BOOTSTRAP))
        self.register_buffer("post_amax", _scalar(0.0))
        self.register_buffer("dpre_scale", _scalar(DPRE_SCALE_BOOTSTRAP))
        self.register_buffer("dpre_amax", _scalar(0.0))
        self.register_buffer("grad_scale", _scalar(grad_scale))
        for name in ("x", "w1", "w2", "post", "dpre", "grad"):
            self.register_buffer(f"_{name}_inv", _scalar(1.0), persistent=False)
        self._w1: Optional[_WeightCache] = None
        self._w2: Optional[_WeightCache] = None

    @torch.no_grad()
    def caches_for(self, w_fc: Tensor, w_proj: Tensor, kern: Any) -> tuple[_WeightCache, _WeightCache]:
        """FP8 copies of both weights, rebuilt (with every delayed scale) when either changed."""
        key = (_weight_key(w_fc), _weight_key(w_proj))
        if self._w1 is not None and self._cache_kern == kern.name and _keys_match(self._cache_key, key):
            return self._w1, self._w2
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
                caches.append(_WeightCache(row, col))
            _fold_delayed(self.post_amax, self.post_scale, POST_HEADROOM / E4M3_MAX, POST_SCALE_FLOOR)
            _fold_delayed(self.dpre_amax, self.dpre_scale, DPRE_HEADROOM / E5M2_MAX, DPRE_SCALE_FLOOR)
            for name in ("x", "post", "dpre", "grad"):
                torch.reciprocal(getattr(self, f"{name}_scale"), out=getattr(self, f"_{name}_inv"))
            self.refresh_count.add_(1)
        self._w1, self._w2 = caches
        self._cache_key, self._cache_kern = key, kern.name
        self._refreshes += 1
        return self._w1, self._w2

    def _refresh_fused(self, w_fc: Tensor, w_proj: Tensor, exact: bool, kern: Any) -> list[_WeightCache]:
        """The same refresh as the PyTorch branch of :meth:`caches_for` in three launches (plus
        two amax passes in the exact phase): one kernel for every scale, one quantize pass per
        weight that also measures its amax for the next refresh. ~30 small launches fewer."""
        if exact:
            for w, amax in ((w_fc, self.w1_amax), (w_proj, self.w2_amax)):
                amax.copy_(w.abs().amax())
        kern.refresh_scales(self, exact)
        return [_WeightCache(*kern.quant_weight_into(w, inv, amax))
                for w, inv, amax in ((w_fc, self._w1_inv, self.w1_amax), (w_proj, self._w2_inv, self.w2_amax))]


class _Fp8MLPFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, w_fc: Tensor, w_proj: Tensor, state: Fp8MLPState, kern: Any,
                c1: _WeightCache, c2: _WeightCache) -> Tensor:
        n = x.shape[0]
        rows = _round_up(n, kern.row_align)
        fused = state.relu2_kernel == "gemm_epilogue"
        with torch.autocast(x.device.type, enabled=False):
            xq, xt = kern.quant(x, state._x_inv, E4M3, rows)
            post, post_t = kern.up_relu2(xq, c1.row, state.x_scale, state.w1_scale, state._post_inv,
                                         state.post_amax, fused)
            y = kern.mm(post, c2.col, state.post_scale, state.w2_scale, x.dtype, True)
        ctx.state, ctx.kern, ctx.c1, ctx.c2, ctx.n = state, kern, c1, c2, n
        ctx.xt, ctx.post, ctx.post_t = xt, post, post_t
        ctx.dtypes = (x.dtype, w_fc.dtype, w_proj.dtype)
        return y[:n] if rows != n else y

    @staticmethod
    def backward(ctx, gy: Tensor):
        state, kern, c1, c2, n = ctx.state, ctx.kern, ctx.c1, ctx.c2, ctx.n
        x_dtype, w1_dtype, w2_dtype = ctx.dtypes
        rows = _round_up(n, kern.row_align)
        fused = state.relu2_kernel == "gemm_epilogue"
        dx = dw1 = dw2 = None
        with torch.autocast(gy.device.type, enabled=False):
            gq, gt = kern.quant(gy, state._grad_inv, E5M2, rows)
            if ctx.needs_input_grad[2]:
                dw2 = kern.mm(ctx.post_t, gt, state.post_scale, state.grad_scale, w2_dtype, False)
            if ctx.needs_input_grad[0] or ctx.needs_input_grad[1]:
                dq, dqt = kern.dpre(gq, c2.row, state.grad_scale, state.w2_scale, ctx.post, state.post_scale,
                                    state._dpre_inv, state.dpre_amax, fused)
                if ctx.needs_input_grad[1]:
                    dw1 = kern.mm(dqt, ctx.xt, state.dpre_scale, state.x_scale, w1_dtype, False)
                if ctx.needs_input_grad[0]:
                    dx = kern.mm(dq, c1.col, state.dpre_scale, state.w1_scale, x_dtype, False)
                    dx = dx[:n] if rows != n else dx
        ctx.xt = ctx.post = ctx.post_t = ctx.c1 = ctx.c2 = None
        return dx, dw1, dw2, None, None, None, None


@torch.compiler.disable
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
    """
    if w_fc.dim() != 2 or w_fc.shape != w_proj.shape or x.shape[-1] != w_fc.shape[1]:
        raise ValueError(f"fp8_mlp: expected x [..., D] and w_fc, w_proj both [H, D]; got {tuple(x.shape)}, "
                         f"{tuple(w_fc.shape)}, {tuple(w_proj.shape)}")
    if not state.training:
        h = F.relu(x @ w_fc.to(x.dtype).t()).square()
        return h @ w_proj.to(x.dtype)
    kern = state._kernels(x.device)
    _check_aligned(kern, state.config_key, *w_fc.shape)
    c1, c2 = state.caches_for(w_fc, w_proj, kern)
    lead = x.shape[:-1]
    y = _Fp8MLPFunction.apply(x.reshape(-1, x.shape[-1]), w_fc, w_proj, state, kern, c1, c2)
    return y.reshape(*lead, y.shape[-1])


# ---------------------------------------------------------------------------------------
# FP8 lm_head for the fused softcapped cross-entropy
# ---------------------------------------------------------------------------------------


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
        backend: ``"auto"``, ``"emulated"`` or ``"scaled_mm"``.
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
        _check_aligned(kern, st.config_key, *weight.shape)
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
        cols = rows.t() if kern.name == "emulated" else self._transpose(rows)
        return _HeadOperands(rows, cols)

    def _transpose(self, q: Tensor) -> Tensor:
        """Contiguous transpose of an fp8 matrix (exact: a scale-1 requantization)."""
        from .triton.fp8_quant import quantize_dual

        if self._one is None or self._one.device != q.device:
            self._one = torch.ones((), dtype=torch.float32, device=q.device)
        _, t, _ = quantize_dual(q, self._one, q.dtype, write_row=False, write_t=True)
        return t

    def logits(self, x: Tensor, w: _HeadOperands) -> tuple[Tensor, float]:
        st, kern = self.state, self._kern
        r = x.shape[0]
        rows = _round_up(r, kern.row_align)
        with torch.autocast(x.device.type, enabled=False):
            xq, xt = kern.quant(x, st._x_inv, E4M3, rows)
            logits = kern.mm(xq, w.rows, st.x_scale, st.w_scale, self.logits_dtype, True)
        self._chunk = (x, xt, None, None)
        return (logits[:r] if rows != r else logits), 1.0

    def grad_buffer(self, logits: Tensor) -> tuple[Tensor, float]:
        r, p = logits.shape
        rows = _round_up(r, self._kern.row_align)
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
            gt = full.t() if kern.name == "emulated" else self._transpose(full)
            part = kern.mm(gt, xt, self._g_scale, st.x_scale, torch.float32, False)
        self._chunk = None
        if acc is None:
            return part
        return acc.add_(part)
