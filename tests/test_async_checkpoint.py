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


CRASH_CHILD = """
import os, signal, sys
sys.path.insert(0, {tests!r})
from lightning.pytorch.callbacks import ModelCheckpoint
from train_helpers import make_run, make_trainer, tiny_gpt, tiny_schedule

import nanogpt_pl.distributed.async_checkpoint as async_checkpoint
import nanogpt_pl.distributed.side_files as side_files
import nanogpt_pl.distributed.strategy as strategy

strategy.INLINE_STATE_LIMIT_BYTES = 0
saves = []


def write_then_die(state, filepath, rank, save_id):
    saves.append(filepath)
    if len(saves) < 2:
        return side_files.write_side_file(state, filepath, rank, save_id)
    # the second save: half a temporary file on disk, then the process is killed
    with open(side_files.rank_file(filepath, rank) + ".tmp", "wb") as f:
        f.write(b"\\0" * 4096)
        f.flush()
        os.kill(os.getpid(), signal.SIGKILL)


async_checkpoint.write_side_file = write_then_die
sched = tiny_schedule(6, adam_every=1, sparse_cadence=2, sparse_cadence_start=2)
module, data = make_run(({train!r}, {val!r}), sched, gpt=tiny_gpt(ngram_rows=1 << 14, ngram_layers=[1]),
                        val_tokens=2048)
ckpt = ModelCheckpoint(dirpath={ckpt_dir!r}, every_n_train_steps=2, save_top_k=1, save_last=True)
make_trainer({root!r}, callbacks=[ckpt], enable_checkpointing=True,
             strategy=strategy.SpeedrunStrategy(async_checkpoint=True)).fit(module, data)
"""


@pytest.mark.slow
def test_a_kill_during_the_background_write_leaves_no_complete_looking_checkpoint(toy_files, tmp_path, monkeypatch):
    """SIGKILL while the second save's side file is half written: the first checkpoint survives (its removal
    waits for the second save), ``last`` still points at it, and the broken one is named as incomplete."""
    from lightning.pytorch.callbacks import ModelCheckpoint
    from test_cli import LAUNCH_VARS
    from train_helpers import LossRecorder, make_trainer

    ckpt_dir = tmp_path / "ckpt"
    script = tmp_path / "child.py"
    script.write_text(CRASH_CHILD.format(tests=str(Path(__file__).parent), train=toy_files[0], val=toy_files[1],
                                         ckpt_dir=str(ckpt_dir), root=str(tmp_path / "run")))
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == -9, out.stderr[-3000:]  # killed, not finished
    good, broken = ckpt_dir / "epoch=0-step=2.ckpt", ckpt_dir / "epoch=0-step=4.ckpt"
    assert good.exists() and Path(rank_file(good, 0)).exists()
    assert not broken.exists() and Path(rank_file(broken, 0) + ".tmp").exists()
    assert os.path.realpath(ckpt_dir / "last.ckpt") == os.path.realpath(good)

    with pytest.raises(RuntimeError, match="incomplete") as err:
        check_complete(broken)
    assert str(broken) in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(RuntimeError, match="epoch=0-step=4.ckpt is incomplete"):
        SpeedrunStrategy().load_checkpoint(broken)

    # --ckpt_path last resumes from the complete checkpoint
    import nanogpt_pl.distributed.strategy as strategy_module

    monkeypatch.setattr(strategy_module, "INLINE_STATE_LIMIT_BYTES", 0)
    module, data = ngram_run(toy_files, 6)
    rec = LossRecorder()
    callback = ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=2, save_top_k=1, save_last=True)
    make_trainer(tmp_path / "resumed", callbacks=[rec, callback], enable_checkpointing=True,
                 strategy=SpeedrunStrategy(async_checkpoint=True)).fit(module, data, ckpt_path="last")
    assert sorted(rec.losses) == [2, 3, 4, 5]
    final = ckpt_dir / "epoch=0-step=6.ckpt"
    assert final.exists() and os.path.realpath(ckpt_dir / "last.ckpt") == os.path.realpath(final)
    assert not good.exists() and not Path(rank_file(good, 0)).exists()  # top-1: removed once step 6 was written
