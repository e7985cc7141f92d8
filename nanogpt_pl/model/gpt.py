"""The speedrun's modernized GPT, as plain ``nn.Module`` s.

Length: over 450 lines because the forward is the record's layer table read top to bottom
(RECORD §2: injection points, the norm(cache[7]) inputs, the parallel MLP, the MUDD mixes);
cut into pieces it would no longer read as one network.

Reading order: :class:`GPTConfig` (every technique is a field), :class:`Block`,
:class:`GPT`; the attention sublayer and its variants are in ``attention.py``, the MUDD
gates in ``mudd.py``. The model maps a packed micro-batch (one flat token sequence
holding several documents, with ``cu_seqlens``) to final hidden states; the loss
(softcapped, possibly sampled, cross-entropy against ``lm_head``) lives in
``nanogpt_pl.ops.cross_entropy``. Nothing here knows about Lightning, ranks or optimizers.

Techniques (RECORD.md §2): rotary embeddings on truncated frequencies with YaRN (one
chain per window kind, each with its own starting scale), QK-norm, per-layer attention
widths (narrow, dv64, wide), paired heads, the key offset, XSA and attention gates,
ReLU² MLP (and a parallel one), RMSNorm without weights, zero-initialized output
projections, an untied lm_head padded to 50,304 classes with a sigmoid softcap, value
embeddings mixed into the attention values through a learned gate, x0 and n-gram
injections at chosen layers, a gated skip, the one-token "smear", residual and post
lambdas, attention inputs read from a cached stream, MUDD's token-conditional gates and
dense connections, long and short attention windows, and document masking inside packed
sequences.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..backends import Backends, check_opt_in
from ..data.tokenizer import PADDED_VOCAB
from .attention import AttentionSpec, CausalSelfAttention, paired_positions, segment_positions
from .embeddings import (
    NGRAM_GATE_INIT,
    CompactRows,
    HashedNgramEmbedding,
    NgramInput,
    check_ngram_rows,
    gather_planes,
)
from .mlp import MLP
from .mudd import (
    CACHE_LAYERS,
    MIX_CACHE0,
    MIX_CACHE7,
    MIX_NGRAM,
    MIX_POST_ATTN,
    MIX_POST_MLP,
    MIX_RESID_ATTN,
    MIX_RESID_MLP,
    MIX_V_CACHE0,
    MIX_V_CACHE7,
    MIX_V_X,
    MIX_VE_GATE,
    MIX_X,
    MIX_X0,
    MIXED_LAYER,
    POST_GATE_INPUT_LAYER,
    Mudd,
    post_gate_layout,
    pre_gate_layout,
)
from .rotary import Rotary

LM_HEAD_INIT_STD = 0.005  # RECORD §2 "Initialization": lm_head ~ N(0, 0.005²)
VALUE_EMBED_INIT_STD = 0.01  # RECORD §2 "Value embeddings": 0.01·N(0, 1)
SMEAR_CHANNELS = 12  # RECORD §2: smear gate reads x[t][:12]
SKIP_LAMBDA_INIT = -1.5  # RECORD §2 "scalars": skip λ = -1.5 (σ ≈ 0.18)
RECORD_RESID_LAMBDA_INIT = math.sqrt(1.1)  # RECORD §2: ρ starts at √1.1 per sublayer (1.1 per layer)
# RECORD §2 "MUDD": the record's value-embedding layers, in plane order (layer 1 → p0, 2 → p1, 8 → p2, 10 → p3)
RECORD_VALUE_EMBED_LAYERS = [1, 2, 8, 10]


@dataclass
class GPTConfig:
    """Shape and techniques of the model; every field is a YAML key under ``model.gpt``.

    Defaults build a plain version of the network (all layers full width, no MUDD, x0 at
    every layer); ``configs/speedrun.yaml`` switches on the record's layer map (RECORD §2).

    Args:
        vocab_size: classes of the lm_head and rows of the embedding (GPT-2's 50,257
            padded to a multiple of 128).
        num_layers: layer slots.
        model_dim: residual stream width.
        num_heads: attention heads.
        head_dim: stored size of a head, and the query/key/value size of a wide layer.
        mlp_hidden: MLP hidden width.
        attention_layers: layers that have attention (None = all).
        mlp_layers: layers that have an MLP (None = all).
        long_window_layers: layers using the long attention window; the others use the short one.
        value_embed_layers: layers whose attention values get a value embedding (one table each).
        skip_from: output of this layer is added (gated) to the input of ``skip_to`` (None = off).
        skip_to: see ``skip_from``.
        smear: mix a gated copy of the previous token's embedding into each token's embedding.
        attn_scale: softmax scale of the short-window chain before YaRN (RECORD §2: 0.13).
        attn_scale_long: softmax scale of the long-window chain before YaRN (RECORD §2: 0.085);
            None = ``attn_scale``.
        narrow_layers: layers with query/key heads of half ``head_dim`` (RECORD §2 "narrow",
            (d_qk, d_v) = (64, 128)).
        dv64_layers: layers with query, key and value heads of half ``head_dim`` (RECORD §2
            "dv64", (64, 64)). Layers in neither list are wide (128, 128).
        paired_layers: paired-head layers (RECORD §2): the sequence doubled, heads j and
            j + H/2 attending to each other as consecutive positions.
        key_offset_layers: layers whose keys' upper half is the previous token's (RECORD §2 step 4).
        xsa_layers: layers that subtract from each head's output its projection on the token's
            own value (RECORD §2 step 6); not on paired layers.
        attn_gate_layers: layers whose head outputs are multiplied by a gate (RECORD §2 step 7).
        attn_input_cache: attention layers after this layer read norm(stream after it) instead
            of the current stream (RECORD §2: 7, so layers 8 and 10); None = off.
        parallel_mlp_layers: layers with a second MLP on the same normed input (RECORD §2: 8).
        x0_layers: layers that add gated x0 after their attention (None = all; RECORD §2:
            0, 1, 2, 4, 5, 7).
        mudd: MUDD gates and dense connections (RECORD §2); needs the record's 11-layer map.
        resid_lambda_init: start value of ρ, the residual scale of every sublayer (RECORD §2: √1.1).
        qkv_lambda_init: start value of λ₀, the scalar on the QKV weights (RECORD §2: 0.5).
        fp8_mlp: run the MLP matmuls in FP8 (CUDA, or the PyTorch reference on CPU).
        fp8_head: run the lm_head matmuls in FP8.
        fp8_qkv: run the QKV projection in FP8.
        fp8_qkv_x_scale: static FP8 scale of the QKV input; None = the clip-free default
            (RECORD §7: 8/448, which clamps |x| > 8).
        ngram_rows: rows of the hashed bigram + trigram table (RECORD §3: 84,602,880); 0 = no
            n-gram channel. The table lives outside the model (``nanogpt_pl.distributed.ngram_shard``);
            ``forward`` receives the rows a batch needs as ``ngram``.
        ngram_layers: layers after whose attention sublayer x0_ngram is added again, each with
            its own gate (RECORD §3 "Injection": 1, 4, 5, 9; plus the residual start).
    """

    vocab_size: int = PADDED_VOCAB
    num_layers: int = 11
    model_dim: int = 768
    num_heads: int = 6
    head_dim: int = 128
    mlp_hidden: int = 2816
    attention_layers: Optional[list[int]] = None
    mlp_layers: Optional[list[int]] = None
    long_window_layers: list[int] = field(default_factory=lambda: [3, 10])
    value_embed_layers: list[int] = field(default_factory=lambda: [1, 2, 8, 10])
    skip_from: Optional[int] = 3
    skip_to: Optional[int] = 6
    smear: bool = True
    attn_scale: float = 0.12
    attn_scale_long: Optional[float] = None
    narrow_layers: list[int] = field(default_factory=list)
    dv64_layers: list[int] = field(default_factory=list)
    paired_layers: list[int] = field(default_factory=list)
    key_offset_layers: list[int] = field(default_factory=list)
    xsa_layers: list[int] = field(default_factory=list)
    attn_gate_layers: list[int] = field(default_factory=list)
    attn_input_cache: Optional[int] = None
    parallel_mlp_layers: list[int] = field(default_factory=list)
    x0_layers: Optional[list[int]] = None
    mudd: bool = False
    resid_lambda_init: float = 1.0
    qkv_lambda_init: float = 1.0
    fp8_mlp: bool = False
    fp8_head: bool = False
    fp8_qkv: bool = False
    fp8_qkv_x_scale: Optional[float] = None
    ngram_rows: int = 0
    ngram_layers: list[int] = field(default_factory=lambda: [1, 4, 5, 9])

    def __post_init__(self) -> None:
        def check_layers(name: str, layers: Optional[list[int]]) -> None:
            for i in layers or []:
                if not 0 <= i < self.num_layers:
                    raise ValueError(f"model.gpt.{name}: layer {i} is outside 0..{self.num_layers - 1} "
                                     f"(model.gpt.num_layers is {self.num_layers}); set --model.gpt.{name} "
                                     "for that depth too")

        if self.ngram_rows:  # ngram_layers only matter (and are checked) when the table is on
            check_ngram_rows(self.ngram_rows)
            check_layers("ngram_layers", self.ngram_layers)
        for name in ("attention_layers", "mlp_layers", "long_window_layers", "value_embed_layers", "narrow_layers",
                     "dv64_layers", "paired_layers", "key_offset_layers", "xsa_layers", "attn_gate_layers",
                     "parallel_mlp_layers", "x0_layers"):
            check_layers(name, getattr(self, name))
        for name in ("skip_from", "skip_to", "attn_input_cache"):
            check_layers(name, [] if getattr(self, name) is None else [getattr(self, name)])
        if (self.skip_from is None) != (self.skip_to is None):
            raise ValueError("model.gpt.skip_from and model.gpt.skip_to must be set together (or both null)")
        if self.skip_from is not None and self.skip_from >= self.skip_to:
            raise ValueError("model.gpt.skip_from must be an earlier layer than model.gpt.skip_to")
        if self.value_embed_layers and self.model_dim != self.num_heads * self.head_dim:
            raise ValueError(
                "model.gpt.value_embed_layers needs model_dim == num_heads * head_dim "
                f"({self.model_dim} != {self.num_heads} * {self.head_dim}); set value_embed_layers: []"
            )
        attn = set(range(self.num_layers)) if self.attention_layers is None else set(self.attention_layers)
        for name in ("value_embed_layers", "narrow_layers", "dv64_layers", "paired_layers", "key_offset_layers",
                     "xsa_layers", "attn_gate_layers"):
            missing = set(getattr(self, name)) - attn
            if missing:
                raise ValueError(f"model.gpt.{name} {sorted(missing)} have no attention")
        mlp = set(range(self.num_layers)) if self.mlp_layers is None else set(self.mlp_layers)
        if set(self.parallel_mlp_layers) - mlp:
            raise ValueError(f"model.gpt.parallel_mlp_layers {sorted(set(self.parallel_mlp_layers) - mlp)} have no MLP")
        both = set(self.narrow_layers) & set(self.dv64_layers)
        if both:
            raise ValueError(f"model.gpt: layers {sorted(both)} are in both narrow_layers and dv64_layers; pick one")
        if (self.narrow_layers or self.dv64_layers) and self.head_dim % 4:
            raise ValueError(f"model.gpt.narrow_layers/dv64_layers halve head_dim={self.head_dim}; it must be a "
                             f"multiple of 4 (rotary pairs)")
        if self.paired_layers and self.num_heads % 2:
            raise ValueError(f"model.gpt.paired_layers need an even num_heads, got {self.num_heads}")
        if set(self.xsa_layers) & set(self.paired_layers):
            clash = sorted(set(self.xsa_layers) & set(self.paired_layers))
            raise ValueError(f"model.gpt.xsa_layers: XSA needs unpaired heads (RECORD §2); remove {clash} "
                             f"from xsa_layers or paired_layers")
        if self.model_dim < SMEAR_CHANNELS and self.smear:
            raise ValueError(f"model.gpt.smear needs model_dim >= {SMEAR_CHANNELS}")
        if self.mudd:
            self._check_mudd()

    def _check_mudd(self) -> None:
        """MUDD's coefficient layout names the record's layers (RECORD §2): check the map fits it."""
        def need(ok: bool, what: str) -> None:
            if not ok:
                raise ValueError(f"model.gpt.mudd needs the record's layer map (RECORD §2): {what}; "
                                 f"set mudd: false for other layouts")

        pre, post = pre_gate_layout(self.num_heads), post_gate_layout(self.num_heads)
        need(self.num_layers == 11, f"num_layers 11 (got {self.num_layers})")
        need(self.value_embed_layers == RECORD_VALUE_EMBED_LAYERS,
             f"value_embed_layers {RECORD_VALUE_EMBED_LAYERS} (got {self.value_embed_layers})")
        need(self.has_attention(MIXED_LAYER) and self.has_mlp(MIXED_LAYER), f"attention and MLP on {MIXED_LAYER}")
        need(self.skip_from == 3 and self.skip_to == 6, "skip_from 3, skip_to 6")
        need(self.num_heads % 2 == 0, "an even num_heads")
        need(self.model_dim % 12 == 0, "model_dim divisible into 12 channel groups")
        gated = {**pre.attn_gate, **post.attn_gate}
        need(set(self.attn_gate_layers) <= set(gated), f"attn_gate_layers within {sorted(gated)}")
        need(set(self.xsa_layers) <= set(pre.xsa), f"xsa_layers within {sorted(pre.xsa)}")
        inject = set(pre.x0) | set(post.x0)
        need(set(self.injected_x0_layers()) <= inject, f"x0_layers within {sorted(inject)}")
        if self.ngram_rows:
            need(set(self.ngram_layers) <= inject, f"ngram_layers within {sorted(inject)}")

    # -- per-layer structure ---------------------------------------------------------
    def has_attention(self, layer: int) -> bool:
        return self.attention_layers is None or layer in self.attention_layers

    def has_mlp(self, layer: int) -> bool:
        return self.mlp_layers is None or layer in self.mlp_layers

    def widths(self, layer: int) -> tuple[int, int]:
        """(d_qk, d_v) of an attention layer."""
        half = self.head_dim // 2
        if layer in self.dv64_layers:
            return half, half
        if layer in self.narrow_layers:
            return half, self.head_dim
        return self.head_dim, self.head_dim

    def width_kind(self, layer: int) -> str:
        return "dv64" if layer in self.dv64_layers else "narrow" if layer in self.narrow_layers else "wide"

    def chain(self, layer: int) -> str:
        return "long" if layer in self.long_window_layers else "short"

    def injected_x0_layers(self) -> list[int]:
        """Layers that add x0 through a gate (the MUDD layer's own μ₁₀ term not counted)."""
        layers = range(self.num_layers) if self.x0_layers is None else self.x0_layers
        return [i for i in layers if not (self.mudd and i == MIXED_LAYER)]

    def mixed_layer(self, layer: int) -> bool:
        """The layer whose residual, values and VE gate come from MUDD's layer mix."""
        return self.mudd and layer == MIXED_LAYER

    def cache_layers(self) -> set[int]:
        out = {k for k in (self.skip_from, self.attn_input_cache) if k is not None}
        return out | (set(CACHE_LAYERS) if self.mudd else set())

    def attention_spec(self, layer: int, backends: Optional[Backends] = None) -> AttentionSpec:
        """Layer ``layer``'s attention; ``backends`` (``model.backends``, default all ``auto``) picks its kernels."""
        backends = Backends() if backends is None else backends
        d_qk, d_v = self.widths(layer)
        return AttentionSpec(
            model_dim=self.model_dim, num_heads=self.num_heads, head_dim=self.head_dim, d_qk=d_qk, d_v=d_v,
            chain=self.chain(layer), paired=layer in self.paired_layers, key_offset=layer in self.key_offset_layers,
            xsa=layer in self.xsa_layers, gate=layer in self.attn_gate_layers, dynamic_gates=self.mudd,
            value_embed=layer in self.value_embed_layers and not self.mixed_layer(layer),
            backend=backends.attention, qk_rotary=backends.qk_rotary, fp8_qkv=self.fp8_qkv, fp8_backend=backends.fp8,
            fp8_qkv_x_scale=self.fp8_qkv_x_scale, qkv_lambda_init=self.qkv_lambda_init,
        )

    def flops_per_token(self, seq_len: int, window_short: int, window_long: int) -> int:
        """Training FLOPs per token (forward + backward = 3x forward) of the dense model.

        Counts the matmuls (2 FLOPs per multiply-add) of every projection at its live width,
        the lm_head over the full vocabulary, and attention scores + values over the mean
        number of keys a query sees with the given windows (capped by ``seq_len``).
        """
        d, h = self.model_dim, self.num_heads
        fwd = 0
        for i in range(self.num_layers):
            if self.has_attention(i):
                d_qk, d_v = self.widths(i)
                window = window_long if i in self.long_window_layers else window_short
                keys = min(window + 1, seq_len)
                fwd += 2 * d * h * (2 * d_qk + 2 * d_v)  # q, k, v, o
                fwd += 2 * h * (d_qk + d_v) * keys  # scores + weighted values (causal mean ≈ keys)
            if self.has_mlp(i):
                fwd += 2 * 2 * d * self.mlp_hidden * (2 if i in self.parallel_mlp_layers else 1)
        fwd += 2 * d * self.vocab_size
        return 3 * fwd


def rms_norm(x: Tensor, eps: Optional[float] = None) -> Tensor:
    return F.rms_norm(x, (x.shape[-1],), eps=eps)


@dataclass
class PackedContext:
    """What every layer needs to know about the packed micro-batch."""

    cu_seqlens: Tensor
    max_seqlen: int
    rotary: dict[str, tuple[Tensor, Tensor]]  # chain -> (cos, sin) [N, head_dim / 2]
    windows: dict[str, int]  # chain -> left window in tokens
    scales: dict[str, float]  # chain -> softmax scale (YaRN-adjusted)
    # chain -> (cos, sin) [N, H, head_dim / 2] at the paired layers' positions 2t + (h mod 2)
    rotary_paired: Optional[dict[str, tuple[Tensor, Tensor]]] = None


@dataclass
class LayerGates:
    """The gates one layer uses this forward (static parameters, or MUDD's per-token values)."""

    x0: Optional[Tensor] = None
    ngram: Optional[Tensor] = None
    xsa: Optional[Tensor] = None
    attn_gate: Optional[Tensor] = None


class Block(nn.Module):
    """One layer slot: optional attention, optional MLP (and parallel MLP), residual lambdas.

    RECORD §2 "Residual structure": x ← ρₐ·x + πₐ·attn(x̂) + g_x0·x0 + g_ng·x0_ngram, then
    x ← ρₘ·x + πₘ·MLP(norm x). A skip target without attention adds the gated skip instead of
    scaling by ρₐ (RECORD §2: layer 6); other layers without attention keep their ρₐ and
    injections (layers 4, 7 and 9).
    """

    def __init__(self, cfg: GPTConfig, layer: int, backends: Backends) -> None:
        super().__init__()
        self.layer = layer
        self.skip_target = layer == cfg.skip_to
        self.attn = CausalSelfAttention(cfg.attention_spec(layer, backends)) if cfg.has_attention(layer) else None

        def mlp() -> MLP:
            return MLP(cfg.model_dim, cfg.mlp_hidden, fp8=cfg.fp8_mlp, fp8_backend=backends.fp8)

        self.mlp = mlp() if cfg.has_mlp(layer) else None
        # RECORD §2: a second MLP on layer 8 reads the same normed input, added with the same post-lambda
        self.parallel_mlp = mlp() if layer in cfg.parallel_mlp_layers else None
        # (attention, MLP) residual scale ρ and post-lambda π; MUDD's layer mix gives its layer both
        # per token, and a layer without sublayers has no output to scale
        mixed = cfg.mixed_layer(layer)
        self.resid_lambdas = None if mixed else nn.Parameter(torch.full((2,), float(cfg.resid_lambda_init)))
        has_sublayer = self.attn is not None or self.mlp is not None
        self.post_lambdas = nn.Parameter(torch.ones(2)) if has_sublayer and not mixed else None
        # the static x0 gate (MUDD computes it per token instead)
        self.x0_lambda = (nn.Parameter(torch.zeros(())) if layer in cfg.injected_x0_layers() and not cfg.mudd
                          else None)

    def mlp_out(self, h: Tensor) -> Tensor:
        out = self.mlp(h)
        return out if self.parallel_mlp is None else out + self.parallel_mlp(h)

    def forward(self, x: Tensor, attn_in: Any, ctx: PackedContext, ve: Optional[Tensor],
                x0: Tensor, x0_ngram: Optional[Tensor], gates: LayerGates) -> Tensor:
        rho = self.resid_lambdas.type_as(x)
        post = self.post_lambdas.type_as(x) if self.post_lambdas is not None else None
        if self.attn is not None or not self.skip_target:  # RECORD §2: layer 6 only adds the skip
            x = rho[0] * x
        if self.attn is not None:
            x = x + self.attn(attn_in, ctx, ve, xsa_alpha=gates.xsa, gate=gates.attn_gate, o_gain=post[0])
        if gates.x0 is not None:
            x = x + gates.x0 * x0
        if gates.ngram is not None and x0_ngram is not None:
            x = x + gates.ngram * x0_ngram
        if self.mlp is not None:
            return rho[1] * x + post[1] * self.mlp_out(rms_norm(x))
        return rho[1] * x


class GPT(nn.Module):
    """Token ids of a packed micro-batch -> final normalized hidden states."""

    def __init__(self, cfg: GPTConfig, backends: Optional[Backends] = None) -> None:
        """``backends``: the attention and FP8 implementations (``model.backends``); default all ``auto``."""
        super().__init__()
        self.cfg = cfg
        backends = Backends() if backends is None else backends
        check_opt_in("value_rows", backends.value_rows)
        check_opt_in("qk_rotary", backends.qk_rotary)
        self.value_rows_backend = backends.value_rows
        d = cfg.model_dim
        self.lm_head = nn.Parameter(torch.randn(cfg.vocab_size, d) * LM_HEAD_INIT_STD)
        # RECORD §2: the embedding starts as a copy of the lm_head (the training module keeps the
        # two tied, one parameter's worth of updates, until the schedule's untie step)
        self.embed = nn.Parameter(self.lm_head.detach().clone())
        self.value_embeds = nn.ParameterList(
            nn.Parameter(torch.randn(cfg.vocab_size, d) * VALUE_EMBED_INIT_STD) for _ in cfg.value_embed_layers
        )
        if cfg.ngram_rows:
            # only the fixed sign table and the gates live here; the table is sharded over ranks
            self.ngram = HashedNgramEmbedding(d, backends.ngram_rows)
            if not cfg.mudd:
                self.ngram_gates = nn.Parameter(torch.full((1 + len(cfg.ngram_layers),), NGRAM_GATE_INIT))
        long_scale = cfg.attn_scale if cfg.attn_scale_long is None else cfg.attn_scale_long
        self.rotaries = nn.ModuleDict(
            {"short": Rotary(cfg.head_dim, cfg.attn_scale), "long": Rotary(cfg.head_dim, long_scale)}
        )
        self.blocks = nn.ModuleList(Block(cfg, i, backends) for i in range(cfg.num_layers))
        if cfg.smear:
            self.smear_gate = nn.Parameter(torch.zeros(1, SMEAR_CHANNELS))
            self.smear_lambda = nn.Parameter(torch.zeros(()))
        if cfg.skip_from is not None:
            self.skip_lambda = nn.Parameter(torch.tensor(SKIP_LAMBDA_INIT))
        self.mudd = Mudd(d, cfg.num_heads) if cfg.mudd else None
        self.fp8_head = None
        if cfg.fp8_head:
            from ..ops.fp8 import Fp8Head  # FP8 (and Triton) load only when used

            # the lm_head GEMMs of the training loss (RECORD §7); validation stays bf16
            self.fp8_head = Fp8Head(backend=backends.fp8)

    # -- embeddings ------------------------------------------------------------------
    def _embed(self, input_ids: Tensor) -> Tensor:
        x = F.embedding(input_ids, self.embed)
        if self.cfg.smear:
            # x[t] += λ·σ(w·x[t][:12])·x[t-1]; crosses document boundaries like the record
            gate = torch.sigmoid(x[1:, :SMEAR_CHANNELS] @ self.smear_gate.type_as(x).t())
            prev = self.smear_lambda.type_as(x) * gate * x[:-1]
            x = torch.cat([x[:1], x[1:] + prev])
        return rms_norm(x)

    def _context(self, cu_seqlens: Tensor, max_seqlen: int, windows: tuple[int, int], n: int,
                 dtype: torch.dtype) -> PackedContext:
        positions = segment_positions(cu_seqlens, n)
        paired = None
        if self.cfg.paired_layers:
            chains = {self.cfg.chain(i) for i in self.cfg.paired_layers}
            pos2 = paired_positions(positions, self.cfg.num_heads).flatten()
            paired = {}
            for name in chains:
                cos, sin = self.rotaries[name].cos_sin(pos2, dtype, bound=2 * max_seqlen)
                paired[name] = (cos.view(n, self.cfg.num_heads, -1), sin.view(n, self.cfg.num_heads, -1))
        return PackedContext(
            cu_seqlens=cu_seqlens,
            max_seqlen=max_seqlen,
            rotary={name: rot.cos_sin(positions, dtype, bound=max_seqlen) for name, rot in self.rotaries.items()},
            windows={"short": windows[0], "long": windows[1]},
            scales={name: rot.attn_scale for name, rot in self.rotaries.items()},
            rotary_paired=paired,
        )

    def build_rotary_tables(self, max_seqlen: int, dtype: torch.dtype) -> None:
        """Tabulate every rotary chain's cos/sin for segments of up to ``max_seqlen`` tokens (twice
        that at the paired layers' positions), in the activations' ``dtype``; longer segments, or
        another dtype, compute them per forward as before (``Rotary.cos_sin``)."""
        length = 2 * max_seqlen if self.cfg.paired_layers else max_seqlen
        for rot in self.rotaries.values():
            rot.build_tables(length, dtype)

    def _static_gates(self, x: Tensor) -> dict[str, dict[int, Tensor]]:
        gates: dict[str, dict[int, Tensor]] = {"x0": {}, "ngram": {}}
        for i, block in enumerate(self.blocks):
            if block.x0_lambda is not None:
                gates["x0"][i] = block.x0_lambda.type_as(x)
        if self.cfg.ngram_rows:
            g = self.ngram_gates.type_as(x)
            gates["ngram"] = {0: g[0], **{layer: g[k + 1] for k, layer in enumerate(self.cfg.ngram_layers)}}
        return gates

    # -- forward ---------------------------------------------------------------------
    def forward(
        self,
        input_ids: Tensor,
        cu_seqlens: Tensor,
        max_seqlen: int,
        windows: tuple[int, int],
        ngram: Optional[NgramInput] = None,
        value_rows: Optional[CompactRows] = None,
    ) -> Tensor:
        """Hidden states [N, model_dim] for a packed micro-batch.

        Args:
            input_ids: token ids [N] (int32 or int64).
            cu_seqlens: int32 segment starts [M + 1], padded at the end with N.
            max_seqlen: the longest segment.
            windows: (short, long) left attention windows in tokens.
            ngram: the batch's n-gram rows (required when ``cfg.ngram_rows`` > 0), see
                ``nanogpt_pl.model.embeddings``.
            value_rows: the value embeddings' rows at the batch's unique token ids (the
                compact-gradient path); None reads the tables directly.
        """
        cfg = self.cfg
        n = input_ids.shape[0]
        input_ids = input_ids.long()
        x0 = self._embed(input_ids)
        x0_ngram = None
        if cfg.ngram_rows:
            if ngram is None:
                raise ValueError(
                    "model.gpt.ngram_rows > 0: pass the batch's n-gram rows as forward(..., ngram=...) "
                    "(nanogpt_pl.distributed.sparse_channels.SparseChannels.inputs builds them)"
                )
            x0_ngram = self.ngram(ngram, x0.dtype)
        elif ngram is not None:
            raise ValueError("forward got n-gram rows but model.gpt.ngram_rows is 0")
        gates = self.mudd.gates("pre", x0) if self.mudd is not None else self._static_gates(x0)
        x = x0
        if x0_ngram is not None:  # RECORD §2: residual start x = x0 + g[0]·x0_ngram
            x = x + gates["ngram"][0] * x0_ngram
        ctx = self._context(cu_seqlens, max_seqlen, windows, n, x.dtype)
        if value_rows is not None:
            # one gather over all planes: its backward is one pass into the leaf's [P, U, D]
            # gradient (a gather per plane gave [U, D] gradients that a further pass stacked)
            planes = gather_planes(value_rows.values, value_rows.index, x.dtype, self.value_rows_backend)
            ve_of_layer = {layer: planes[p] for p, layer in enumerate(cfg.value_embed_layers)}
        else:
            ve_of_layer = {layer: F.embedding(input_ids, table).to(x.dtype)
                           for layer, table in zip(cfg.value_embed_layers, self.value_embeds)}
        cache, keep = {0: x}, cfg.cache_layers()
        normed_cache: Optional[Tensor] = None  # norm(cache[attn_input_cache]), shared by its readers
        cache_attn_in: Any = None  # what those readers take: normed_cache, quantized once if they run FP8
        last_mlp_input: Optional[Tensor] = None
        for i, block in enumerate(self.blocks):
            if self.mudd is not None and i == POST_GATE_INPUT_LAYER:
                for kind, values in self.mudd.gates("post", x).items():
                    gates.setdefault(kind, {}).update(values)
            if i == cfg.skip_to and cfg.skip_from is not None:
                skip_gate = torch.sigmoid(self.skip_lambda).type_as(x)
                if self.mudd is not None:  # RECORD §2: x ← x + σ(skip λ)·g_skip·cache[3]
                    skip_gate = skip_gate * gates["skip"][0]
                x = x + skip_gate * cache[cfg.skip_from]
            attn_in = None
            if block.attn is not None:
                if cfg.attn_input_cache is not None and i > cfg.attn_input_cache:
                    if normed_cache is None:
                        normed_cache = rms_norm(cache[cfg.attn_input_cache])
                        cache_attn_in = self._cache_attn_input(normed_cache)
                    attn_in = cache_attn_in
                else:
                    attn_in = rms_norm(x)
            if cfg.mixed_layer(i):
                x, last_mlp_input = self._mixed_layer(block, x, attn_in, ctx, ve_of_layer, cache, x0_ngram, gates)
            else:
                layer_gates = LayerGates(
                    x0=gates["x0"].get(i) if i in cfg.injected_x0_layers() else None,
                    ngram=gates["ngram"].get(i) if cfg.ngram_rows and i in cfg.ngram_layers else None,
                    xsa=gates.get("xsa", {}).get(i), attn_gate=gates.get("attn_gate", {}).get(i),
                )
                x = block(x, attn_in, ctx, ve_of_layer.get(i), x0, x0_ngram, layer_gates)
            if i in keep:
                cache[i] = x
        if self.mudd is not None:
            ve = [ve_of_layer[layer] for layer in RECORD_VALUE_EMBED_LAYERS]
            if normed_cache is None:
                normed_cache = rms_norm(cache[7])
            # RECORD §2 "Post-loop MUDD": the sources in the record's order
            sources = [cache[0], cache[7], cache[9], ve[0], cache[3], ve[1], ve[3], ve[2], last_mlp_input,
                       normed_cache]
            x = self.mudd.final(x, sources)
        return rms_norm(x)

    def _cache_attn_input(self, normed: Tensor) -> Any:
        """The input of the attention layers that read ``norm(cache[attn_input_cache])``: with FP8 QKV
        in training and several readers, quantized once by the first (RECORD §2/§7: layers 8 and 10
        share one quantize); else ``normed`` itself."""
        readers = [b.attn for b in self.blocks[self.cfg.attn_input_cache + 1:] if b.attn is not None]
        return readers[0].quantize_input(normed) if len(readers) > 1 else normed

    def _mixed_layer(self, block: Block, x: Tensor, attn_in: Any, ctx: PackedContext,
                     ve_of_layer: dict[int, Tensor], cache: dict[int, Tensor], x0_ngram: Optional[Tensor],
                     gates: dict[str, dict[int, Tensor]]) -> tuple[Tensor, Tensor]:
        """RECORD §2 "MUDD at layer 10": 14 coefficients μ from the stream entering the layer.

        Returns the new stream and the MLP's normed input (a source of the final mix)."""
        h = self.cfg.num_heads
        cache[9] = x
        mu = self.mudd.layer_coefs(x)

        def m(j: int) -> Tensor:
            return mu[:, j:j + 1]

        v_mudd = m(MIX_V_CACHE0) * cache[0] + m(MIX_V_CACHE7) * cache[7] + m(MIX_V_X) * x
        x = (1 + m(MIX_X)) * x + m(MIX_CACHE0) * cache[0] + m(MIX_CACHE7) * cache[7]
        # the VE gate (μ₆, μ₇), each tiled over half of the heads
        ve_gate = torch.cat([m(j) for j in MIX_VE_GATE], dim=-1).repeat_interleave(h // len(MIX_VE_GATE), dim=-1)
        ve = ve_of_layer[self.cfg.value_embed_layers[-1]].view(-1, h, self.cfg.head_dim)
        extra_v = ve_gate[..., None] * ve + v_mudd.view(-1, h, self.cfg.head_dim)
        a = block.attn(attn_in, ctx, extra_v=extra_v, xsa_alpha=gates.get("xsa", {}).get(block.layer),
                       gate=gates.get("attn_gate", {}).get(block.layer))
        x = m(MIX_RESID_ATTN) * x + m(MIX_POST_ATTN) * a + m(MIX_X0) * cache[0]
        if x0_ngram is not None:
            x = x + m(MIX_NGRAM) * x0_ngram
        normed = rms_norm(x)
        return m(MIX_RESID_MLP) * x + m(MIX_POST_MLP) * block.mlp_out(normed), normed

    def refresh_fp8(self) -> None:
        """Refresh every FP8 layer's weight caches whose weights changed: the check a compiled forward
        cannot run (it reads the caches as they are). An eager forward checks by itself."""
        for m in self.modules():
            if m is not self and hasattr(m, "refresh_fp8"):
                m.refresh_fp8()

    # -- parameter roles (structure only; optimizer settings live in nanogpt_pl.optim.groups) ---
    def matrix_params(self) -> list[nn.Parameter]:
        """The hidden matrices (attention and MLP projections)."""
        out = []
        for block in self.blocks:
            if block.attn is not None:
                out += [block.attn.qk_w, block.attn.v_w, block.attn.o_w]
            for mlp in (block.mlp, block.parallel_mlp):
                if mlp is not None:
                    out += [mlp.fc_w, mlp.proj_w]
        return out

    def param_roles(self) -> dict[str, list[nn.Parameter]]:
        """Parameters by role: matrices, embed, lm_head, value_embeds, scalars (everything else)."""
        matrices = self.matrix_params()
        roles: dict[str, list[nn.Parameter]] = {
            "matrices": matrices,
            "embed": [self.embed],
            "lm_head": [self.lm_head],
            "value_embeds": list(self.value_embeds),
        }
        taken = {id(p) for ps in roles.values() for p in ps}
        roles["scalars"] = [p for p in self.parameters() if id(p) not in taken]
        return roles

    def param_families(self) -> dict[str, list[nn.Parameter]]:
        """``param_roles`` plus the matrices split as the record's banks: qk, vo, mlp."""
        fams = self.param_roles()
        fams["qk"], fams["vo"], fams["mlp"] = [], [], []
        for block in self.blocks:
            if block.attn is not None:
                fams["qk"].append(block.attn.qk_w)
                fams["vo"] += [block.attn.v_w, block.attn.o_w]
            for mlp in (block.mlp, block.parallel_mlp):
                if mlp is not None:
                    fams["mlp"] += [mlp.fc_w, mlp.proj_w]
        return fams
