"""Causal sliding-window attention over packed documents.

A micro-batch is one flat sequence of N tokens holding several documents; ``cu_seqlens``
(int32, cumulative segment starts, padded at the end with N) marks where each
attention segment begins. A query attends to keys of its own segment that are at
most ``window`` tokens behind it (FlashAttention's left window).

Six kernels compute the same function:

- ``reference``: a dense boolean mask and ``F.scaled_dot_product_attention``; the plain
  PyTorch path, and the one that trains on CPU (flex attention has no CPU backward in torch 2.13).
- ``varlen``: ``torch.nn.attention.varlen.varlen_attn`` (FlashAttention varlen with a
  window); CUDA only, needs d_v == d_qk.
- ``flex``: compiled ``flex_attention`` with a document + window block mask; CUDA.
- ``triton``: our FlashAttention-2-style kernels (``nanogpt_pl.ops.triton.attention``); CUDA,
  any d_qk, d_v in {16, 32, 64, 128}.
- ``fa3`` / ``fa4``: FlashAttention 3 / 4's varlen kernels where they are installed
  (``flash_attn_interface`` / ``flash_attn.cute``); CUDA. The record runs FA3 (RECORD §2).

``auto`` picks, on CUDA, triton for every layer kind of the record (in the whole training step, where it
beat varlen on the (64, 64) layers too; at head widths the kernels do not hold, varlen or flex), and the
reference on CPU. Layers whose value heads are wider than their query/key
heads (RECORD §2 "narrow") run on flex even when varlen is asked for, because torch's
varlen kernel needs d_qk == d_v.

The second half of the file holds the record's per-layer attention variants as small
functions (RECORD §2 "Attention sublayer", "Paired-head layers"), each with a formula
reference in ``tests/test_attention_kinds.py``, and :class:`CausalSelfAttention`, which
composes them for one layer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..backends import resolve_fast_on_gpu
from ..ops.triton import ATTENTION_HEAD_DIMS, QK_ROTARY_HEAD_DIMS, triton_usable
from .rotary import apply_rotary

# The choices of `model.backends.attention`; "reference" is the plain-PyTorch path.
BACKENDS = ("auto", "reference", "varlen", "flex", "triton", "fa3", "fa4")
# FlashAttention 3 (Hopper) and 4 (Hopper and Blackwell, CuTe DSL), used where they import: the
# module each must import from, and the package that provides it
FLASH_MODULES = {"fa3": ("flash_attn_interface", "FlashAttention 3 (the hopper build of Dao-AILab/flash-attention)"),
                 "fa4": ("flash_attn.cute", "FlashAttention 4 (flash-attn's CuTe interface, package fa4)")}


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


_flash_fns: dict[str, Any] = {}  # backend -> its varlen function or None, looked up once (outside any compile)
_flash_errors: dict[str, str] = {}  # backend -> why its import failed, for the one-line error


def _flash_fn(backend: str):
    """``flash_attn_varlen_func`` of FlashAttention 3 or 4, or None where it does not import.

    Any exception of the import counts as "does not import", not only ImportError: a build whose
    CUDA libraries do not load raises OSError, and FA4's CuTe DSL a RuntimeError where none of its
    toolkit flavours suits the driver. Its first line is kept for :func:`resolve_backend`'s error."""
    if backend not in _flash_fns:
        import importlib

        try:
            _flash_fns[backend] = importlib.import_module(FLASH_MODULES[backend][0]).flash_attn_varlen_func
        except Exception as exc:  # noqa: BLE001 - whatever stops the import, the backend is unavailable
            _flash_fns[backend] = None
            first = str(exc).splitlines()[0][:160] if str(exc) else ""
            _flash_errors[backend] = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
    return _flash_fns[backend]


def flash_import_failure(backend: str) -> str:
    """What :func:`_flash_fn` met for ``backend``: "`import MODULE` failed (the exception's first line)"."""
    why = _flash_errors.get(backend)
    return f"`import {FLASH_MODULES[backend][0]}` failed" + (f" ({why})" if why else "")


# ``auto`` on CUDA is our Triton kernel for every layer kind. In ``benchmarks/attention.py`` alone
# (one layer, fwd + bwd, 49,152 tokens) torch's varlen kernel tied or led for (64, 64) heads, but in
# the stage-2 training step on an H100 the two (64, 64) layers on triton made the whole step 1.043x
# faster than on varlen, same run (BENCHMARKS.md "The QKV's λ₀ in the GEMM scales").


def resolve_backend(backend: str, device: torch.device, same_head_dims: bool = True,
                    head_dims: Optional[tuple[int, int]] = None) -> str:
    """Map ``auto`` to a concrete kernel and reject kernels the device cannot run.

    ``same_head_dims=False`` (a layer with d_qk != d_v) turns ``varlen`` into ``flex``.
    ``head_dims`` (d_qk, d_v): ``auto`` takes the Triton kernel only at widths it holds
    (``ATTENTION_HEAD_DIMS``), else varlen or flex, so ``auto`` runs whatever the widths.
    """
    if backend not in BACKENDS:
        hint = " (the plain-PyTorch path is 'reference')" if backend == "sdpa" else ""
        raise ValueError(f"model.backends.attention={backend!r}{hint}: choose one of {', '.join(BACKENDS)}")
    if backend == "auto":
        if device.type != "cuda":
            return "reference"
        if triton_usable(device) and (head_dims is None or all(d in ATTENTION_HEAD_DIMS for d in head_dims)):
            return "triton"
        return "varlen" if same_head_dims and _varlen_fn() is not None else "flex"
    if backend in ("varlen", "flex", "fa3", "fa4") and device.type != "cuda":
        raise RuntimeError(
            f"model.backends.attention={backend!r} needs a CUDA GPU but the model runs on {device}; "
            f"use 'reference' or 'auto' on CPU"
        )
    if backend == "triton" and not triton_usable(device):
        raise RuntimeError(
            f"model.backends.attention='triton' needs a CUDA GPU with triton but the model runs on {device}; "
            f"use 'reference' or 'auto' on CPU"
        )
    if backend in FLASH_MODULES and _flash_fn(backend) is None:
        raise RuntimeError(
            f"model.backends.attention={backend!r} needs {FLASH_MODULES[backend][1]}: "
            f"{flash_import_failure(backend)}; install it, or use 'triton' or 'auto'"
        )
    if backend == "varlen":
        if _varlen_fn() is None:
            raise RuntimeError(
                "model.backends.attention='varlen' needs torch.nn.attention.varlen (torch >= 2.9); "
                "use 'flex' or 'auto'"
            )
        if not same_head_dims:  # torch's varlen kernel needs d_qk == d_v: narrow layers run on flex
            return "flex"
    return backend


SDPA_BLOCK = 256  # query rows per dense block on the reference path


def attention_sdpa(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, window: int, scale: float) -> Tensor:
    """Masked ``F.scaled_dot_product_attention``. q, k [N, H, Dqk], v [N, H, Dv] -> [N, H, Dv].

    Queries are processed in blocks of ``SDPA_BLOCK`` rows against only the keys their
    window can reach, so the work is N·(window + block) rather than N², which is what
    makes CPU training practical; the mask inside each block keeps it exact. The blocks go in
    with a batch dimension: 4-D inputs take torch's CPU flash kernel (3-D ones the math path).
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
            q[start:end].transpose(0, 1)[None], k[k0:end].transpose(0, 1)[None], v[k0:end].transpose(0, 1)[None],
            attn_mask=mask, scale=scale,
        )
        outs.append(out[0].transpose(0, 1))
    return torch.cat(outs)


def attention_varlen(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int, window: int, scale: float
) -> Tensor:
    varlen_attn = _varlen_fn()
    cu = cu_seqlens.to(torch.int32)
    return varlen_attn(q, k, v, cu, cu, max_seqlen, max_seqlen, scale=scale, window_size=(window, 0))


def attention_flash(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int, window: int, scale: float,
                    backend: str) -> Tensor:
    """FlashAttention 3 or 4's varlen kernel (``backend`` ``fa3`` / ``fa4``), as the record calls FA3
    (RECORD §2 step 5): causal, left window ``window``, the packed segments of ``cu_seqlens``.

    Its window is ``(left, right)`` keys around the query, both inclusive, so ``(window, 0)`` with
    ``causal`` is this module's function. Whether a build takes d_qk != d_v (the narrow layers'
    (64, 128)) depends on the build: the record patches FA3 for it (RECORD §2); an official build
    raises its own error there.
    """
    cu = cu_seqlens.to(torch.int32)
    call = _flash_call_eager if backend in EAGER_FLASH else _flash_call
    return call(_flash_fn(backend), q, k, v, cu, max_seqlen, window, scale)


# FA3's interface wraps registered torch ops, which torch.compile traces. FA4's is Python over the CuTe
# DSL and its own FFI (JIT compiles, caches, no torch op), so a compiled model calls it across a
# graph break, as an eager autograd call between two compiled graphs, rather than tracing into it.
EAGER_FLASH = ("fa4",)


def _flash_call(fn, q: Tensor, k: Tensor, v: Tensor, cu: Tensor, max_seqlen: int, window: int,
                scale: float) -> Tensor:
    out = fn(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max_seqlen, max_seqlen_k=max_seqlen,
             softmax_scale=scale, causal=True, window_size=(window, 0))
    return out[0] if isinstance(out, tuple) else out  # some versions return (out, log-sum-exp)


_flash_call_eager = torch.compiler.disable(_flash_call)


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

    # compiled mask construction: the eager one evaluates mask_mod on the dense n x n grid (OOM at 98k slots)
    block_mask = create_block_mask(mask_mod, None, None, n, n, device=q.device, _compile=True)
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
    """Causal windowed attention inside segments. ``backend`` must already be resolved.

    The kernels take one dtype: autocast's (its QK norm returns float32 while the QKV GEMM gave
    bf16, and a float32 value embedding can make v float32), else v's.
    """
    kind = v.device.type
    dt = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else v.dtype
    if q.dtype != dt or k.dtype != dt or v.dtype != dt:
        q, k, v = q.to(dt), k.to(dt), v.to(dt)
    if backend == "reference":
        return attention_sdpa(q, k, v, cu_seqlens, window, scale)
    if backend == "varlen" and q.shape[-1] == v.shape[-1]:
        return attention_varlen(q, k, v, cu_seqlens, max_seqlen, window, scale)
    if backend == "varlen":  # torch's varlen kernel rejects d_qk != d_v; flex computes the same function
        return attention_flex(q, k, v, cu_seqlens, window, scale)
    if backend == "flex":
        return attention_flex(q, k, v, cu_seqlens, window, scale)
    if backend in FLASH_MODULES:
        return attention_flash(q, k, v, cu_seqlens, max_seqlen, window, scale, backend)
    if backend == "triton":
        from nanogpt_pl.ops.triton.attention import triton_packed_attention  # imports triton: only when chosen

        return triton_packed_attention(q, k, v, cu_seqlens, max_seqlen, window, scale)
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


# -- the record's per-layer attention variants (RECORD §2) --------------------------------
QK_NORM_EPS = 1.1920929e-7  # RECORD §2: per-head RMS norm of Q and K, eps = float32 machine epsilon
XSA_EPS = 1e-8  # floor of ‖v‖² in the XSA projection (the record clamps the denominator there)
VE_GATE_CHANNELS = 6  # RECORD §2: value-embedding gate reads x̂[:6] and ve[:6]
QKV_LAMBDA_INIT = 0.5  # RECORD §2 "scalars": λ₀ = 0.5 on the QKV weights
O_LAMBDA_INIT = 1.0  # RECORD §2 "scalars": λ₁ = 1.0 on W_O
ATTN_GATE_INIT = 0.25  # RECORD §2: the attention gate starts at 0.25 (bias 2.5 × 0.1)
# RECORD §2 "Initialization": qk/vo banks ~ U(±√3·0.5·768^-½) = U(±0.03125)
PROJ_INIT_GAIN = 0.5


def paired_positions(positions: Tensor, num_heads: int) -> Tensor:
    """Rotary position of every (token, head) on a paired layer, ``[N, H]``.

    RECORD §2 "Paired-head layers": as implemented, head ``h`` of token ``t`` rotates at
    ``2t + (h mod 2)``, not at its sequence slot ``2t + ⌊h / (H/2)⌋``; the quirk is kept.
    """
    parity = torch.arange(num_heads, device=positions.device) % 2
    return 2 * positions[:, None] + parity[None, :]


def to_paired(x: Tensor) -> Tensor:
    """``[N, H, d] -> [2N, H/2, d]``: slot 2t holds heads 0..H/2-1 of token t, slot 2t+1 the rest,
    so kernel head j sees heads j and j + H/2 as consecutive positions (RECORD §2)."""
    n, h, d = x.shape
    return x.reshape(2 * n, h // 2, d)


def from_paired(y: Tensor, num_heads: int) -> Tensor:
    """Inverse of :func:`to_paired`."""
    return y.reshape(-1, num_heads, y.shape[-1])


def shift_keys(k: Tensor) -> Tensor:
    """RECORD §2 step 4, the key offset: the upper half of every key head (the non-rotating
    dims 64..127 at the record's width) is replaced by the previous token's normalized key.
    Token 0 keeps its own. The shift runs over the packed batch, so it crosses document
    boundaries as the record's does (RECORD §2 "Numerical quirks")."""
    half = k.shape[-1] // 2
    upper = torch.cat([k[:1, :, half:], k[:-1, :, half:]])
    return torch.cat([k[..., :half], upper], dim=-1)


def resolve_qk_rotary_backend(backend: str, device: torch.device, head_dim: Optional[int] = None) -> str:
    """``model.backends.qk_rotary``: ``auto`` is the Triton pass on a CUDA device (a stage-1 step
    1.020x and a stage-2 step 1.012x faster on an H100, BENCHMARKS.md) for the head widths it takes
    (``QK_ROTARY_HEAD_DIMS``), and the reference elsewhere; ``triton`` asked for by name at another
    width is an error (one line, from the kernel)."""
    resolved = resolve_fast_on_gpu("qk_rotary", backend, device, "the activations are")
    if backend == "auto" and head_dim is not None and head_dim not in QK_ROTARY_HEAD_DIMS:
        return "reference"
    return resolved


def qk_norm_rotary(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, key_offset: bool, backend: str = "reference"
                   ) -> tuple[Tensor, Tensor]:
    """RECORD §2 steps 3 and 4: the per-head RMS norm of q and k, the rotary rotation, and with
    ``key_offset`` :func:`shift_keys`. ``backend`` is ``model.backends.qk_rotary``
    (:func:`resolve_qk_rotary_backend`): ``triton`` runs ``nanogpt_pl.ops.triton.qk_rotary`` (one
    pass forward, one backward); ``reference`` these PyTorch expressions, which inductor fuses."""
    if resolve_qk_rotary_backend(backend, q.device, q.shape[-1]) == "triton":
        from ..ops.triton.qk_rotary import qk_norm_rotary_triton

        return qk_norm_rotary_triton(q, k, cos, sin, QK_NORM_EPS, key_offset)
    q, k = F.rms_norm(q, (q.shape[-1],), eps=QK_NORM_EPS), F.rms_norm(k, (k.shape[-1],), eps=QK_NORM_EPS)
    q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    return q, (shift_keys(k) if key_offset else k)


def xsa(y: Tensor, v: Tensor, alpha: Tensor) -> Tensor:
    """RECORD §2 step 6: y ← y − tanh(α)·((y·v)/‖v‖²)·v per token and head.

    ``y``, ``v`` are ``[N, H, d_v]``; ``alpha`` broadcasts against ``[N, H]``.
    """
    dot = (y * v).sum(-1, keepdim=True)
    denom = v.square().sum(-1, keepdim=True).clamp_min(XSA_EPS)
    return y - torch.tanh(alpha).type_as(y)[..., None] * (dot / denom) * v


def live_rows(w: Tensor, num_heads: int, width: int) -> Tensor:
    """Rows ``0..width-1`` of every head's block of ``w [H·head_dim, D]``; the rest are the dead rows
    of narrow and dv64 layers (RECORD §2: drawn at init, never read, so they get no gradient)."""
    if width * num_heads == w.shape[0]:
        return w
    return w.view(num_heads, -1, w.shape[-1])[:, :width].reshape(num_heads * width, w.shape[-1])


def live_row_blocks(w: Tensor, num_heads: int, width: int) -> tuple[Tensor, ...]:
    """:func:`live_rows` as contiguous views of ``w``: one block per head, or ``w`` itself."""
    if width * num_heads == w.shape[0]:
        return (w,)
    hd = w.shape[0] // num_heads
    return tuple(w[h * hd:h * hd + width] for h in range(num_heads))


@dataclass
class AttentionSpec:
    """Shape and variant of one attention layer (built by the GPT from its config).

    Args:
        model_dim: residual width.
        num_heads: heads.
        head_dim: stored head size (rows per head in the weights; the V/O size of a wide layer).
        d_qk: query/key width per head (RECORD §2: 64 narrow and dv64, 128 wide).
        d_v: value width per head (RECORD §2: 64 on dv64 layers, else 128).
        chain: ``short`` or ``long``: which window, rotary table and softmax scale it uses.
        paired: RECORD §2 paired heads (doubled sequence).
        key_offset: RECORD §2 step 4.
        xsa: RECORD §2 step 6.
        gate: RECORD §2 step 7 (per-head output gate).
        dynamic_gates: the XSA α and attention gate come from the MUDD gates at forward time;
            otherwise each is a learned per-head parameter here.
        value_embed: the layer adds a gated value embedding to its values.
        backend: attention kernel (see :func:`resolve_backend`).
        qk_rotary: the QK norm, rotary and key offset (``model.backends.qk_rotary``, see
            :func:`qk_norm_rotary`).
        fp8_qkv: run the QKV projection in FP8.
        fp8_backend: FP8 backend.
        fp8_qkv_x_scale: static FP8 scale of the QKV input (None = the clip-free default of
            ``ops.fp8``; the record's is 8/448, clamping |x| > 8, RECORD §7).
        qkv_lambda_init: λ₀, the scalar on the QKV weights.
    """

    model_dim: int
    num_heads: int
    head_dim: int
    d_qk: int
    d_v: int
    chain: str = "short"
    paired: bool = False
    key_offset: bool = False
    xsa: bool = False
    gate: bool = False
    dynamic_gates: bool = False
    value_embed: bool = False
    backend: str = "auto"
    qk_rotary: str = "auto"
    fp8_qkv: bool = False
    fp8_backend: str = "auto"
    fp8_qkv_x_scale: Optional[float] = None
    qkv_lambda_init: float = QKV_LAMBDA_INIT


class CausalSelfAttention(nn.Module):
    """One attention sublayer of the record (RECORD §2 "Attention sublayer", steps 1–8).

    Weights are stored at full head width whatever the layer's widths: ``qk_w [2, H·hd, D]``
    (Q then K), ``v_w [H·hd, D]`` and ``o_w [D, H·hd]`` with rows over output channels (the
    record's W_O layout, so the optimizer's lanes run over output channels). Narrow and
    dv64 layers read the first ``d_qk`` / ``d_v`` rows of each head (columns of W_O).
    """

    def __init__(self, spec: AttentionSpec) -> None:
        super().__init__()
        s = self.spec = spec
        if s.d_qk > s.head_dim or s.d_v > s.head_dim:
            raise ValueError(f"attention widths (d_qk={s.d_qk}, d_v={s.d_v}) exceed head_dim={s.head_dim}")
        if s.paired and s.num_heads % 2:
            raise ValueError(f"paired heads need an even number of heads, got {s.num_heads}")
        hd_total = s.num_heads * s.head_dim
        bound = math.sqrt(3) * PROJ_INIT_GAIN * s.model_dim**-0.5
        self.qk_w = nn.Parameter(torch.empty(2, hd_total, s.model_dim).uniform_(-bound, bound))
        self.v_w = nn.Parameter(torch.empty(hd_total, s.model_dim).uniform_(-bound, bound))
        self.o_w = nn.Parameter(torch.zeros(s.model_dim, hd_total))
        # (λ₀ on the QKV weights, λ₁ on W_O): RECORD §2 "scalars"
        self.lambdas = nn.Parameter(torch.tensor([s.qkv_lambda_init, O_LAMBDA_INIT]))
        # RECORD §2: v += 2·σ(W_g·[x̂[:6], ve[:6]])·ve, W_g zero-initialized so the gate starts at 1.
        self.ve_gate = (nn.Parameter(torch.zeros(s.num_heads, 2 * VE_GATE_CHANNELS))
                        if s.value_embed else None)
        if not s.dynamic_gates:
            if s.xsa:
                self.xsa_alpha = nn.Parameter(torch.zeros(s.num_heads))  # tanh(0) = 0: XSA starts off
            if s.gate:
                self.gate = nn.Parameter(torch.full((s.num_heads,), ATTN_GATE_INIT))
        if s.fp8_qkv:
            from ..ops.fp8 import Fp8LinearState  # FP8 (and Triton) load only when used

            # one exact weight scale per refresh over the layer's packed live QK‖V rows (RECORD §7)
            scale = {} if s.fp8_qkv_x_scale is None else {"x_scale": s.fp8_qkv_x_scale}
            self.fp8_state = Fp8LinearState(backend=s.fp8_backend, **scale)

    def _fp8_blocks(self) -> tuple[Tensor, ...]:
        # row blocks that are views of the parameters, so the FP8 cache follows their versions
        s = self.spec
        return (*live_row_blocks(self.qk_w[0], s.num_heads, s.d_qk),
                *live_row_blocks(self.qk_w[1], s.num_heads, s.d_qk),
                *live_row_blocks(self.v_w, s.num_heads, s.d_v))

    def refresh_fp8(self) -> None:
        """Refresh the FP8 QKV weight cache if the weights changed (eager; before a compiled forward)."""
        if self.spec.fp8_qkv and self.training:
            self.fp8_state.refresh(self._fp8_blocks())

    def quantize_input(self, x: Tensor) -> Any:
        """``x`` with its FP8 copies at this layer's input scale (an ``ops.fp8.QuantizedInput``), for
        every layer that reads ``x`` to pass as its input; ``x`` itself where the QKV is not FP8."""
        if not (self.spec.fp8_qkv and self.training) or self.fp8_state.graph_break:
            return x  # (with graph breaks at the FP8 layers, each quantizes its own input)
        if not torch.compiler.is_compiling():
            self.refresh_fp8()  # a compiled forward reads the cache as refresh_fp8() left it
        return self.fp8_state.quantize_input(x)

    def _qkv(self, x: Tensor, quantized: Any = None) -> tuple[Tensor, Tensor, Tensor]:
        s, n = self.spec, x.shape[0]
        parts = (live_rows(self.qk_w[0], s.num_heads, s.d_qk), live_rows(self.qk_w[1], s.num_heads, s.d_qk),
                 live_rows(self.v_w, s.num_heads, s.d_v))
        # λ₀ scales the weights (RECORD §2 "scalars"), so its gradient is a sum over the weight,
        # ⟨dW, W⟩ (RECORD §7), and no pass over the [N, out] product multiplies it afterwards
        lam = self.lambdas[0]
        if s.fp8_qkv and self.training:
            from ..ops.fp8 import fp8_linear  # FP8 (and Triton) load only when used

            # λ₀ in the GEMMs' scales
            qkv = fp8_linear(x, self._fp8_blocks(), self.fp8_state, gain=lam, quantized=quantized)
        else:
            qkv = x @ (torch.cat(parts) * lam).type_as(x).t()
        hq = s.num_heads * s.d_qk
        q, k, v = qkv.split((hq, hq, s.num_heads * s.d_v), dim=-1)
        return q.view(n, s.num_heads, s.d_qk), k.view(n, s.num_heads, s.d_qk), v.view(n, s.num_heads, s.d_v)

    def gated_value_embed(self, x: Tensor, ve: Tensor) -> Tensor:
        """2·σ(W_g·[x̂[:6], ve[:6]])·ve per head, ``[N, H, head_dim]``."""
        s = self.spec
        gate_in = torch.cat([x[:, :VE_GATE_CHANNELS], ve[:, :VE_GATE_CHANNELS]], dim=-1)
        gate = 2 * torch.sigmoid(gate_in @ self.ve_gate.type_as(x).t())
        return gate[..., None] * ve.view(-1, s.num_heads, s.head_dim)

    def forward(
        self,
        x: Any,
        ctx: Any,
        ve: Optional[Tensor] = None,
        extra_v: Optional[Tensor] = None,
        xsa_alpha: Optional[Tensor] = None,
        gate: Optional[Tensor] = None,
        o_gain: Optional[Tensor] = None,
    ) -> Tensor:
        """``x``: the normed attention input ``[N, D]``, or it quantized once for several layers
        (:meth:`quantize_input`); ``ctx``: the GPT's packed context.

        ``ve`` is gated by this layer's own VE gate; ``extra_v`` ``[N, H, head_dim]`` is added to
        the values as is (layer 10's MUDD values). ``xsa_alpha`` ``[N, H]`` and ``gate`` ``[N, H]``
        are the MUDD gates when ``dynamic_gates``. ``o_gain`` (the post-lambda) multiplies W_O.
        """
        quantized = None if isinstance(x, Tensor) else x
        x = x if quantized is None else quantized.x
        s, n = self.spec, x.shape[0]
        q, k, v = self._qkv(x, quantized)
        cos, sin = (ctx.rotary_paired if s.paired else ctx.rotary)[s.chain]
        cos, sin = cos[..., : s.d_qk // 2], sin[..., : s.d_qk // 2]
        q, k = qk_norm_rotary(q, k, cos, sin, s.key_offset, s.qk_rotary)
        if ve is not None:
            v = v + self.gated_value_embed(x, ve)[..., : s.d_v]
        if extra_v is not None:
            v = v + extra_v[..., : s.d_v]
        backend = resolve_backend(s.backend, x.device, same_head_dims=s.d_qk == s.d_v, head_dims=(s.d_qk, s.d_v))
        window, scale = ctx.windows[s.chain], ctx.scales[s.chain]
        if s.paired:
            y = packed_attention(to_paired(q), to_paired(k), to_paired(v), 2 * ctx.cu_seqlens,
                                 2 * ctx.max_seqlen, window, scale, backend)
            y = from_paired(y, s.num_heads)
        else:
            y = packed_attention(q, k, v, ctx.cu_seqlens, ctx.max_seqlen, window, scale, backend)
        if s.xsa:
            y = xsa(y, v, xsa_alpha if s.dynamic_gates else self.xsa_alpha)
        if s.gate:
            y = y * (gate if s.dynamic_gates else self.gate).type_as(y)[..., None]
        w_o = self.o_w if s.d_v == s.head_dim else self.o_w.view(s.model_dim, s.num_heads, s.head_dim)[
            :, :, : s.d_v].reshape(s.model_dim, s.num_heads * s.d_v)
        gain = self.lambdas[1] if o_gain is None else self.lambdas[1] * o_gain
        return y.reshape(n, -1) @ (gain.type_as(y) * w_o.type_as(y)).t()
