"""FP8 linear layer ``y = x @ Wᵀ``: the QKV projection and the lm_head's scales (RECORD §7)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import Tensor

from .backends import check_aligned
from .cache import Fp8State, WeightCache, keep_addresses, keys_match, scalar_buffer, weight_key
from .formats import (
    E4M3_MAX,
    GRAD_DTYPES,
    HEAD_GRAD_SCALE,
    HEAD_W_SCALE,
    HEAD_X_SCALE,
    NORMED_X_SCALE,
    QKV_GRAD_SCALE,
    RECORD_QKV_X_SCALE,
    WEIGHT_AMAX_FLOOR,
)
from .ops import fp8_linear_call, fp8_linear_q_call, fp8_quant_input_call, kernel_id


@dataclass
class QuantizedInput:
    """An activation and its two FP8 copies, made once for every FP8 linear layer that reads it
    (RECORD §2/§7: layers 8 and 10 read norm(cache[7]), quantized once).

    ``x_scale`` is the dequantization scale the copies were made at (the quantizing layer's); every
    reader's GEMMs dequantize with it. Build it with :meth:`Fp8LinearState.quantize_input`.
    """

    x: Tensor
    xq: Tensor
    xt: Tensor
    x_scale: Tensor


class Fp8LinearState(Fp8State):
    """Scales and weight cache of one FP8 linear layer ``y = x @ Wᵀ``.

    Defaults are the record's QKV projection (RECORD §7): e4m3 input at a static scale,
    exact per-refresh weight scale, e4m3 gradient at the static scale 1/448.
    :meth:`for_lm_head` gives the lm_head's static scales, :meth:`for_record_qkv` the
    record's QKV input scale.

    Args:
        x_scale: static dequantization scale of the input. Default 2⁻⁴, clip-free for
            RMSNorm outputs of width <= 784 (the record's QKV used 8/448, which clips |x| > 8).
        weight_scale: static weight scale; None = exact amax/448 at every refresh.
        grad_dtype: ``"e4m3"`` or ``"e5m2"``, format of the incoming gradient.
        grad_scale: static dequantization scale of the incoming gradient (see "Loss
            normalization" in ``fp8.md``).
        backend: ``"auto"``, ``"reference"`` or ``"scaled_mm"``.
        config_key: the config option that switched this layer to FP8, named in errors.
    """

    def __init__(self, x_scale: float = NORMED_X_SCALE, weight_scale: Optional[float] = None,
                 grad_dtype: Literal["e4m3", "e5m2"] = "e4m3", grad_scale: float = QKV_GRAD_SCALE,
                 backend: str = "auto", config_key: str = "model.gpt.fp8_qkv") -> None:
        super().__init__(backend, config_key)
        if grad_dtype not in GRAD_DTYPES:
            raise ValueError(f"{config_key}: grad_dtype must be 'e4m3' or 'e5m2', got {grad_dtype!r}")
        self.grad_dtype = GRAD_DTYPES[grad_dtype]
        self.exact_weight_scale = weight_scale is None
        self.register_buffer("x_scale", scalar_buffer(x_scale))
        self.register_buffer("w_scale", scalar_buffer(1.0 if weight_scale is None else weight_scale))
        self.register_buffer("grad_scale", scalar_buffer(grad_scale))
        self.register_buffer("w_amax", scalar_buffer(0.0))  # amax of the weight at the last refresh
        for name in ("x", "w", "grad"):
            self.register_buffer(f"_{name}_inv", scalar_buffer(1.0), persistent=False)
        self._cache: Optional[WeightCache] = None
        self._kern_id = -1  # the backend's index in ops._KERNELS, set at each refresh

    def refresh(self, parts: Sequence[Tensor]) -> WeightCache:
        """The weight cache of ``parts`` (row blocks stacked along ``out``), refreshed if stale (eager)."""
        kern = self._kernels(parts[0].device)
        check_aligned(kern, self.config_key, parts[0].shape[1], sum(p.shape[0] for p in parts))
        return self.cache_for(parts, kern)

    def current_cache(self) -> WeightCache:
        """The weight cache as the last refresh left it (inside a compiled forward, which cannot run
        the staleness check)."""
        if self._cache is None:
            raise RuntimeError(f"{self.config_key}: the FP8 linear ran inside torch.compile before its weight cache "
                               "was built; call the model's refresh_fp8() (or state.refresh) before the "
                               "compiled forward")
        return self._cache

    def operator_args(self, cache: WeightCache) -> tuple:
        """The arguments of ``ops.fp8_linear_call`` after ``x`` and the weight's blocks: the cache,
        the scales and their reciprocals, the backend and the gradient format."""
        return (cache.row, cache.col, self.x_scale, self._x_inv, self.w_scale, self.grad_scale, self._grad_inv,
                self._kern_id, self.grad_dtype)

    @classmethod
    def for_lm_head(cls, backend: str = "auto", config_key: str = "model.gpt.fp8_head") -> "Fp8LinearState":
        """The record's lm_head scales (RECORD §7): x 100/448, weight 2/448, e5m2 gradient (0.75/8)/448."""
        return cls(x_scale=HEAD_X_SCALE, weight_scale=HEAD_W_SCALE, grad_dtype="e5m2",
                   grad_scale=HEAD_GRAD_SCALE, backend=backend, config_key=config_key)

    @classmethod
    def for_record_qkv(cls, backend: str = "auto", config_key: str = "model.gpt.fp8_qkv") -> "Fp8LinearState":
        """The record's QKV scales (RECORD §7): static input scale 8/448, so |x| > 8 saturates at
        ±448 in e4m3 (never inf); exact weight scale over all row blocks; e4m3 gradient at 1/448."""
        return cls(x_scale=RECORD_QKV_X_SCALE, backend=backend, config_key=config_key)

    @torch.no_grad()
    def cache_for(self, parts: Sequence[Tensor], kern: Any) -> WeightCache:
        """The FP8 copies of the row-stacked ``parts``; rebuilt only when a part changed."""
        key = tuple(weight_key(p) for p in parts)
        self._kern_id = kernel_id(kern)
        if self._cache is not None and self._cache_kern == kern.name and keys_match(self._cache_key, key):
            return self._cache
        self._before_refresh(tuple(parts), kern)
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
        new = WeightCache(row, col)
        self._cache = keep_addresses(self._cache, new) if self._hold else new
        self._cache_key, self._cache_kern = key, kern.name
        self._count_refresh()
        return self._cache

    def quantize_input(self, x: Tensor) -> QuantizedInput:
        """``x`` [n, in] with its FP8 copies at this layer's input scale, for several layers to read
        (``fp8_linear(..., quantized=...)``). The layer's cache must have been refreshed (the
        backend and the reciprocal scales are set there)."""
        if self._cache is None:
            raise RuntimeError(f"{self.config_key}: quantize_input before the layer's first refresh; "
                               "refresh its weight cache first (state.refresh or the model's refresh_fp8())")
        xq, xt = fp8_quant_input_call(x, self._x_inv, self._kern_id)
        return QuantizedInput(x, xq, xt, self.x_scale)

    def _refresh_with(self, weights: tuple, kern: Any) -> None:
        self.cache_for(weights, kern)

    def cache_tensors(self) -> list[Tensor]:
        return [] if self._cache is None else [self._cache.row, self._cache.col]


def _as_parts(weight: Union[Tensor, Sequence[Tensor]]) -> tuple[Tensor, ...]:
    parts = (weight,) if isinstance(weight, Tensor) else tuple(weight)
    if not parts or any(p.dim() != 2 or p.shape[1] != parts[0].shape[1] for p in parts):
        raise ValueError("fp8_linear: weight must be a 2-D [out, in] tensor or a sequence of them with the "
                         f"same `in`; got shapes {[tuple(p.shape) for p in parts]}")
    return parts


def fp8_linear(x: Tensor, weight: Union[Tensor, Sequence[Tensor]], state: Fp8LinearState,
               gain: Optional[Tensor] = None, quantized: Optional[QuantizedInput] = None) -> Tensor:
    """``x @ (gain·weight)ᵀ`` with e4m3 operands forward and the state's gradient format backward.

    Args:
        x: ``[..., in]`` activations (bf16 on GPU).
        weight: ``[out, in]`` (nn.Linear layout), or a sequence of such blocks stacked along
            ``out`` (e.g. ``(qk_w.flatten(0, 1), v_w)``): pass parameters or views of them,
            not a tensor recomputed every forward, or the FP8 cache is rebuilt every call.
        state: the layer's :class:`Fp8LinearState`; in eval mode this is a plain matmul.
        gain: a 0-dim scalar on the weight (the QKV's λ₀), or None. In training it is folded into
            the GEMMs' scales, and its gradient is ⟨dW, W⟩ over the weight (RECORD §7), not a
            pass over the ``[..., out]`` output.
        quantized: ``x`` already quantized (:meth:`Fp8LinearState.quantize_input`, ``x`` 2-D and
            ``quantized.x`` itself): the GEMMs read its copies at its scale instead of quantizing
            ``x`` again. Ignored outside training and with ``state.graph_break``.

    Returns:
        ``[..., out]`` in ``x.dtype``.

    The matmuls run as the custom operator ``nanogpt_pl::fp8_linear`` (``ops.py``), which
    ``torch.compile`` traces as one call. Inside a compiled region the weight cache is not
    checked: refresh it eagerly first (``state.refresh``; ``GPT.refresh_fp8`` does every layer's).
    """
    parts = _as_parts(weight)
    if x.shape[-1] != parts[0].shape[1]:
        raise ValueError(f"fp8_linear: x has {x.shape[-1]} features, weight expects {parts[0].shape[1]}")
    if not state.training:
        w = parts[0] if len(parts) == 1 else torch.cat(parts)
        return F.linear(x, (w if gain is None else w * gain).to(x.dtype))
    if state.graph_break and torch.compiler.is_compiling():
        return _fp8_linear_outside_graph(x, weight, state, gain)
    cache = state.current_cache() if torch.compiler.is_compiling() else state.refresh(parts)
    if quantized is not None:
        if quantized.x is not x:
            raise ValueError("fp8_linear: `quantized` holds another tensor than x; pass x as quantized.x")
        # the layer's own arguments, but the copies' scale for the input's
        row, col, _, _, *rest = state.operator_args(cache)
        return fp8_linear_q_call(x, quantized.xq, quantized.xt, list(parts), row, col, quantized.x_scale, *rest, gain)
    lead = x.shape[:-1]
    y, _ = fp8_linear_call(x.reshape(-1, x.shape[-1]), list(parts), *state.operator_args(cache), gain)
    return y.reshape(*lead, y.shape[-1])


# ``state.graph_break``: the same function, run by dynamo as a graph break (eagerly)
_fp8_linear_outside_graph = torch.compiler.disable(fp8_linear)
