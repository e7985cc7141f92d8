"""Sparse embedding channels: the hashed bigram + trigram table and compact value-embedding rows.

The n-gram channel (RECORD §3) adds to the residual stream a vector looked up from a
huge table by hashes of the last two and three token ids:

    x0_ngram[t] = W[b_t] ⊙ S[si_t] + W[c_t] ⊙ S[ss_t]

with ``b_t`` a bigram row, ``c_t`` a trigram row and ``S`` a fixed ±1 sign table, so two
n-grams that collide on a row usually read it with different signs. The record's
table has 84,602,880 rows × 768 (65 billion parameters), far too large to hold on one
device or to give a dense gradient, so the model never sees the table. The caller
(``nanogpt_pl.distributed.ngram_shard``) finds the unique rows a micro-batch needs,
fetches them from the ranks that own them, and hands the model a compact ``[U, D]``
leaf tensor plus, per token, the position of its two rows in it
(:class:`NgramInput`). Backward then yields a ``[U, D]`` gradient (the gather's
backward sums each row's tokens), which goes back to the owners. Value embeddings
take the same route (:class:`CompactRows`): one gather of the micro-batch's unique
token ids per plane, so no dense ``[vocab, D]`` gradient is built per step.

Hashes (RECORD §3) use 32-bit signed arithmetic with wrap-around, then a floor modulo,
exactly as the record computes them; here they run in int64 and wrap to int32 after
every product, which reproduces the record's values bit for bit. They read the packed
sequence as one stream and therefore **hash across document boundaries**, as the
record does (RECORD §15 lists this as a kept quirk): the first token of a document
gets the bigram of (last token of the previous document, its BOS). Only position 0
of the packed sequence (and 1 for the trigram) gets the reserved row.

Collisions: a bigram is one of 50,304² ≈ 2.5e9 pairs and the bigram half has
``H - 1`` hashed rows (42.3M in the record), so distinct n-grams must share rows. The
XOR-multiply hashes behave like uniform hashing: the fraction of distinct n-grams that
share their row with another one matches ``1 - E[occupied rows]/n`` of a uniform hash
(``tests/test_ngram_hash.py``). Measured on the GPT-2 tokens of Python's help topics
(139k tokens; 31.7k distinct bigrams, 58.4k distinct trigrams):

==============  ================  =================  ==========================
table rows      bigram collided   trigram collided   uniform hashing predicts
==============  ================  =================  ==========================
84,602,880      0.03 %            0.07 %             0.04 % / 0.07 %
1,048,576       3.0 %             5.4 %              3.0 % / 5.4 %
65,536          36 %              53 %               36 % / 53 %
==============  ================  =================  ==========================

Collided n-grams still differ in their sign rows (8192 of them), so a shared row is
read with independent ±1 patterns and the collision acts as noise rather than as a
copy. The benchmark (``benchmarks/ngram_table.py``) prints the unique-row fractions of
a training batch on real text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..backends import check_opt_in, resolve_fast_on_gpu, resolve_opt_in

# RECORD §3 "Row hashes": multipliers of the bigram and trigram row hashes.
BIGRAM_MUL_CUR, BIGRAM_MUL_PREV = 36313, 27191
TRIGRAM_MUL_CUR, TRIGRAM_MUL_PREV, TRIGRAM_MUL_PREV2 = 17351, 60961, 45259
# RECORD §3 "Sign trick": multipliers of the sign-row hashes and the sign table size (8192 rows, & 8191).
SIGN_BIGRAM_MUL_PREV, SIGN_BIGRAM_MUL_CUR = 30011, 48271
SIGN_TRIGRAM_MUL_PREV2, SIGN_TRIGRAM_MUL_PREV, SIGN_TRIGRAM_MUL_CUR = 26801, 39779, 58699
SIGN_ROWS = 8192
# RECORD §3 "Size": the record's table, 84,602,880 rows (bigram half 42,301,440).
RECORD_NGRAM_ROWS = 84_602_880
# RECORD §3 "Injection": the scalar gates on x0_ngram start at 0.05.
NGRAM_GATE_INIT = 0.05
# The sign table is drawn from its own generator so that every rank and every run builds
# the same table without communication (the record draws sign(N(0, 1)) from its global
# RNG stream and broadcasts it; only the ±1 pattern matters).
SIGN_TABLE_SEED = 20240520

_INT32_WRAP = 1 << 32
_INT32_MAX = (1 << 31) - 1


def wrap_int32(x: Tensor) -> Tensor:
    """Two's-complement wrap of int64 values to the int32 range (still int64)."""
    return torch.remainder(x + (_INT32_MAX + 1), _INT32_WRAP) - (_INT32_MAX + 1)


def _mul32(a: int, x: Tensor) -> Tensor:
    # Products of a token id (< 2^16 in practice, any int32 in general) and a 16-bit
    # multiplier stay far inside int64, so wrapping after the product is exact.
    return wrap_int32(a * x)


def _shift(x: Tensor, k: int) -> Tensor:
    """x_{t-k} (0 where t < k; those positions are overridden by the caller)."""
    out = torch.zeros_like(x)
    if x.shape[0] > k:
        out[k:] = x[:-k]
    return out


def bigram_half(ngram_rows: int) -> int:
    """H, the number of bigram rows (the first half of the table)."""
    check_ngram_rows(ngram_rows)
    return ngram_rows // 2


def check_ngram_rows(ngram_rows: int) -> None:
    """Raise a clear error unless ``ngram_rows`` is a usable table size."""
    if ngram_rows < 4 or ngram_rows % 2:
        raise ValueError(
            f"model.gpt.ngram_rows={ngram_rows}: the table needs an even number of rows >= 4 "
            f"(bigram half + trigram half; the record uses {RECORD_NGRAM_ROWS:,}); use 0 to switch it off"
        )


def ngram_row_ids(input_ids: Tensor, ngram_rows: int) -> Tensor:
    """Table rows of every token's bigram and trigram, ``[2, T]`` int64.

    Row 0 of the result is the bigram row ``((36313·x_t) ^ (27191·x_{t-1})) mod M`` with
    ``M = H - 1`` and the reserved row ``M`` at t = 0; row 1 is the trigram row
    ``H + (((17351·x_t) ^ (60961·x_{t-1}) ^ (45259·x_{t-2})) mod M)`` with the reserved
    row ``ngram_rows - 1`` for t < 2 (RECORD §3). Arithmetic is int32 with wrap-around
    and the modulo is a floor modulo (non-negative). ``input_ids`` is the packed
    sequence [T]; hashes cross document boundaries.
    """
    h = bigram_half(ngram_rows)
    m = h - 1
    x = input_ids.reshape(-1).long()
    x1, x2 = _shift(x, 1), _shift(x, 2)
    big = torch.remainder(_mul32(BIGRAM_MUL_CUR, x) ^ _mul32(BIGRAM_MUL_PREV, x1), m)
    tri = h + torch.remainder(
        _mul32(TRIGRAM_MUL_CUR, x) ^ _mul32(TRIGRAM_MUL_PREV, x1) ^ _mul32(TRIGRAM_MUL_PREV2, x2), m
    )
    # fill_ with a Python number: item assignment would copy a host scalar to the device each call
    big[:1].fill_(m)
    tri[:2].fill_(ngram_rows - 1)
    return torch.stack([big, tri])


def ngram_sign_rows(input_ids: Tensor) -> Tensor:
    """Rows of the sign table for every token's bigram and trigram, ``[2, T]`` int64.

    Bigram: ``((30011·x_{t-1}) ^ (48271·x_t)) & 8191``, 0 at t = 0; trigram:
    ``((26801·x_{t-2}) ^ (39779·x_{t-1}) ^ (58699·x_t)) & 8191``, 0 for t < 2 (RECORD §3).
    """
    x = input_ids.reshape(-1).long()
    x1, x2 = _shift(x, 1), _shift(x, 2)
    mask = SIGN_ROWS - 1
    big = (_mul32(SIGN_BIGRAM_MUL_PREV, x1) ^ _mul32(SIGN_BIGRAM_MUL_CUR, x)) & mask
    tri = (_mul32(SIGN_TRIGRAM_MUL_PREV2, x2) ^ _mul32(SIGN_TRIGRAM_MUL_PREV, x1)
           ^ _mul32(SIGN_TRIGRAM_MUL_CUR, x)) & mask
    big[:1].fill_(0)
    tri[:2].fill_(0)
    return torch.stack([big, tri])


def resolve_hash_backend(backend: str, device: torch.device | str) -> str:
    """``reference`` or ``triton`` for the n-gram hashes (``model.backends.ngram``); raises for an
    impossible choice. ``auto`` is the Triton pass on a GPU (1.004x and 1.005x a stage-0 and a
    stage-1 step on an H100, BENCHMARKS.md) and PyTorch elsewhere."""
    return resolve_fast_on_gpu("ngram", backend, device, "the n-gram table is")


def ngram_hashes(input_ids: Tensor, ngram_rows: int, backend: str = "reference") -> tuple[Tensor, Tensor]:
    """``(ngram_row_ids(input_ids, ngram_rows), ngram_sign_rows(input_ids))``.

    ``backend="triton"`` computes all four hashes in one Triton pass
    (``nanogpt_pl.ops.triton.ngram_hash``) instead of the PyTorch functions above; ``auto``
    as :func:`resolve_hash_backend` resolves it for the ids' device.
    """
    if resolve_hash_backend(backend, input_ids.device) == "triton":
        from ..ops.triton.ngram_hash import ngram_hashes_triton

        return ngram_hashes_triton(input_ids, ngram_rows)
    return ngram_row_ids(input_ids, ngram_rows), ngram_sign_rows(input_ids)


def make_sign_table(dim: int, rows: int = SIGN_ROWS, seed: int = SIGN_TABLE_SEED) -> Tensor:
    """The fixed ±1 table ``[rows, dim]`` (fp32), the same on every rank and run."""
    gen = torch.Generator().manual_seed(seed)
    return torch.where(torch.rand(rows, dim, generator=gen) < 0.5, -1.0, 1.0)


def compact_rows(row_ids: Tensor, pad_to: Optional[int] = None) -> tuple[Tensor, Tensor]:
    """Sorted unique rows of ``row_ids`` and the position of every id among them.

    Returns ``(unique [U], index shaped like row_ids)``. ``pad_to`` only checks that the
    caller's padded leaf (see :func:`padded_leaf`) can hold ``U`` rows.
    """
    unique, inverse = torch.unique(row_ids.reshape(-1), sorted=True, return_inverse=True)
    if pad_to is not None and unique.numel() > pad_to:
        raise ValueError(f"{unique.numel()} unique rows do not fit the padded buffer of {pad_to} rows")
    return unique, inverse.view(row_ids.shape)


def padded_leaf(values: Tensor, pad_to: Optional[int] = None, dtype: torch.dtype = torch.float32) -> Tensor:
    """``values`` [U, D] as a fresh leaf that requires grad, optionally zero-padded to ``pad_to`` rows.

    Padding keeps the leaf's shape fixed across steps (``torch.compile`` and CUDA graphs
    then see one shape); padded rows are never indexed, so their gradient is zero.
    """
    values = values.detach().to(dtype)
    if pad_to is not None and pad_to > values.shape[-2]:
        pad = values.new_zeros(*values.shape[:-2], pad_to - values.shape[-2], values.shape[-1])
        values = torch.cat([values, pad], dim=-2)
    return values.contiguous().requires_grad_(True)


def gather_rows_(out: Tensor, table: Tensor, ids: Tensor, limit: int, fused: Optional[bool] = None) -> Tensor:
    """``out[i] = table[ids[i]]`` for ``0 <= ids[i] < limit`` and 0 for the padding, in ``out``'s dtype.

    The fixed exchange's leaves are gathered this way (padded id lists, fp32 leaves). On a GPU
    one Triton pass does it (``nanogpt_pl.ops.triton.gather_rows``); ``fused=False`` (or a
    device the kernel cannot run on) takes this PyTorch reference.
    """
    from ..ops.triton import triton_usable

    if fused is not False and triton_usable(out.device) and table.stride(-1) == 1 and out.stride(-1) == 1:
        from ..ops.triton.gather_rows import gather_rows_triton_

        return gather_rows_triton_(out, table, ids, limit)
    real = ((ids >= 0) & (ids < limit)).unsqueeze(-1)
    rows = table.index_select(0, ids.clamp(min=0, max=limit - 1))
    return out.copy_(torch.where(real, rows, torch.zeros((), dtype=rows.dtype, device=rows.device)))


@dataclass
class NgramInput:
    """The n-gram rows one micro-batch reads (built by the caller; see the module docstring).

    Attributes:
        values: compact table rows ``[U (+ padding), D]``, a leaf requiring grad when training.
        index: ``[2, T]`` position in ``values`` of each token's bigram (row 0) and trigram (row 1) row.
        sign_rows: ``[2, T]`` rows of the sign table for the bigram and trigram.
        rows: ``[U]`` the global table rows of ``values[:U]``, sorted (for the exchange; unused by the model).
    """

    values: Tensor
    index: Tensor
    sign_rows: Tensor
    rows: Optional[Tensor] = None

    @property
    def num_unique(self) -> int:
        return self.values.shape[0] if self.rows is None else self.rows.numel()


@dataclass
class CompactRows:
    """Value-embedding rows of one micro-batch: every plane read at the batch's unique token ids.

    Attributes:
        values: ``[planes, U (+ padding), D]``, a leaf requiring grad when training.
        index: ``[T]`` position of each token's id among the unique ids.
        ids: ``[U]`` the unique token ids, sorted.
    """

    values: Tensor
    index: Tensor
    ids: Optional[Tensor] = None


def prepare_ngram_input(input_ids: Tensor, ngram_rows: int) -> tuple[Tensor, Tensor, Tensor]:
    """Host-side preparation of a micro-batch: ``(unique_rows [U], index [2, T], sign_rows [2, T])``."""
    rows = ngram_row_ids(input_ids, ngram_rows)
    unique, index = compact_rows(rows)
    return unique, index, ngram_sign_rows(input_ids)


def compact_value_rows(tables: list[Tensor], input_ids: Tensor, pad_to: Optional[int] = None,
                       dtype: torch.dtype = torch.float32) -> CompactRows:
    """Gather the unique token ids of ``input_ids`` from every value-embedding table as one leaf."""
    ids, index = compact_rows(input_ids.long(), pad_to)
    values = torch.stack([t.detach()[ids] for t in tables]) if tables else None
    return CompactRows(values=padded_leaf(values, pad_to, dtype), index=index, ids=ids)


def resolve_value_rows_backend(backend: str, device: torch.device | str) -> str:
    """``reference`` or ``triton`` for the value planes' gather gradient (``model.backends.value_rows``);
    raises for an unknown choice or a ``triton`` the device cannot run. ``auto`` is the sorted sums
    on a GPU (1.004-1.009x a stage-2 step and 1.008x a stage-1 step on an H100, BENCHMARKS.md)."""
    return resolve_fast_on_gpu("value_rows", backend, device, "the value rows are")


class _GatherPlanes(torch.autograd.Function):
    """``values[p, index]`` in ``dtype`` for every plane, whose backward is the sorted segment sum."""

    @staticmethod
    def forward(ctx, values: Tensor, index: Tensor, dtype: torch.dtype) -> tuple[Tensor, ...]:
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(index)
        ctx.rows, ctx.leaf_dtype = values.shape[1], values.dtype
        return tuple(values[p][index].to(dtype) for p in range(values.shape[0]))

    @staticmethod
    def backward(ctx, *grads: Optional[Tensor]):
        from ..ops.triton.row_sum import sorted_row_sum

        (index,) = ctx.saved_tensors
        if all(g is None for g in grads):
            return None, None, None
        return sorted_row_sum(list(grads), index, ctx.rows, ctx.leaf_dtype), None, None


def gather_planes(values: Tensor, index: Tensor, dtype: torch.dtype, backend: str = "auto") -> tuple[Tensor, ...]:
    """Every plane of a micro-batch's value leaf ``[P, U, D]`` at the tokens' rows: ``P`` tensors ``[T, D]``.

    ``reference`` gathers all planes at once; autograd's backward scatters ``P·T`` rows into the
    leaf's gradient with one atomic add per element. ``triton`` (``model.backends.value_rows``)
    gives the same values and sums the gradient per row after sorting the tokens by row
    (``nanogpt_pl.ops.triton.row_sum``): one atomic per run of equal rows in a chunk of 64.
    """
    if values.requires_grad and resolve_value_rows_backend(backend, values.device) == "triton":
        return _GatherPlanes.apply(values, index, dtype)
    planes = values[:, index].to(dtype)
    return tuple(planes[p] for p in range(planes.shape[0]))


def resolve_ngram_rows_backend(backend: str, device: torch.device | str) -> str:
    """``reference`` or ``triton`` for the n-gram leaf's gradient (``model.backends.ngram_rows``);
    raises for an unknown choice or a ``triton`` the device cannot run."""
    return resolve_opt_in("ngram_rows", backend, device, "the n-gram rows are")


def _signed_ngram_rows(values: Tensor, index: Tensor, sign_rows: Tensor, signs: Tensor, dtype: torch.dtype) -> Tensor:
    rows = F.embedding(index, values.float())  # [2, T, D]
    return (rows * F.embedding(sign_rows, signs.float())).sum(0).to(dtype)


class _SignedNgramRows(torch.autograd.Function):
    """:func:`_signed_ngram_rows`, whose leaf gradient is summed per row and stored once (Triton)."""

    @staticmethod
    def forward(ctx, values: Tensor, index: Tensor, sign_rows: Tensor, signs: Tensor, dtype: torch.dtype) -> Tensor:
        ctx.save_for_backward(index, sign_rows, signs)
        ctx.rows, ctx.leaf_dtype = values.shape[0], values.dtype
        return _signed_ngram_rows(values, index, sign_rows, signs, dtype)

    @staticmethod
    def backward(ctx, grad: Tensor):
        from ..ops.triton.ngram_grad import ngram_grad

        index, sign_rows, signs = ctx.saved_tensors
        return ngram_grad(grad, index, sign_rows, signs, ctx.rows).to(ctx.leaf_dtype), None, None, None, None


class HashedNgramEmbedding(nn.Module):
    """x0_ngram from the compact rows a micro-batch needs (no parameters of its own).

    The table lives outside the model (sharded over ranks); this module holds only the
    fixed sign table as a buffer. Output is summed in fp32 and returned in ``dtype``.

    Args:
        dim: row width (the model dim).
        backend: the leaf gradient's path (``model.backends.ngram_rows``): ``auto`` and
            ``reference`` are autograd's (a zero fill and an atomic add per element), ``triton``
            sums each row's terms after sorting and stores every row once
            (``nanogpt_pl.ops.triton.ngram_grad``). The forward is the same either way.
    """

    def __init__(self, dim: int, backend: str = "auto") -> None:
        super().__init__()
        check_opt_in("ngram_rows", backend)
        self.dim = dim
        self.backend = backend
        self.register_buffer("signs", make_sign_table(dim))

    def forward(self, ngram: NgramInput, dtype: torch.dtype) -> Tensor:
        values = ngram.values
        if values.shape[-1] != self.dim:
            raise ValueError(f"n-gram rows have width {values.shape[-1]}, the model expects {self.dim}")
        if values.requires_grad and resolve_ngram_rows_backend(self.backend, values.device) == "triton":
            return _SignedNgramRows.apply(values, ngram.index, ngram.sign_rows, self.signs, dtype)
        return _signed_ngram_rows(values, ngram.index, ngram.sign_rows, self.signs, dtype)


def dense_ngram_reference(table: Tensor, input_ids: Tensor, signs: Tensor) -> Tensor:
    """x0_ngram read straight from a full table (tests and tiny tables): W[b]⊙S[si] + W[c]⊙S[ss]."""
    rows = ngram_row_ids(input_ids, table.shape[0])
    sr = ngram_sign_rows(input_ids)
    out = table[rows[0]].float() * signs[sr[0]].float() + table[rows[1]].float() * signs[sr[1]].float()
    return out
