"""Validation metrics (torchmetrics) reduced over 2 gloo ranks with uneven batches equal a direct computation."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from gloo_group import init_gloo, leave, spawn_ranks, store_path

from nanogpt_pl.metrics import BitsPerByte, MeanTokenLoss, token_byte_lengths
from nanogpt_pl.ops.cross_entropy import softcap

VOCAB, DIM, EOT = 96, 16, 95
# tokens per validation batch on each rank: uneven within and across ranks
BATCHES = {0: [37, 5, 64], 1: [11]}
CHECKS = 4


def batch(rank: int, index: int, seed: int):
    g = torch.Generator().manual_seed(seed * 1000 + rank * 10 + index)
    n = BATCHES[rank][index]
    targets = torch.randint(0, VOCAB, (n,), generator=g)
    targets[:: 4] = EOT  # byte-less document separators among the targets
    return torch.randn(n, DIM, generator=g), targets


def tables(seed: int):
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(VOCAB, DIM, generator=g)
    token_bytes = torch.randint(1, 7, (VOCAB,), generator=g)
    token_bytes[EOT] = 0
    return weight, token_bytes


def direct(seed: int) -> tuple[float, float]:
    """Every token of every rank at once, in float64."""
    weight, token_bytes = tables(seed)
    hidden, targets = zip(*(batch(r, i, seed) for r in BATCHES for i in range(len(BATCHES[r]))))
    hidden, targets = torch.cat(hidden).double(), torch.cat(targets)
    nats = F.cross_entropy(softcap(hidden @ weight.double().t()), targets, reduction="none")
    text = token_bytes[targets] > 0
    return float(nats.mean()), float(nats[text].sum() / (math.log(2) * token_bytes[targets].sum()))


def _worker(rank: int, world: int, store: str, out: str, seed: int) -> None:
    from nanogpt_pl.ops.cross_entropy import full_cross_entropy

    init_gloo(rank, world, store)
    torch.set_num_threads(1)
    weight, token_bytes = tables(seed)
    loss_metric, bpb_metric = MeanTokenLoss(), BitsPerByte(token_bytes)
    for i in range(len(BATCHES[rank])):
        hidden, targets = batch(rank, i, seed)
        loss = full_cross_entropy(hidden, weight, targets)
        loss_metric.update(loss, targets.numel())
        bpb_metric.update_from_loss(hidden, weight, targets, loss)
    loss, bpb = float(loss_metric.compute()), float(bpb_metric.compute())
    want_loss, want_bpb = direct(seed)
    passed = 0
    assert abs(loss - want_loss) < 1e-5 * want_loss, (rank, loss, want_loss)
    passed += 1
    assert abs(bpb - want_bpb) < 1e-5 * want_bpb, (rank, bpb, want_bpb)
    passed += 1
    # the mean of per-batch means (what logging a loss per batch and averaging gives) is not the answer here
    means = [float(full_cross_entropy(*batch(r, i, seed)[:1], weight, batch(r, i, seed)[1]))
             for r in BATCHES for i in range(len(BATCHES[r]))]
    assert abs(sum(means) / len(means) - want_loss) > 1e-3, means
    passed += 1
    loss_metric.reset()
    assert loss_metric.tokens == 0
    passed += 1
    Path(out, f"rank{rank}.txt").write_text(str(passed))
    dist.barrier()  # no rank tears the group down while a peer still talks to it (gloo aborts)
    dist.destroy_process_group()
    leave()


@pytest.mark.slow
def test_two_ranks_with_uneven_batches_equal_one_direct_computation(tmp_path):
    seed = int(torch.randint(0, 10**6, ()).item())  # fresh inputs each run
    spawn_ranks(_worker, (2, store_path(tmp_path), str(tmp_path), seed), 2)
    assert [int((tmp_path / f"rank{r}.txt").read_text()) for r in range(2)] == [CHECKS, CHECKS], seed


def test_bits_per_byte_of_gpt2_tokens():
    from nanogpt_pl.data.tokenizer import get_encoding

    enc = get_encoding()
    table = token_byte_lengths(50304, enc)
    ids = enc.encode("héllo, wörld")
    assert int(table[ids].sum()) == len("héllo, wörld".encode())
    assert table[50256] == 0 and int(table[50257:].sum()) == 0
    # a uniform guess over 256 byte values per byte is 8 bits per byte
    metric = BitsPerByte(table)
    metric.update(torch.tensor(10 * 8 * math.log(2)), torch.tensor(10))
    assert float(metric.compute()) == 8.0
