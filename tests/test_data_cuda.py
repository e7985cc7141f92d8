"""GPU side of the data path: pinned batches and their asynchronous copy (skipped without CUDA)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from data_fixtures import random_documents, small_schedule, write_random_shards

from nanogpt_pl.data.shards import write_shard
from nanogpt_pl.data.stream import TrainStream, iter_steps
from nanogpt_pl.data.validation import ValidationSet

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("seed", [0, 1])
def test_pinned_batches_copy_to_gpu(tmp_path, seed):
    # the record's stage-2 shapes per rank: T = 49,152 with the 3072 cap and 2560 attention split
    T = 49_152
    sched = small_schedule([(6, 2 * T, T, 3072)], attention_cap=2560)
    paths = write_random_shards(tmp_path, seed, n_shards=1, docs_per_shard=800, mean_len=1100)
    stream = TrainStream([str(p) for p in paths], sched)  # pins by default when CUDA is available
    try:
        steps = iter_steps(stream, 6)
    finally:
        stream.close()
    stream_copy = torch.cuda.Stream()
    for item in steps:
        for mb in item:
            for key in ("inputs", "targets", "cu_seqlens"):
                assert mb[key].is_pinned()
            with torch.cuda.stream(stream_copy):
                gpu = {k: v.to("cuda", non_blocking=True) for k, v in mb.items() if torch.is_tensor(v)}
            stream_copy.synchronize()
            for k, v in gpu.items():
                assert v.is_cuda and torch.equal(v.cpu(), mb[k])
            seg = torch.diff(gpu["cu_seqlens"].long())
            assert int(seg.max()) == mb["max_seqlen"] <= 2560


def test_validation_batches_pinned(tmp_path):
    rng = np.random.default_rng(3)
    path = write_shard(tmp_path / "v_val_000000.bin", np.concatenate(random_documents(rng, 300, 900)))
    vs = ValidationSet(str(path), 2 * 65_536, 65_536, world_size=2, rank=1)
    for b in vs:
        assert b["inputs"].is_pinned() and b["targets"].is_pinned()
        g = b["inputs"].to("cuda", non_blocking=True)
        torch.cuda.synchronize()
        assert torch.equal(g.cpu(), b["inputs"])
