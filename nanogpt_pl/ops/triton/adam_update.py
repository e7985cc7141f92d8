"""The dense Adam groups' update as one Triton pass: moments, bias correction, decay and step.

``nanogpt_pl.optim.adam.DistAdam._update`` in PyTorch makes about a dozen passes per
parameter (cast, lerp, mul and addcmul of the moments, the bias-corrected denominator, the
update, the decay mask, the step, the copy back); for the record's embedding and lm_head
(50,304 x 768 each) every pass is 150-300 MB. :func:`adam_update_` reads the gradient, both
moments and the parameter once and writes the moments and the parameter once, with the
reference's arithmetic in its order (torch's lerp formula; ``addcmul``'s ``value·a·b``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.autograd.graph import increment_version

from nanogpt_pl.ops.triton import interpret_mode
from nanogpt_pl.ops.triton.fp8_quant import store_rounded

_BLOCK = 64 if interpret_mode() else 1024


@triton.jit
def _adam_kernel(p_ptr, g_ptr, m_ptr, v_ptr, n, one_minus_beta1, beta2, one_minus_beta2, bias1, bias2, eps, lr, decay,
                 DECAY: tl.constexpr, CAUTIOUS: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    m = tl.load(m_ptr + offs, mask=mask, other=0.0)
    diff = g - m
    # m.lerp_(g, 1 - beta1), torch's formula for either side of 0.5
    if one_minus_beta1 < 0.5:
        m = m + one_minus_beta1 * diff
    else:
        m = g - diff * (1.0 - one_minus_beta1)
    v = tl.load(v_ptr + offs, mask=mask, other=0.0) * beta2 + one_minus_beta2 * g * g
    update = (m / bias1) / (tl.sqrt(v / bias2) + eps) * lr
    p = tl.load(p_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if DECAY:
        if CAUTIOUS:
            update = update + decay * p * tl.where(update * p > 0, 1.0, 0.0)
        else:
            update = update + decay * p
    p = p - update
    store_rounded(p_ptr + offs, p, mask)  # rounded to nearest even, as torch's copy_
    tl.store(m_ptr + offs, m, mask=mask)
    tl.store(v_ptr + offs, v, mask=mask)


def adam_update_(param: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, beta1: float, beta2: float,
                 step: int, eps: float, lr: float, decay: float, cautious: bool) -> None:
    """One Adam step of ``param`` in place (``DistAdam._update``'s formulas); the moments are updated too.

    Args:
        param: bf16 or fp32, contiguous; ``grad``: its gradient (any float dtype), contiguous, same shape.
        exp_avg, exp_avg_sq: fp32 moments of the same shape, contiguous.
        step: the step count after this step (bias corrections ``1 - β^step``).
        lr: the group's lr times its lr multiplier; ``decay``: the decay factor of this step (0 for none).
        cautious: decay only where the update and the parameter agree in sign.
    """
    for name, t in (("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        if t.shape != param.shape or not t.is_contiguous():
            raise ValueError(f"adam_update_: {name} must be contiguous and of the parameter's shape "
                             f"{tuple(param.shape)}, got {tuple(t.shape)}")
    if exp_avg.dtype != torch.float32 or exp_avg_sq.dtype != torch.float32 or not param.is_contiguous():
        raise ValueError("adam_update_: fp32 moments and a contiguous parameter")
    n = param.numel()
    if n:
        _adam_kernel[(triton.cdiv(n, _BLOCK),)](
            param, grad, exp_avg, exp_avg_sq, n, 1.0 - beta1, beta2, 1.0 - beta2, 1.0 - beta1**step,
            1.0 - beta2**step, eps, lr, decay, DECAY=bool(decay), CAUTIOUS=bool(cautious), BLOCK=_BLOCK, num_warps=4,
        )
    # a kernel's writes are invisible to autograd's version counters, which the FP8 weight caches
    # (nanogpt_pl.ops.fp8.cache) read to see that a weight changed
    increment_version([param, exp_avg, exp_avg_sq])
