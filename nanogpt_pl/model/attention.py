"""Causal sliding-window attention over packed documents.

A micro-batch is one flat sequence of N tokens holding several documents; ``cu_seqlens``
(int32, cumulative segment starts, padded at the end with N) marks where each
attention segment begins. A query attends to keys of its own segment that are at
most ``window`` tokens behind it (FlashAttention's left window).

Three kernels compute the same function:

- ``sdpa``: a dense boolean mask and ``F.scaled_dot_product_attention``; the reference,
  and the path that trains on CPU (flex attention has no CPU backward in torch 2.13).
- ``varlen``: ``torch.nn.attention.varlen.varlen_attn`` (FlashAttention varlen with a
  window); CUDA only, needs d_v == d_qk.
- ``flex``: compiled ``flex_attention`` with a document + window block mask; CUDA.

``auto`` picks varlen on CUDA when it exists and head sizes match, flex on CUDA
otherwise, and sdpa on CPU.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

BACKENDS = ("auto", "sdpa", "varlen", "flex")


def segment_ids(cu_seqlens: Tensor, n: int) -> Tensor:
    """Segment index of every position 0..n-1 (int64)."""
    pos = torch.arange(n, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    return torch.searchsorted(cu_seqlens, pos, right=True) - 1


def segment_positions(cu_seqlens: Tensor, n: int) -> Tensor:
    """Position of every token inside its segment (int64)."""
    seg = segment_ids(cu_seqlens, n)
    return torch.arange(n, device=cu_seqlens.device) - cu_seqlens.long()[seg]


def _varlen_fn():
    try:
        from torch.nn.attention.varlen import varlen_attn  # optional: torch >= 2.9
    except ImportError:
        return None
    return varlen_attn


def resolve_backend(backend: str, device: torch.device, same_head_dims: bool = True) -> str:
    """Map ``auto`` to a concrete kernel and reject kernels the device cannot run."""
    if backend not in BACKENDS:
        raise ValueError(f"model.backends.attention={backend!r}: choose one of {BACKENDS}")
    if backend == "auto":
        if device.type != "cuda":
            return "sdpa"
        if same_head_dims and _varlen_fn() is not None:
            return "varlen"
        return "flex"
    if backend in ("varlen", "flex") and device.type != "cuda":
        raise RuntimeError(
            f"model.backends.attention={backend!r} needs a CUDA GPU but the model runs on {device}; "
            f"use 'sdpa' or 'auto' on CPU"
        )
    if backend == "varlen":
        if _varlen_fn() is None:
            raise RuntimeError(
                "model.backends.attention='varlen' needs torch.nn.attention.varlen (torch >= 2.9); "
                "use 'flex' or 'auto'"
            )
        if not same_head_dims:
            raise ValueError("model.backends.attention='varlen' needs equal query and value head sizes; use 'flex'")
    return backend


SDPA_BLOCK = 256  # query rows per dense block on the sdpa path


def attention_sdpa(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, window: int, scale: float) -> Tensor:
    """Masked ``F.scaled_dot_product_attention``. q, k [N, H, Dqk], v [N, H, Dv] -> [N, H, Dv].

    Queries are processed in blocks of ``SDPA_BLOCK`` rows against only the keys their
    window can reach, so the work is N·(window + block) rather than N², which is what
    makes CPU training practical; the mask inside each block keeps it exact.
    """
    n = q.shape[0]
    seg = segment_ids(cu_seqlens, n)
    outs = []
    for start in range(0, n, SDPA_BLOCK):
        end = min(n, start + SDPA_BLOCK)
        k0 = max(0, start - window)
        iq = torch.arange(start, end, device=q.device)
        ik = torch.arange(k0, end, device=q.device)
        delta = iq[:, None] - ik[None, :]
        mask = (seg[start:end, None] == seg[None, k0:end]) & (delta >= 0) & (delta <= window)
        out = F.scaled_dot_product_attention(
            q[start:end].transpose(0, 1), k[k0:end].transpose(0, 1), v[k0:end].transpose(0, 1),
            attn_mask=mask, scale=scale,
        )
        outs.append(out.transpose(0, 1))
    return torch.cat(outs)


def attention_varlen(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int, window: int, scale: float
) -> Tensor:
    varlen_attn = _varlen_fn()
    cu = cu_seqlens.to(torch.int32)
    return varlen_attn(q, k, v, cu, cu, max_seqlen, max_seqlen, scale=scale, window_size=(window, 0))


_flex_compiled = None


def _flex():
    global _flex_compiled
    if _flex_compiled is None:
        from torch.nn.attention.flex_attention import flex_attention  # flex attention loads only when chosen

        _flex_compiled = torch.compile(flex_attention, dynamic=False)
    return _flex_compiled


def attention_flex(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, window: int, scale: float) -> Tensor:
    from torch.nn.attention.flex_attention import create_block_mask  # flex attention loads only when chosen

    n = q.shape[0]
    seg = segment_ids(cu_seqlens, n)

    def mask_mod(b, h, qi, ki):
        return (seg[qi] == seg[ki]) & (qi >= ki) & (qi - ki <= window)

    block_mask = create_block_mask(mask_mod, None, None, n, n, device=q.device)
    out = _flex()(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], block_mask=block_mask, scale=scale
    )
    return out[0].transpose(0, 1)


def packed_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens: Tensor,
    max_seqlen: int,
    window: int,
    scale: float,
    backend: str,
) -> Tensor:
    """Causal windowed attention inside segments. ``backend`` must already be resolved."""
    if backend == "sdpa":
        return attention_sdpa(q, k, v, cu_seqlens, window, scale)
    if backend == "varlen":
        return attention_varlen(q, k, v, cu_seqlens, max_seqlen, window, scale)
    if backend == "flex":
        return attention_flex(q, k, v, cu_seqlens, window, scale)
    raise ValueError(f"unresolved attention backend {backend!r}")


def dense_reference(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, window: int, scale: float,
                    upcast: Optional[torch.dtype] = torch.float64) -> Tensor:
    """Loop-free float64 reference used by tests to check every kernel."""
    dt = q.dtype
    if upcast is not None:
        q, k, v = q.to(upcast), k.to(upcast), v.to(upcast)
    n = q.shape[0]
    seg = segment_ids(cu_seqlens, n)
    i = torch.arange(n, device=q.device)
    delta = i[:, None] - i[None, :]
    mask = (seg[:, None] == seg[None, :]) & (delta >= 0) & (delta <= window)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(dt)
