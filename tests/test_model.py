"""The GPT and its attention kernels on CPU."""

import copy
import math

import pytest
import torch

from nanogpt_pl.backends import Backends
from nanogpt_pl.data.tokenizer import PADDED_VOCAB, TOKENIZER_VOCAB
from nanogpt_pl.model.attention import (
    attention_sdpa,
    dense_reference,
    packed_attention,
    resolve_backend,
    segment_positions,
)
from nanogpt_pl.model.gpt import GPT, GPTConfig
from nanogpt_pl.model.rotary import Rotary, apply_rotary
from nanogpt_pl.module import SpeedrunModule


def tiny_config(**kw) -> GPTConfig:
    base = dict(vocab_size=384, num_layers=4, model_dim=64, num_heads=2, head_dim=32, mlp_hidden=96,
                long_window_layers=[3], value_embed_layers=[1, 2], skip_from=1, skip_to=3)
    base.update(kw)
    return GPTConfig(**base)


def random_cu(n: int, gen: torch.Generator, pad: int = 2) -> torch.Tensor:
    cuts = torch.randperm(n - 1, generator=gen)[: max(1, n // 17)] + 1
    cu = torch.cat([torch.tensor([0]), cuts.sort().values, torch.tensor([n] * (pad + 1))])
    return cu.to(torch.int32)


@pytest.mark.parametrize("seed", [11, 23, 97])
@pytest.mark.parametrize("window", [1, 7, 40, 1000])
def test_sdpa_matches_float64_reference(seed, window):
    gen = torch.Generator().manual_seed(seed)
    n, h, d = 96, 3, 16
    q, k, v = (torch.randn(n, h, d, generator=gen) for _ in range(3))
    cu = random_cu(n, gen)
    out = attention_sdpa(q, k, v, cu, window, 0.3)
    ref = dense_reference(q, k, v, cu, window, 0.3)
    assert torch.allclose(out, ref, atol=1e-5, rtol=1e-5)


def test_attention_never_crosses_documents():
    gen = torch.Generator().manual_seed(5)
    n, h, d = 64, 2, 8
    q, k, v = (torch.randn(n, h, d, generator=gen) for _ in range(3))
    cu = torch.tensor([0, 20, 45, 64, 64], dtype=torch.int32)
    base = attention_sdpa(q, k, v, cu, 100, 0.5)
    v2 = v.clone()
    v2[20:45] += 100 * torch.randn(25, h, d, generator=gen)  # change only document 1
    out = attention_sdpa(q, k, v2, cu, 100, 0.5)
    assert torch.allclose(out[:20], base[:20]) and torch.allclose(out[45:], base[45:])
    assert not torch.allclose(out[20:45], base[20:45])


@pytest.mark.parametrize("seed", [4, 31])
def test_float32_queries_with_bf16_values_run_in_the_values_dtype(seed):
    # under autocast the QK norm returns float32 while v stays bf16; the kernels take one dtype
    # (flex refused the mix, torch's varlen raised "query and value must have the same dtype")
    gen = torch.Generator().manual_seed(seed)
    n, h, d = 80, 2, 16
    q, k = (torch.randn(n, h, d, generator=gen) for _ in range(2))
    v = torch.randn(n, h, d, generator=gen).bfloat16()
    cu = random_cu(n, gen)
    out = packed_attention(q, k, v, cu, n, 24, 0.25, "flex")
    ref = dense_reference(q.bfloat16().double(), k.bfloat16().double(), v.double(), cu, 24, 0.25)
    assert out.dtype == torch.bfloat16
    assert torch.allclose(out.double(), ref, atol=2e-2, rtol=2e-2)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # float32 values too: autocast's dtype
        mixed = packed_attention(q, k, v.float(), cu, n, 24, 0.25, "flex")
    assert mixed.dtype == torch.bfloat16 and torch.allclose(mixed.double(), ref, atol=2e-2, rtol=2e-2)


def test_segment_positions_restart_at_each_document():
    cu = torch.tensor([0, 3, 7, 10, 10], dtype=torch.int32)
    assert segment_positions(cu, 10).tolist() == [0, 1, 2, 0, 1, 2, 3, 0, 1, 2]


def test_rotary_is_relative_and_norm_preserving():
    gen = torch.Generator().manual_seed(3)
    rot = Rotary(64, 0.12)
    q, k = torch.randn(2, 1, 1, 64, generator=gen, dtype=torch.float64).unbind(0)
    def score(i, j):
        ci, si = rot.cos_sin(torch.tensor([i]), torch.float64)
        cj, sj = rot.cos_sin(torch.tensor([j]), torch.float64)
        return (apply_rotary(q, ci, si) * apply_rotary(k, cj, sj)).sum()
    assert torch.allclose(score(10, 3), score(107, 100))
    c, s = rot.cos_sin(torch.tensor([1234]), torch.float64)
    assert torch.allclose(apply_rotary(q, c, s).norm(), q.norm())


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("per_head", [False, True])
def test_full_width_rotation_equals_the_pairwise_formula_bit_for_bit(random_seed, dtype, per_head):
    """The same products and sums in the same order, so equal in every dtype (bf16 rounds each
    product and the sum the same way); per-head tables are the paired layers'."""
    from nanogpt_pl.model.rotary import apply_rotary_reference

    gen = torch.Generator().manual_seed(random_seed)
    n, h, d = 37, 6, 64
    rot = Rotary(d, 0.12)
    rot.apply_yarn(384, 896)
    positions = torch.randint(0, 3000, (n * h if per_head else n,), generator=gen)
    cos, sin = rot.cos_sin(positions, torch.float32 if dtype == torch.bfloat16 else dtype)
    if per_head:
        cos, sin = cos.view(n, h, -1), sin.view(n, h, -1)
    x = torch.randn(n, h, d, generator=gen).to(dtype)
    for c, s in ((cos, sin), (cos.to(dtype), sin.to(dtype))):  # wider tables, and tables in x's dtype
        got, want = apply_rotary(x, c, s), apply_rotary_reference(x, c, s)
        assert got.dtype == want.dtype == dtype
        assert torch.equal(got, want)
    # a narrow layer's tables: the first d_qk / 2 pairs of a wider head's
    xq = x[..., :32]
    assert torch.equal(apply_rotary(xq, cos[..., :16], sin[..., :16]),
                       apply_rotary_reference(xq, cos[..., :16], sin[..., :16]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_built_rotary_tables_give_the_computed_rows_and_follow_omega(random_seed, dtype):
    """Rows gathered from the tables equal the float64 computation rounded once, bit for bit, also
    after a YaRN change (rebuilt in place) and after loading another omega; positions the tables do
    not cover, another dtype, or a module converted to another dtype compute them instead."""
    from nanogpt_pl.model.rotary import rotary_cos_sin

    gen = torch.Generator().manual_seed(random_seed)
    rot = Rotary(128, 0.12)
    rot.build_tables(500, dtype)
    table_ptr = rot.cos_table.data_ptr()
    positions = torch.randint(0, 500, (300,), generator=gen)

    def uses_tables(r, bound):
        """Whether the rows come from the tables: a row changed there shows in the result."""
        with torch.no_grad():
            saved = r.cos_table[positions[0]].clone()
            r.cos_table[positions[0]] += 1
            got = r.cos_sin(positions, dtype, bound=bound)[0][0]
            r.cos_table[positions[0]] = saved
        return not torch.equal(got, rotary_cos_sin(positions[:1], r.omega, dtype)[0][0])

    def check(r, bound=500, used=True):
        got = r.cos_sin(positions, dtype, bound=bound)
        want = rotary_cos_sin(positions, r.omega, dtype)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert uses_tables(r, bound) == used

    check(rot)
    rot.apply_yarn(384, 896)  # rebuilt from the stretched omega, in place
    assert rot.cos_table.data_ptr() == table_ptr
    check(rot)
    other = Rotary(128, 0.12)
    other.apply_yarn(128, 640)
    rot.load_state_dict(other.state_dict())
    assert torch.equal(rot.omega, other.omega)
    check(rot)
    # uncovered positions (a validation segment longer than any training micro-batch) are computed
    long_positions = torch.randint(0, 900, (300,), generator=gen)
    got = rot.cos_sin(long_positions, dtype, bound=900)
    assert torch.equal(got[0], rotary_cos_sin(long_positions, rot.omega, dtype)[0])
    # another dtype or no bound: computed
    wider = torch.float64
    assert torch.equal(rot.cos_sin(positions, wider, bound=500)[0], rotary_cos_sin(positions, rot.omega, wider)[0])
    check(rot, bound=None, used=False)
    # module.to(dtype) keeps omega in float64 and the tables as built (a conversion would round them twice)
    converted = copy.deepcopy(rot).to(torch.float16)
    assert converted.omega.dtype == torch.float64 and converted.cos_table.dtype == dtype
    check(converted)


def test_a_model_with_rotary_tables_computes_what_it_computes_without(random_seed):
    """Every chain's tables (the paired layers' at twice the length) leave the record network's
    output and gradients exactly as they were."""
    from tests.test_record_network import SMALL, ngram_input, open_attention_outputs, speedrun_gpt

    torch.manual_seed(random_seed)
    model = GPT(speedrun_gpt(**SMALL))
    open_attention_outputs(model)
    ids = torch.randint(0, 256, (40,))
    cu = torch.tensor([0, 17, 40, 40], dtype=torch.int32)
    runs = []
    for tables in (False, True):
        if tables:
            model.build_rotary_tables(32, torch.float32)
            assert all(r.cos_table.shape[0] == 64 for r in model.rotaries.values())  # paired: 2 x 32
        model.zero_grad()
        out = model(ids, cu, 23, (8, 16), ngram=ngram_input(ids, model.cfg.ngram_rows, model.cfg.model_dim))
        out.square().sum().backward()
        runs.append((out.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]))
    assert torch.equal(runs[0][0], runs[1][0])
    assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1]))


def test_rotary_tables_are_built_once_under_compile():
    """The tables are an opaque operator: the compiled rotation reads them and computes no cos/sin
    of its own (fused in, the float64 trigonometry ran once per head, forward and backward), and
    equals the plain-tensor reference bit for bit."""
    from torch._inductor.utils import run_and_get_code

    from nanogpt_pl.model.rotary import cos_sin_reference

    gen = torch.Generator().manual_seed(11)
    rot = Rotary(128, 0.12)
    rot.apply_yarn(384, 896)  # a stretched table, as after a window change
    positions = torch.randint(0, 3000, (40,), generator=gen)
    x = torch.randn(40, 6, 128, generator=gen).to(torch.bfloat16)

    def rotate(x, positions, table):
        cos, sin = table(positions, rot.omega, torch.float32)
        return apply_rotary(x, cos, sin)

    torch._dynamo.reset()
    try:
        out, codes = run_and_get_code(torch.compile(rotate, fullgraph=True), x, positions,
                                      lambda p, o, d: rot.cos_sin(p, d))
        code = "\n".join(codes)
        assert "rotary_cos_sin" in code
        assert "cos(" not in code and "sin(" not in code
        assert torch.equal(out, rotate(x, positions, cos_sin_reference))
        # built tables: the compiled rotation gathers their rows, no operator and no trigonometry
        rot.build_tables(3000, torch.float32)
        torch._dynamo.reset()
        out, codes = run_and_get_code(torch.compile(rotate, fullgraph=True), x, positions,
                                      lambda p, o, d: rot.cos_sin(p, d, bound=3000))
        code = "\n".join(codes)
        assert "rotary_cos_sin" not in code and "cos(" not in code and "sin(" not in code
        assert torch.equal(out, rotate(x, positions, cos_sin_reference))
    finally:
        torch._dynamo.reset()


def test_yarn_matches_record_scale_chain():
    # RECORD §2: narrow chain 128 → 384 → 640 → 768 takes the scale 0.13 → ≈0.1811
    rot = Rotary(64, 0.13)
    omega0 = rot.omega.clone()
    for old, new in [(128, 384), (384, 640), (640, 768)]:
        rot.apply_yarn(old, new)
    assert abs(rot.attn_scale - 0.1811) < 5e-4
    # fast frequencies (many turns per window) are stretched less than slow ones, which are
    # stretched by the full window ratio
    assert rot.omega[0] / omega0[0] > rot.omega[-1] / omega0[-1]
    assert math.isclose(rot.omega[-1].item(), omega0[-1].item() * 128 / 768, rel_tol=1e-9)
    state = rot.state_dict()
    fresh = Rotary(64, 0.13)
    fresh.load_state_dict(state)
    assert fresh.attn_scale == rot.attn_scale and torch.equal(fresh.omega, rot.omega)


def test_yarn_chain_of_the_configs_scale():
    """The speedrun configs' attn_scale through their schedule's short-window chain.

    RECORD §2 starts the narrow chain at 0.13 and ends it at ≈0.1811; speedrun_1gpu.yaml takes
    its network from speedrun.yaml (``base:``). The quickstart's small network keeps its own scale.
    """
    from pathlib import Path

    from nanogpt_pl.config_files import load_config

    root = Path(__file__).resolve().parents[1]
    for name in ("speedrun.yaml", "speedrun_1gpu.yaml"):
        cfg = load_config(root / "configs" / name)
        scale = cfg["model"]["gpt"]["attn_scale"]
        assert scale == 0.13, name  # RECORD §2
        windows = [st["window_short"] for st in cfg["schedule"]["stages"]]
        rot = Rotary(64, scale)
        for old, new in zip(windows, windows[1:]):
            if new != old:
                rot.apply_yarn(old, new)
        assert [128, 384, 640, 768] == sorted(set(windows)), name  # RECORD §2's narrow chain
        assert abs(rot.attn_scale - 0.1811) < 5e-4, name


@pytest.mark.parametrize("seed", [1, 2])
def test_gpt_forward_backward_and_identity_at_init(seed):
    torch.manual_seed(seed)
    cfg = tiny_config()
    model = GPT(cfg)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (80,), generator=gen)
    cu = random_cu(80, gen)
    h = model(ids, cu, 80, (8, 32))
    assert h.shape == (80, cfg.model_dim) and torch.isfinite(h).all()
    # zero-initialized output projections: every block is the identity on x at step 0, so the
    # final state is norm(x0 + sum of x0-lambdas·x0) = norm(x0) (x0-lambdas start at 0).
    x0 = model._embed(ids.long())
    assert torch.allclose(h, torch.nn.functional.rms_norm(x0, (cfg.model_dim,)), atol=1e-5)
    logits = h @ model.lm_head.t()
    loss = torch.nn.functional.cross_entropy(logits, ids.roll(-1))
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())


def test_documents_are_independent_in_the_full_model():
    torch.manual_seed(0)
    cfg = tiny_config(smear=False)
    model = GPT(cfg)
    for p in model.parameters():  # leave the zero-init state so attention matters
        p.data.add_(0.05 * torch.randn_like(p))
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (60,), generator=gen)
    cu = torch.tensor([0, 25, 60, 60], dtype=torch.int32)
    a = model(ids, cu, 35, (64, 64))
    ids2 = ids.clone()
    ids2[:25] = torch.randint(0, cfg.vocab_size, (25,), generator=gen)
    b = model(ids2, cu, 35, (64, 64))
    assert torch.allclose(a[25:], b[25:], atol=1e-5)
    assert not torch.allclose(a[:25], b[:25])


def test_param_roles_cover_every_parameter_once():
    model = GPT(tiny_config())
    roles = model.param_roles()
    ids = [id(p) for ps in roles.values() for p in ps]
    assert len(ids) == len(set(ids)) == len(list(model.parameters()))
    assert all(p.ndim >= 2 for p in roles["matrices"])


def test_embedding_starts_as_a_copy_of_the_lm_head():
    model = GPT(tiny_config())
    assert torch.equal(model.embed, model.lm_head)
    assert model.embed.data_ptr() != model.lm_head.data_ptr()


@pytest.mark.parametrize("field,value,match", [
    ("attention_layers", [0, 9], "outside"),
    ("value_embed_layers", [2], "have no attention"),
    ("skip_from", 3, "earlier layer"),
])
def test_config_errors_name_the_option(field, value, match):
    kw = {field: value}
    if field == "value_embed_layers":
        kw["attention_layers"] = [0, 1]
    if field == "skip_from":
        kw["skip_to"] = 2
    with pytest.raises(ValueError, match=match):
        tiny_config(**kw)


def test_gpu_only_attention_backend_on_cpu_is_a_clear_error():
    with pytest.raises(RuntimeError, match="model.backends.attention='varlen' needs a CUDA GPU"):
        resolve_backend("varlen", torch.device("cpu"))
    with pytest.raises(ValueError, match="choose one of"):
        resolve_backend("fa2", torch.device("cpu"))
    assert resolve_backend("auto", torch.device("cpu")) == "reference"
    # on a GPU, auto takes the Triton kernel at the widths it holds, and another kernel elsewhere
    assert resolve_backend("auto", torch.device("cuda"), head_dims=(64, 128)) == "triton"
    assert resolve_backend("auto", torch.device("cuda"), same_head_dims=False, head_dims=(48, 96)) == "flex"
    assert resolve_backend("auto", torch.device("cuda"), head_dims=(96, 96)) in ("varlen", "flex")
    # the former name of the plain path points to the new one, in one line
    with pytest.raises(ValueError, match=r"^model\.backends\.attention='sdpa' \(the plain-PyTorch path is 'reference'"):
        resolve_backend("sdpa", torch.device("cpu"))


def test_flops_per_token_counts_the_head_and_layers():
    cfg = GPTConfig()
    f = cfg.flops_per_token(49152, 640, 1408)
    # 6·(matmul params) plus attention; the lm_head alone is 6·768·50304 ≈ 0.23 GFLOP
    assert 6 * 768 * 50304 < f < 3e9


def test_the_two_vocabulary_sizes_have_two_names():
    # RECORD §2: GPT-2's tokenizer yields ids below 50,257; the model's rows are 50,304, padded to 128
    assert TOKENIZER_VOCAB == 50257 and PADDED_VOCAB == 50304 and PADDED_VOCAB % 128 == 0
    assert GPTConfig().vocab_size == PADDED_VOCAB


def test_model_backends_reach_every_part():
    cfg = tiny_config(fp8_mlp=True, fp8_head=True, fp8_qkv=True)
    chosen = Backends(attention="reference", fp8="reference", loss="chunked", polar="reference", anvil="reference",
                      adam="reference", ngram="reference")
    module = SpeedrunModule(gpt=cfg, backends=chosen)
    blocks = module.model.blocks
    assert {b.attn.spec.backend for b in blocks if b.attn is not None} == {"reference"}
    fp8_states = [b.attn.fp8_state for b in blocks if b.attn is not None] + [b.mlp.fp8_state for b in blocks
                                                                            if b.mlp is not None]
    assert {st.backend for st in fp8_states} == {"reference"} and module.model.fp8_head.state.backend == "reference"
    matrices = module.configure_optimizers().parts["matrices"]
    assert matrices.backend == "reference" and matrices.update_backend == "reference"
    assert module.configure_optimizers().parts["adam"].update_backend == "reference"
    assert module.backends.loss == "chunked" and module.hparams["backends"] == chosen
    assert {b.attn.spec.backend for b in GPT(cfg).blocks if b.attn is not None} == {"auto"}  # default: auto
