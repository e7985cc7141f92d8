"""Asynchronous checkpoint saves (SpeedrunStrategy(async_checkpoint=True)): exact resume, crash safety, last.

The n-gram table is forced into side files at one rank (``INLINE_STATE_LIMIT_BYTES = 0``),
as a record-size shard always is, so every test goes through the background side-file write.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from nanogpt_pl.distributed.async_checkpoint import AsyncCheckpointWriter, HostSnapshot
from nanogpt_pl.distributed.side_files import (
    RANK_LOCAL_KEY,
    check_complete,
    load_rank_local,
    rank_file,
    side_file_marker,
    write_side_file,
)
from nanogpt_pl.distributed.strategy import SpeedrunStrategy

sys.path.insert(0, str(Path(__file__).parent))
ROOT = Path(__file__).resolve().parents[1]
ROWS = 1 << 14


@pytest.fixture(scope="module")
def toy_files(tmp_path_factory):
    from train_helpers import write_markov_shards

    return write_markov_shards(tmp_path_factory.mktemp("toy"), n_train=150_000, n_val=20_000)


def ngram_run(files, steps: int):
    from train_helpers import make_run, tiny_gpt, tiny_schedule

    # sparse events every step until step 2, then every 2nd step (3, 5); a checkpoint after step 3
    # (global_step 3) holds step 2's queued gradient
    sched = tiny_schedule(steps, adam_every=1, sparse_cadence=2, sparse_cadence_start=2)
    return make_run(files, sched, gpt=tiny_gpt(ngram_rows=ROWS, ngram_layers=[1]), val_tokens=2048)


def sparse_state(module) -> dict[str, torch.Tensor]:
    ngram = module.sparse_channels.ngram
    ve = module.sparse_channels.value_embeds
    return {"table": ngram.weight.clone(), "v": ngram.adam.v.clone(), "last_event": ngram.adam.last_event.clone(),
            "ve_exp_avg": ve.adam.exp_avg.clone(), "ve_exp_avg_sq": ve.adam.exp_avg_sq.clone()}


def model_tensors(module) -> dict[str, torch.Tensor]:
    return {f"model.{k}": v.clone() for k, v in module.model.state_dict().items() if isinstance(v, torch.Tensor)}


def assert_same_run(got: dict, want: dict) -> int:
    """Bit-for-bit equality of two runs' final states; the number of tensors compared."""
    n = 0
    for name, value in want.items():
        assert torch.equal(got[name], value), name
        n += 1
    return n


@pytest.mark.slow
def test_resume_from_an_async_checkpoint_is_bit_exact(toy_files, tmp_path, monkeypatch):
    """6 straight steps == 3 steps, an async checkpoint mid-cycle, and 3 resumed steps: losses, weights,
    table, row Adam state and value-embedding Adam state bit for bit."""
    from lightning.pytorch.callbacks import ModelCheckpoint
    from train_helpers import LossRecorder, make_trainer

    import nanogpt_pl.distributed.side_files as side_files

    monkeypatch.setattr(side_files, "INLINE_STATE_LIMIT_BYTES", 0)
    import nanogpt_pl.distributed.strategy as strategy_module

    monkeypatch.setattr(strategy_module, "INLINE_STATE_LIMIT_BYTES", 0)

    module, data = ngram_run(toy_files, 6)
    straight = LossRecorder()
    make_trainer(tmp_path / "straight", callbacks=[straight]).fit(module, data)
    want = {**sparse_state(module), **model_tensors(module)}

    module, data = ngram_run(toy_files, 6)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=3, save_top_k=-1, save_last=True)
    first = make_trainer(tmp_path / "first", max_steps=3, callbacks=[ckpt], enable_checkpointing=True,
                         strategy=SpeedrunStrategy(async_checkpoint=True))
    first.fit(module, data)
    assert module.sparse_channels.ngram.pending_rows() > 0  # mid-cycle: a queued gradient is in the checkpoint
    saved = tmp_path / "ckpt" / "epoch=0-step=3.ckpt"
    assert saved.exists() and Path(rank_file(saved, 0)).exists()
    last = tmp_path / "ckpt" / "last.ckpt"
    assert last.is_symlink() and os.path.realpath(last) == os.path.realpath(saved)  # a link, not a second copy
    main = torch.load(saved, weights_only=False)
    assert main[RANK_LOCAL_KEY]["side_files"] and main[RANK_LOCAL_KEY]["save_id"]

    module, data = ngram_run(toy_files, 6)
    second = LossRecorder()
    make_trainer(tmp_path / "second", callbacks=[second],
                 strategy=SpeedrunStrategy(async_checkpoint=True)).fit(module, data, ckpt_path=str(last))
    assert sorted(second.losses) == [3, 4, 5]
    for step in (3, 4, 5):
        assert second.losses[step] == straight.losses[step], step
    got = {**sparse_state(module), **model_tensors(module)}
    assert want["table"].abs().sum() > 0
    assert assert_same_run(got, want) == len(want)
