"""The n-gram channel's four hashes of a micro-batch in one Triton pass.

``nanogpt_pl.model.embeddings`` computes every token's bigram and trigram table row and its
two sign rows (RECORD §3) with PyTorch: 32-bit wrap-around products, XORs, a floor modulo
and the reserved rows at the sequence start, about sixty elementwise kernels a micro-batch
on tensors of a few ten thousand tokens, each too small to fill the GPU. Here one program
reads a block of tokens (and the two before it) once and writes the four hashes, with the
same integer arithmetic: the products are exact in int64 and wrap to int32 by truncation,
the XORs run on the wrapped values, and the modulo is made non-negative as torch's
``remainder`` does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from nanogpt_pl.model.embeddings import (
    BIGRAM_MUL_CUR,
    BIGRAM_MUL_PREV,
    SIGN_BIGRAM_MUL_CUR,
    SIGN_BIGRAM_MUL_PREV,
    SIGN_ROWS,
    SIGN_TRIGRAM_MUL_CUR,
    SIGN_TRIGRAM_MUL_PREV,
    SIGN_TRIGRAM_MUL_PREV2,
    TRIGRAM_MUL_CUR,
    TRIGRAM_MUL_PREV,
    TRIGRAM_MUL_PREV2,
    bigram_half,
)
from nanogpt_pl.ops.triton import interpret_mode

_BLOCK = 64 if interpret_mode() else 1024


@triton.jit
def _wrap(a, x):
    """``a·x`` wrapped to int32 (two's complement), as int64."""
    return (x * a).to(tl.int32).to(tl.int64)


@triton.jit
def _floor_mod(v, m):
    r = v % m  # C remainder: the sign of v
    return tl.where(r < 0, r + m, r)


@triton.jit
def _ngram_hash_kernel(x_ptr, rows_ptr, signs_ptr, n, half, modulus, last_row,
                       B_CUR: tl.constexpr, B_PREV: tl.constexpr,
                       T_CUR: tl.constexpr, T_PREV: tl.constexpr, T_PREV2: tl.constexpr,
                       SB_PREV: tl.constexpr, SB_CUR: tl.constexpr,
                       ST_PREV2: tl.constexpr, ST_PREV: tl.constexpr, ST_CUR: tl.constexpr,
                       SIGN_MASK: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = t < n
    x = tl.load(x_ptr + t, mask=inside, other=0).to(tl.int64)
    x1 = tl.load(x_ptr + t - 1, mask=inside & (t >= 1), other=0).to(tl.int64)
    x2 = tl.load(x_ptr + t - 2, mask=inside & (t >= 2), other=0).to(tl.int64)
    big = _floor_mod(_wrap(B_CUR, x) ^ _wrap(B_PREV, x1), modulus)
    tri = half + _floor_mod(_wrap(T_CUR, x) ^ _wrap(T_PREV, x1) ^ _wrap(T_PREV2, x2), modulus)
    big = tl.where(t < 1, modulus, big)  # reserved rows at the start of the packed sequence
    tri = tl.where(t < 2, last_row, tri)
    sbig = (_wrap(SB_PREV, x1) ^ _wrap(SB_CUR, x)) & SIGN_MASK
    stri = (_wrap(ST_PREV2, x2) ^ _wrap(ST_PREV, x1) ^ _wrap(ST_CUR, x)) & SIGN_MASK
    sbig = tl.where(t < 1, 0, sbig)
    stri = tl.where(t < 2, 0, stri)
    tl.store(rows_ptr + t, big, mask=inside)
    tl.store(rows_ptr + n + t, tri, mask=inside)
    tl.store(signs_ptr + t, sbig, mask=inside)
    tl.store(signs_ptr + n + t, stri, mask=inside)


def ngram_hashes_triton(input_ids: Tensor, ngram_rows: int) -> tuple[Tensor, Tensor]:
    """(table rows ``[2, T]``, sign rows ``[2, T]``), int64, of the packed sequence ``input_ids``.

    Equal to ``(ngram_row_ids(input_ids, ngram_rows), ngram_sign_rows(input_ids))``.
    """
    x = input_ids.reshape(-1)
    if x.dtype.is_floating_point or x.dtype == torch.bool:
        raise ValueError(f"ngram hashes: token ids must be integers, got {x.dtype}")
    x = x.contiguous()
    n = x.numel()
    h = bigram_half(ngram_rows)
    rows = torch.empty(2, n, dtype=torch.int64, device=x.device)
    signs = torch.empty(2, n, dtype=torch.int64, device=x.device)
    if n:
        _ngram_hash_kernel[(triton.cdiv(n, _BLOCK),)](
            x, rows, signs, n, h, h - 1, ngram_rows - 1,
            B_CUR=BIGRAM_MUL_CUR, B_PREV=BIGRAM_MUL_PREV,
            T_CUR=TRIGRAM_MUL_CUR, T_PREV=TRIGRAM_MUL_PREV, T_PREV2=TRIGRAM_MUL_PREV2,
            SB_PREV=SIGN_BIGRAM_MUL_PREV, SB_CUR=SIGN_BIGRAM_MUL_CUR,
            ST_PREV2=SIGN_TRIGRAM_MUL_PREV2, ST_PREV=SIGN_TRIGRAM_MUL_PREV, ST_CUR=SIGN_TRIGRAM_MUL_CUR,
            SIGN_MASK=SIGN_ROWS - 1, BLOCK=_BLOCK, num_warps=4,
        )
    return rows, signs
