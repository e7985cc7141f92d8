"""The n-gram channel on a CUDA device at the record's batch shape, against a float64 CPU reference."""

from __future__ import annotations

import math

import pytest
import torch

from nanogpt_pl.distributed.ngram_shard import NgramShard
from nanogpt_pl.distributed.value_embed_shard import ValueEmbedShard
from nanogpt_pl.model.embeddings import HashedNgramEmbedding

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

T, DIM, ROWS, VOCAB = 49_152, 768, 1 << 22, 50_304  # RECORD §9 tokens per rank, §2 width; a 6 GiB table
CHUNK = 1 << 20  # rows per comparison: the tests fit an 80 GB card


@pytest.mark.parametrize("seed", [0, 1])
def test_cuda_step_matches_float64_reference(seed):
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(seed)
    shard = NgramShard(ROWS, DIM, device=dev)
    assert shard.weight.dtype == torch.bfloat16
    shard.weight.normal_(0.0, 0.02, generator=gen)
    embed = HashedNgramEmbedding(DIM).to(dev)
    ids = torch.randint(0, VOCAB, (T,), device=dev, generator=gen, dtype=torch.int32)
    w = torch.randn(DIM, device=dev, generator=gen)

    inp = shard.prepare(ids)
    out = embed(inp, torch.float32)
    assert inp.values.dtype == torch.float32
    assert torch.equal(embed(inp, torch.bfloat16), out.bfloat16())  # the model-dtype output is one rounding
    (out @ w).sin().sum().backward()

    # float64 reference of the forward and of the compact gradient, from the same pulled rows
    values = inp.values.detach().double().cpu().requires_grad_()
    signs = embed.signs.double().cpu()
    index, sign_rows = inp.index.cpu(), inp.sign_rows.cpu()
    ref = values[index[0]] * signs[sign_rows[0]] + values[index[1]] * signs[sign_rows[1]]
    torch.testing.assert_close(out.double().cpu(), ref.detach(), rtol=1e-5, atol=1e-7)
    (ref @ w.double().cpu()).sin().sum().backward()
    torch.testing.assert_close(inp.values.grad.double().cpu(), values.grad, rtol=1e-4, atol=1e-5)

    before = shard.weight.clone()
    shard.push(inp.rows, inp.values.grad)
    lr, beta2, wd = 0.008 * 70, 0.95, 0.005 * 5
    shard.step(lr=lr, betas=(0.0, beta2), eps=1e-10, weight_decay=wd)

    # first event: v = (1-β₂)·mean(g²), u = g/(√v+ε)·lr·√(1-β₂), cautious decay lr²·wd
    g, p = values.grad, values.detach()
    v = (1 - beta2) * g.square().mean(-1)
    u = g / (v.sqrt() + 1e-10)[:, None] * (lr * math.sqrt(1 - beta2))
    u = u + torch.where(u * p > 0, p * lr * lr * wd, torch.zeros_like(p))
    expected = p - u
    got = shard.weight[inp.rows].double().cpu()
    torch.testing.assert_close(got, expected, rtol=1e-2, atol=2e-3)  # bf16 storage of the result
    untouched = torch.ones(ROWS, dtype=torch.bool, device=dev)
    untouched[inp.rows] = False
    for a in range(0, ROWS, CHUNK):  # no table-sized masked copies on the GPU
        keep = untouched[a:a + CHUNK]
        assert torch.equal(shard.weight[a:a + CHUNK][keep], before[a:a + CHUNK][keep])
    assert int(shard.adam.last_event[inp.rows].min()) == 1 and int(shard.adam.last_event[untouched].max()) == 0


def test_cuda_value_embedding_channel_matches_cpu():
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(3)
    init = [(torch.randn(VOCAB, DIM, device=dev, generator=gen) * 0.01).bfloat16() for _ in range(4)]
    ids = torch.randint(0, VOCAB, (T,), device=dev, generator=gen)
    w = torch.randn(DIM, device=dev, generator=gen)
    results = []
    for device in (dev, torch.device("cpu")):
        planes = [torch.nn.Parameter(p.to(device).float() if device.type == "cpu" else p.clone()) for p in init]
        channel = ValueEmbedShard(planes)
        # one event: both devices start from the same values, so only summation order and the
        # bf16 storage of the CUDA result differ
        rows = channel.prepare(ids.to(device))
        x = torch.nn.functional.embedding(rows.index, rows.values.sum(0))
        (x @ w.to(device)).square().sum().backward()
        channel.push(rows.ids, rows.values.grad)
        channel.step(lr=0.56, betas=(0.75, 0.95), eps=1e-10, weight_decay=0.025)
        assert all(p.grad is None for p in planes)  # only compact gradients, never a dense [vocab, D] one
        results.append([p.detach().float().cpu() for p in planes])
    for got, want, start in zip(*results, init):
        assert not torch.equal(got, start.float().cpu())
        # the CUDA tables are bf16 (one rounding per update), the CPU reference fp32
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-3)


def test_cuda_fixed_exchange_never_waits_on_the_device():
    """The fixed exchange at the record's batch shape under CUDA's sync debug mode set to 'error'.

    Only the exchange calls (channel inputs, gradient hand-back, the event) run under the
    check; the model's own backward (the embedding backward reads a segment count) does not.
    The result matches the reference exchange (bf16 storage, atomics: not bit for bit).
    """
    from nanogpt_pl.distributed.sparse_channels import SparseChannels
    from nanogpt_pl.optim.sparse_adam import SparseAdam

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(5)
    table = torch.randn(ROWS, DIM, device=dev, generator=gen, dtype=torch.bfloat16).mul_(0.02)
    planes0 = [(torch.randn(VOCAB, DIM, device=dev, generator=gen) * 0.01).bfloat16() for _ in range(2)]
    batches = [torch.randint(0, VOCAB, (T,), device=dev, generator=gen) for _ in range(2)]
    w = torch.randn(DIM, device=dev, generator=gen)
    embed = HashedNgramEmbedding(DIM).to(dev)
    results = {}
    for exchange in ("reference", "fixed"):
        shard = NgramShard(ROWS, DIM, device=dev, exchange=exchange)
        shard.weight.copy_(table)
        planes = [torch.nn.Parameter(p.clone()) for p in planes0]
        channels = SparseChannels(shard, ValueEmbedShard(planes, exchange=exchange), fixed_shapes=exchange == "fixed")
        opt = SparseAdam(channels.channels())
        for step, ids in enumerate(batches):
            torch.cuda.synchronize()
            if exchange == "fixed":
                torch.cuda.set_sync_debug_mode("error")
            try:
                inputs = channels.inputs(ids, train=True)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            ve = inputs["value_rows"]
            x = embed(inputs["ngram"], torch.float32) + torch.nn.functional.embedding(ve.index, ve.values.sum(0))
            (x @ w).sin().sum().backward()
            torch.cuda.synchronize()
            if exchange == "fixed":
                torch.cuda.set_sync_debug_mode("error")
            try:
                channels.push_grads(inputs)
                if step == len(batches) - 1:
                    opt.step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        results[exchange] = (shard.weight.detach().clone(), [p.detach().float() for p in planes])
        del shard, channels, opt, inputs
    (ref_table, ref_planes), (fix_table, fix_planes) = results["reference"], results["fixed"]
    assert not torch.equal(ref_table, table)
    for a in range(0, ROWS, CHUNK):
        torch.testing.assert_close(fix_table[a:a + CHUNK].float(), ref_table[a:a + CHUNK].float(), rtol=2e-2,
                                   atol=2e-3)
    for got, want in zip(fix_planes, ref_planes):
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-3)
