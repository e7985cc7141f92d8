"""The QK norm, rotary rotation and key offset in one Triton pass each way
(``nanogpt_pl.ops.triton.qk_rotary``) against the PyTorch expressions
(``qk_norm_rotary(..., backend="reference")``, RECORD §2 "Attention sublayer", steps 3-4).

On CPU the kernels run under ``TRITON_INTERPRET=1`` in a child process, in float32 on fresh
seeds, at a few dozen tokens with 8-token tiles: q and k as strided views of one packed QKV
tensor, tables per token and per (token, head) (the paired layers), with and without the key
offset, token counts that are not a multiple of a tile and a single token. Outputs and the
gradient of the packed tensor must match the reference to float32 rounding; in bfloat16 they
must be within one bfloat16 step of a float32 evaluation. The custom operators pass ``opcheck``,
compile without a graph break, and the small record network trains the same numbers with
either path.

On the GPU (``@pytest.mark.cuda``): a stage-1 micro-batch (32,768 tokens, 6 heads, RECORD §2
and §9) at each layer kind, in bf16, against a float32 evaluation of the same bf16 inputs;
our error must be no worse than the compiled reference's (plus a bf16 step).
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from interpreter import INTERPRETED, interp, run_module_under_interpreter
from seeds import fresh_seed

from nanogpt_pl.backends import Backends
from nanogpt_pl.model.attention import qk_norm_rotary, resolve_qk_rotary_backend

BF16_STEP = 2.0**-8


@pytest.mark.skipif(INTERPRETED, reason="already inside the interpreter run")
def test_kernel_suite_under_interpreter():
    run_module_under_interpreter(__file__)


def case(n, h, d, per_head, gen, dtype=torch.float32, device="cpu", pad=24):
    """A packed QKV tensor [n, 2·h·d + pad] (q and k are its strided views), tables of random
    angles and the output gradients."""
    qkv = torch.randn(n, 2 * h * d + pad, generator=gen).to(device, dtype)
    angles = torch.randn(*((n, h, d // 2) if per_head else (n, d // 2)), generator=gen, dtype=torch.float64)
    cos, sin = angles.cos().to(device, dtype), angles.sin().to(device, dtype)
    gq, gk = (torch.randn(n, h, d, generator=gen).to(device, dtype) for _ in range(2))
    return qkv, cos, sin, gq, gk


def run(backend, qkv, h, d, cos, sin, gq, gk, key_offset, op=qk_norm_rotary):
    """(q out, k out, gradient of the packed tensor) of ``op`` (``qk_norm_rotary``) on ``qkv``'s views."""
    x = qkv.detach().clone().requires_grad_()
    n = x.shape[0]
    q, k = x[:, : h * d].view(n, h, d), x[:, h * d: 2 * h * d].view(n, h, d)
    qo, ko = op(q, k, cos, sin, key_offset, backend)
    ((qo.float() * gq.float()).sum() + (ko.float() * gk.float()).sum()).backward()
    return qo.detach(), ko.detach(), x.grad


def assert_close(got, want, what, rtol):
    scale = want.abs().max().item() + 1e-12
    err = (got.double() - want.double()).abs().max().item()
    assert err <= rtol * scale, f"{what}: max error {err:.3e} against scale {scale:.3e}"


@interp
@pytest.mark.parametrize("d", [16, 64, 128])
@pytest.mark.parametrize("per_head", [False, True], ids=["per token", "per head"])
@pytest.mark.parametrize("key_offset", [False, True], ids=["", "key offset"])
def test_matches_reference(d, per_head, key_offset):
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    for n in (37, 8, 1):  # not a multiple of the 8-token tile, one whole tile, one token
        qkv, cos, sin, gq, gk = case(n, 3, d, per_head, gen)
        got = run("triton", qkv, 3, d, cos, sin, gq, gk, key_offset)
        want = run("reference", qkv, 3, d, cos, sin, gq, gk, key_offset)
        for name, a, b in zip(("q", "k", "d(qkv)"), got, want):
            assert_close(a, b, f"{name}, n {n}, seed {seed}", rtol=2e-6)
        pad = got[2][:, 2 * 3 * d:]
        assert not pad.any()  # the columns past q and k (v's) get no gradient from here


@interp
@pytest.mark.parametrize("key_offset", [False, True], ids=["", "key offset"])
def test_bf16_within_one_rounding_of_float32(key_offset):
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    n, h, d = 29, 2, 64
    qkv, cos, sin, gq, gk = case(n, h, d, True, gen, dtype=torch.bfloat16)
    got = run("triton", qkv, h, d, cos, sin, gq, gk, key_offset)
    want = run("reference", qkv.float(), h, d, cos.float(), sin.float(), gq, gk, key_offset)
    assert all(t.dtype == torch.bfloat16 for t in got)
    # one step of a value's binade is at most 2^-7 of the largest: the interpreter's conversion to
    # bfloat16 truncates (the GPU's rounds to nearest, half that)
    for name, a, b in zip(("q", "k", "d(qkv)"), got, want):
        assert_close(a, b, f"{name}, seed {seed}", rtol=2 * BF16_STEP)


@interp
def test_key_offset_moves_the_upper_half_to_the_next_token():
    """The formula itself (RECORD §2 step 4), not only agreement with the reference: token t's key
    is its own lower half and token t - 1's upper half; token 0 keeps its own."""
    gen = torch.Generator().manual_seed(fresh_seed())
    n, h, d = 11, 2, 16
    qkv, cos, sin, gq, gk = case(n, h, d, False, gen)
    _, plain, _ = run("triton", qkv, h, d, cos, sin, gq, gk, False)
    _, shifted, _ = run("triton", qkv, h, d, cos, sin, gq, gk, True)
    assert torch.equal(shifted[:, :, : d // 2], plain[:, :, : d // 2])
    assert torch.equal(shifted[1:, :, d // 2:], plain[:-1, :, d // 2:])
    assert torch.equal(shifted[0, :, d // 2:], plain[0, :, d // 2:])


@interp
def test_operators_pass_opcheck_and_compile_without_a_graph_break():
    from nanogpt_pl.ops.triton.qk_rotary import _qk_bwd, _qk_fwd

    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    n, h, d = 19, 2, 32
    qkv, cos, sin, gq, gk = case(n, h, d, True, gen)
    q, k = qkv[:, : h * d].view(n, h, d), qkv[:, h * d: 2 * h * d].view(n, h, d)
    checks = ("test_schema", "test_autograd_registration", "test_faketensor")
    torch.library.opcheck(_qk_fwd, (q.clone().requires_grad_(), k.clone().requires_grad_(), cos, sin, 1e-6, True),
                          test_utils=checks)
    rstd = torch.rand(n, 2 * h, generator=gen) + 0.5
    torch.library.opcheck(_qk_bwd, (gq, gk, q, k, cos, sin, rstd, True), test_utils=checks)

    def layer(x):
        a, b = x[:, : h * d].view(n, h, d) * 2.0, x[:, h * d: 2 * h * d].view(n, h, d)
        qo, ko = qk_norm_rotary(a, b, cos, sin, True, "triton")
        return torch.tanh(qo * ko)

    outs = []
    for fn in (layer, torch.compile(layer, backend="aot_eager", fullgraph=True)):
        x = qkv.clone().requires_grad_()
        y = fn(x)
        (y * gq).sum().backward()
        outs.append((y.detach(), x.grad))
    for name, a, b in zip(("output", "gradient"), *outs):
        assert torch.equal(a, b), f"compiled {name}, seed {seed}"


@interp
def test_record_network_trains_the_same_numbers_with_either_path():
    """The small record network (paired, dv64 and wide layers with the key offset) with
    ``model.backends.qk_rotary: triton`` against the reference: the output to float32 rounding, and
    every parameter's gradient no further from a float64 run of the reference than twice the float32
    reference's own distance from it (plus 1e-6 of its scale). Gradients of the scalar lambdas sum
    many cancelling terms: the float32 reference itself is off by up to ~1e-3 of their scale, and
    two float32 paths can differ by more than 1e-4 (seed 13031460). Every attention layer takes
    the kernel."""
    from test_record_network import SMALL, ngram_input, open_attention_outputs, speedrun_gpt

    from nanogpt_pl.model.gpt import GPT
    from nanogpt_pl.ops.triton import qk_rotary as kernels

    seed = fresh_seed()
    torch.manual_seed(seed)
    cfg = speedrun_gpt(**SMALL)
    ref = GPT(cfg, Backends())
    open_attention_outputs(ref)
    fast = GPT(cfg, Backends(qk_rotary="triton"))
    fast.load_state_dict(ref.state_dict())
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (96,), generator=gen)
    cu = torch.tensor([0, 40, 96, 96], dtype=torch.int32)
    w = torch.randn(cfg.model_dim, generator=gen)
    calls = []
    launch = kernels._qk_fwd

    def counting(*args):
        calls.append(args[-1])  # key_offset
        return launch(*args)

    exact = copy.deepcopy(ref).double()
    results = []
    try:
        kernels._qk_fwd = counting
        for m in (fast, ref, exact):
            ngram = ngram_input(ids, cfg.ngram_rows, cfg.model_dim)
            if m is exact:
                ngram = dataclasses.replace(ngram, values=ngram.values.detach().double().requires_grad_())
            out = m(ids, cu, 56, (8, 24), ngram=ngram)
            (out.double() @ w.double()).sum().backward()
            results.append((out.detach(), {n: p.grad.double() for n, p in m.named_parameters() if p.grad is not None}))
    finally:
        kernels._qk_fwd = launch
    attn_layers = [i for i in range(cfg.num_layers) if cfg.has_attention(i)]
    assert len(calls) == len(attn_layers)
    assert calls == [i in cfg.key_offset_layers for i in attn_layers]
    (out, grads), (ref_out, ref_grads), (_, exact_grads) = results
    assert_close(out, ref_out, f"output, seed {seed}", rtol=1e-5)
    assert grads.keys() == ref_grads.keys() == exact_grads.keys()
    for name, want in exact_grads.items():
        scale = want.abs().max().item()
        err, ref_err = ((g[name] - want).abs().max().item() for g in (grads, ref_grads))
        assert err <= 2 * ref_err + 1e-6 * scale, (
            f"{name}, seed {seed}: error {err:.3e} against the float32 reference's {ref_err:.3e} (scale {scale:.3e})")


@pytest.mark.skipif(INTERPRETED, reason="checks the choice without the interpreter")
def test_backend_choice_and_errors():
    from test_record_network import SMALL, speedrun_gpt

    from nanogpt_pl.model.gpt import GPT

    assert resolve_qk_rotary_backend("auto", torch.device("cpu")) == "reference"
    assert resolve_qk_rotary_backend("auto", torch.device("cuda")) == "triton"  # timed faster in the step
    assert resolve_qk_rotary_backend("reference", torch.device("cuda")) == "reference"
    # auto never fails where the reference runs: a width the kernel does not take gets the reference
    assert resolve_qk_rotary_backend("auto", torch.device("cuda"), 48) == "reference"
    assert resolve_qk_rotary_backend("auto", torch.device("cuda"), 64) == "triton"
    assert resolve_qk_rotary_backend("triton", torch.device("cuda"), 48) == "triton"  # the kernel says no
    q = k = torch.randn(4, 2, 16)
    cos = sin = torch.randn(4, 8)
    want = qk_norm_rotary(q, k, cos, sin, False, "reference")
    for got, ref in zip(qk_norm_rotary(q, k, cos, sin, False, "auto"), want):  # on CPU, auto is the reference
        assert torch.equal(got, ref)
    with pytest.raises(RuntimeError, match=r"model\.backends\.qk_rotary='triton' needs a CUDA device"):
        qk_norm_rotary(q, k, cos, sin, False, "triton")
    with pytest.raises(ValueError, match=r"model\.backends\.qk_rotary='fast': choose one of auto, reference, triton"):
        GPT(speedrun_gpt(**SMALL), Backends(qk_rotary="fast"))


@interp
def test_unsupported_shapes_are_one_line():
    from nanogpt_pl.ops.triton.qk_rotary import qk_norm_rotary_triton

    q = torch.randn(4, 2, 24)
    with pytest.raises(ValueError, match="head width 24 unsupported.*model.backends.qk_rotary=reference"):
        qk_norm_rotary_triton(q, q, torch.randn(4, 12), torch.randn(4, 12), 1e-6)
    q = torch.randn(4, 2, 16)
    with pytest.raises(ValueError, match=r"cos is \(4, 2, 4\); want \[4, 8\] or \[4, 2, 8\]"):
        qk_norm_rotary_triton(q, q, torch.randn(4, 2, 4), torch.randn(4, 2, 4), 1e-6)


# ---------------------------------------------------------------- GPU, bf16, a stage-1 micro-batch


@pytest.mark.cuda
@pytest.mark.parametrize("d,per_head,key_offset", [(64, True, False), (64, False, False), (128, False, True)],
                         ids=["paired narrow", "dv64", "wide, key offset"])
def test_gpu_record_shapes_no_worse_than_the_compiled_reference(d, per_head, key_offset):
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    n, h = 32768, 6
    qkv, cos, sin, gq, gk = case(n, h, d, per_head, gen, dtype=torch.bfloat16, device="cuda", pad=h * 128)
    ours = run("triton", qkv, h, d, cos, sin, gq, gk, key_offset)
    inductor = run("reference", qkv, h, d, cos, sin, gq, gk, key_offset, op=torch.compile(qk_norm_rotary))
    exact = run("reference", qkv.float(), h, d, cos.float(), sin.float(), gq, gk, key_offset)
    for name, a, b, c in zip(("q", "k", "d(qkv)"), ours, inductor, exact):
        scale = c.abs().max().item()
        err_ours = (a.float() - c).abs().max().item()
        err_inductor = (b.float() - c).abs().max().item()
        assert err_ours <= err_inductor + BF16_STEP * scale, (
            f"{name}, d {d}, seed {seed}: error {err_ours:.3e} against inductor's {err_inductor:.3e} "
            f"(scale {scale:.3e})")
