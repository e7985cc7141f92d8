"""ANVIL's elementwise update as Triton kernels: the rails and lookahead, the lanes and the step.

``nanogpt_pl.optim.anvil`` writes the per-bank update as PyTorch functions around the polar
cascade: ``rails_lookahead`` before it and ``finish_update`` after it. Run eagerly they are
about forty full passes over the bank (casts, lerps, squares, reductions, the bit
arithmetic of the fp32 master), fp32 mostly. Here:

1. :func:`rails_lookahead_`: one pass reads the gradient and both rails, writes both rails
   and the fp32 lookahead ``u`` (the same lerps as the reference, with torch's lerp formula);
2. :func:`finish_update_`, three kernels:

   a. the mean square of every lane of the cascade's output (a row when rows >= cols, else a
      column), one program per (matrix, block of lanes);
   b. per matrix: the lane-energy EMA, the gains, the Frobenius norms before and after, and
      one scale per lane, written over the lane powers;
   c. one pass over the bank: ``v = x·scale``, the cautious decay gated on the slow rail and
      the step, on the fp32 master rebuilt from the bf16 weight's bits and the sidecar, then
      split back into both.

The per-step scalars (momentum, lerp weights, lr, ...) are read from the device buffer the
optimizer fills each step (0-dim tensor views), never passed as Python numbers, so a CUDA
graph of the update replays with the current step's values.

The arithmetic is the reference's, in its order; reductions are tree sums, so the lane
powers, and through them the update, can differ from PyTorch's in the last fp32 bits.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.autograd.graph import increment_version

from nanogpt_pl.ops.triton import interpret_mode

# Elements per program of the elementwise kernels; lanes x lane elements per tile of the
# reduction. Small under the interpreter, so the CPU tests cross block and tile edges.
_BLOCK = 64 if interpret_mode() else 1024
_LANES, _ELEMS = (8, 16) if interpret_mode() else (64, 64)


@triton.jit
def _lerp(start, end, weight):
    # torch.lerp's formula: weight·(end - start) from the start for |weight| < 0.5, else from the end
    diff = end - start
    return tl.where(tl.abs(weight) < 0.5, start + weight * diff, end - diff * (1.0 - weight))


@triton.jit
def _rails_kernel(g_ptr, fast_ptr, slow_ptr, u_ptr, a_fast_ptr, a_slow_ptr, blend_ptr, mu_ptr, n,
                  BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    fast = _lerp(tl.load(fast_ptr + offs, mask=mask, other=0.0), g, tl.load(a_fast_ptr))
    slow = _lerp(tl.load(slow_ptr + offs, mask=mask, other=0.0), g, tl.load(a_slow_ptr))
    w = tl.load(blend_ptr)
    m = w * fast + (1.0 - w) * slow
    u = _lerp(g, m, tl.load(mu_ptr))
    tl.store(fast_ptr + offs, fast, mask=mask)
    tl.store(slow_ptr + offs, slow, mask=mask)
    tl.store(u_ptr + offs, u, mask=mask)


def rails_lookahead_(g: Tensor, rails: Tensor, one_minus_fast: Tensor, one_minus_slow: Tensor, blend: Tensor,
                     mu: Tensor) -> Tensor:
    """``anvil.rails_lookahead``: advance both rails with ``g`` in place, return ``(1 − μ)·g + μ·m`` (fp32).

    Args:
        g: ``[n, rows, cols]`` gradient (bf16 or fp32), contiguous.
        rails: ``[2, n, rows, cols]`` fp32 (fast, slow), contiguous.
        one_minus_fast, one_minus_slow, blend, mu: 0-dim fp32 device tensors (the step's scalars).
    """
    if rails.dtype != torch.float32 or rails.shape[0] != 2 or rails.shape[1:] != g.shape:
        raise ValueError(f"rails_lookahead_: fp32 rails [2, *{tuple(g.shape)}], got {rails.dtype} "
                         f"{tuple(rails.shape)}")
    if not (g.is_contiguous() and rails.is_contiguous()):
        raise ValueError("rails_lookahead_: the gradient and the rails must be contiguous")
    u = torch.empty(g.shape, dtype=torch.float32, device=g.device)
    n = g.numel()
    if n:
        _rails_kernel[(triton.cdiv(n, _BLOCK),)](g, rails[0], rails[1], u, one_minus_fast, one_minus_slow, blend, mu,
                                                 n, BLOCK=_BLOCK, num_warps=4)
    increment_version(rails)  # the kernel's writes, visible to autograd's version counters
    return u


@triton.jit
def _lane_power_kernel(x_ptr, power_ptr, lanes, length, lane_stride, elem_stride, matrix_stride,
                       BLOCK_L: tl.constexpr, BLOCK_K: tl.constexpr):
    m = tl.program_id(0).to(tl.int64)
    lane = tl.program_id(1) * BLOCK_L + tl.arange(0, BLOCK_L)
    lane_mask = lane < lanes
    base = x_ptr + m * matrix_stride + lane[:, None].to(tl.int64) * lane_stride
    acc = tl.zeros([BLOCK_L, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, length, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        t = tl.load(base + k[None, :].to(tl.int64) * elem_stride, mask=lane_mask[:, None] & (k < length)[None, :],
                    other=0.0).to(tl.float32)
        acc += t * t
    tl.store(power_ptr + m * lanes + lane, tl.sum(acc, axis=1) / length, mask=lane_mask)


@triton.jit
def _lane_scale_kernel(power_ptr, energy_ptr, lanes, length, a_lane_ptr, eps_ptr, BLOCK_L: tl.constexpr):
    m = tl.program_id(0).to(tl.int64)
    lane = tl.arange(0, BLOCK_L)
    mask = lane < lanes
    power = tl.load(power_ptr + m * lanes + lane, mask=mask, other=0.0)
    energy = tl.load(energy_ptr + m * lanes + lane, mask=mask, other=0.0)
    eps = tl.load(eps_ptr)
    pre = tl.sqrt(tl.sum(power, axis=0) * length)
    energy = _lerp(energy, power, tl.load(a_lane_ptr))
    gain = tl.math.rsqrt(tl.maximum(energy, eps))
    post = tl.sqrt(tl.sum(tl.where(mask, power * length * (gain * gain), 0.0), axis=0))
    scale = gain * (pre / tl.maximum(post, eps))
    tl.store(energy_ptr + m * lanes + lane, energy, mask=mask)
    tl.store(power_ptr + m * lanes + lane, scale, mask=mask)  # the scales replace the powers


@triton.jit
def _step_kernel(x_ptr, scale_ptr, slow_ptr, p_ptr, side_ptr, lr_mul_ptr, lr_ptr, wd_lr_ptr, n, rows, cols,
                 ROW_LANES: tl.constexpr, SIDECAR: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    matrix = offs // (rows * cols)
    if ROW_LANES:
        lane = offs // cols
    else:
        lane = matrix * cols + offs % cols
    v = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32) * tl.load(scale_ptr + lane, mask=mask, other=0.0)
    lr_eff = tl.load(lr_mul_ptr + matrix, mask=mask, other=0.0) * tl.load(lr_ptr)
    wd = tl.load(wd_lr_ptr) * lr_eff
    slow = tl.load(slow_ptr + offs, mask=mask, other=0.0)
    if SIDECAR:
        # the fp32 master: the bf16 weight's bits above the sidecar's 16
        hi = tl.load(p_ptr + offs, mask=mask, other=0).to(tl.int32) << 16
        lo = tl.load(side_ptr + offs, mask=mask, other=0).to(tl.int32) & 0xFFFF
        theta = (hi | lo).to(tl.float32, bitcast=True)
    else:
        theta = tl.load(p_ptr + offs, mask=mask, other=0.0)
    aligned = tl.where(slow * theta >= 0, 1.0, 0.0)
    theta = theta - theta * aligned * wd - v * lr_eff
    if SIDECAR:
        bits = theta.to(tl.int32, bitcast=True)
        tl.store(p_ptr + offs, (bits >> 16).to(tl.int16), mask=mask)
        tl.store(side_ptr + offs, bits.to(tl.int16), mask=mask)
    else:
        tl.store(p_ptr + offs, theta, mask=mask)


def finish_update_(x: Tensor, lane_energy: Tensor, slow: Tensor, params: Tensor, sidecar: Optional[Tensor],
                   lr_mul: Tensor, one_minus_lane: Tensor, eps: Tensor, wd_lr: Tensor, lr: Tensor,
                   lane_dim: int) -> None:
    """``anvil.finish_update``: lanes, cautious decay and the step, into ``params`` (and the sidecar) in place.

    Args:
        x: ``[n, rows, cols]`` the cascade's output (bf16 or fp32).
        lane_energy: ``[n, rows, 1]`` (``lane_dim`` -1: lanes are rows) or ``[n, 1, cols]`` (-2) fp32, updated.
        slow: ``[n, rows, cols]`` fp32, the slow rail (gates the decay).
        params: ``[n, rows, cols]`` bf16 (with ``sidecar`` int16, the master's low bits) or fp32 (no sidecar).
        lr_mul: ``[n, 1, 1]`` fp32 per-matrix lr multipliers.
        one_minus_lane, eps, wd_lr, lr: 0-dim fp32 device tensors (the step's scalars).
    """
    n, rows, cols = x.shape
    tensors = {"x": x, "lane_energy": lane_energy, "slow": slow, "params": params, "lr_mul": lr_mul}
    if sidecar is not None:
        tensors["sidecar"] = sidecar
    for name, t in tensors.items():
        if not t.is_contiguous():
            raise ValueError(f"finish_update_: {name} must be contiguous")
    row_lanes = lane_dim == -1
    lanes, length = (rows, cols) if row_lanes else (cols, rows)
    if lane_energy.numel() != n * lanes or slow.shape != x.shape or params.shape != x.shape:
        raise ValueError(f"finish_update_: shapes do not match x {tuple(x.shape)} with lane_dim {lane_dim}")
    if (params.dtype == torch.bfloat16) != (sidecar is not None) or params.dtype not in (torch.bfloat16,
                                                                                           torch.float32):
        raise ValueError("finish_update_: bf16 parameters with an int16 sidecar, or fp32 parameters without one")
    if n == 0:
        return
    scale = torch.empty(n, lanes, dtype=torch.float32, device=x.device)
    grid = (n, triton.cdiv(lanes, _LANES))
    lane_stride, elem_stride = (cols, 1) if row_lanes else (1, cols)
    _lane_power_kernel[grid](x, scale, lanes, length, lane_stride, elem_stride, rows * cols, BLOCK_L=_LANES,
                             BLOCK_K=_ELEMS, num_warps=4)
    _lane_scale_kernel[(n,)](scale, lane_energy, lanes, length, one_minus_lane, eps,
                             BLOCK_L=triton.next_power_of_2(lanes), num_warps=4)
    bits = params.view(torch.int16) if sidecar is not None else params
    total = x.numel()
    _step_kernel[(triton.cdiv(total, _BLOCK),)](x, scale, slow, bits, sidecar if sidecar is not None else bits,
                                                lr_mul, lr, wd_lr, total, rows, cols, ROW_LANES=row_lanes,
                                                SIDECAR=sidecar is not None, BLOCK=_BLOCK, num_warps=4)
    # the kernels' writes, made visible to autograd's version counters (what the FP8 caches read)
    increment_version([params, lane_energy] + ([sidecar] if sidecar is not None else []))
