"""Rotary position embeddings with truncated frequencies and YaRN window extension.

RECORD.md §2 "RoPE / YaRN": the first ``rot_dim`` (at most 64) dims of a head rotate
on interleaved pairs with angular frequencies (1/1024)^(i/(rot_dim/2 - 1)); the rest
of the head is stationary (frequency 0). When the attention window grows from
``w_old`` to ``w_new`` tokens, YaRN rescales the low frequencies and raises the
attention scale; both live in buffers so checkpoints carry them.

Positions are counted from the start of each document. Attention never crosses a
document boundary and RoPE only depends on i - j, so this equals packed positions
while keeping the angles small.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor, nn

ROT_DIM_MAX = 64  # RECORD §2: rot_dim = 64 (all of a 64-dim head, half of a 128-dim head)
BASE_FREQ = 1 / 1024  # RECORD §2: ω_i = (1/1024)^(i/31)
YARN_SCALE_SLOPE = 0.2  # RECORD §2: attn_scale *= 1 + 0.2·ln(w_new / w_old)
# RECORD §2: γ = clamp((r - 1) / 31, 0, 1): frequencies with under one turn per old window are
# fully stretched, those with 32 or more turns kept (YaRN's alpha = 1, beta = 32).
YARN_ALPHA = 1.0
YARN_BETA = 32.0


class Rotary(nn.Module):
    """Rotary embedding of one attention "chain" (layers sharing windows and YaRN state).

    Args:
        head_dim: per-head query/key size.
        attn_scale: the softmax scale before any YaRN change.
    """

    def __init__(self, head_dim: int, attn_scale: float) -> None:
        super().__init__()
        rot_dim = min(head_dim, ROT_DIM_MAX)
        if rot_dim % 2:
            raise ValueError(f"head_dim {head_dim} must be even for rotary embeddings")
        pairs = rot_dim // 2
        self.head_dim = head_dim
        self.rot_pairs = pairs
        self.register_buffer("omega", self._base_omega(), persistent=True)  # [head_dim // 2], fp64
        # a Python float (a GPU scalar would force a sync every forward); saved via extra state
        self.attn_scale = float(attn_scale)
        self.base_attn_scale = float(attn_scale)
        # cos/sin at every position below their length (build_tables); empty until built. Not
        # saved: rebuilt from omega whenever it changes (apply_yarn, load_state_dict)
        self.register_buffer("cos_table", torch.empty(0, head_dim // 2), persistent=False)
        self.register_buffer("sin_table", torch.empty(0, head_dim // 2), persistent=False)
        self.register_load_state_dict_post_hook(lambda module, keys: module._rebuild_tables())

    def _base_omega(self) -> Tensor:
        """The frequencies before any YaRN change: BASE_FREQ^(i / (pairs - 1)), zeros past ``rot_pairs``."""
        exponent = torch.arange(self.rot_pairs, dtype=torch.float64) / max(1, self.rot_pairs - 1)
        omega = BASE_FREQ**exponent
        return torch.cat([omega, omega.new_zeros(self.head_dim // 2 - self.rot_pairs)])

    @torch.no_grad()
    def reset_yarn(self) -> None:
        """Back to the state before any YaRN change (the frequencies and softmax scale of construction),
        in place: a YaRN change multiplies onto the current state, so the state of a schedule step
        depends on the path of window changes that led to it (:meth:`SpeedrunModule.apply_schedule`
        replays the schedule's own path from here when it jumps)."""
        self.omega.copy_(self._base_omega())
        self.attn_scale = self.base_attn_scale
        self._rebuild_tables()

    @torch.no_grad()
    def build_tables(self, length: int, dtype: torch.dtype) -> None:
        """Tabulate cos/sin at positions ``0 .. length - 1`` in ``dtype``, so that :meth:`cos_sin`
        gathers rows instead of computing float64 trigonometry for every token of every forward
        (three ``[N, head_dim / 2]`` tables a micro-batch, 2.7 ms of a stage-2 step on an H100:
        BENCHMARKS.md). Rebuilt in place while the length and dtype stay, so a CUDA graph that
        reads the tables keeps reading the current ones."""
        positions = torch.arange(length, device=self.omega.device)
        cos, sin = cos_sin_reference(positions, self.omega, dtype)
        if self.cos_table.shape == cos.shape and self.cos_table.dtype == dtype:
            self.cos_table.copy_(cos)
            self.sin_table.copy_(sin)
        else:
            self.cos_table, self.sin_table = cos, sin

    def _rebuild_tables(self) -> None:
        if self.cos_table.shape[0]:
            self.build_tables(self.cos_table.shape[0], self.cos_table.dtype)

    def _apply(self, fn, recurse=True):
        """``module.to``, ``.cuda()``, ``.bfloat16()``...: the buffers follow the device but keep their
        dtypes (omega in float64; the tables as built, which a conversion would round a second time)."""
        kept = {name: getattr(self, name) for name in ("omega", "cos_table", "sin_table")}
        out = super()._apply(fn, recurse)
        for name, old in kept.items():
            new = getattr(self, name)
            if new.dtype != old.dtype:
                setattr(self, name, old.to(new.device))
        return out

    @torch.no_grad()
    def apply_yarn(self, old_window: int, new_window: int) -> None:
        """Stretch the slow frequencies for a window grown from ``old_window`` to ``new_window``."""
        if new_window == old_window:
            return
        s = old_window / new_window
        r = old_window * self.omega / (2 * math.pi)
        gamma = ((r - YARN_ALPHA) / (YARN_BETA - YARN_ALPHA)).clamp(0, 1)
        self.omega.mul_(s + gamma * (1 - s))
        self.attn_scale *= 1 + YARN_SCALE_SLOPE * math.log(new_window / old_window)
        self._rebuild_tables()

    def get_extra_state(self) -> dict:
        return {"attn_scale": self.attn_scale}

    def set_extra_state(self, state: dict) -> None:
        self.attn_scale = float(state["attn_scale"])

    def cos_sin(self, positions: Tensor, dtype: torch.dtype, bound: Optional[int] = None) -> tuple[Tensor, Tensor]:
        """cos/sin tables [N, head_dim // 2] for integer ``positions`` [N] (see :func:`rotary_cos_sin`).

        ``bound`` (a Python int, every position below it) lets the rows come from the built tables
        when they are long enough and in ``dtype``: the same values, bit for bit, as computing them.
        """
        table = self.cos_table
        if bound is not None and table.dtype == dtype and table.shape[0] >= bound and table.device == positions.device:
            return self.cos_table[positions], self.sin_table[positions]
        return rotary_cos_sin(positions, self.omega, dtype)


def cos_sin_reference(positions: Tensor, omega: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos/sin of ``positions[:, None] * omega[None, :]``, in float64, rounded once to ``dtype``."""
    theta = positions.to(torch.float64)[:, None] * omega[None, :]
    return theta.cos().to(dtype), theta.sin().to(dtype)


@torch.library.custom_op("nanogpt_pl::rotary_cos_sin", mutates_args=())
def rotary_cos_sin(positions: Tensor, omega: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """The rotary tables, computed once per call and kept in memory, also under ``torch.compile``.

    As plain tensor code, inductor fuses the float64 ``cos``/``sin`` into every kernel that
    reads the tables: the query and key rotations of each head, forward and backward, each
    recomputed the trigonometry per (token, head, pair) instead of once per (token, pair). On
    an H200 at stage 0 those kernels ran ~250 µs apiece against ~20 µs of memory traffic. A
    custom operator is opaque to inductor, so the tables are built once and read.
    """
    return cos_sin_reference(positions, omega, dtype)


@rotary_cos_sin.register_fake
def _(positions: Tensor, omega: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    shape = (positions.shape[0], omega.shape[0])
    return positions.new_empty(shape, dtype=dtype), positions.new_empty(shape, dtype=dtype)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate interleaved pairs of ``x`` [N, H, head_dim] by angles with cos/sin [N, head_dim // 2]
    (one angle per token) or [N, H, head_dim // 2] (per token and head: paired layers).

    The result keeps ``x``'s dtype (tables in a wider dtype rotate in it, then round once).
    :func:`apply_rotary_reference` is the formula pair by pair; this is the same products and sums
    written at full width, y = x·(c, c) + swap(x)·(s, −s) with ``swap`` exchanging the two entries
    of every pair: one pointwise expression with one store, which inductor compiles to a plain
    kernel. The pairwise unbind and stack compiled to a kernel that loaded every element four times
    under masks, beside the QK norm (BENCHMARKS.md "The QKV's λ₀ in the GEMM scales").
    """
    if cos.dim() == 2:
        cos, sin = cos[:, None, :], sin[:, None, :]
    full = (*cos.shape, 2)
    c = cos.unsqueeze(-1).expand(full).flatten(-2)
    s = torch.stack((sin, -sin), dim=-1).flatten(-2)
    swapped = x.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
    return (x * c + swapped * s).to(x.dtype)


def apply_rotary_reference(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """:func:`apply_rotary` pair by pair: (x₂ᵢ, x₂ᵢ₊₁) -> (x₂ᵢ·c + x₂ᵢ₊₁·s, x₂ᵢ₊₁·c − x₂ᵢ·s)."""
    x_even, x_odd = x.unflatten(-1, (-1, 2)).unbind(-1)
    if cos.dim() == 2:
        cos, sin = cos[:, None, :], sin[:, None, :]
    y_even = x_even * cos + x_odd * sin
    y_odd = x_odd * cos - x_even * sin
    return torch.stack((y_even, y_odd), dim=-1).flatten(-2).to(x.dtype)
