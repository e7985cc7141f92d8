"""Validation metrics as torchmetrics ``Metric`` s: the mean token loss and bits per byte.

Both keep sums (of nats, tokens, bytes) as states reduced with ``sum`` over ranks, so the
result is the token-weighted mean over every validation token of every rank, whatever
the batch sizes. With the record's equal batches (RECORD §12: 5 batches of 262,144 tokens
per rank) it equals the record's "per-rank mean, averaged over batches, then over ranks".

Bits per byte normalizes the loss by the UTF-8 bytes the targets stand for, which
makes runs comparable across tokenizers: ``bpb = Σ nats / (ln 2 · Σ bytes)`` over the
targets that are text. Targets without bytes (``<|endoftext|>``, the document separator)
are left out of both sums.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor
from torchmetrics import Metric

from .data.tokenizer import get_encoding, mergeable_ranks
from .ops.cross_entropy import full_cross_entropy


class MeanTokenLoss(Metric):
    """Token-weighted mean of per-batch mean losses: ``Σ loss_b·n_b / Σ n_b`` over batches and ranks."""

    full_state_update = False
    higher_is_better = False

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.add_state("nats", torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("tokens", torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, mean_loss: Tensor, tokens: int) -> None:
        self.nats += mean_loss.detach().double() * tokens
        self.tokens += tokens

    def compute(self) -> Tensor:
        return (self.nats / self.tokens).float()


def token_byte_lengths(vocab_size: int, encoding=None) -> Tensor:
    """UTF-8 bytes of every token id (0 for special and padded ids); GPT-2's tokenizer by default."""
    if encoding is None:
        encoding = get_encoding()
    table = torch.zeros(vocab_size, dtype=torch.int64)
    for b, i in mergeable_ranks(encoding).items():
        if i < vocab_size:
            table[i] = len(b)
    return table


class BitsPerByte(Metric):
    """Bits per UTF-8 byte of the validation targets.

    Args:
        token_bytes: bytes of each token id ``[vocab]``; default: read from GPT-2's tokenizer
            on first use.
    """

    full_state_update = False
    higher_is_better = False

    def __init__(self, token_bytes: Optional[Tensor] = None, **kwargs) -> None:
        super().__init__(**kwargs)
        self.token_bytes = token_bytes
        self.add_state("nats", torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("bytes", torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, nats: Tensor, num_bytes: Tensor) -> None:
        """Add the summed loss (nats) of the byte-bearing targets and their byte count."""
        self.nats += nats.detach().double()
        self.bytes += num_bytes.detach().double()

    def update_from_loss(self, hidden: Tensor, weight: Tensor, targets: Tensor, mean_loss: Tensor) -> None:
        """Update from a batch whose full-vocabulary mean loss is ``mean_loss``.

        Only the few byte-less targets get a second loss evaluation, which is subtracted.
        """
        if self.token_bytes is None:
            self.token_bytes = token_byte_lengths(weight.shape[0])
        table = self.token_bytes.to(targets.device)
        targets = targets.long()
        nbytes = table[targets]
        total = mean_loss.detach().double() * targets.numel()
        empty = nbytes == 0
        if empty.any():
            total = total - full_cross_entropy(hidden[empty], weight, targets[empty]).double() * empty.sum()
        self.update(total, nbytes.sum())

    def compute(self) -> Tensor:
        return (self.nats / (math.log(2) * self.bytes)).float()
