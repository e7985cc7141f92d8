"""SpeedrunDataModule inside a real Lightning Trainer: data order, checkpointed stream state, resume."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
from data_fixtures import random_documents, small_schedule, write_random_shards
from seeds import fresh_seed

from nanogpt_pl.data.datamodule import SpeedrunDataModule
from nanogpt_pl.data.shards import ShardError, write_shard


class Recorder(L.LightningModule):
    """Trains one scalar on a function of the tokens and records what each step saw."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor(0.5))
        self.seen: list[tuple[int, int, int]] = []
        self.val_seen: list[int] = []

    def training_step(self, batch, batch_idx):
        assert isinstance(batch, list) and all(isinstance(mb, dict) for mb in batch)
        x = torch.cat([mb["inputs"] for mb in batch]).double()
        self.seen.append((batch[0]["step"], len(batch), int(x.sum().item())))
        return ((self.w * x.mean() / 50_000.0) - 0.1) ** 2

    def validation_step(self, batch, batch_idx):
        self.val_seen.append(int(batch["inputs"].double().sum().item()))
        return None

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _trainer(root: Path, max_steps: int, callbacks=()) -> L.Trainer:
    return L.Trainer(
        default_root_dir=str(root),
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        val_check_interval=3,
        check_val_every_n_epoch=None,
        callbacks=list(callbacks),
    )


@pytest.fixture
def data_dir(tmp_path):
    d = tmp_path / "data"
    write_random_shards(d, 5, n_shards=3, docs_per_shard=80, mean_len=30, name="t")
    rng = np.random.default_rng(6)
    write_shard(d / "t_val_000000.bin", np.where(rng.random(2000) < 0.03, 50256, rng.integers(0, 50256, 2000)))
    return d


def _dm(d: Path, schedule) -> SpeedrunDataModule:
    return SpeedrunDataModule(
        train_files=str(d / "t_train_*.bin"), val_files=str(d / "t_val_*.bin"),
        val_tokens=512, val_seq_len=128, prefetch=3, schedule=schedule,
    )


def test_fit_resume_continues_the_stream(tmp_path, data_dir):
    sched = small_schedule([(4, 64, 32, 40), (16, 128, 32, 60)])
    straight = Recorder()
    _trainer(tmp_path / "a", 10).fit(straight, datamodule=_dm(data_dir, sched))
    assert [s for s, _, _ in straight.seen] == list(range(10))
    assert [a for _, a, _ in straight.seen] == [2] * 4 + [4] * 6  # grad accumulation follows the schedule
    assert len(straight.val_seen) == 3 * 4  # validation at steps 3, 6, 9; 512 / 128 = 4 batches

    ckpt_cb = L.pytorch.callbacks.ModelCheckpoint(dirpath=str(tmp_path / "ck"), every_n_train_steps=4, save_top_k=-1)
    first = Recorder()
    _trainer(tmp_path / "b", 4, [ckpt_cb]).fit(first, datamodule=_dm(data_dir, sched))
    ckpts = sorted((tmp_path / "ck").glob("*.ckpt"))
    assert len(ckpts) == 1
    state = torch.load(ckpts[0], weights_only=False)["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]
    assert state["step"] == 4  # the first step not yet trained, although the stream ran ahead

    resumed = Recorder()
    _trainer(tmp_path / "c", 10).fit(resumed, datamodule=_dm(data_dir, sched), ckpt_path=str(ckpts[0]))
    assert first.seen == straight.seen[:4]
    assert resumed.seen == straight.seen[4:]
    assert resumed.val_seen[:4] == straight.val_seen[:4]  # the validation set is the same every run


def test_missing_data_errors(tmp_path):
    dm = SpeedrunDataModule()
    with pytest.raises(ShardError, match=r"data.train_files is not set.*nanogpt-pl data fineweb"):
        dm.setup("fit")
    dm = SpeedrunDataModule(train_files=str(tmp_path / "none_*.bin"), val_files=str(tmp_path / "v_*.bin"))
    with pytest.raises(ShardError, match=r"data.train_files=.*matches no files"):
        dm.setup("fit")
    with pytest.raises(ShardError, match=r"data.val_files=.*matches no files"):
        dm.val_dataloader()
    with pytest.raises(ValueError, match="data.corpus='wiki' is unknown"):
        SpeedrunDataModule(corpus="wiki")


def test_world_size_check(tmp_path, data_dir):
    dm = _dm(data_dir, small_schedule([(4, 96, 32, 40)]))
    dm.world_size = 2
    with pytest.raises(ValueError, match="not divisible by world_size 2"):
        dm.setup("fit")


def test_batch_at_matches_the_stream_and_leaves_it_alone(tmp_path, data_dir):
    sched = small_schedule([(4, 64, 32, 40), (16, 128, 32, 60)])
    dm = _dm(data_dir, sched)
    dm.world_size, dm.rank = 2, 1
    dm.setup("fit")
    straight = dm.train_dataloader()
    it = iter(straight)
    first = next(it)
    for step in (9, 2, 0, 5):  # any order
        probe = dm.batch_at(step)
        ref = _take_one(dm, step)
        assert [mb["step"] for mb in probe] == [step] * len(ref)
        for a, b in zip(probe, ref):
            assert torch.equal(a["inputs"], b["inputs"]) and torch.equal(a["cu_seqlens"], b["cu_seqlens"])
    second = next(it)  # the training stream did not move
    assert first[0]["step"] == 0 and second[0]["step"] == 1
    dm.teardown("fit")


def _take_one(dm: SpeedrunDataModule, step: int):
    from nanogpt_pl.data.stream import TrainStream

    s = TrainStream(dm.train_files, dm.schedule, world_size=dm.world_size, rank=dm.rank, start_step=step,
                    pin_memory=False)
    try:
        return next(iter(s))
    finally:
        s.close()


def test_plan_bounds_are_the_largest_of_every_ranks_batches(tmp_path, data_dir):
    """The speedrun timer sizes the CUDA graphs' inputs and the value-embedding leaf from this before
    its out-of-order warmup: per sequence length, the longest ``cu_seqlens`` and the most distinct
    input tokens any rank's micro-batch has (attention splits included), up to ``stop``; each
    micro-batch's own count is what the loader hands out with it."""
    d = tmp_path / "short"
    rng = np.random.default_rng(fresh_seed())
    # short documents, then longer ones: a slice holds more than the 128 entries of the smallest bucket,
    # and the 4096-token slices of the first shard hold far more than those of the second
    for i, (docs, mean_len) in enumerate(((6000, 8), (3000, 40))):
        write_shard(d / f"s_train_{i + 1:06d}.bin", np.concatenate(random_documents(rng, docs, mean_len)))
    sched = small_schedule([(4, 8192, 2048, 40), (5, 8192, 4096, 200), (3, 8192, 4096, 200)], attention_cap=12)
    dm = SpeedrunDataModule(train_files=str(d / "s_train_*.bin"), prefetch=2, schedule=sched)
    dm.world_size = 2
    dm.setup("fit")
    for stop in (None, 6):
        want: dict[int, int] = {}
        want_ids: dict[int, int] = {}
        every: set = set()
        for rank in (0, 1):
            dm.rank, dm._probe = rank, None
            for step in range(sched.total_steps if stop is None else stop):
                for mb in dm.batch_at(step):
                    T = mb["inputs"].numel()
                    ids = torch.unique(mb["inputs"]).numel()
                    assert mb["distinct_tokens"] == ids
                    want[T] = max(want.get(T, 0), mb["cu_seqlens"].numel())
                    want_ids[T] = max(want_ids.get(T, 0), ids)
                    every.add((T, mb["cu_seqlens"].numel(), ids))
        bounds = dm.plan_bounds(stop)
        assert bounds.cu_seqlens == want and bounds.distinct_tokens == want_ids
        if stop is None:  # they vary within a T: the largest is a real maximum
            assert len({n for T, n, _ in every if T == 4096}) > 1
            assert len({u for T, _, u in every if T == 4096}) > 1
    assert min(want.values()) > 128 and sched.attention_split(9) == 12  # the last stage splits documents
    dm.teardown("fit")
