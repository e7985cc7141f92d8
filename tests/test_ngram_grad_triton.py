"""The n-gram leaf's gradient as sorted row sums stored once (``nanogpt_pl.ops.triton.ngram_grad``).

``ngram_grad`` against ``index_add_`` of the signed gradient rows (its reference) on fresh
random inputs: a row whose run crosses several 64-entry chunks (read on by the chunk where it
starts), rows no entry reads (the leaf's padding, which must come out zero whatever the
buffer held), rows read by both the bigram and the trigram entries, widths and token counts
that are not a multiple of a tile, fp32 and bf16 gradients. Sums of small integers are exact
in any order, so there the two agree bit for bit; on normal draws to fp32 rounding.

``HashedNgramEmbedding`` with ``model.backends.ngram_rows: triton`` against ``reference``: the
same output bit for bit, the same leaf gradient, through ``torch.compile`` (``aot_eager``, one
graph) and inside the record network (every other gradient bit for bit).

On CPU the kernel runs under ``TRITON_INTERPRET=1`` in a child process at small sizes; on the
GPU at a stage-2 micro-batch (49,152 tokens, width 768, hashed rows of text-like tokens).
"""

from __future__ import annotations

import pytest
import torch
from interpreter import INTERPRETED, interp, run_module_under_interpreter
from seeds import draw_values, fresh_seed

from nanogpt_pl.backends import Backends
from nanogpt_pl.model.embeddings import (
    SIGN_ROWS,
    HashedNgramEmbedding,
    NgramInput,
    make_sign_table,
    resolve_ngram_rows_backend,
)


@pytest.mark.skipif(INTERPRETED, reason="already inside the interpreter run")
def test_kernel_suite_under_interpreter():
    run_module_under_interpreter(__file__)


def signs_of(gen: torch.Generator, rows: int, d: int) -> torch.Tensor:
    return torch.where(torch.rand(rows, d, generator=gen) < 0.5, -1.0, 1.0)


# -- ngram_grad against index_add_ ----------------------------------------------------------
@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("integers", [True, False])
def test_ngram_grad_matches_index_add(dtype, integers):
    from nanogpt_pl.ops.triton.ngram_grad import CHUNK, ngram_grad_into, ngram_grad_reference

    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    t, d, used, rows = 3 * CHUNK + 21, 80, 150, 170  # 2T = 426 entries, width 80, 20 padding rows
    index = torch.randint(0, used, (2, t), generator=gen)
    index[1, 5: 5 + 2 * CHUNK + 9] = 7  # one row's run across three chunks
    index[0, :3] = 7  # ... read by bigram entries too
    index[:, -4:] = used - 1  # the last sorted row, read by the last entries
    wide = draw_values(gen, (t, d + 16), dtype, integers)
    grad = wide[:, 8: 8 + d]  # row stride d + 16
    sign_rows = torch.randint(0, 12, (2, t), generator=gen)
    signs = signs_of(gen, 12, d)
    out = torch.full((rows, d), float("nan"))  # the kernel must store every row, padding included
    got = ngram_grad_into(out, grad, index, sign_rows, signs)
    want = ngram_grad_reference(grad, index, sign_rows, signs, rows)
    if integers:
        assert torch.equal(got, want), f"seed {seed}"
    else:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"seed {seed}")
    unread = torch.ones(rows, dtype=torch.bool)
    unread[index.reshape(-1)] = False
    assert unread[used:].all() and not got[unread].any()
    assert got[7].abs().sum() > 0


@interp
def test_ngram_grad_edges():
    from nanogpt_pl.ops.triton.ngram_grad import ngram_grad, ngram_grad_into, ngram_grad_reference

    gen = torch.Generator().manual_seed(fresh_seed())
    # one token; every entry on one row (a run of 130 entries, three chunks); rows no entry reads
    # before the first and between runs; the sign table's rows shared by entries
    for t, rows, lo in ((1, 1, 0), (65, 1, 0), (40, 9, 3), (100, 64 * 3 + 5, 64)):
        index = torch.randint(lo, rows, (2, t), generator=gen)
        sign_rows = torch.randint(0, 3, (2, t), generator=gen)
        signs = signs_of(gen, 3, 16)
        grad = torch.randint(-4, 5, (t, 16), generator=gen).float()
        want = ngram_grad_reference(grad, index, sign_rows, signs, rows)
        assert torch.equal(ngram_grad(grad, index, sign_rows, signs, rows), want)
        assert torch.equal(ngram_grad_into(torch.full((rows, 16), float("nan")), grad, index, sign_rows, signs), want)
    empty = ngram_grad(torch.zeros(0, 16), torch.zeros(2, 0, dtype=torch.long), torch.zeros(2, 0, dtype=torch.long),
                       signs_of(gen, 3, 16), 5)
    assert empty.shape == (5, 16) and not empty.any()


@interp
def test_ngram_grad_names_mismatched_shapes():
    from nanogpt_pl.ops.triton.ngram_grad import ngram_grad, ngram_grad_into

    g, signs = torch.randn(10, 16), signs_of(torch.Generator().manual_seed(0), 4, 16)
    idx = torch.zeros(2, 10, dtype=torch.long)
    with pytest.raises(ValueError, match=r"ngram_grad: gradient \(10, 16\), index \(2, 9\)"):
        ngram_grad(g, torch.zeros(2, 9, dtype=torch.long), idx, signs, 4)
    with pytest.raises(ValueError, match=r"sign table \(4, 8\); give \[T, D\], \[2, T\], \[2, T\] and \[S, D\]"):
        ngram_grad(g, idx, idx, torch.ones(4, 8), 4)
    with pytest.raises(ValueError, match=r"ngram_grad: out \(4, 8\) torch.float32; give a \[rows, 16\] fp32"):
        ngram_grad_into(torch.zeros(4, 8), g, idx, idx, signs)


# -- HashedNgramEmbedding: triton against reference ---------------------------------------------
def _inputs(gen: torch.Generator, t: int, used: int, rows: int, d: int) -> NgramInput:
    index = torch.randint(0, used, (2, t), generator=gen)
    index[0, :40] = 2  # a long run
    sign_rows = torch.randint(0, SIGN_ROWS, (2, t), generator=gen)
    values = torch.randn(rows, d, generator=gen).requires_grad_()
    return NgramInput(values=values, index=index, sign_rows=sign_rows)


@interp
@pytest.mark.parametrize("compiled", [False, True])
def test_ngram_embedding_triton_matches_reference(compiled):
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    t, used, rows, d = 300, 200, 256, 48
    ngram = _inputs(gen, t, used, rows, d)
    ref = NgramInput(values=ngram.values.detach().clone().requires_grad_(), index=ngram.index,
                     sign_rows=ngram.sign_rows)
    weight = torch.randint(-3, 4, (t, d), generator=gen).bfloat16()
    fast, slow = HashedNgramEmbedding(d, "triton"), HashedNgramEmbedding(d, "reference")
    assert torch.equal(fast.signs, make_sign_table(d))

    def loss(module, inp):
        out = module(inp, torch.bfloat16)
        return (out * weight).sum(), out

    fn = torch.compile(loss, backend="aot_eager", fullgraph=True) if compiled else loss
    total, out = fn(fast, ngram)
    ref_total, ref_out = loss(slow, ref)
    assert out.dtype == torch.bfloat16 and torch.equal(out, ref_out)
    total.float().backward()
    ref_total.float().backward()
    # the terms are bf16 integers times ±1: compare to fp32 rounding of the row sums
    torch.testing.assert_close(ngram.values.grad, ref.values.grad, rtol=1e-5, atol=1e-4, msg=f"seed {seed}")
    assert not ngram.values.grad[used:].any() and ngram.values.grad[2].abs().sum() > 0


@interp
def test_record_network_with_triton_ngram_rows_matches_reference():
    from test_record_network import backend_against_reference, ngram_input

    seed = fresh_seed()
    cfg, ids, fast, ref = backend_against_reference(
        seed, Backends(ngram_rows="triton"), lambda gen, cfg: torch.randint(0, cfg.vocab_size, (96,), generator=gen),
        lambda model, ids, cfg: {"ngram": ngram_input(ids, cfg.ngram_rows, cfg.model_dim)})
    ng, ref_ng = fast["ngram"], ref["ngram"]
    torch.testing.assert_close(ng.values.grad, ref_ng.values.grad, rtol=1e-5, atol=1e-6, msg=f"seed {seed}")
    read = torch.zeros(cfg.ngram_rows, dtype=torch.bool)
    read[ng.index.reshape(-1)] = True
    assert ng.values.grad[read].abs().sum(-1).gt(0).all() and not ng.values.grad[~read].any()


# -- choosing the path --------------------------------------------------------------------------
@pytest.mark.skipif(INTERPRETED, reason="checks the choice without the interpreter")
def test_ngram_rows_backend_choice_and_errors():
    from test_record_network import SMALL, speedrun_gpt

    from nanogpt_pl.model.gpt import GPT

    assert resolve_ngram_rows_backend("auto", "cpu") == resolve_ngram_rows_backend("auto", "cuda") == "reference"
    assert resolve_ngram_rows_backend("reference", "cpu") == "reference"
    with pytest.raises(RuntimeError, match=r"model\.backends\.ngram_rows='triton' needs a CUDA device"):
        resolve_ngram_rows_backend("triton", "cpu")
    with pytest.raises(ValueError, match=r"model\.backends\.ngram_rows='fast': choose one of auto, reference, triton"):
        GPT(speedrun_gpt(**SMALL), Backends(ngram_rows="fast"))
    # rows without grad (validation) never ask for the kernel: the reference on any device
    gen = torch.Generator().manual_seed(fresh_seed())
    ngram = _inputs(gen, 20, 10, 12, 16)
    ngram.values.requires_grad_(False)
    out = HashedNgramEmbedding(16, "triton")(ngram, torch.float32)
    assert torch.equal(out, HashedNgramEmbedding(16, "reference")(ngram, torch.float32))


# -- GPU: a stage-2 micro-batch -------------------------------------------------------------
@pytest.mark.cuda
@pytest.mark.parametrize("compiled", [False, True])
def test_ngram_embedding_triton_on_the_gpu_at_stage_2(compiled):
    from nanogpt_pl.distributed.row_exchange import unique_fixed
    from nanogpt_pl.model.embeddings import ngram_row_ids, ngram_sign_rows
    from nanogpt_pl.ops.triton.ngram_grad import ngram_grad_reference

    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    t, d, table = 49_152, 768, 10_575_360
    weights = torch.arange(1, 50_258, dtype=torch.float64).pow(-1.0)  # Zipf token ids, as on text
    ids = torch.multinomial(weights, t, replacement=True, generator=gen).cuda()
    unique, index = unique_fixed(ngram_row_ids(ids, table).reshape(-1), 2 * t, table)  # as the shard pads
    index = index.view(2, t)
    ngram = NgramInput(values=torch.randn(2 * t, d, generator=gen).mul_(0.02).cuda().requires_grad_(),
                       index=index, sign_rows=ngram_sign_rows(ids))
    module = HashedNgramEmbedding(d, "triton").cuda()
    grad = torch.randn(t, d, generator=gen).to("cuda", torch.bfloat16)
    fn = torch.compile(module) if compiled else module
    out = fn(ngram, torch.bfloat16)
    assert torch.equal(out, HashedNgramEmbedding(d, "reference").cuda()(ngram, torch.bfloat16))
    out.backward(grad)
    want = ngram_grad_reference(grad, index, ngram.sign_rows, module.signs, 2 * t)
    torch.testing.assert_close(ngram.values.grad, want, rtol=1e-5, atol=1e-5, msg=f"seed {seed}")
    used = int((unique < table).sum())
    assert not ngram.values.grad[used:].any() and ngram.values.grad[:used].abs().sum(-1).gt(0).all()
