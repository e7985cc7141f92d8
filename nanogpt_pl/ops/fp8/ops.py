"""The FP8 linear and MLP as ``torch.library`` custom operators, forward and backward.

``torch.compile`` traces a custom operator as one opaque call, so the model's forward compiles
as one graph with the FP8 matmuls inside it (an ``autograd.Function`` holding the layer state
had to be ``torch.compiler.disable``d: a graph break per layer, and the layer loop left eager).
The operators are functional, as an autograd formula requires:

- the forward returns the running maximum it measured (``post`` of the MLP) as an output; the
  caller folds it into the state's buffer;
- the backward's maximum (``dpre`` of the MLP) cannot be an output of the forward, so it leaves
  as the gradient of a scalar "probe" leaf the forward takes: the probe's post-accumulate hook
  folds it into the state's ``dpre_amax`` and clears the gradient (:func:`amax_probe`).

The weight caches and scales are inputs, refreshed eagerly before the forward (``caches_for``).
Which backend runs (reference, the fast path, or a test's stand-in) is an integer index into
:data:`_KERNELS`, a constant of the traced graph.

Eager calls skip the dispatcher: ``fp8_linear_call`` and ``fp8_mlp_call`` run the operators'
own forward and backward functions inside an ``autograd.Function`` (``_EagerLinear``,
``_EagerMLP``) unless ``torch.compile`` is tracing, which costs about half the host time per
call (``benchmarks/fp8_mlp.py --host``) and gives the same numbers.
"""

from __future__ import annotations

import weakref
from typing import Any, Optional

import torch
from torch import Tensor

from .backends import round_up
from .formats import E4M3, E5M2

_KERNELS: list[Any] = []


def kernel_id(kern: Any) -> int:
    """The index of a backend object (``_REFERENCE``, ``_FAST``, a test's stand-in) in :data:`_KERNELS`."""
    for i, k in enumerate(_KERNELS):
        if k is kern:
            return i
    _KERNELS.append(kern)
    return len(_KERNELS) - 1


def _own(t: Tensor, *others: Tensor) -> Tensor:
    """``t`` as a contiguous tensor sharing no memory with ``others`` (operator outputs may not alias)."""
    t = t.contiguous()
    if any(t.untyped_storage().data_ptr() == o.untyped_storage().data_ptr() for o in others):
        t = t.clone()
    return t


def _backend(kern: int, n: int) -> tuple[Any, int]:
    """The backend of index ``kern`` and the row count ``n`` is padded to for its GEMMs."""
    k = _KERNELS[kern]
    return k, round_up(n, k.row_align)


def _unpadded(t: Tensor, n: int) -> Tensor:
    """The first ``n`` rows of a GEMM output computed on padded rows, as an operator output."""
    return _own(t[:n] if t.shape[0] != n else t)


def _fp8_t(rows: int, cols: int, like: Tensor, dtype: torch.dtype) -> Tensor:
    return like.new_empty((rows, cols), dtype=dtype)


# -- probes: a backward's running maximum, out through a gradient ---------------------------------
def _fold_probe(target: "weakref.ref[Tensor]", probe: Tensor) -> None:
    buf = target()
    if buf is not None and probe.grad is not None:
        with torch.no_grad():
            torch.maximum(buf, probe.grad, out=buf)  # in place: one launch, where max-then-copy made two
    probe.grad = None


def amax_probe(buffer: Tensor) -> Tensor:
    """A scalar leaf whose gradient, at each accumulation, is max-folded into ``buffer`` and dropped."""
    probe = torch.zeros((), dtype=torch.float32, device=buffer.device, requires_grad=True)
    probe.register_post_accumulate_grad_hook(lambda p, t=weakref.ref(buffer): _fold_probe(t, p))
    return probe


# -- linear: y = x @ Wᵀ ---------------------------------------------------------------------------
def _gained(w_scale: Tensor, gain: Optional[Tensor]) -> Tensor:
    """The weight's dequantization scale with the layer's gain folded in (``w_scale`` without one)."""
    return w_scale if gain is None else w_scale * gain.float()


def _linear_forward(x: Tensor, parts: list[Tensor], w_row: Tensor, w_col: Tensor, x_scale: Tensor, x_inv: Tensor,
                    w_scale: Tensor, grad_scale: Tensor, grad_inv: Tensor, kern: int,
                    grad_dtype: torch.dtype, gain: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    """``(y [n, out] in x's dtype, xᵀ [in, rows] e4m3)``; ``parts`` (the weight's row blocks) only
    receive the gradient, the GEMM reads the cache ``w_row``. ``gain`` (a 0-dim tensor, or None)
    multiplies the weight: y = x @ (gain·W)ᵀ, with gain folded into the GEMM's weight scale, so no
    pass over y multiplies it afterwards (RECORD §7: λ₀ on the QKV weights)."""
    n = x.shape[0]
    k, rows = _backend(kern, n)
    with torch.autocast(x.device.type, enabled=False):
        xq, xt = k.quant(x, x_inv, E4M3, rows, want_row=True, want_t=True)
        y = k.mm(xq, w_row, x_scale, _gained(w_scale, gain), x.dtype, True)
    y = _unpadded(y, n)
    return y, _own(xt, y)


fp8_linear_op = torch.library.custom_op("nanogpt_pl::fp8_linear", mutates_args=())(_linear_forward)


@fp8_linear_op.register_fake
def _(x, parts, w_row, w_col, x_scale, x_inv, w_scale, grad_scale, grad_inv, kern, grad_dtype, gain):
    _, rows = _backend(kern, x.shape[0])
    return x.new_empty((x.shape[0], w_row.shape[0])), _fp8_t(x.shape[1], rows, x, E4M3)


def _linear_backward_impl(gy: Tensor, xt: Tensor, w_col: Tensor, x_scale: Tensor, w_scale: Tensor,
                          grad_scale: Tensor, grad_inv: Tensor, kern: int, grad_dtype: torch.dtype,
                          w_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """``(dx [n, in] in gy's dtype, dW [out, in] in w_dtype)``."""
    n = gy.shape[0]
    k, rows = _backend(kern, n)
    with torch.autocast(gy.device.type, enabled=False):
        gq, gt = k.quant(gy, grad_inv, grad_dtype, rows, want_row=True, want_t=True)
        dx = k.mm(gq, w_col, grad_scale, w_scale, gy.dtype, False)
        dw = k.mm(gt, xt, grad_scale, x_scale, w_dtype, False)
    dx = _unpadded(dx, n)
    return dx, _own(dw, dx)


fp8_linear_backward = torch.library.custom_op("nanogpt_pl::fp8_linear_backward",
                                              mutates_args=())(_linear_backward_impl)


@fp8_linear_backward.register_fake
def _(gy, xt, w_col, x_scale, w_scale, grad_scale, grad_inv, kern, grad_dtype, w_dtype):
    return gy.new_empty((gy.shape[0], w_col.shape[0])), gy.new_empty((w_col.shape[1], w_col.shape[0]), dtype=w_dtype)


def _save_linear(ctx, xt: Tensor, parts: list[Tensor], w_col: Tensor, x_scale: Tensor, w_scale: Tensor,
                 grad_scale: Tensor, grad_inv: Tensor, kern: int, grad_dtype: torch.dtype,
                 gain: Optional[Tensor]) -> None:
    """What :func:`_linear_grads` reads, for either linear operator."""
    # with a gain, the weight itself too: the gain's gradient is ⟨dW, W⟩
    ctx.save_for_backward(xt, w_col, x_scale, w_scale, grad_scale, grad_inv, gain,
                          *(parts if gain is not None else ()))
    ctx.kern, ctx.grad_dtype = kern, grad_dtype
    ctx.part_meta = [(p.shape[0], p.dtype) for p in parts]


def _linear_setup(ctx, inputs, output) -> None:
    x, parts, w_row, w_col, x_scale, x_inv, w_scale, grad_scale, grad_inv, kern, grad_dtype, gain = inputs
    _save_linear(ctx, output[1], parts, w_col, x_scale, w_scale, grad_scale, grad_inv, kern, grad_dtype, gain)


def _linear_grads(ctx, gy: Tensor, backward) -> tuple[Tensor, list[Tensor], Optional[Tensor]]:
    """``(dx, the weight blocks' gradients, the gain's gradient)`` of either linear operator."""
    xt, w_col, x_scale, w_scale, grad_scale, grad_inv, gain, *parts = ctx.saved_tensors
    # dx = gy @ (gain·W): the gain in the GEMM's scale; dW comes out without it (gyᵀx)
    dx, dw = backward(gy.contiguous(), xt, w_col, x_scale, _gained(w_scale, gain), grad_scale, grad_inv, ctx.kern,
                      ctx.grad_dtype, ctx.part_meta[0][1])
    dgain = None
    if gain is not None:
        # RECORD §7: the gain's gradient is ⟨dW, W⟩, a sum over the weight (not over the [n, out]
        # activations, as autograd of y·gain would be); the weight's own gradient is gain·dW
        w = parts[0] if len(parts) == 1 else torch.cat(parts)
        dgain = (dw.float() * w.float()).sum().to(gain.dtype)
        dw = dw * gain.to(dw.dtype)
    dparts, start = [], 0
    for size, dtype in ctx.part_meta:
        dparts.append(dw[start:start + size].to(dtype))
        start += size
    return dx, dparts, dgain


def _linear_backward(ctx, gy: Tensor, gxt: Tensor, backward=fp8_linear_backward):
    dx, dparts, dgain = _linear_grads(ctx, gy, backward)
    return dx, dparts, None, None, None, None, None, None, None, None, None, dgain


fp8_linear_op.register_autograd(_linear_backward, setup_context=_linear_setup)


class _EagerLinear(torch.autograd.Function):
    """The operator's forward and backward without the dispatcher, for eager calls (the operator
    costs about twice the host time per call; a compiled graph needs the operator). The weight's
    blocks come last, one argument each: autograd tracks tensor arguments, not lists."""

    @staticmethod
    def forward(ctx, x, w_row, w_col, x_scale, x_inv, w_scale, grad_scale, grad_inv, kern, grad_dtype, gain,
                *parts):
        inputs = (x, list(parts), w_row, w_col, x_scale, x_inv, w_scale, grad_scale, grad_inv, kern, grad_dtype,
                  gain)
        out = _linear_forward(*inputs)
        _linear_setup(ctx, inputs, out)
        ctx.mark_non_differentiable(out[1])
        return out

    @staticmethod
    def backward(ctx, gy, gxt):
        dx, dparts, *_, dgain = _linear_backward(ctx, gy, gxt, backward=_linear_backward_impl)
        return (dx,) + (None,) * 9 + (dgain,) + tuple(dparts)


def fp8_linear_call(x: Tensor, parts: list[Tensor], w_row: Tensor, w_col: Tensor, x_scale: Tensor, x_inv: Tensor,
                    w_scale: Tensor, grad_scale: Tensor, grad_inv: Tensor, kern: int,
                    grad_dtype: torch.dtype, gain: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    """``fp8_linear_op``'s result: through the operator when compiling, else its eager twin."""
    if torch.compiler.is_compiling():
        return fp8_linear_op(x, parts, w_row, w_col, x_scale, x_inv, w_scale, grad_scale, grad_inv, kern, grad_dtype,
                             gain)
    return _EagerLinear.apply(x, w_row, w_col, x_scale, x_inv, w_scale, grad_scale, grad_inv, kern, grad_dtype,
                              gain, *parts)


# -- one quantized input for several linear layers ------------------------------------------------
# RECORD §2/§7: layers 8 and 10 both read norm(cache[7]), and the record quantizes it once. The
# input's two FP8 copies come from one operator; each layer's GEMMs then read them through
# ``fp8_linear_q``, which differs from ``fp8_linear`` only in taking the copies as inputs.
def _quant_input(x: Tensor, x_inv: Tensor, kern: int) -> tuple[Tensor, Tensor]:
    """``(x e4m3 [rows, in], xᵀ e4m3 [in, rows])`` at ``x_inv``, rows padded for the backend's GEMMs."""
    k, rows = _backend(kern, x.shape[0])
    with torch.autocast(x.device.type, enabled=False):
        xq, xt = k.quant(x, x_inv, E4M3, rows, want_row=True, want_t=True)
    xq = _own(xq)
    return xq, _own(xt, xq)


fp8_quant_input_op = torch.library.custom_op("nanogpt_pl::fp8_quant_input", mutates_args=())(_quant_input)


@fp8_quant_input_op.register_fake
def _(x, x_inv, kern):
    _, rows = _backend(kern, x.shape[0])
    return _fp8_t(rows, x.shape[1], x, E4M3), _fp8_t(x.shape[1], rows, x, E4M3)


def fp8_quant_input_call(x: Tensor, x_inv: Tensor, kern: int) -> tuple[Tensor, Tensor]:
    """The input's two FP8 copies (no gradient flows through them: the layers' operators take ``x`` too)."""
    x = x.detach()
    if torch.compiler.is_compiling():
        return fp8_quant_input_op(x, x_inv, kern)
    return _quant_input(x, x_inv, kern)


def _linear_q_forward(x: Tensor, xq: Tensor, xt: Tensor, parts: list[Tensor], w_row: Tensor, w_col: Tensor,
                      x_scale: Tensor, w_scale: Tensor, grad_scale: Tensor, grad_inv: Tensor, kern: int,
                      grad_dtype: torch.dtype, gain: Optional[Tensor]) -> Tensor:
    """``y [n, out]`` in x's dtype from the quantized input ``xq`` (``x`` itself only receives the
    gradient, and ``xt`` is kept for the weight's)."""
    n = x.shape[0]
    k, _ = _backend(kern, n)
    with torch.autocast(x.device.type, enabled=False):
        y = k.mm(xq, w_row, x_scale, _gained(w_scale, gain), x.dtype, True)
    return _unpadded(y, n)


fp8_linear_q_op = torch.library.custom_op("nanogpt_pl::fp8_linear_q", mutates_args=())(_linear_q_forward)


@fp8_linear_q_op.register_fake
def _(x, xq, xt, parts, w_row, w_col, x_scale, w_scale, grad_scale, grad_inv, kern, grad_dtype, gain):
    return x.new_empty((x.shape[0], w_row.shape[0]))


def _linear_q_setup(ctx, inputs, output) -> None:
    x, xq, xt, parts, w_row, w_col, x_scale, w_scale, grad_scale, grad_inv, kern, grad_dtype, gain = inputs
    _save_linear(ctx, xt, parts, w_col, x_scale, w_scale, grad_scale, grad_inv, kern, grad_dtype, gain)


def _linear_q_backward(ctx, gy: Tensor, backward=fp8_linear_backward):
    dx, dparts, dgain = _linear_grads(ctx, gy, backward)
    return (dx, None, None, dparts) + (None,) * 8 + (dgain,)


fp8_linear_q_op.register_autograd(_linear_q_backward, setup_context=_linear_q_setup)


class _EagerLinearQ(torch.autograd.Function):
    """``fp8_linear_q_op`` without the dispatcher, for eager calls (as ``_EagerLinear``)."""

    @staticmethod
    def forward(ctx, x, xq, xt, w_row, w_col, x_scale, w_scale, grad_scale, grad_inv, kern, grad_dtype, gain,
                *parts):
        inputs = (x, xq, xt, list(parts), w_row, w_col, x_scale, w_scale, grad_scale, grad_inv, kern, grad_dtype,
                  gain)
        y = _linear_q_forward(*inputs)
        _linear_q_setup(ctx, inputs, y)
        return y

    @staticmethod
    def backward(ctx, gy):
        dx, dparts, dgain = _linear_grads(ctx, gy, _linear_backward_impl)
        return (dx,) + (None,) * 10 + (dgain,) + tuple(dparts)


def fp8_linear_q_call(x: Tensor, xq: Tensor, xt: Tensor, parts: list[Tensor], w_row: Tensor, w_col: Tensor,
                      x_scale: Tensor, w_scale: Tensor, grad_scale: Tensor, grad_inv: Tensor, kern: int,
                      grad_dtype: torch.dtype, gain: Optional[Tensor]) -> Tensor:
    """``fp8_linear_q_op``'s result: through the operator when compiling, else its eager twin."""
    if torch.compiler.is_compiling():
        return fp8_linear_q_op(x, xq, xt, parts, w_row, w_col, x_scale, w_scale, grad_scale, grad_inv, kern,
                               grad_dtype, gain)
    return _EagerLinearQ.apply(x, xq, xt, w_row, w_col, x_scale, w_scale, grad_scale, grad_inv, kern, grad_dtype,
                               gain, *parts)


# -- MLP: relu(x @ w_fcᵀ)² @ w_proj -------------------------------------------------------------------
def _mlp_forward(x: Tensor, w_fc: Tensor, w_proj: Tensor, dpre_probe: Tensor, c1_row: Tensor, c1_col: Tensor,
                 c2_row: Tensor, c2_col: Tensor, x_scale: Tensor, x_inv: Tensor, w1_scale: Tensor, w2_scale: Tensor,
                 post_scale: Tensor, post_inv: Tensor, grad_scale: Tensor, grad_inv: Tensor, dpre_scale: Tensor,
                 dpre_inv: Tensor, kern: int, fused: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(y [n, D], xᵀ [D, rows] e4m3, post [rows, H] e4m3, postᵀ [H, rows] e4m3, max(post) fp32)``.

    ``w_fc``, ``w_proj`` and ``dpre_probe`` only receive gradients (the probe: max |dpre|)."""
    n = x.shape[0]
    k, rows = _backend(kern, n)
    amax = torch.empty((), dtype=torch.float32, device=x.device)  # max(post), cleared by the quantize
    with torch.autocast(x.device.type, enabled=False):
        xq, xt = k.quant(x, x_inv, E4M3, rows, clear=amax)
        post, post_t = k.up_relu2(xq, c1_row, x_scale, w1_scale, post_inv, amax, fused)
        y = k.mm(post, c2_col, post_scale, w2_scale, x.dtype, True)
    y = _unpadded(y, n)
    xt = _own(xt, y)
    post = _own(post, y, xt)
    return y, xt, post, _own(post_t, y, xt, post), amax


fp8_mlp_op = torch.library.custom_op("nanogpt_pl::fp8_mlp", mutates_args=())(_mlp_forward)


@fp8_mlp_op.register_fake
def _(x, w_fc, w_proj, dpre_probe, c1_row, c1_col, c2_row, c2_col, x_scale, x_inv, w1_scale, w2_scale,
      post_scale, post_inv, grad_scale, grad_inv, dpre_scale, dpre_inv, kern, fused):
    n, d = x.shape
    h = c1_row.shape[0]
    _, rows = _backend(kern, n)
    return (x.new_empty((n, c2_col.shape[0])), _fp8_t(d, rows, x, E4M3), _fp8_t(rows, h, x, E4M3),
            _fp8_t(h, rows, x, E4M3), x.new_empty((), dtype=torch.float32))


def _mlp_backward_impl(gy: Tensor, xt: Tensor, post: Tensor, post_t: Tensor, c1_col: Tensor, c2_row: Tensor,
                       x_scale: Tensor, w1_scale: Tensor, w2_scale: Tensor, post_scale: Tensor, grad_scale: Tensor,
                       grad_inv: Tensor, dpre_scale: Tensor, dpre_inv: Tensor, kern: int, fused: bool,
                       w1_dtype: torch.dtype, w2_dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(dx [n, D], dW_fc [H, D], dW_proj [H, D], max |dpre| fp32)``."""
    n = gy.shape[0]
    k, rows = _backend(kern, n)
    amax = torch.empty((), dtype=torch.float32, device=gy.device)  # max |dpre|, cleared by the quantize
    with torch.autocast(gy.device.type, enabled=False):
        gq, gt = k.quant(gy, grad_inv, E5M2, rows, clear=amax)
        dw2 = k.mm(post_t, gt, post_scale, grad_scale, w2_dtype, False)
        dq, dqt = k.dpre(gq, c2_row, grad_scale, w2_scale, post, post_scale, dpre_inv, amax, fused)
        dw1 = k.mm(dqt, xt, dpre_scale, x_scale, w1_dtype, False)
        dx = k.mm(dq, c1_col, dpre_scale, w1_scale, gy.dtype, False)
    dx = _unpadded(dx, n)
    dw1 = _own(dw1, dx)
    return dx, dw1, _own(dw2, dx, dw1), amax


fp8_mlp_backward = torch.library.custom_op("nanogpt_pl::fp8_mlp_backward", mutates_args=())(_mlp_backward_impl)


@fp8_mlp_backward.register_fake
def _(gy, xt, post, post_t, c1_col, c2_row, x_scale, w1_scale, w2_scale, post_scale, grad_scale, grad_inv,
      dpre_scale, dpre_inv, kern, fused, w1_dtype, w2_dtype):
    h, d = c2_row.shape[0], xt.shape[0]
    return (gy.new_empty((gy.shape[0], d)), gy.new_empty((h, d), dtype=w1_dtype),
            gy.new_empty((h, d), dtype=w2_dtype), gy.new_empty((), dtype=torch.float32))


def _mlp_setup(ctx, inputs, output) -> None:
    (x, w_fc, w_proj, dpre_probe, c1_row, c1_col, c2_row, c2_col, x_scale, x_inv, w1_scale, w2_scale,
     post_scale, post_inv, grad_scale, grad_inv, dpre_scale, dpre_inv, kern, fused) = inputs
    _, xt, post, post_t, _ = output
    ctx.save_for_backward(xt, post, post_t, c1_col, c2_row, x_scale, w1_scale, w2_scale, post_scale, grad_scale,
                          grad_inv, dpre_scale, dpre_inv)
    ctx.kern, ctx.fused, ctx.w_dtypes = kern, fused, (w_fc.dtype, w_proj.dtype)


def _mlp_backward(ctx, gy: Tensor, gxt, gpost, gpost_t, gamax, backward=fp8_mlp_backward):
    saved = ctx.saved_tensors
    dx, dw1, dw2, amax = backward(gy.contiguous(), *saved, ctx.kern, ctx.fused, *ctx.w_dtypes)
    return (dx, dw1, dw2, amax) + (None,) * 16


fp8_mlp_op.register_autograd(_mlp_backward, setup_context=_mlp_setup)


class _EagerMLP(torch.autograd.Function):
    """The operator's forward and backward without the dispatcher, for eager calls (as ``_EagerLinear``)."""

    @staticmethod
    def forward(ctx, *inputs):
        out = _mlp_forward(*inputs)
        _mlp_setup(ctx, inputs, out)
        ctx.mark_non_differentiable(*out[1:])
        return out

    @staticmethod
    def backward(ctx, gy, gxt, gpost, gpost_t, gamax):
        return _mlp_backward(ctx, gy, gxt, gpost, gpost_t, gamax, backward=_mlp_backward_impl)


def fp8_mlp_call(*inputs) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``fp8_mlp_op``'s result: through the operator when compiling, else its eager twin."""
    if torch.compiler.is_compiling():
        return fp8_mlp_op(*inputs)
    return _EagerMLP.apply(*inputs)
