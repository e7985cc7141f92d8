"""The value planes' gather gradient as a sorted segment sum (``nanogpt_pl.ops.triton.row_sum``).

``sorted_row_sum`` against ``index_add_`` (its reference) on fresh random inputs: rows that
run across several 64-position chunks, rows no token reads (the leaf's padding), a plane with
no gradient, a row-strided gradient, widths and token counts that are not a multiple of a
tile, fp32 and bf16 gradients. Sums of small integers are exact in any order, so there the
two must agree bit for bit; on normal draws to fp32 rounding.

``gather_planes`` with ``model.backends.value_rows: triton`` against ``reference``: the same
planes bit for bit, the same leaf gradient, through ``torch.compile`` (``aot_eager``, one
graph) and inside the record network (every other gradient bit for bit).

On CPU the kernel runs under ``TRITON_INTERPRET=1`` in a child process at small sizes; on the
GPU at a stage-2 micro-batch (49,152 tokens, 4 planes of 768, Zipf-distributed token rows as
on text, 4,224 leaf rows: the one-GPU plan's reservation, BENCHMARKS.md).
"""

from __future__ import annotations

import pytest
import torch
from interpreter import INTERPRETED, interp, run_module_under_interpreter
from seeds import draw_values, fresh_seed

from nanogpt_pl.backends import Backends
from nanogpt_pl.model.embeddings import gather_planes, resolve_value_rows_backend


@pytest.mark.skipif(INTERPRETED, reason="already inside the interpreter run")
def test_kernel_suite_under_interpreter():
    run_module_under_interpreter(__file__)


def zipf_index(n: int, rows: int, gen: torch.Generator, device="cpu", exponent: float = 1.1) -> torch.Tensor:
    """``n`` row ids in ``[0, rows)`` with Zipf frequencies (rank r drawn ∝ r^-exponent), shuffled ranks."""
    weights = torch.arange(1, rows + 1, dtype=torch.float64).pow(-exponent)
    ranks = torch.multinomial(weights, n, replacement=True, generator=gen)
    return torch.randperm(rows, generator=gen)[ranks].to(device)


# -- sorted_row_sum against index_add_ ------------------------------------------------------
@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("integers", [True, False])
def test_sorted_row_sum_matches_index_add(dtype, integers):
    from nanogpt_pl.ops.triton.row_sum import CHUNK, row_sum_reference, sorted_row_sum

    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    n, d, used, rows = 5 * CHUNK + 23, 80, 29, 40  # 6 chunks, width 80 (not a power of two), 11 padding rows
    index = zipf_index(n, used, gen)
    index[CHUNK - 10: 3 * CHUNK + 5] = 3  # one row's run across three chunks
    grads = [draw_values(gen, (n, d), dtype, integers), None, draw_values(gen, (n, d), dtype, integers)]
    wide = draw_values(gen, (n, d + 16), dtype, integers)
    grads.append(wide[:, 8: 8 + d])  # row stride d + 16
    got = sorted_row_sum(grads, index, rows, torch.float32)
    want = row_sum_reference(grads, index, rows, torch.float32)
    assert got.shape == (4, rows, d) and got.dtype == torch.float32
    if integers:
        assert torch.equal(got, want), f"seed {seed}"
    else:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"seed {seed}")
    assert not got[1].any() and not got[:, used:].any()  # the None plane and the unread rows
    assert got[0, 3].abs().sum() > 0


@interp
def test_sorted_row_sum_one_row_and_one_token():
    from nanogpt_pl.ops.triton.row_sum import row_sum_reference, sorted_row_sum

    gen = torch.Generator().manual_seed(fresh_seed())
    for n, rows in ((1, 1), (130, 1), (3, 7)):
        index = torch.randint(0, rows, (n,), generator=gen)
        grads = [torch.randint(-4, 5, (n, 16), generator=gen).float()]
        assert torch.equal(sorted_row_sum(grads, index, rows, torch.float32),
                           row_sum_reference(grads, index, rows, torch.float32))


@interp
def test_sorted_row_sum_names_mismatched_shapes():
    from nanogpt_pl.ops.triton.row_sum import sorted_row_sum

    g = torch.randn(10, 16)
    with pytest.raises(ValueError, match="sorted_row_sum: 9 indices"):
        sorted_row_sum([g], torch.zeros(9, dtype=torch.long), 4, torch.float32)
    with pytest.raises(ValueError, match=r"\(10, 16\), \(10, 8\)"):
        sorted_row_sum([g, torch.randn(10, 8)], torch.zeros(10, dtype=torch.long), 4, torch.float32)


# -- gather_planes: triton against reference --------------------------------------------------
def _leaf(gen: torch.Generator, planes: int, rows: int, d: int) -> torch.Tensor:
    return torch.randn(planes, rows, d, generator=gen).requires_grad_()


@interp
@pytest.mark.parametrize("compiled", [False, True])
def test_gather_planes_triton_matches_reference(compiled):
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    planes, used, rows, n, d = 3, 50, 64, 300, 48
    index = zipf_index(n, used, gen)
    weights = [torch.randint(-3, 4, (n, d), generator=gen).bfloat16() for _ in range(planes)]

    def loss(values, backend):
        out = gather_planes(values, index, torch.bfloat16, backend)
        # plane 1 is read twice, plane 2 not at all: its gradient is None
        return (out[0] * weights[0]).sum() + (out[1] * weights[1]).sum() + (out[1] * weights[2]).sum(), out

    fn = torch.compile(loss, backend="aot_eager", fullgraph=True) if compiled else loss
    leaf = _leaf(gen, planes, rows, d)
    ref_leaf = leaf.detach().clone().requires_grad_()
    total, out = fn(leaf, "triton")
    ref_total, ref_out = loss(ref_leaf, "reference")
    assert len(out) == planes and all(torch.equal(a, b) for a, b in zip(out, ref_out))
    assert out[0].dtype == torch.bfloat16
    total.float().backward()
    ref_total.float().backward()
    # the terms are bf16 integers times bf16 rows: compare to fp32 rounding of the row sums
    torch.testing.assert_close(leaf.grad, ref_leaf.grad, rtol=1e-5, atol=1e-4, msg=f"seed {seed}")
    assert not leaf.grad[2].any() and not leaf.grad[:, used:].any()
    assert leaf.grad[1].abs().sum() > 0


@interp
def test_record_network_with_triton_value_rows_matches_reference():
    from test_record_network import backend_against_reference, ngram_input

    from nanogpt_pl.distributed.value_embed_shard import ValueEmbedShard

    def inputs(model, ids, cfg):
        return {"ngram": ngram_input(ids, cfg.ngram_rows, cfg.model_dim),
                "value_rows": ValueEmbedShard(list(model.value_embeds)).prepare(ids, pad_to=cfg.vocab_size)}

    seed = fresh_seed()
    cfg, ids, fast, ref = backend_against_reference(
        seed, Backends(value_rows="triton"), lambda gen, cfg: zipf_index(96, cfg.vocab_size, gen), inputs)
    ve, ref_ve = fast["value_rows"], ref["value_rows"]
    torch.testing.assert_close(ve.values.grad, ref_ve.values.grad, rtol=1e-5, atol=1e-6, msg=f"seed {seed}")
    used = torch.unique(ids).numel()
    assert ve.values.grad[:, :used].abs().sum(-1).gt(0).all()  # every plane reaches every read row
    assert not ve.values.grad[:, used:].any()


# -- choosing the path --------------------------------------------------------------------------
@pytest.mark.skipif(INTERPRETED, reason="checks the choice without the interpreter")
def test_value_rows_backend_choice_and_errors():
    assert resolve_value_rows_backend("auto", "cpu") == "reference"
    assert resolve_value_rows_backend("auto", "cuda") == "triton"  # timed faster in the step (BENCHMARKS.md)
    assert resolve_value_rows_backend("reference", "cpu") == "reference"
    with pytest.raises(RuntimeError, match=r"model\.backends\.value_rows='triton' needs a CUDA device"):
        resolve_value_rows_backend("triton", "cpu")
    with pytest.raises(ValueError, match=r"model\.backends\.value_rows='fast': choose one of auto, reference, triton"):
        from test_record_network import SMALL, speedrun_gpt

        from nanogpt_pl.model.gpt import GPT

        GPT(speedrun_gpt(**SMALL), Backends(value_rows="fast"))
    # a leaf without grad (validation) never asks for the kernel: the reference gather on any device
    values = torch.randn(2, 5, 4)
    index = torch.tensor([4, 0, 4])
    out = gather_planes(values, index, torch.bfloat16, "triton")
    assert torch.equal(torch.stack(out), values[:, index].bfloat16())


# -- GPU: a stage-2 micro-batch -------------------------------------------------------------
@pytest.mark.cuda
@pytest.mark.parametrize("compiled", [False, True])
def test_gather_planes_triton_on_the_gpu_at_stage_2(compiled):
    from nanogpt_pl.ops.triton.row_sum import row_sum_reference

    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    planes, rows, n, d = 4, 4224, 49_152, 768
    index = zipf_index(n, 3700, gen, "cuda")
    leaf = torch.randn(planes, rows, d, generator=gen).mul_(0.02).cuda().requires_grad_()
    grads = [torch.randn(n, d, generator=gen).to("cuda", torch.bfloat16) for _ in range(planes)]

    def planes_of(values):
        return gather_planes(values, index, torch.bfloat16, "triton")

    fn = torch.compile(planes_of) if compiled else planes_of
    out = fn(leaf)
    assert all(torch.equal(o, leaf.detach()[p, index].bfloat16()) for p, o in enumerate(out))
    torch.autograd.backward(out, grads)
    want = row_sum_reference(grads, index, rows, torch.float32)
    # fp32 sums of up to ~5k terms of N(0, 1) in another order
    torch.testing.assert_close(leaf.grad, want, rtol=1e-4, atol=2e-4, msg=f"seed {seed}")
    assert not leaf.grad[:, 3700:].any()
