"""The sparse channels' Triton kernels against their PyTorch references.

The row gather (``nanogpt_pl.ops.triton.gather_rows``): table rows at padded ids into an
fp32 leaf, zeros at the padding; a copy and a cast, so it must equal the reference bit for bit.

The scatter-add of a micro-batch's value-embedding gradient into the cycle buffer: one term
per real row, the padding skipped, so it must equal ``index_add_`` bit for bit.

The n-gram hashes (``nanogpt_pl.ops.triton.ngram_hash``): the four hashes of a micro-batch in
one pass, equal to the PyTorch functions and to RECORD §3's formulas in plain Python; chosen
by ``model.backends.ngram: triton`` (and by ``auto`` on a GPU).

The lazy row-Adam event kernel (``nanogpt_pl.ops.triton.row_adam``) against the PyTorch update.

Both run the same events on the same shard: padded queues whose entries repeat rows (so
each row sums several terms), a β₂ change between events (the decay replay crosses
segments), rows that sleep through events, weight decay on and off, and once a merged row
list through ``update_`` (one term per row). The kernel sums each row's terms in queue
order, as the reference does; the row mean of g² is a tree sum, so the moments agree to
fp32 rounding and the bf16 table to one bf16 rounding.

On CPU the kernel runs under ``TRITON_INTERPRET=1`` in a child process at small sizes; on
the GPU at a stage-0 event of the one-GPU config (32 queued micro-batches of 2 x 16,384
rows of 768, a 4M-row shard).
"""

from __future__ import annotations

from typing import Optional

import pytest
import torch
from interpreter import INTERPRETED, interp, run_module_under_interpreter  # noqa: E402
from seeds import fresh_seed

from nanogpt_pl.distributed.ngram_shard import NgramShard
from nanogpt_pl.distributed.row_exchange import segments_fixed
from nanogpt_pl.model.embeddings import (
    RECORD_NGRAM_ROWS,
    gather_rows_,
    ngram_hashes,
    ngram_row_ids,
    ngram_sign_rows,
    resolve_hash_backend,
)
from nanogpt_pl.optim.sparse_adam import LazyRowAdam

BETA2S = (0.95, 0.95, 0.9025, 0.9025)  # RECORD §4-§5: β₂ 0.95, squared when the cadence engages
WEIGHT_DECAYS = (0.025, 0.0, 0.05, 0.05)


@pytest.mark.skipif(INTERPRETED, reason="already inside the interpreter run")
def test_kernel_suite_under_interpreter():
    run_module_under_interpreter(__file__)


# the mean over ranks an owner's event takes with two sources (per event; event 1 goes through update_)
DIVISORS = (2, 1, 3, 8)


def run_events(device: str, rows: int, dim: int, table_dtype: torch.dtype, entries: int, per_entry: int,
               seed: int, fused: bool, two_sources: bool = False, keep_start: bool = True,
               ) -> tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor, torch.Tensor]:
    """Four events on one shard; ``two_sources``: as at an owner of a multi-rank table, the first
    entry is the own request (fp32) and the rest the peers' rows (bf16, the wire), in two tensors,
    and each row's sum is divided by :data:`DIVISORS` (the mean over ranks). The starting table
    is returned with ``keep_start`` (else None: one table less held on the GPU)."""
    gen = torch.Generator(device=device).manual_seed(seed)  # drawn where they are used (GPU-sized queues)
    # drawn in the table's dtype: no fp32 table-sized temporary (13 GB at the GPU's 4M rows)
    table = torch.randn(rows + 1, dim, generator=gen, device=device, dtype=table_dtype).mul_(0.02)
    start = table.clone() if keep_start else None
    adam = LazyRowAdam(rows, torch.device(device), fused=fused)
    for event, (beta2, wd) in enumerate(zip(BETA2S, WEIGHT_DECAYS)):
        lr = 0.56 * (1.0 - 0.1 * event)
        # rows drawn from a growing part of the shard, so some rows sleep through events; padding = rows
        high = min(rows, (event + 1) * (rows // 3))
        ids = [torch.randint(0, high, (per_entry,), generator=gen, device=device) for _ in range(entries)]
        queue = [torch.where(torch.rand(per_entry, generator=gen, device=device) < 0.2, rows, i) for i in ids]
        queued = torch.cat(queue)
        extra = {}
        if two_sources and event != 1:  # the peers' rows drawn in bf16: no fp32 copy of them
            src = torch.randn(per_entry, dim, generator=gen, device=device)
            extra = dict(src2=torch.randn(queued.numel() - per_entry, dim, generator=gen, device=device,
                                          dtype=torch.bfloat16), grad_divisor=DIVISORS[event])
        else:
            src = torch.randn(queued.numel(), dim, generator=gen, device=device)
        if event == 1:  # a merged row list (one term per row) through update_
            merged_rows, inverse = torch.unique(queued, return_inverse=True)
            merged = torch.zeros(merged_rows.numel(), dim, device=device).index_add_(0, inverse, src)
            adam.update_(table, merged_rows, merged, lr, beta2, 1e-10, wd)
            continue
        seg = segments_fixed(queued, queued.numel(), rows)
        adam.update_segments_(table, seg.unique, src, seg.order, seg.offsets, seg.slot, lr, beta2, 1e-10, wd,
                              **extra)
    return table[:rows], None if start is None else start[:rows], adam.v, adam.last_event


def assert_close_but_rare(got: torch.Tensor, want: torch.Tensor, rtol: float, atol: float, rare: float,
                          cap: float) -> int:
    """Every element within ``atol + rtol·|want|`` but a fraction ``rare``, and every one within ``cap``;
    returns how many elements differ at all.

    A bf16 result of fp32 arithmetic done in another order differs by one rounding almost
    everywhere; where the cautious decay's sign test ``u·p > 0`` sits at zero, the decay term
    (lr²·λ·p, about 2⁻⁷·p here) flips, and later events carry that on. Those are rare.
    """
    bad, worst, differ = 0, 0.0, 0
    for a in range(0, got.shape[0], 1 << 20):  # in row chunks: the GPU tables are billions of elements
        g, w = got[a:a + (1 << 20)].double(), want[a:a + (1 << 20)].double()
        diff = (g - w).abs()
        bad += int((diff > atol + rtol * w.abs()).sum())
        differ += int((diff != 0).sum())
        worst = max(worst, float(diff.max()))
    assert bad <= rare * got.numel(), f"{bad} of {got.numel()} elements beyond one rounding"
    assert worst <= cap, f"largest difference {worst}"
    return differ


def check_fused_against_pytorch(device: str, rows: int, dim: int, table_dtype: torch.dtype, entries: int,
                                per_entry: int, seed: int, two_sources: bool = False) -> None:
    got, start, v, last = run_events(device, rows, dim, table_dtype, entries, per_entry, seed, True, two_sources)
    want, _, v_ref, last_ref = run_events(device, rows, dim, table_dtype, entries, per_entry, seed, False,
                                          two_sources, keep_start=False)
    assert torch.equal(last, last_ref)
    assert int(last.max()) == len(BETA2S) and int((last == 0).sum()) > 0  # some rows never touched
    torch.testing.assert_close(v, v_ref, rtol=1e-5, atol=1e-30)
    untouched = last_ref == 0
    moved = False
    for a in range(0, rows, 1 << 20):  # in row chunks: no table-sized masked copies on the GPU
        keep, sl = untouched[a:a + (1 << 20)], slice(a, a + (1 << 20))
        assert torch.equal(got[sl][keep], start[sl][keep])
        moved = moved or not torch.equal(want[sl][~keep], start[sl][~keep])
    assert moved
    # the update is ~lr-sized against rows of 0.02: one bf16 rounding of the row, or fp32 noise
    if table_dtype == torch.bfloat16:
        # the GPU run (4 events, 3.2e9 elements) saw 575 beyond one rounding, the largest 2^-6
        differ = assert_close_but_rare(got, want, rtol=2**-7, atol=1e-3, rare=1e-5, cap=2**-4)
        assert differ < 1e-3 * got.numel()  # all but a few agree bit for bit
    else:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@interp
@pytest.mark.parametrize("table_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("two_sources", [False, True])
def test_fused_event_matches_pytorch(table_dtype, seed, two_sources):
    # width 48 (not a power of two: the masked tail), 3 entries of 40 rows in a 90-row shard
    check_fused_against_pytorch("cpu", 90, 48, table_dtype, 3, 40, seed, two_sources)


def test_segments_hand_the_kernel_every_term_once():
    # every queued term lands in exactly one row's segment, the padding in none
    gen = torch.Generator().manual_seed(5)
    fill = 50
    values = torch.where(torch.rand(64, generator=gen) < 0.3, fill, torch.randint(0, 20, (64,), generator=gen))
    seg = segments_fixed(values, 40, fill)
    real = torch.unique(values[values != fill])
    assert torch.equal(seg.unique[: real.numel()], real) and bool((seg.unique[real.numel():] == fill).all())
    counts = seg.offsets[1:] - seg.offsets[:-1]
    assert int(counts.sum()) == int((values != fill).sum()) and bool((counts[real.numel():] == 0).all())
    for i, value in enumerate(real.tolist()):
        members = seg.order[seg.offsets[i]:seg.offsets[i + 1]]
        assert torch.equal(members, (values == value).nonzero().flatten())  # in input order
        assert bool((seg.slot[seg.offsets[i]:seg.offsets[i + 1]] == i).all())


@pytest.mark.skipif(INTERPRETED, reason="the interpreter compiles nothing")
def test_the_per_event_integers_do_not_make_new_compiled_variants():
    """``event`` grows an event and ``split`` follows the queue: specialized (Triton's value classes
    1 / multiple of 16 / other), each new class compiled a kernel mid-run, on the clock."""
    from nanogpt_pl.ops.triton.row_adam import _lazy_row_adam_kernel

    unspecialized = {p.name for p in _lazy_row_adam_kernel.params if p.do_not_specialize}
    assert {"split", "scratch", "event"} <= unspecialized


@pytest.mark.cuda
def test_events_past_the_first_compile_nothing_on_the_gpu():
    """Events 1, 2, 16, 17 and 32 with queues of several lengths: one compiled variant of the kernel."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    from nanogpt_pl.ops.triton.row_adam import _lazy_row_adam_kernel, lazy_row_adam_

    dev = torch.device("cuda")
    rows, dim = 1000, 768
    table = torch.randn(rows + 1, dim, device=dev) * 0.02
    v = torch.zeros(rows + 1, device=dev)
    last = torch.zeros(rows + 1, dtype=torch.int32, device=dev)
    decay = torch.ones(64, device=dev)
    variants = []
    for event, terms in ((1, 16), (2, 17), (16, 33), (17, 48), (32, 1)):
        src = torch.randn(terms, dim, device=dev)
        used = torch.arange(terms, device=dev) % 7  # 7 rows share the terms, in order
        order = torch.argsort(used, stable=True)
        counts = torch.bincount(used, minlength=7)
        offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
        lazy_row_adam_(table, v, last, torch.arange(7, device=dev), src, order, offsets, decay[:event],
                       scratch=rows, event=event, beta2=0.95, step_size=1e-3, eps=1e-10, decay_wd=0.0)
        torch.cuda.synchronize()
        variants.append(len(_lazy_row_adam_kernel.device_caches[dev.index or 0][0]))
    assert variants == [variants[0]] * 5, variants
    assert int(last[:7].max()) == 32 and int(last[7:].max()) == 0


@pytest.mark.cuda
@pytest.mark.parametrize("seed", [0])
def test_fused_event_matches_pytorch_on_the_gpu(seed):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    check_fused_against_pytorch("cuda", 1 << 22, 768, torch.bfloat16, 32, 2 * 16_384, seed)


@pytest.mark.cuda
def test_owner_event_with_two_sources_matches_pytorch_on_the_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    # an owner at 8 ranks, stage-2 event: its own 4 x 2 x 49,152 queued rows and 7 peers' as many (bf16)
    check_fused_against_pytorch("cuda", 1 << 22, 768, torch.bfloat16, 8, 4 * 2 * 49_152, 2, two_sources=True)


def check_gather(device: str, rows: int, dim: int, n: int, table_dtype: torch.dtype, seed: int) -> None:
    gen = torch.Generator(device="cpu").manual_seed(seed)
    table = torch.randn(rows, dim, generator=gen).to(device=device, dtype=table_dtype)
    # real ids, the padding sentinel and ids past the limit (rows of another owner): zeros
    ids = torch.randint(0, rows + rows // 4, (n,), generator=gen).to(device)
    limit = rows - rows // 8
    got = gather_rows_(torch.full((n, dim), float("nan"), device=device), table, ids, limit)
    want = gather_rows_(torch.empty(n, dim, device=device), table, ids, limit, fused=False)
    assert torch.equal(got, want)
    pad = ids >= limit
    assert bool(pad.any()) and bool((got[pad] == 0).all()) and torch.equal(got[~pad], table[ids[~pad]].float())


@interp
@pytest.mark.parametrize("table_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [48, 300])  # one partial column block; two blocks of 256
def test_gather_rows_matches_pytorch(table_dtype, dim):
    check_gather("cpu", 70, dim, 37, table_dtype, seed=dim)


@pytest.mark.cuda
def test_gather_rows_matches_pytorch_on_the_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    check_gather("cuda", 50_304, 768, 49_152, torch.bfloat16, seed=7)  # a value-embedding plane, stage-2 ids


def check_dense_adam(device: str, planes: int, rows: int, dim: int, param_dtype: torch.dtype, seed: int) -> None:
    """Three events of the value-embedding block Adam, fused against PyTorch, rows untouched in some."""
    from nanogpt_pl.optim.sparse_adam import ShardAdam

    gen = torch.Generator(device="cpu").manual_seed(seed)
    start = [(torch.randn(rows, dim, generator=gen) * 0.02).to(device=device, dtype=param_dtype) for _ in range(planes)]
    grads = []
    for _ in range(3):
        g = torch.randn(planes, rows, dim, generator=gen)
        g[:, torch.rand(rows, generator=gen) < 0.4] = 0.0  # rows the cycle did not touch
        grads.append(g.to(device))
    out = []
    for fused in (True, False):
        blocks = [b.clone() for b in start]
        adam = ShardAdam(planes, rows, dim, fused=fused)
        for event, g in enumerate(grads):
            g = g.clone()
            adam.update_dense_(blocks, g, lr=0.56 * (1 - 0.1 * event), betas=(0.75, 0.95), eps=1e-10,
                               weight_decay=0.025 if event != 1 else 0.0)
            if fused:
                assert bool((g == 0).all())  # the cycle buffer is left empty
        out.append((blocks, adam.exp_avg.clone(), adam.exp_avg_sq.clone()))
    (got, m, v), (want, m_ref, v_ref) = out
    torch.testing.assert_close(m, m_ref, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(v, v_ref, rtol=1e-6, atol=1e-9)
    for b, r, s in zip(got, want, start):
        assert not torch.equal(r, s)
        if param_dtype == torch.bfloat16:
            # the GPU run (3 events, 4 planes of 3.9e7 elements) saw 11 in a plane beyond one rounding
            assert_close_but_rare(b, r, rtol=2**-7, atol=1e-3, rare=1e-5, cap=2**-4)
            assert int((b != r).sum()) < 1e-3 * b.numel()
        else:
            torch.testing.assert_close(b, r, rtol=1e-5, atol=1e-5)


@interp
@pytest.mark.parametrize("param_dtype", [torch.float32, torch.bfloat16])
def test_dense_adam_matches_pytorch(param_dtype):
    check_dense_adam("cpu", 2, 30, 40, param_dtype, seed=3)  # 2,400 elements: three blocks, the last partial


@pytest.mark.cuda
def test_dense_adam_matches_pytorch_on_the_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    check_dense_adam("cuda", 4, 50_304, 768, torch.bfloat16, seed=4)  # RECORD §5's four planes


def check_value_embed_event(device: str, vocab: int, dim: int, planes: int, seed: int) -> None:
    """A one-rank value-embedding shard (fixed exchange) over two cycles, the block Adam fused
    against PyTorch: the same tables, and the cycle buffer empty after each event (at one rank
    the fused pass empties the token rows and only the scratch rows are zeroed after it)."""
    from nanogpt_pl.distributed.value_embed_shard import ValueEmbedShard

    gen = torch.Generator(device="cpu").manual_seed(seed)
    start = [torch.randn(vocab, dim, generator=gen) * 0.02 for _ in range(planes)]
    cycles = [[torch.randint(0, vocab, (n,), generator=gen) for n in (vocab // 3, vocab // 2, vocab)]
              for _ in range(2)]
    grads = [[torch.randn(planes, min(t.numel(), vocab), dim, generator=gen) for t in cycle] for cycle in cycles]
    out = []
    for fused in (True, False):
        tables = [t.clone().to(device) for t in start]
        ve = ValueEmbedShard(tables, exchange="fixed")
        ve.adam.fused = fused
        for event, (cycle, cycle_grads) in enumerate(zip(cycles, grads)):
            for tokens, g in zip(cycle, cycle_grads):
                rows = ve.prepare(tokens.to(device))
                g = g.to(device) * (rows.ids < vocab)[None, :, None]  # no token reads a padding row
                ve.push(rows.ids, g)
            ve.step(lr=0.56 * (1 - 0.1 * event), betas=(0.75, 0.95), eps=1e-10, weight_decay=0.025)
            buf, touched = ve._buffers()
            assert not bool(buf.any()) and not bool(touched.any())  # the next cycle starts empty
        out.append(tables)
    for got, want, s in zip(*out, start):
        assert not torch.equal(want.cpu(), s)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@interp
def test_one_rank_value_embed_event_fused_matches_pytorch():
    check_value_embed_event("cpu", 40, 24, 2, seed=11)


@pytest.mark.cuda
def test_one_rank_value_embed_event_fused_matches_pytorch_on_the_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    check_value_embed_event("cuda", 50_304, 768, 4, seed=12)  # RECORD §5's four planes


def check_scatter_add(device: str, planes: int, rows: int, dim: int, n: int, seed: int) -> None:
    from nanogpt_pl.distributed.row_exchange import unique_fixed
    from nanogpt_pl.ops.triton.gather_rows import scatter_add_rows_triton_

    gen = torch.Generator(device=device).manual_seed(seed)
    limit = rows - rows // 8  # the vocabulary; the sentinel and the scratch rows lie past it
    tokens = torch.randint(0, limit, (n,), generator=gen, device=device)
    ids, _ = unique_fixed(tokens, n, limit)  # sorted unique ids, then the sentinel padding
    buf = torch.randn(planes, rows, dim, generator=gen, device=device)
    src = torch.randn(planes, n, dim, generator=gen, device=device)
    got = scatter_add_rows_triton_(buf.clone(), ids, src, limit)
    real = ids < limit
    assert bool(real.any()) and bool((~real).any())
    want = buf.clone().index_add_(1, ids[real], src[:, real])
    assert torch.equal(got, want)


@interp
def test_kernels_bump_the_version_counters_of_what_they_write():
    """A kernel's writes are invisible to autograd's version counters (the FP8 weight caches read
    them to see a changed weight); each wrapper bumps the counters of the tensors it wrote."""
    from nanogpt_pl.ops.triton.gather_rows import gather_rows_triton_, scatter_add_rows_triton_
    from nanogpt_pl.ops.triton.row_adam import dense_adam_

    gen = torch.Generator().manual_seed(fresh_seed())
    table, ids = torch.randn(20, 8, generator=gen), torch.randint(0, 20, (6,), generator=gen)
    out = torch.zeros(6, 8)
    v0 = out._version
    gather_rows_triton_(out, table, ids, 20)
    assert out._version > v0 and torch.equal(out, table[ids])
    buf, src = torch.zeros(1, 20, 8), torch.randn(1, 6, 8, generator=gen)
    v0 = buf._version
    scatter_add_rows_triton_(buf, torch.arange(6) * 3, src, 20)
    assert buf._version > v0 and buf.abs().sum() > 0
    param, grad = torch.randn(5, 7, generator=gen), torch.randn(5, 7, generator=gen)
    m, v = torch.zeros(5, 7), torch.zeros(5, 7)
    before, start = [t._version for t in (param, m, v, grad)], param.clone()
    dense_adam_(param, m, v, grad, 0.9, 0.95, 1e-2, 1e-10, 0.0)
    assert all(t._version > b for t, b in zip((param, m, v, grad), before)) and not torch.equal(param, start)


@interp
@pytest.mark.parametrize("dim", [48, 300])
def test_scatter_add_rows_matches_index_add(dim):
    check_scatter_add("cpu", 3, 80, dim, 50, seed=dim)


@pytest.mark.cuda
def test_scatter_add_rows_matches_index_add_on_the_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    check_scatter_add("cuda", 4, 50_304 + 1024, 768, 49_152, seed=9)  # a stage-2 micro-batch into the cycle buffer


# -- the n-gram hashes ---------------------------------------------------------------------
@interp
@pytest.mark.parametrize("n", [1, 2, 3, 200])  # the reserved rows; several blocks, the last partial
@pytest.mark.parametrize("high", [50304, (1 << 31) - 1])  # GPT-2 ids; any int32 (products far past 2^32)
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_ngram_hashes_match_pytorch_and_the_record(n, high, dtype):
    from test_ngram_hash import reference_rows

    gen = torch.Generator().manual_seed(1000 * n + high % 997)
    ids = torch.randint(0, high, (n,), generator=gen).to(dtype)
    for ngram_rows in (RECORD_NGRAM_ROWS, 2 * 4099):
        rows, signs = ngram_hashes(ids, ngram_rows, backend="triton")
        assert rows.dtype == signs.dtype == torch.int64 and rows.shape == signs.shape == (2, n)
        assert torch.equal(rows, ngram_row_ids(ids, ngram_rows)) and torch.equal(signs, ngram_sign_rows(ids))
        big, tri, sb, st = reference_rows(ids.tolist(), ngram_rows)  # RECORD §3 with its literal multipliers
        assert rows.tolist() == [big, tri] and signs.tolist() == [sb, st]


@pytest.mark.skipif(INTERPRETED, reason="checks the CPU choice without the interpreter")
def test_ngram_hash_backend_choices_and_errors():
    ids = torch.randint(0, 50304, (40,), generator=torch.Generator().manual_seed(11))
    assert resolve_hash_backend("auto", "cpu") == resolve_hash_backend("reference", "cpu") == "reference"
    assert resolve_hash_backend("auto", "cuda") == "triton"  # timed faster in the step (BENCHMARKS.md, session 7)
    rows, signs = ngram_hashes(ids, 2 * 4099, backend="auto")
    assert torch.equal(rows, ngram_row_ids(ids, 2 * 4099)) and torch.equal(signs, ngram_sign_rows(ids))
    with pytest.raises(ValueError, match=r"^model.backends.ngram='fused': choose one of auto, reference, triton$"):
        resolve_hash_backend("fused", "cpu")
    with pytest.raises(RuntimeError, match=r"model.backends.ngram='triton' needs a CUDA device"):
        NgramShard(2 * 4099, 8, hash_backend="triton")
    assert NgramShard(2 * 4099, 8).hash_backend == "reference"


@pytest.mark.cuda
def test_ngram_hashes_match_pytorch_on_the_gpu():
    ids = torch.randint(0, 50304, (49152,), device="cuda", generator=torch.Generator("cuda").manual_seed(3))
    rows, signs = ngram_hashes(ids.to(torch.int32), RECORD_NGRAM_ROWS, backend="triton")
    assert torch.equal(rows, ngram_row_ids(ids, RECORD_NGRAM_ROWS)) and torch.equal(signs, ngram_sign_rows(ids))
