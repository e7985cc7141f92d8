"""MUDD: token-conditional gates and dense connections (RECORD §2 "MUDD gates").

Multiway dynamic dense connections (arXiv:2502.12170), trimmed as the record trims them.
Every block is a two-layer map of one stream to a few coefficients per token,

    coef(x) = (W₂·gelu(W₁·x) + b)·scale,

with W₁ (64 × D) Kaiming-uniform, W₂ zero-initialized (so every coefficient starts at its
bias times the scale) and the scale either the learnable κ (the two gate blocks share one)
or the fixed 0.1. Four blocks:

- the **pre gate** (26 coefficients at 6 heads) reads x0 and gives the XSA α of layers 1
  and 3, the attention gate of layer 3 and the (x0, n-gram) injection gates of layers 0..3;
- the **post gate** (41) reads the stream entering layer 4 and gives the attention gate of
  layer 10, the (x0, n-gram) gates of layers 4, 5, 7, 8, 9 and the skip gate; the XSA α of
  4 and 7 and 12 retired slots are computed and unused, as in the record;
- the **layer mix** (14, fixed ×0.1) reads the stream entering the last layer: its value
  sources, residual recombination, value-embedding gate and dynamic residual lambdas;
- the **final mix** (10 per 12 channel groups, fixed ×0.1) mixes ten cached streams into
  the output before the final norm; a zero-initialized (10 × 12 × 64) tensor reads
  per-group deltas off the same hidden.

The coefficient layouts below are the record's (RECORD §2); they name record layers, so
MUDD needs the record's 11-layer map (``GPTConfig`` checks it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

MUDD_HIDDEN = 64  # RECORD §2: W₁ is 64 × 768
MUDD_SCALE = 0.1  # RECORD §2: κ starts at 0.1; the layer and final mixes use a fixed ×0.1
FINAL_MIX_GROUPS = 12  # RECORD §2 "Post-loop MUDD": 12 channel groups (64 channels each at 768)

# RECORD §2 "Bias inits (before the ×0.1)"
ATTN_GATE_BIAS = 2.5
NGRAM_GATE_BIAS = 0.5
SKIP_GATE_BIAS = 5.0
X0_GATE_BIAS = 0.0
RETIRED_BIAS = 10.0  # post-gate slots 29–34 (the retired layer-10 correction); 35–40 stay 0

# The record's layers whose gates each block provides (RECORD §2).
PRE_XSA_LAYERS = (1, 3)
PRE_GATE_LAYERS = (3,)
PRE_INJECT_LAYERS = (0, 1, 2, 3)
POST_GATE_INPUT_LAYER = 4  # the post gate reads the stream entering this layer
POST_XSA_LAYERS = (4, 7)  # computed, unused
POST_GATE_LAYERS = (10,)
POST_INJECT_LAYERS = (4, 5, 7, 8, 9)
MIXED_LAYER = 10  # the layer-mix block runs at the start of this layer
CACHE_LAYERS = (3, 7, 9)  # cache[k] = the stream after layer k (cache[9] = entering layer 10)

# Layer mix, RECORD §2 "MUDD at layer 10": index of each of the 14 coefficients.
MIX_V_CACHE0, MIX_V_CACHE7, MIX_V_X = 0, 1, 2
MIX_CACHE0, MIX_CACHE7, MIX_X = 3, 4, 5
MIX_VE_GATE = (6, 7)
MIX_RESID_ATTN, MIX_POST_ATTN, MIX_X0, MIX_NGRAM, MIX_RESID_MLP, MIX_POST_MLP = 8, 9, 10, 11, 12, 13
LAYER_MIX_COEFS = 14
# The bias init reproduces the static defaults (RECORD §2): VE gate 2, ρ √1.1, π 1, x0 0, n-gram 0.05.
LAYER_MIX_BIAS = {6: 2.0, 7: 2.0, 8: math.sqrt(1.1), 9: 1.0, 10: 0.0, 11: 0.05, 12: math.sqrt(1.1), 13: 1.0}

# Final mix, RECORD §2 "Post-loop MUDD": the sources in order, and the backout bias.
FINAL_MIX_SOURCES = ("cache0", "cache7", "cache9", "ve_plane0", "cache3", "ve_plane1", "ve_plane3",
                     "ve_plane2", "last_mlp_input", "norm_cache7")
FINAL_MIX_BIAS = {1: -0.5}  # backout: cache[7]'s coefficient starts at −0.5


@dataclass(frozen=True)
class GateLayout:
    """Where each gate sits in a gate block's output (slices of the coefficient axis)."""

    xsa: dict[int, slice]
    attn_gate: dict[int, slice]
    x0: dict[int, int]
    ngram: dict[int, int]
    skip: Optional[int]
    retired: Optional[slice]
    size: int

    def bias(self) -> Tensor:
        """Bias init before the scale (RECORD §2)."""
        b = torch.zeros(self.size)
        for sl in self.attn_gate.values():
            b[sl] = ATTN_GATE_BIAS
        for i in self.ngram.values():
            b[i] = NGRAM_GATE_BIAS
        for i in self.x0.values():
            b[i] = X0_GATE_BIAS
        if self.skip is not None:
            b[self.skip] = SKIP_GATE_BIAS
        if self.retired is not None:
            half = (self.retired.stop - self.retired.start) // 2
            b[self.retired.start:self.retired.start + half] = RETIRED_BIAS
        return b


def gate_layout(xsa_layers: tuple[int, ...], gate_layers: tuple[int, ...], inject_layers: tuple[int, ...],
                num_heads: int, skip: bool, retired: int) -> GateLayout:
    """The record's order: XSA α per layer (one per head), attention gates (one per head),
    (x0, n-gram) pairs per layer, the skip gate, then retired slots."""
    pos, xsa, gates, x0, ngram = 0, {}, {}, {}, {}
    for layer in xsa_layers:
        xsa[layer] = slice(pos, pos + num_heads)
        pos += num_heads
    for layer in gate_layers:
        gates[layer] = slice(pos, pos + num_heads)
        pos += num_heads
    for layer in inject_layers:
        x0[layer], ngram[layer] = pos, pos + 1
        pos += 2
    skip_at = None
    if skip:
        skip_at, pos = pos, pos + 1
    retired_at = slice(pos, pos + retired) if retired else None
    return GateLayout(xsa, gates, x0, ngram, skip_at, retired_at, pos + retired)


def pre_gate_layout(num_heads: int) -> GateLayout:
    return gate_layout(PRE_XSA_LAYERS, PRE_GATE_LAYERS, PRE_INJECT_LAYERS, num_heads, skip=False, retired=0)


def post_gate_layout(num_heads: int) -> GateLayout:
    # the 12 retired slots at 6 heads are the record's old per-head-pair correction: 2 per head
    return gate_layout(POST_XSA_LAYERS, POST_GATE_LAYERS, POST_INJECT_LAYERS, num_heads, skip=True,
                       retired=2 * num_heads)


class MuddBlock(nn.Module):
    """coef(x) = (W₂·gelu(W₁·x) + b)·scale; ``groups`` > 0 adds per-channel-group deltas."""

    def __init__(self, dim: int, num_coef: int, bias: Tensor, groups: int = 0, hidden: int = MUDD_HIDDEN) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(hidden, dim))
        nn.init.kaiming_uniform_(self.w1, a=math.sqrt(5))
        self.w2 = nn.Parameter(torch.zeros(num_coef, hidden))
        self.b2 = nn.Parameter(bias.clone().float())
        self.w2g = nn.Parameter(torch.zeros(num_coef, groups, hidden)) if groups else None

    def hidden(self, x: Tensor) -> Tensor:
        return F.gelu(x @ self.w1.type_as(x).t())

    def forward(self, x: Tensor, scale: Tensor | float) -> Tensor:
        """Coefficients ``[N, num_coef]``."""
        return self.coefs(self.hidden(x), scale)

    def coefs(self, h: Tensor, scale: Tensor | float) -> Tensor:
        scale = scale.type_as(h) if torch.is_tensor(scale) else scale
        return (h @ self.w2.type_as(h).t() + self.b2.type_as(h)) * scale

    def deltas(self, h: Tensor) -> Tensor:
        """Per-group deltas ``[N, num_coef, groups]`` (fixed ×0.1)."""
        return torch.einsum("nd,kgd->nkg", h, self.w2g.type_as(h)) * MUDD_SCALE


class Mudd(nn.Module):
    """The record's four MUDD blocks (see the module docstring)."""

    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        if dim % FINAL_MIX_GROUPS:
            raise ValueError(f"model.gpt.mudd: model_dim {dim} must split into {FINAL_MIX_GROUPS} channel groups")
        self.num_heads = num_heads
        self.pre = pre_gate_layout(num_heads)
        self.post = post_gate_layout(num_heads)
        self.pre_gate = MuddBlock(dim, self.pre.size, self.pre.bias())
        self.post_gate = MuddBlock(dim, self.post.size, self.post.bias())
        # κ, shared by both gate blocks (RECORD §2)
        self.gate_scale = nn.Parameter(torch.tensor(MUDD_SCALE))
        mix_bias = torch.zeros(LAYER_MIX_COEFS)
        for i, v in LAYER_MIX_BIAS.items():
            mix_bias[i] = v / MUDD_SCALE
        self.layer_mix = MuddBlock(dim, LAYER_MIX_COEFS, mix_bias)
        final_bias = torch.zeros(len(FINAL_MIX_SOURCES))
        for i, v in FINAL_MIX_BIAS.items():
            final_bias[i] = v / MUDD_SCALE
        self.final_mix = MuddBlock(dim, len(FINAL_MIX_SOURCES), final_bias, groups=FINAL_MIX_GROUPS)

    def gates(self, which: str, x: Tensor) -> dict[str, dict[int, Tensor]]:
        """The gates of the pre or post block for stream ``x``, by kind and layer."""
        block, layout = (self.pre_gate, self.pre) if which == "pre" else (self.post_gate, self.post)
        g = block(x, self.gate_scale)
        out: dict[str, dict[int, Tensor]] = {
            "xsa": {k: g[:, sl] for k, sl in layout.xsa.items()},
            "attn_gate": {k: g[:, sl] for k, sl in layout.attn_gate.items()},
            "x0": {k: g[:, i:i + 1] for k, i in layout.x0.items()},
            "ngram": {k: g[:, i:i + 1] for k, i in layout.ngram.items()},
        }
        if layout.skip is not None:
            out["skip"] = {0: g[:, layout.skip:layout.skip + 1]}
        return out

    def layer_coefs(self, x: Tensor) -> Tensor:
        """The 14 layer-mix coefficients ``[N, 14]`` (fixed ×0.1)."""
        return self.layer_mix(x, MUDD_SCALE)

    def final(self, x: Tensor, sources: list[Tensor]) -> Tensor:
        """x + Σ_k (μ_k + δ_{k,g})·src_k per channel group g (RECORD §2 "Post-loop MUDD").

        ``final_reference`` written for fusion: the per-group deltas as one plain matmul of the
        hidden, and the sources added one by one in fp32, with no stacked ``[N, K, D]`` copy. At
        stage 2's 49,152 tokens on an H100, compiled forward + backward, it takes 1.64 ms against
        the reference's 3.87 (``benchmarks/mudd_final.py``, BENCHMARKS.md).
        """
        block = self.final_mix
        h = block.hidden(x)
        k, g = len(sources), FINAL_MIX_GROUPS
        deltas = (h @ block.w2g.type_as(h).reshape(k * g, -1).t()).view(-1, k, g) * MUDD_SCALE
        c = (block.coefs(h, MUDD_SCALE)[:, :, None] + deltas).float()  # [N, K, G]
        mix = None
        for i, src in enumerate(sources):
            term = c[:, i, :, None] * src.unflatten(-1, (g, -1)).float()
            mix = term if mix is None else mix + term
        return x + mix.flatten(-2).to(x.dtype)

    def final_reference(self, x: Tensor, sources: list[Tensor]) -> Tensor:
        """``final`` as the formula reads: the coefficients of every source and group, times the
        stacked sources, summed over the sources."""
        h = self.final_mix.hidden(x)
        c = self.final_mix.coefs(h, MUDD_SCALE)[:, :, None] + self.final_mix.deltas(h)  # [N, K, G]
        grouped = torch.stack(sources, dim=1).unflatten(-1, (FINAL_MIX_GROUPS, -1))  # [N, K, G, D/G]
        mix = (c[..., None] * grouped).sum(1)
        return x + mix.flatten(-2)
