"""The speedrun's modernized GPT, as plain ``nn.Module`` s.

Reading order: :class:`GPTConfig` (every technique is a field), :class:`CausalSelfAttention`,
:class:`Block`, :class:`GPT`. The model maps a packed micro-batch (one flat token
sequence holding several documents, with ``cu_seqlens``) to final hidden states; the
loss (softcapped, possibly sampled, cross-entropy against ``lm_head``) lives in
``nanogpt_pl.ops.cross_entropy``. Nothing here knows about Lightning, ranks or optimizers.

Techniques (RECORD.md §2): rotary embeddings on truncated frequencies with YaRN,
QK-norm, ReLU² MLP, RMSNorm without weights, zero-initialized output projections,
an untied lm_head padded to 50,304 classes with a sigmoid softcap, value embeddings
mixed into the attention values through a learned gate, the x0 skip into every
block, a U-net skip from block 3 to block 6, the one-token "smear", long and short
attention windows, and document masking inside packed sequences.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .attention import packed_attention, resolve_backend, segment_positions
from .embeddings import NGRAM_GATE_INIT, CompactRows, HashedNgramEmbedding, NgramInput, check_ngram_rows
from .mlp import FC_INIT_GAIN, MLP
from .rotary import Rotary, apply_rotary

QK_NORM_EPS = 1.1920929e-7  # RECORD §2: per-head RMS norm of Q and K, eps = float32 machine epsilon
LM_HEAD_INIT_STD = 0.005  # RECORD §2 "Initialization": lm_head ~ N(0, 0.005²)
VALUE_EMBED_INIT_STD = 0.01  # RECORD §2 "Value embeddings": 0.01·N(0, 1)
GATE_CHANNELS = 6  # RECORD §2: value-embedding gate reads x̂[:6] and ve[:6]
SMEAR_CHANNELS = 12  # RECORD §2: smear gate reads x[t][:12]
SKIP_LAMBDA_INIT = -1.5  # RECORD §2 "scalars": skip λ = -1.5 (σ ≈ 0.18)


@dataclass
class GPTConfig:
    """Shape and techniques of the model; every field is a YAML key under ``model.gpt``.

    Args:
        vocab_size: classes of the lm_head and rows of the embedding (GPT-2's 50,257
            padded to a multiple of 128).
        num_layers: layer slots.
        model_dim: residual stream width.
        num_heads: attention heads.
        head_dim: query/key/value size per head.
        mlp_hidden: MLP hidden width.
        attention_layers: layers that have attention (None = all).
        mlp_layers: layers that have an MLP (None = all).
        long_window_layers: layers using the long attention window; the others use the short one.
        value_embed_layers: layers whose attention values get a value embedding (one table each).
        skip_from: output of this layer is added (gated) to the input of ``skip_to`` (None = off).
        skip_to: see ``skip_from``.
        smear: mix a gated copy of the previous token's embedding into each token's embedding.
        attn_scale: softmax scale of attention before YaRN (RECORD §2 uses 0.13 / 0.085 per width).
        attention_backend: ``auto``, ``sdpa`` (dense reference, CPU), ``varlen`` or ``flex`` (CUDA).
        fp8_mlp: run the MLP matmuls in FP8 (CUDA, or emulated on CPU).
        fp8_head: run the lm_head matmuls in FP8.
        fp8_qkv: run the QKV projection in FP8.
        fp8_backend: ``auto``, ``scaled_mm`` (CUDA only) or ``emulated``.
        ngram_rows: rows of the hashed bigram + trigram table (RECORD §3: 84,602,880); 0 = no
            n-gram channel. The table lives outside the model (``nanogpt_pl.distributed.ngram_shard``);
            ``forward`` receives the rows a batch needs as ``ngram``.
        ngram_layers: layers after whose attention sublayer x0_ngram is added again, each with
            its own scalar gate (RECORD §3 "Injection": 1, 4, 5, 9; plus the residual start).
    """

    vocab_size: int = 50304
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
    attention_backend: str = "auto"
    fp8_mlp: bool = False
    fp8_head: bool = False
    fp8_qkv: bool = False
    fp8_backend: str = "auto"
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
        for name in ("attention_layers", "mlp_layers", "long_window_layers", "value_embed_layers"):
            check_layers(name, getattr(self, name))
        for name in ("skip_from", "skip_to"):
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
        missing = set(self.value_embed_layers) - attn
        if missing:
            raise ValueError(f"model.gpt.value_embed_layers {sorted(missing)} have no attention")
        if self.model_dim < SMEAR_CHANNELS and self.smear:
            raise ValueError(f"model.gpt.smear needs model_dim >= {SMEAR_CHANNELS}")

    def has_attention(self, layer: int) -> bool:
        return self.attention_layers is None or layer in self.attention_layers

    def has_mlp(self, layer: int) -> bool:
        return self.mlp_layers is None or layer in self.mlp_layers

    def flops_per_token(self, seq_len: int, window_short: int, window_long: int) -> int:
        """Training FLOPs per token (forward + backward = 3x forward) of the dense model.

        Counts the matmuls (2 FLOPs per multiply-add) of every projection, the lm_head over
        the full vocabulary, and attention scores + values over the mean number of keys a
        query sees with the given windows (capped by ``seq_len``).
        """
        d, hd_total = self.model_dim, self.num_heads * self.head_dim
        fwd = 0
        for i in range(self.num_layers):
            if self.has_attention(i):
                window = window_long if i in self.long_window_layers else window_short
                keys = min(window + 1, seq_len)
                fwd += 2 * d * hd_total * 4  # q, k, v, o
                fwd += 2 * 2 * hd_total * keys  # scores + weighted values (causal mean ≈ keys)
            if self.has_mlp(i):
                fwd += 2 * 2 * d * self.mlp_hidden
        fwd += 2 * d * self.vocab_size
        return 3 * fwd


def rms_norm(x: Tensor, eps: Optional[float] = None) -> Tensor:
    return F.rms_norm(x, (x.shape[-1],), eps=eps)


@dataclass
class PackedContext:
    """What every layer needs to know about the packed micro-batch."""

    cu_seqlens: Tensor
    max_seqlen: int
    rotary: dict[str, tuple[Tensor, Tensor]]  # chain -> (cos, sin)
    windows: dict[str, int]  # chain -> left window in tokens
    scales: dict[str, float]  # chain -> softmax scale (YaRN-adjusted)


class CausalSelfAttention(nn.Module):
    """QK-normed rotary attention over packed documents, with an optional value embedding."""

    def __init__(self, cfg: GPTConfig, chain: str, value_embed: bool) -> None:
        super().__init__()
        hd_total = cfg.num_heads * cfg.head_dim
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.chain = chain  # "short" or "long": which window, rotary table and scale it uses
        self.backend = cfg.attention_backend
        bound = math.sqrt(3) * FC_INIT_GAIN * cfg.model_dim**-0.5  # RECORD §2: qk/vo banks U(±0.03125)
        self.qk_w = nn.Parameter(torch.empty(2, hd_total, cfg.model_dim).uniform_(-bound, bound))
        self.v_w = nn.Parameter(torch.empty(hd_total, cfg.model_dim).uniform_(-bound, bound))
        self.o_w = nn.Parameter(torch.zeros(hd_total, cfg.model_dim))
        # RECORD §8: the optimizer orthogonalizes Q and K in groups of two heads (256×768).
        self.qk_w.anvil_block = (2 * cfg.head_dim, cfg.model_dim)
        # RECORD §2: v += 2·σ(W_g·[x̂[:6], ve[:6]])·ve, W_g zero-initialized so the gate starts at 1.
        self.ve_gate = nn.Parameter(torch.zeros(cfg.num_heads, 2 * GATE_CHANNELS)) if value_embed else None
        self.fp8_qkv = cfg.fp8_qkv
        if cfg.fp8_qkv:
            from ..ops.fp8 import Fp8LinearState

            self.fp8_state = Fp8LinearState(backend=cfg.fp8_backend)

    def _qkv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        n = x.shape[0]
        if self.fp8_qkv and self.training:
            from ..ops.fp8 import fp8_linear

            # the weight parts are passed separately so the FP8 cache follows each one's version
            qkv = fp8_linear(x, (self.qk_w.flatten(0, 1), self.v_w), self.fp8_state)
        else:
            w = torch.cat([self.qk_w.flatten(0, 1), self.v_w]).type_as(x)
            qkv = x @ w.t()
        q, k, v = qkv.view(n, 3, self.num_heads, self.head_dim).unbind(1)
        return q, k, v

    def forward(self, x: Tensor, ctx: PackedContext, ve: Optional[Tensor] = None) -> Tensor:
        n = x.shape[0]
        q, k, v = self._qkv(x)
        q, k = rms_norm(q, QK_NORM_EPS), rms_norm(k, QK_NORM_EPS)
        cos, sin = ctx.rotary[self.chain]
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if ve is not None:
            gate_in = torch.cat([x[:, :GATE_CHANNELS], ve[:, :GATE_CHANNELS]], dim=-1)
            gate = 2 * torch.sigmoid(gate_in @ self.ve_gate.type_as(x).t())
            v = v + gate[..., None] * ve.view(n, self.num_heads, self.head_dim)
        backend = resolve_backend(self.backend, x.device)
        y = packed_attention(
            q, k, v, ctx.cu_seqlens, ctx.max_seqlen, ctx.windows[self.chain], ctx.scales[self.chain], backend
        )
        return y.reshape(n, -1) @ self.o_w.type_as(y)


class Block(nn.Module):
    """One layer slot: optional attention, optional MLP, the x0 skip and residual scales."""

    def __init__(self, cfg: GPTConfig, layer: int) -> None:
        super().__init__()
        chain = "long" if layer in cfg.long_window_layers else "short"
        self.attn = (
            CausalSelfAttention(cfg, chain, layer in cfg.value_embed_layers)
            if cfg.has_attention(layer)
            else None
        )
        self.mlp = (
            MLP(cfg.model_dim, cfg.mlp_hidden, fp8=cfg.fp8_mlp, fp8_backend=cfg.fp8_backend)
            if cfg.has_mlp(layer)
            else None
        )
        # residual scale of the attention and MLP sublayers, and the weight of x0 added back
        self.resid_lambdas = nn.Parameter(torch.ones(2))
        self.x0_lambda = nn.Parameter(torch.zeros(()))

    def forward(self, x: Tensor, x0: Tensor, ctx: PackedContext, ve: Optional[Tensor],
                x0_ngram: Optional[Tensor] = None) -> Tensor:
        lam = self.resid_lambdas.type_as(x)
        if self.attn is not None:
            x = lam[0] * x + self.attn(rms_norm(x), ctx, ve)
        x = x + self.x0_lambda.type_as(x) * x0
        if x0_ngram is not None:  # already gated (RECORD §2: "+ g_bg[i]·x0_ngram where allowed")
            x = x + x0_ngram
        if self.mlp is not None:
            x = lam[1] * x + self.mlp(rms_norm(x))
        return x


class GPT(nn.Module):
    """Token ids of a packed micro-batch -> final normalized hidden states."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
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
            self.ngram = HashedNgramEmbedding(d)
            self.ngram_gates = nn.Parameter(torch.full((1 + len(cfg.ngram_layers),), NGRAM_GATE_INIT))
        self.rotaries = nn.ModuleDict(
            {"short": Rotary(cfg.head_dim, cfg.attn_scale), "long": Rotary(cfg.head_dim, cfg.attn_scale)}
        )
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_layers))
        if cfg.smear:
            self.smear_gate = nn.Parameter(torch.zeros(1, SMEAR_CHANNELS))
            self.smear_lambda = nn.Parameter(torch.zeros(()))
        if cfg.skip_from is not None:
            self.skip_lambda = nn.Parameter(torch.tensor(SKIP_LAMBDA_INIT))
        self.fp8_head = None
        if cfg.fp8_head:
            from ..ops.fp8 import Fp8Head

            # the lm_head GEMMs of the training loss (RECORD §7); validation stays bf16
            self.fp8_head = Fp8Head(backend=cfg.fp8_backend)

    # -- embeddings ------------------------------------------------------------------
    def _embed(self, input_ids: Tensor) -> Tensor:
        x = F.embedding(input_ids, self.embed)
        if self.cfg.smear:
            # x[t] += λ·σ(w·x[t][:12])·x[t-1]; crosses document boundaries like the record
            gate = torch.sigmoid(x[1:, :SMEAR_CHANNELS] @ self.smear_gate.type_as(x).t())
            prev = self.smear_lambda.type_as(x) * gate * x[:-1]
            x = torch.cat([x[:1], x[1:] + prev])
        return rms_norm(x)

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
        n = input_ids.shape[0]
        input_ids = input_ids.long()
        x = x0 = self._embed(input_ids)
        x0_ngram, ngram_gate = None, {}
        if self.cfg.ngram_rows:
            if ngram is None:
                raise ValueError(
                    "model.gpt.ngram_rows > 0: pass the batch's n-gram rows as forward(..., ngram=...) "
                    "(nanogpt_pl.distributed.ngram_shard.SparseChannels.inputs builds them)"
                )
            x0_ngram = self.ngram(ngram, x.dtype)
            gates = self.ngram_gates.type_as(x)
            x = x + gates[0] * x0_ngram  # RECORD §2: residual start x = x0 + g[0]·x0_ngram
            ngram_gate = {layer: gates[k + 1] for k, layer in enumerate(self.cfg.ngram_layers)}
        elif ngram is not None:
            raise ValueError("forward got n-gram rows but model.gpt.ngram_rows is 0")
        positions = segment_positions(cu_seqlens, n)
        ctx = PackedContext(
            cu_seqlens=cu_seqlens,
            max_seqlen=max_seqlen,
            rotary={name: rot.cos_sin(positions, x.dtype) for name, rot in self.rotaries.items()},
            windows={"short": windows[0], "long": windows[1]},
            scales={name: rot.attn_scale for name, rot in self.rotaries.items()},
        )
        if value_rows is not None:
            ve_of_layer = {layer: F.embedding(value_rows.index, value_rows.values[p]).to(x.dtype)
                           for p, layer in enumerate(self.cfg.value_embed_layers)}
        else:
            ve_of_layer = {layer: F.embedding(input_ids, table)
                           for layer, table in zip(self.cfg.value_embed_layers, self.value_embeds)}
        skip = None
        for i, block in enumerate(self.blocks):
            if i == self.cfg.skip_to and skip is not None:
                x = x + torch.sigmoid(self.skip_lambda).type_as(x) * skip
            ng = ngram_gate[i] * x0_ngram if i in ngram_gate else None
            x = block(x, x0, ctx, ve_of_layer.get(i), ng)
            if i == self.cfg.skip_from:
                skip = x
        return rms_norm(x)

    # -- parameter roles (read by the module to build optimizer groups) ---------------
    def matrix_params(self) -> list[nn.Parameter]:
        """The hidden matrices (attention and MLP projections)."""
        out = []
        for block in self.blocks:
            if block.attn is not None:
                out += [block.attn.qk_w, block.attn.v_w, block.attn.o_w]
            if block.mlp is not None:
                out += [block.mlp.fc_w, block.mlp.proj_w]
        return out

    def param_roles(self) -> dict[str, list[nn.Parameter]]:
        """Parameters by role: matrices, embed, lm_head, value_embeds, scalars."""
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
            if block.mlp is not None:
                fams["mlp"] += [block.mlp.fc_w, block.mlp.proj_w]
        return fams
