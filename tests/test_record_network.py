"""The record's network (RECORD §2) as configs/speedrun.yaml builds it, layer for layer.

Expected values are literals copied from RECORD.md (section named at each), not values
derived from the code under test.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml
from seeds import fresh_seed

from nanogpt_pl.backends import Backends
from nanogpt_pl.model.attention import (
    QK_NORM_EPS,
    AttentionSpec,
    CausalSelfAttention,
    dense_reference,
    segment_positions,
    shift_keys,
    xsa,
)
from nanogpt_pl.model.embeddings import NgramInput, ngram_row_ids, ngram_sign_rows
from nanogpt_pl.model.gpt import GPT, GPTConfig, PackedContext
from nanogpt_pl.model.mudd import FINAL_MIX_SOURCES, Mudd
from nanogpt_pl.model.rotary import Rotary, apply_rotary
from nanogpt_pl.module import OptimConfig, SpeedrunModule
from nanogpt_pl.optim.groups import adam_families, adam_family, anvil_group
from nanogpt_pl.schedule import Schedule

ROOT = Path(__file__).resolve().parents[1]
SPEEDRUN = yaml.safe_load((ROOT / "configs" / "speedrun.yaml").read_text())
# small dims where only the structure matters: 6 heads (MUDD's layout), 12 channel groups
SMALL = dict(vocab_size=256, model_dim=96, head_dim=16, mlp_hidden=64, ngram_rows=64, fp8_mlp=False, fp8_head=False,
             fp8_qkv=False)

# RECORD §2 "Per-layer map" (attention kind, window, paired, key offset, XSA, gate, value-embedding
# plane, x0 / n-gram injection, other). None = no attention sublayer.
RECORD_MAP = {
    0: dict(kind="narrow", window="short", paired=True, key_offset=False, xsa=False, gate=False, plane=None,
            x0=True, ngram=False, mlp=True),
    1: dict(kind="dv64", window="short", paired=False, key_offset=False, xsa=True, gate=False, plane=0,
            x0=True, ngram=True, mlp=True),
    2: dict(kind="narrow", window="short", paired=True, key_offset=False, xsa=False, gate=False, plane=1,
            x0=True, ngram=False, mlp=True),
    3: dict(kind="wide", window="long", paired=False, key_offset=True, xsa=True, gate=True, plane=None,
            x0=False, ngram=False, mlp=True),
    4: dict(kind=None, x0=True, ngram=True, mlp=True),
    5: dict(kind="narrow", window="short", paired=True, key_offset=False, xsa=False, gate=False, plane=None,
            x0=True, ngram=True, mlp=True),
    6: dict(kind=None, x0=False, ngram=False, mlp=True),
    7: dict(kind=None, x0=True, ngram=False, mlp=False),  # removed whole
    8: dict(kind="dv64", window="short", paired=False, key_offset=False, xsa=False, gate=False, plane=2,
            x0=False, ngram=False, mlp=True),
    9: dict(kind=None, x0=False, ngram=True, mlp=True),
    10: dict(kind="wide", window="long", paired=False, key_offset=True, xsa=False, gate=True, plane=3,
             x0=False, ngram=False, mlp=True),  # its x0 (μ₁₀) and n-gram (μ₁₁) terms come from MUDD
}
RECORD_WIDTHS = {"narrow": (64, 128), "dv64": (64, 64), "wide": (128, 128)}  # RECORD §2 (d_qk, d_v)


def ngram_input(ids: torch.Tensor, rows: int, dim: int) -> NgramInput:
    """The whole (random) table as the batch's rows, indexed by raw row ids."""
    values = torch.randn(rows, dim, generator=torch.Generator().manual_seed(7)).requires_grad_()
    return NgramInput(values=values, index=ngram_row_ids(ids, rows), sign_rows=ngram_sign_rows(ids))


@torch.no_grad()
def open_attention_outputs(model: GPT) -> None:
    """Draw the zero-initialized W_O of every attention layer, so attention reaches the output."""
    for block in model.blocks:
        if block.attn is not None:
            block.attn.o_w.normal_(std=0.05)


def speedrun_gpt(**kw) -> GPTConfig:
    return GPTConfig(**{**SPEEDRUN["model"]["gpt"], **kw})


def backend_against_reference(seed: int, backends: Backends, draw_ids, inputs
                              ) -> tuple[GPTConfig, torch.Tensor, dict, dict]:
    """The small record network with ``backends`` and with every reference path, the same weights and
    batch: asserts the outputs and every parameter gradient equal bit for bit, and returns ``(cfg,
    ids, fast inputs, reference inputs)`` for the caller's checks of its leaves' gradients.

    ``draw_ids(gen, cfg)`` draws the 96 token ids; ``inputs(model, ids, cfg)`` builds one run's
    forward keyword arguments (``ngram=``, ``value_rows=``), fresh leaves for each run.
    """
    torch.manual_seed(seed)
    cfg = speedrun_gpt(**SMALL)
    ref_model = GPT(cfg, Backends())
    open_attention_outputs(ref_model)
    model = GPT(cfg, backends)
    model.load_state_dict(ref_model.state_dict())
    gen = torch.Generator().manual_seed(seed)
    ids = draw_ids(gen, cfg)
    cu = torch.tensor([0, 40, 96, 96], dtype=torch.int32)
    w = torch.randn(cfg.model_dim, generator=gen)
    results = []
    for m in (model, ref_model):
        kwargs = inputs(m, ids, cfg)
        out = m(ids, cu, 56, (8, 24), **kwargs)
        (out.float() @ w).sum().backward()
        results.append((out.detach(), kwargs, {n: p.grad for n, p in m.named_parameters() if p.grad is not None}))
    (out, kwargs, grads), (ref_out, ref_kwargs, ref_grads) = results
    assert torch.equal(out, ref_out)
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        assert torch.equal(grads[name], ref_grads[name]), name
    return cfg, ids, kwargs, ref_kwargs


@pytest.fixture(scope="module")
def small_model() -> GPT:
    torch.manual_seed(0)
    return GPT(speedrun_gpt(**SMALL))


def test_speedrun_builds_the_record_layer_map(small_model):
    model, cfg = small_model, small_model.cfg
    for layer, row in RECORD_MAP.items():
        block = model.blocks[layer]
        assert (block.mlp is not None) == row["mlp"], layer
        assert (block.attn is not None) == (row["kind"] is not None), layer
        assert (layer in cfg.injected_x0_layers()) == row["x0"], layer
        assert (layer in cfg.ngram_layers) == row["ngram"], layer
        if row["kind"] is None:
            continue
        spec = block.attn.spec
        assert cfg.width_kind(layer) == row["kind"] and spec.chain == row["window"], layer
        assert (spec.paired, spec.key_offset, spec.xsa, spec.gate) == (
            row["paired"], row["key_offset"], row["xsa"], row["gate"]), layer
        plane = cfg.value_embed_layers.index(layer) if layer in cfg.value_embed_layers else None
        assert plane == row["plane"], layer
        # the live widths at this size are the record's halved the same way
        assert (spec.d_qk, spec.d_v) == tuple(w * cfg.head_dim // 128 for w in RECORD_WIDTHS[row["kind"]])
    # the record's widths at the record's head size
    record = speedrun_gpt()
    for layer, row in RECORD_MAP.items():
        if row["kind"] is not None:
            assert record.widths(layer) == RECORD_WIDTHS[row["kind"]], layer
    # RECORD §2: a parallel MLP on layer 8 only; layers 8 and 10 read norm(cache[7])
    assert [i for i, b in enumerate(model.blocks) if b.parallel_mlp is not None] == [8]
    assert cfg.attn_input_cache == 7
    # RECORD §2 "Attention scales": 0.13 narrow chain, 0.085 wide chain
    assert model.rotaries["short"].attn_scale == 0.13 and model.rotaries["long"].attn_scale == 0.085


def test_residual_and_mudd_initial_values(small_model):
    model = small_model
    mudd = model.mudd
    # RECORD §2 "Bias inits (before the ×0.1)": pre gate = XSA α 1, 3 | attention gate 3 | (x0, n-gram) 0..3
    assert mudd.pre_gate.b2.tolist() == [0.0] * 12 + [2.5] * 6 + [0.0, 0.5] * 4
    # post gate = XSA α 4, 7 | attention gate 10 | (x0, n-gram) 4, 5, 7, 8, 9 | skip | retired 29–34, 35–40
    assert mudd.post_gate.b2.tolist() == [0.0] * 12 + [2.5] * 6 + [0.0, 0.5] * 5 + [5.0] + [10.0] * 6 + [0.0] * 6
    assert mudd.pre_gate.b2.numel() == 26 and mudd.post_gate.b2.numel() == 41
    assert mudd.gate_scale.item() == pytest.approx(0.1)  # learnable κ, init 0.1
    # RECORD §2 "MUDD at layer 10" (after the fixed ×0.1): μ₆,₇ = 2, μ₈,₁₂ = √1.1, μ₉,₁₃ = 1, μ₁₀ = 0, μ₁₁ = 0.05
    mix = (mudd.layer_mix.b2 * 0.1).tolist()
    expect = [0.0] * 6 + [2.0, 2.0, math.sqrt(1.1), 1.0, 0.0, 0.05, math.sqrt(1.1), 1.0]
    assert mix == pytest.approx(expect, abs=1e-6)
    # RECORD §2 "Post-loop MUDD": 10 sources × 12 channel groups, backout bias −0.5 on cache[7]
    assert (mudd.final_mix.b2 * 0.1).tolist() == pytest.approx([0.0, -0.5] + [0.0] * 8, abs=1e-7)
    assert tuple(mudd.final_mix.w2g.shape[:2]) == (10, 12) and not mudd.final_mix.w2g.any()
    assert not mudd.pre_gate.w2.any() and not mudd.layer_mix.w2.any()  # W₂ zero init
    # RECORD §2 "Residual structure" and "scalars": ρ = √1.1, π = 1, (λ₀, λ₁) = (0.5, 1.0)
    for block in model.blocks:
        if block.resid_lambdas is not None:
            assert block.resid_lambdas.tolist() == pytest.approx([math.sqrt(1.1)] * 2)
        if block.post_lambdas is not None:
            assert block.post_lambdas.tolist() == [1.0, 1.0]
        if block.attn is not None:
            assert block.attn.lambdas.tolist() == [0.5, 1.0]
    assert model.skip_lambda.item() == -1.5


def test_parameter_counts_per_family_at_the_record_dims():
    with torch.device("meta"):
        model = GPT(speedrun_gpt())
    fams = model.param_families()

    def count(name):
        return sum(p.numel() for p in fams[name])

    # RECORD §8 qk_bank: 42 live (256 × 768) groups; vo_bank: 14 live 768 × 768 matrices
    assert count("qk") == 42 * 256 * 768 == 8_257_536
    assert count("vo") == 14 * 768 * 768 == 8_257_536
    # RECORD §8 mlp_bank (12, 2, 2816, 768): 11 live slots (slot 7 dead, slot 11 = layer 8's parallel MLP)
    assert count("mlp") == 11 * 2 * 2816 * 768 == 47_579_136
    # RECORD §2 "Value embeddings": 201,216 rows × 768 = 154.5M
    assert count("value_embeds") == 201_216 * 768 == 154_533_888
    assert count("embed") == count("lm_head") == 50304 * 768
    mudd = dict(model.mudd.named_parameters())
    gates = sum(p.numel() for n, p in mudd.items() if n.startswith(("pre_gate", "post_gate", "gate_scale")))
    mixes = sum(p.numel() for n, p in mudd.items() if n.startswith(("layer_mix", "final_mix")))
    # RECORD §2: W₁ 64×768 per block; 26 + 41 gate coefficients and κ; 14 + 10 mix coefficients and
    # the (10 × 12 × 64) per-group deltas
    assert gates == 2 * 64 * 768 + (26 + 41) * 64 + (26 + 41) + 1
    assert mixes == 2 * 64 * 768 + (14 + 10) * 64 + (14 + 10) + 10 * 12 * 64
    assert all(p.device.type == "meta" for p in model.parameters())


def test_dead_rows_are_drawn_and_get_no_gradient(small_model):
    torch.manual_seed(3)
    model = GPT(small_model.cfg)
    open_attention_outputs(model)
    ids = torch.randint(0, 256, (48,))
    cu = torch.tensor([0, 20, 48, 48], dtype=torch.int32)
    ngram = ngram_input(ids, model.cfg.ngram_rows, model.cfg.model_dim)
    model(ids, cu, 28, (8, 24), ngram=ngram).square().sum().backward()
    hd, q = model.cfg.head_dim, model.cfg.head_dim // 2
    narrow, dv64 = model.blocks[0].attn, model.blocks[1].attn
    # RECORD §2: the dead rows are drawn from U(±bound), not zero, and get exactly zero gradient
    assert narrow.qk_w.view(2, 6, hd, -1)[:, :, q:].abs().max() > 0
    assert not narrow.qk_w.grad.view(2, 6, hd, -1)[:, :, q:].any()
    assert narrow.qk_w.grad.view(2, 6, hd, -1)[:, :, :q].abs().max() > 0
    assert not dv64.v_w.grad.view(6, hd, -1)[:, q:].any() and dv64.v_w.grad.view(6, hd, -1)[:, :q].abs().max() > 0
    assert not dv64.o_w.grad.view(-1, 6, hd)[:, :, q:].any() and dv64.o_w.grad.view(-1, 6, hd)[:, :, :q].any()
    assert dv64.v_w.view(6, hd, -1)[:, q:].abs().max() > 0


# -- formula references ---------------------------------------------------------------
@pytest.mark.parametrize("seed", [4, 19])
def test_key_offset_matches_its_formula(seed):
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(9, 3, 8, generator=gen)
    out = shift_keys(k)
    ref = k.clone()
    for t in range(1, 9):  # RECORD §2 step 4: dims d/2.. of token t are token t-1's; token 0 keeps its own
        ref[t, :, 4:] = k[t - 1, :, 4:]
    assert torch.equal(out, ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_final_mudd_mix_matches_its_reference(dtype):
    """``Mudd.final`` (deltas as one matmul, sources summed one by one) against ``final_reference``
    (the formula: stacked sources times coefficients, summed), output and every gradient."""
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    mudd = Mudd(96, 2)  # 12 groups of 8 channels
    with torch.no_grad():  # the zero-initialized W₂ and delta weights random, so every term counts
        for p in mudd.final_mix.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    mudd = mudd.to(dtype)
    n = 37
    x = torch.randn(n, 96, generator=gen).to(dtype).requires_grad_()
    sources = [torch.randn(n, 96, generator=gen).to(dtype).requires_grad_() for _ in FINAL_MIX_SOURCES]
    grad = torch.randn(n, 96, generator=gen).to(dtype)
    leaves = [x, *sources, *mudd.final_mix.parameters()]
    results = []
    for fn in (mudd.final, mudd.final_reference):
        for t in leaves:
            t.grad = None
        out = fn(x, sources)
        out.backward(grad)
        results.append([out.detach().float()] + [t.grad.float() for t in leaves])
    # bf16: the reference rounds its products to bf16, the fast path sums them in fp32
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for a, b in zip(*results):
        assert (a - b).abs().max() <= tol * b.abs().max(), (seed, (a - b).abs().max())
    assert all(r.abs().sum() > 0 for r in results[1])


@pytest.mark.parametrize("seed", [5, 31])
def test_xsa_matches_its_formula(seed):
    gen = torch.Generator().manual_seed(seed)
    y, v = torch.randn(2, 7, 3, 8, generator=gen, dtype=torch.float64).unbind(0)
    alpha = torch.randn(7, 3, generator=gen, dtype=torch.float64)
    ref = torch.empty_like(y)
    for t in range(7):
        for h in range(3):  # RECORD §2 step 6: y − tanh(α)·((y·v)/‖v‖²)·v
            yy, vv = y[t, h], v[t, h]
            ref[t, h] = yy - math.tanh(alpha[t, h].item()) * (yy @ vv) / (vv @ vv) * vv
    assert torch.allclose(xsa(y, v, alpha), ref, atol=1e-12)
    # α = 0 leaves y alone; tanh(α) = 1 removes y's component along v entirely
    assert torch.equal(xsa(y, v, torch.zeros(7, 3, dtype=torch.float64)), y)
    cleaned = xsa(y, v, torch.full((7, 3), 50.0, dtype=torch.float64))
    assert (cleaned * v).sum(-1).abs().max() < 1e-10


def packed_context(n: int, cu: torch.Tensor, window: int, rot: Rotary, heads: int) -> PackedContext:
    from nanogpt_pl.model.attention import paired_positions

    pos = segment_positions(cu, n)
    cos, sin = rot.cos_sin(paired_positions(pos, heads).flatten(), torch.float64)
    return PackedContext(cu_seqlens=cu, max_seqlen=n, rotary={"short": rot.cos_sin(pos, torch.float64)},
                         windows={"short": window}, scales={"short": 0.2},
                         rotary_paired={"short": (cos.view(n, heads, -1), sin.view(n, heads, -1))})


@pytest.mark.parametrize("seed", [2, 13])
@pytest.mark.parametrize("window", [3, 40])
def test_paired_heads_match_a_per_head_reference(seed, window):
    torch.manual_seed(seed)
    heads, hd, d_qk, dim, n = 6, 16, 8, 96, 30
    spec = AttentionSpec(model_dim=dim, num_heads=heads, head_dim=hd, d_qk=d_qk, d_v=hd, paired=True,
                         backend="reference")
    attn = CausalSelfAttention(spec).double()
    with torch.no_grad():
        attn.o_w.normal_(std=0.1)
        attn.lambdas.copy_(torch.tensor([0.7, 1.3]))
    rot = Rotary(hd, 0.2).double()
    cu = torch.tensor([0, 11, 30, 30], dtype=torch.int32)
    x = torch.randn(n, dim, dtype=torch.float64)
    out = attn(x, packed_context(n, cu, window, rot, heads))

    # plain reference: per head h, rotate at position 2·pos + (h mod 2) (RECORD §2's quirk), then
    # for each kernel head j build the doubled sequence [head j of token t, head j + 3 of token t, ...]
    wq = attn.qk_w[0].view(heads, hd, dim)[:, :d_qk]
    wk = attn.qk_w[1].view(heads, hd, dim)[:, :d_qk]
    q = 0.7 * torch.einsum("nd,hkd->nhk", x, wq)
    k = 0.7 * torch.einsum("nd,hkd->nhk", x, wk)
    v = 0.7 * torch.einsum("nd,hkd->nhk", x, attn.v_w.view(heads, hd, dim))
    q, k = F.rms_norm(q, (d_qk,), eps=QK_NORM_EPS), F.rms_norm(k, (d_qk,), eps=QK_NORM_EPS)
    pos = segment_positions(cu, n)
    for h in range(heads):
        cos, sin = rot.cos_sin(2 * pos + h % 2, torch.float64)
        cos, sin = cos[:, : d_qk // 2], sin[:, : d_qk // 2]
        q[:, h:h + 1] = apply_rotary(q[:, h:h + 1], cos, sin)
        k[:, h:h + 1] = apply_rotary(k[:, h:h + 1], cos, sin)
    y = torch.empty(n, heads, hd, dtype=torch.float64)
    half = heads // 2
    for j in range(half):
        def doubled(t):
            s = torch.empty(2 * n, 1, t.shape[-1], dtype=t.dtype)
            s[0::2, 0], s[1::2, 0] = t[:, j], t[:, j + half]
            return s
        yj = dense_reference(doubled(q), doubled(k), doubled(v), 2 * cu, window, 0.2)
        y[:, j], y[:, j + half] = yj[0::2, 0], yj[1::2, 0]
    ref = 1.3 * y.reshape(n, -1) @ attn.o_w.t()
    assert torch.allclose(out, ref, atol=1e-10)


# -- configs ----------------------------------------------------------------------------
def test_speedrun_yaml_model_section_holds_the_record_literals():
    g = SPEEDRUN["model"]["gpt"]
    # RECORD §2 "Global dimensions" and "Per-layer map"
    assert (g["vocab_size"], g["num_layers"], g["model_dim"], g["num_heads"], g["head_dim"], g["mlp_hidden"]) == (
        50304, 11, 768, 6, 128, 2816)
    assert g["attention_layers"] == [0, 1, 2, 3, 5, 8, 10]
    assert g["mlp_layers"] == [0, 1, 2, 3, 4, 5, 6, 8, 9, 10]
    assert g["parallel_mlp_layers"] == [8]
    assert g["narrow_layers"] == [0, 2, 5] and g["dv64_layers"] == [1, 8]
    assert g["paired_layers"] == [0, 2, 5] and g["key_offset_layers"] == [3, 10] and g["long_window_layers"] == [3, 10]
    assert g["xsa_layers"] == [1, 3] and g["attn_gate_layers"] == [3, 10]
    assert g["value_embed_layers"] == [1, 2, 8, 10]
    assert g["x0_layers"] == [0, 1, 2, 4, 5, 7] and g["ngram_layers"] == [1, 4, 5, 9]
    assert g["attn_input_cache"] == 7 and (g["skip_from"], g["skip_to"]) == (3, 6)
    assert g["mudd"] is True and g["smear"] is True
    assert g["attn_scale"] == 0.13 and g["attn_scale_long"] == 0.085
    assert g["resid_lambda_init"] == pytest.approx(math.sqrt(1.1), abs=1e-15) and g["qkv_lambda_init"] == 0.5
    assert g["ngram_rows"] == 84_602_880  # RECORD §3


# RECORD §8 "Adam parameter groups": (lr_mul, betas, wd_mul)
RECORD_ADAM = {
    "lm_head": (1, (0.5, 0.95), 150), "embed": (1, (0.5, 0.95), 150), "value_embeds": (70, (0.75, 0.95), 5),
    "scalars": (5, (0.9, 0.99), 0), "smear_gate": (0.01, (0.9, 0.99), 0), "ve_gate": (1, (0.9, 0.99), 1),
    "post_lambdas": (1, (0.9, 0.95), 0), "resid_lambdas": (5, (0.9, 0.95), 0),
    "mudd": (0.25, (0.9, 0.99), 1), "mudd_bias": (0.25, (0.9, 0.99), 0),
    "mudd_gate": (0.1, (0.9, 0.99), 1), "mudd_gate_bias": (0.1, (0.9, 0.99), 0),
}


def test_speedrun_yaml_optim_section_holds_the_record_literals():
    o = SPEEDRUN["model"]["optim"]
    # RECORD §8 "Hyperparameters" and "Adam parameter groups"
    assert (o["matrix_optimizer"], o["matrix_lr"], o["matrix_weight_decay"]) == ("anvil", 0.023, 2.25)
    assert (o["adam_lr"], o["adam_eps"], o["adam_weight_decay"]) == (0.008, 1e-10, 0.005)
    defaults = OptimConfig()
    for name, (lr_mul, betas, wd_mul) in RECORD_ADAM.items():
        entry = o.get(name)
        if entry is not None:  # the YAML states it ...
            assert (entry["lr_mul"], tuple(entry["betas"]), entry["wd_mul"]) == (lr_mul, betas, wd_mul), name
        group = getattr(defaults, name)  # ... and the defaults agree
        assert (group.lr_mul, tuple(group.betas), group.wd_mul) == (lr_mul, betas, wd_mul), name
    assert SPEEDRUN["schedule"]["anvil_engage_step"] == 514  # RECORD §8 DUAL_MOMENTUM


def test_optimizer_groups_come_from_parameter_names(small_model):
    model = small_model
    assert not any(hasattr(p, "anvil_block") or hasattr(p, "anvil_lr_mul") for p in model.parameters())
    expect = {"smear_gate": "smear_gate", "blocks.1.attn.ve_gate": "ve_gate", "blocks.0.post_lambdas": "post_lambdas",
              "blocks.0.resid_lambdas": "resid_lambdas", "mudd.gate_scale": "mudd_gate_bias",
              "mudd.pre_gate.w1": "mudd_gate", "mudd.post_gate.b2": "mudd_gate_bias",
              "mudd.final_mix.w2g": "mudd", "mudd.layer_mix.b2": "mudd_bias", "blocks.3.attn.lambdas": "scalars",
              "skip_lambda": "scalars", "embed": "embed", "value_embeds.2": "value_embeds"}
    names = dict(model.named_parameters())
    for name, family in expect.items():
        assert name in names and adam_family(name) == family, name
    group = anvil_group(model, model.cfg.head_dim)
    by_id = {id(p): (b, m) for p, b, m in zip(group["params"], group["blocks"], group["lr_muls"])}
    hd, d = model.cfg.head_dim, model.cfg.model_dim
    assert by_id[id(model.blocks[0].attn.qk_w)] == ((2 * hd, d), 1.0)  # RECORD §8: two heads per group
    assert by_id[id(model.blocks[8].parallel_mlp.proj_w)] == ((model.cfg.mlp_hidden, d), 2.0)  # c_proj ×2
    assert by_id[id(model.blocks[1].attn.o_w)] == ((d, model.cfg.num_heads * hd), 1.0)
    # every parameter in exactly one optimizer
    fams = adam_families(model)
    ids = [id(p) for ps in fams.values() for p in ps] + list(by_id)
    assert sorted(ids) == sorted(id(p) for p in model.parameters())


def test_schedule_engage_step_reaches_anvil():
    module = SpeedrunModule(gpt=speedrun_gpt(**{**SMALL, "ngram_rows": 0}), schedule=Schedule(anvil_engage_step=7))
    opt = module.configure_optimizers()
    assert [g["engage_step"] for g in opt.parts["matrices"].param_groups] == [7]
    groups = {g["name"]: g for g in opt.parts["adam"].param_groups}
    assert groups["smear_gate"]["lr_mul"] == 0.01 and groups["mudd_gate"]["lr_mul"] == 0.1


def test_w_o_rows_are_output_channels(small_model):
    # RECORD §2 step 8: out = y·W_Oᵀ with W_O [model_dim, heads·head_dim], so ANVIL's lanes (rows when
    # rows ≥ cols) run over output channels as the record's
    attn = small_model.blocks[3].attn
    assert tuple(attn.o_w.shape) == (small_model.cfg.model_dim, 6 * small_model.cfg.head_dim)


def test_describe_prints_the_layer_table_and_family_counts(capsys):
    from nanogpt_pl.cli import main

    assert main(["describe", "--config", str(ROOT / "configs" / "speedrun.yaml")]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split() for line in out.splitlines()[1:12]}
    # RECORD §2 "Per-layer map"
    assert rows["0"][1:8] == ["narrow", "(64,128)", "short", "yes", "-", "-", "-"]
    assert rows["1"][1:8] == ["dv64", "(64,64)", "short", "-", "-", "yes", "-"] and rows["1"][8] == "p0"
    assert rows["3"][1:8] == ["wide", "(128,128)", "long", "-", "yes", "yes", "yes"]
    assert rows["7"][1] == "none" and "removed" in rows["7"]
    assert rows["8"][8] == "p2" and "parallel" in rows["8"]
    assert rows["10"][1:8] == ["wide", "(128,128)", "long", "-", "yes", "-", "yes"] and rows["10"][8] == "p3"
    counts = {line.split()[0]: line.split()[1] for line in out.splitlines() if line.startswith("  ")}
    # RECORD §8 banks and §2 value embeddings, as in test_parameter_counts_per_family_at_the_record_dims
    assert counts["qk"] == counts["vo"] == "8,257,536" and counts["mlp"] == "47,579,136"
    assert counts["adam:value_embeds"] == "154,533,888"
    assert "64,975,011,840  (not allocated)" in out  # RECORD §3: 84,602,880 rows × 768, only counted


def test_describe_names_a_missing_config(tmp_path):
    from nanogpt_pl.cli import main

    with pytest.raises(SystemExit, match="--config"):
        main(["describe", "--config", str(tmp_path / "missing.yaml")])


def test_fp8_qkv_uses_the_record_scales_on_the_live_rows():
    # RECORD §7 "Attention QKV": static input scale 8/448; one exact weight scale per layer over
    # its packed (live) QK‖V rows
    assert SPEEDRUN["model"]["gpt"]["fp8_qkv_x_scale"] == 8 / 448
    torch.manual_seed(1)
    spec = AttentionSpec(model_dim=96, num_heads=6, head_dim=16, d_qk=8, d_v=16, fp8_qkv=True,
                         fp8_backend="reference", fp8_qkv_x_scale=8 / 448, backend="reference")
    attn = CausalSelfAttention(spec).train()
    assert attn.fp8_state.x_scale.item() == pytest.approx(8 / 448)
    with torch.no_grad():
        attn.qk_w.view(2, 6, 16, 96)[:, :, 8:] *= 100  # dead rows far larger: must not set the scale
    x = F.rms_norm(torch.randn(20, 96), (96,))
    q, k, v = attn._qkv(x)
    live = torch.cat([attn.qk_w.view(2, 6, 16, 96)[:, :, :8].reshape(-1, 96), attn.v_w])
    assert attn.fp8_state.w_scale.item() == pytest.approx(live.abs().max().item() / 448)
    ref = 0.5 * x @ live.t()
    got = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=1)
    assert torch.allclose(got, ref, atol=0.05 * ref.abs().max().item())


@pytest.mark.parametrize("seed", [0, 8])
def test_anvil_group_blocks_equal_parameter_attributes(seed):
    from nanogpt_pl.optim.anvil import Anvil

    gen = torch.Generator().manual_seed(seed)
    shapes = [(2, 16, 12), (16, 12), (12, 16)]
    base = [torch.randn(*s, generator=gen) for s in shapes]
    grads = [[torch.randn(*s, generator=gen) for s in shapes] for _ in range(3)]
    by_group = [torch.nn.Parameter(b.clone()) for b in base]
    by_attr = [torch.nn.Parameter(b.clone()) for b in base]
    by_attr[0].anvil_block = (8, 12)
    by_attr[2].anvil_lr_mul = 2.0
    opt_g = Anvil([dict(params=by_group, blocks=[(8, 12), (16, 12), (12, 16)], lr_muls=[1.0, 1.0, 2.0])], lr=0.02)
    opt_a = Anvil(by_attr, lr=0.02)
    for step in range(3):
        for ps, opt in ((by_group, opt_g), (by_attr, opt_a)):
            for p, g in zip(ps, grads[step]):
                p.grad = g.clone()
            opt.step()
    for a, b in zip(by_group, by_attr):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="'blocks' has 1 entries for 3 parameters"):
        Anvil([dict(params=[torch.nn.Parameter(b.clone()) for b in base], blocks=[(8, 12)])])


def test_injection_points_act_where_the_record_injects(small_model):
    # RECORD §2: x0 injected on 0, 1, 2, 4, 5, 7; n-gram on 1, 4, 5, 9 (and the residual start through
    # layer 0's gate); the gates MUDD computes for x0 3/8/9, n-gram 2/3/7/8, XSA 4/7 and the retired
    # slots are unused, so moving their biases changes nothing
    torch.manual_seed(5)
    model = GPT(small_model.cfg).eval()
    with torch.no_grad():
        for block in model.blocks:
            if block.mlp is not None:
                block.mlp.proj_w.normal_(std=0.05)
            if block.attn is not None:
                block.attn.o_w.normal_(std=0.05)
    ids = torch.randint(0, 256, (40,))
    cu = torch.tensor([0, 40, 40], dtype=torch.int32)
    ngram = ngram_input(ids, model.cfg.ngram_rows, model.cfg.model_dim)
    base = model(ids, cu, 40, (8, 24), ngram=ngram)
    mudd = model.mudd

    def acts(block, index) -> bool:
        with torch.no_grad():
            block.b2[index] += 3.0
            out = model(ids, cu, 40, (8, 24), ngram=ngram)
            block.b2[index] -= 3.0
        return not torch.allclose(out, base)

    x0 = {layer: acts(mudd.pre_gate if layer in mudd.pre.x0 else mudd.post_gate,
                      {**mudd.pre.x0, **mudd.post.x0}[layer]) for layer in (0, 1, 2, 3, 4, 5, 7, 8, 9)}
    assert [k for k, v in x0.items() if v] == [0, 1, 2, 4, 5, 7]
    ng = {layer: acts(mudd.pre_gate if layer in mudd.pre.ngram else mudd.post_gate,
                      {**mudd.pre.ngram, **mudd.post.ngram}[layer]) for layer in (0, 1, 2, 3, 4, 5, 7, 8, 9)}
    assert [k for k, v in ng.items() if v] == [0, 1, 4, 5, 9]
    assert not any(acts(mudd.post_gate, i) for i in range(12))  # XSA α of 4 and 7
    assert not any(acts(mudd.post_gate, i) for i in range(29, 41))  # retired
    assert acts(mudd.post_gate, 28) and acts(mudd.pre_gate, 0)  # the skip gate; XSA α of layer 1


def test_describe_names_an_unknown_model_key(tmp_path):
    from nanogpt_pl.cli import main

    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  gpt:\n    num_layer: 4\n")
    with pytest.raises(SystemExit, match="model.gpt.num_layer"):
        main(["describe", "--config", str(ROOT / "configs" / "speedrun.yaml"), "--config", str(bad)])


@pytest.mark.parametrize("overrides,match", [
    (dict(xsa_layers=[0, 1]), "XSA needs unpaired heads"),
    (dict(dv64_layers=[1, 2]), "both narrow_layers and dv64_layers"),
    (dict(paired_layers=[4]), r"paired_layers \[4\] have no attention"),
    (dict(parallel_mlp_layers=[7]), r"parallel_mlp_layers \[7\] have no MLP"),
    (dict(attn_gate_layers=[3, 8]), "mudd needs the record's layer map.*attn_gate_layers"),
    (dict(x0_layers=[0, 6]), "mudd needs the record's layer map.*x0_layers"),
])
def test_record_options_are_checked_by_name(overrides, match):
    with pytest.raises(ValueError, match=match):
        speedrun_gpt(**{**SMALL, **overrides})


def test_each_chain_runs_its_own_yarn_from_its_own_scale():
    module = SpeedrunModule(gpt=speedrun_gpt(**{**SMALL, "ngram_rows": 0}))
    # RECORD §2 "Split chains": short 128 → 384 → 640 → 768 and long 384 → 896 → 1408 → 1664 blocks·128
    for (s0, l0), (s1, l1) in [((128, 384), (384, 896)), ((384, 896), (640, 1408)), ((640, 1408), (768, 1664))]:
        module.set_windows(s1, l1, yarn_from=(s0, l0))
    rot = module.model.rotaries
    assert rot["short"].attn_scale == pytest.approx(0.1811, abs=5e-5)  # 0.13 → ≈0.1811
    assert rot["long"].attn_scale == pytest.approx(0.1120, abs=5e-5)  # 0.085 → ≈0.1120
