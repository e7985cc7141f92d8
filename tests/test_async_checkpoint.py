"""Asynchronous checkpoint saves (SpeedrunStrategy(async_checkpoint=True)): exact resume, crash safety, last.

The n-gram table is forced into side files at one rank (``INLINE_STATE_LIMIT_BYTES = 0``),
as a record-size shard always is, so every test goes through the background side-file write.
"""

from __future__ import annotations

import os
import sys
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

ROOT = Path(__file__).resolve().parents[1]
ROWS = 1 << 14


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


def same_tree(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same_tree(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same_tree(x, y) for x, y in zip(a, b))
    return a == b


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
    # the same state saved both ways: the asynchronous files hold what the synchronous ones do
    first.save_checkpoint(tmp_path / "async.ckpt")
    first.strategy.finish_checkpoints()
    first.strategy.async_checkpoint = False
    first.save_checkpoint(tmp_path / "sync.ckpt")
    a, s = (first.strategy.load_checkpoint(tmp_path / f"{kind}.ckpt") for kind in ("async", "sync"))
    assert same_tree(a["state_dict"], s["state_dict"]) and same_tree(a["optimizer_states"], s["optimizer_states"])
    assert same_tree(a[RANK_LOCAL_KEY], s[RANK_LOCAL_KEY])

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

side_files.INLINE_STATE_LIMIT_BYTES = 0
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
    from background import command_env
    from lightning.pytorch.callbacks import ModelCheckpoint
    from train_helpers import LossRecorder, make_trainer

    ckpt_dir = tmp_path / "ckpt"
    script = tmp_path / "child.py"
    script.write_text(CRASH_CHILD.format(tests=str(Path(__file__).parent), train=toy_files[0], val=toy_files[1],
                                         ckpt_dir=str(ckpt_dir), root=str(tmp_path / "run")))
    from warm_python import run

    out = run([sys.executable, str(script)], cwd=tmp_path, env=command_env(), timeout=600)  # forked from a warm process
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
    import nanogpt_pl.distributed.side_files as side_files

    monkeypatch.setattr(side_files, "INLINE_STATE_LIMIT_BYTES", 0)
    module, data = ngram_run(toy_files, 6)
    rec = LossRecorder()
    callback = ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=2, save_top_k=1, save_last=True)
    make_trainer(tmp_path / "resumed", callbacks=[rec, callback], enable_checkpointing=True,
                 strategy=SpeedrunStrategy(async_checkpoint=True)).fit(module, data, ckpt_path="last")
    assert sorted(rec.losses) == [2, 3, 4, 5]
    final = ckpt_dir / "epoch=0-step=6.ckpt"
    assert final.exists() and os.path.realpath(ckpt_dir / "last.ckpt") == os.path.realpath(final)
    assert not good.exists() and not Path(rank_file(good, 0)).exists()  # top-1: removed once step 6 was written


def csv_losses(work: Path) -> dict[int, float]:
    import csv

    out = {}
    for path in (work / "logs").rglob("metrics.csv"):
        with open(path) as f:
            for row in csv.DictReader(f):
                if row.get("train/loss"):
                    out[int(row["step"])] = float(row["train/loss"])
    return out


@pytest.mark.slow
def test_two_gloo_ranks_resume_from_async_side_files_bit_exact(tmp_path, monkeypatch, toy_config, run_cli):
    """devices=2 through the CLI: a straight 6-step run with async checkpoints every 3 steps, and a run
    resumed from its step-3 checkpoint, end with the same weights, tables and Adam state bit for bit."""
    from background import LAUNCH_VARS
    from train_helpers import write_markov_shards

    for name in LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)
    files = write_markov_shards(tmp_path / "toy", n_train=150_000, n_val=20_000)
    overrides = {
        "model.gpt.ngram_rows": ROWS, "model.gpt.ngram_layers": [1], "schedule.adam_every": 1,
        "schedule.sparse_cadence": 2, "schedule.sparse_cadence_start": 2, "trainer.log_every_n_steps": 1,
        "trainer.strategy": {"class_path": "nanogpt_pl.distributed.strategy.SpeedrunStrategy",
                             "init_args": {"async_checkpoint": True}},
    }
    runs = {}
    for name in ("straight", "resumed"):
        work = tmp_path / name
        work.mkdir()
        cfg = toy_config(work, files, **overrides)
        text = cfg.read_text().replace("save_last: true", "save_last: true\n      every_n_train_steps: 3\n"
                                       "      save_top_k: -1")
        cfg.write_text(text)
        args = ["fit", "--config", str(cfg), "--trainer.devices", "2"]
        if name == "resumed":
            args += ["--ckpt_path", str(tmp_path / "straight" / "ckpt" / "epoch=0-step=3.ckpt")]
        out = run_cli(args, work)
        assert out.returncode == 0, out.stderr[-3000:]
        runs[name] = work
    compared = 0
    finals = {}
    for name, work in runs.items():
        path = work / "ckpt" / "last.ckpt"
        assert path.is_symlink() and os.path.basename(os.path.realpath(path)) == "epoch=0-step=6.ckpt"
        main = torch.load(path, map_location="cpu", weights_only=False)
        assert main["global_step"] == 6 and main[RANK_LOCAL_KEY]["world_size"] == 2
        finals[name] = (main, [load_rank_local(main, path, r, 2)[RANK_LOCAL_KEY] for r in range(2)])
    (a, a_sides), (b, b_sides) = finals["straight"], finals["resumed"]
    for key, value in a["state_dict"].items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(b["state_dict"][key], value), key
            compared += 1
    for r in range(2):
        for channel in ("ngram", "value_embeds"):
            want, got = a_sides[r][channel], b_sides[r][channel]
            tensors = {k: want.get(k) for k in ("weight", "exp_avg", "exp_avg_sq")}
            if channel == "ngram":
                tensors.update(v=want["adam"]["v"], last_event=want["adam"]["last_event"])
                assert got["adam"]["event"] == want["adam"]["event"] > 0
            for key, value in tensors.items():
                if value is None:
                    continue
                other = got["adam"][key] if key in ("v", "last_event") else got[key]
                assert torch.equal(other, value), (r, channel, key)
                compared += 1
        assert a_sides[r]["ngram"]["weight"].abs().sum() > 0
    # every float tensor of the model plus, per rank, the table, its row Adam state and the value-embedding moments
    assert compared == sum(isinstance(v, torch.Tensor) for v in a["state_dict"].values()) + 2 * 5
    straight, resumed = csv_losses(runs["straight"]), csv_losses(runs["resumed"])
    assert sorted(resumed) == [3, 4, 5] and all(resumed[s] == straight[s] for s in (3, 4, 5)), (straight, resumed)


# -- pieces ---------------------------------------------------------------------------------
def test_host_snapshot_is_a_point_in_time_copy():
    state = {"w": torch.randn(5, 3), "n": [torch.arange(4)], "k": 7}
    want = {"w": state["w"].clone(), "n": [state["n"][0].clone()]}
    copy, event, live = HostSnapshot().take(state)
    assert event is None and not live  # CPU: the copy is complete when take() returns
    state["w"].add_(1.0)
    state["n"][0].mul_(3)
    assert torch.equal(copy["w"], want["w"]) and torch.equal(copy["n"][0], want["n"][0]) and copy["k"] == 7


@pytest.mark.cuda
@pytest.mark.parametrize("staging", [True, False])
def test_host_snapshot_on_cuda_stays_consistent_under_the_next_update(staging):
    """Both ways of a CUDA snapshot: device clones (no wait), or live reads with the update waiting on the event."""
    snap = HostSnapshot(device_staging=staging)
    for size in (1 << 16, 1 << 24):  # the second round reuses nothing: new shapes, new pinned buffers
        table = torch.randn(size, 8, device="cuda")
        rows = torch.arange(0, size, 7, device="cuda")
        want = {"table": table.cpu(), "rows": rows.cpu()}
        copy, event, live = snap.take({"table": table, "rows": rows})
        assert copy["table"].is_pinned() and event is not None and live == (not staging)
        if live:
            torch.cuda.current_stream().wait_event(event)  # what SpeedrunStrategy.optimizer_step does
        table.mul_(-1.0)
        del rows  # a temporary freed right away must not be overwritten before its copy ran
        torch.empty(size, device="cuda").fill_(3.0)
        event.synchronize()
        assert torch.equal(copy["table"], want["table"]) and torch.equal(copy["rows"], want["rows"])
    again = snap.take({"table": table, "rows": torch.arange(0, size, 7, device="cuda")})
    again.done.synchronize()
    assert again.state["table"].data_ptr() == copy["table"].data_ptr()  # same shape: the pinned buffer is reused


def test_side_file_of_another_save_is_refused(tmp_path):
    path = tmp_path / "a.ckpt"
    write_side_file({"x": torch.ones(2)}, path, 0, "one")
    main = {RANK_LOCAL_KEY: side_file_marker(1, "two")}
    with pytest.raises(RuntimeError, match="ngram-rank0.pt belongs to another save"):
        load_rank_local(main, path, 0, 1)
    main[RANK_LOCAL_KEY]["save_id"] = "one"
    assert torch.equal(load_rank_local(main, path, 0, 1)[RANK_LOCAL_KEY]["x"], torch.ones(2))


def test_rank_zero_writes_the_main_file_only_after_every_side_file(tmp_path):
    import threading
    import time

    path = str(tmp_path / "b.ckpt")
    writer = AsyncCheckpointWriter(peer_wait_s=60)
    write_main = lambda main, p: torch.save(main, p)  # noqa: E731
    writer.submit_save(path, 0, 2, "id", {"x": torch.zeros(1)}, None, {"main": 1}, write_main, step=1)
    time.sleep(0.3)
    assert os.path.exists(rank_file(path, 0)) and not os.path.exists(path)  # rank 1 has not written yet
    peer = threading.Thread(target=write_side_file, args=({"x": torch.ones(1)}, path, 1, "id"))
    peer.start()
    peer.join()
    writer.wait()
    assert torch.load(path)["main"] == 1

    # a peer that never writes: the save fails with the file named, and removals behind it do not run
    other = str(tmp_path / "c.ckpt")
    writer = AsyncCheckpointWriter(peer_wait_s=0.2)
    removed = []
    writer.submit_save(other, 0, 2, "id2", {"x": torch.zeros(1)}, None, {"main": 2}, write_main, step=2)
    writer.submit_remove(lambda: removed.append(path))
    with pytest.raises(RuntimeError, match="c.ckpt.ngram-rank1.pt of checkpoint .* did not appear"):
        writer.wait()
    assert not removed and not os.path.exists(other) and os.path.exists(path)
    writer.close()


@pytest.mark.slow
def test_save_last_link_is_refused_with_async_saves(toy_files, tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint
    from train_helpers import make_trainer

    module, data = ngram_run(toy_files, 2)
    trainer = make_trainer(tmp_path, callbacks=[ModelCheckpoint(dirpath=tmp_path, save_last="link")],
                           enable_checkpointing=True, strategy=SpeedrunStrategy(async_checkpoint=True))
    with pytest.raises(ValueError, match="save_last: true"):
        trainer.fit(module, data)


class _SlowSaveStrategy(SpeedrunStrategy):
    """A save that takes half a second on the training thread (a large synchronous write)."""

    def save_checkpoint(self, checkpoint, filepath, storage_options=None):
        import time

        time.sleep(0.5)
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)


@pytest.mark.slow
def test_checkpoint_saves_are_off_the_speedrun_clock(toy_files, tmp_path):
    import time

    from lightning.pytorch.callbacks import ModelCheckpoint
    from train_helpers import make_trainer

    from callbacks.speedrun_timer import SpeedrunTimer

    module, data = ngram_run(toy_files, 6)
    timer = SpeedrunTimer(warmup_steps=[], target=0.0)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)
    start = time.perf_counter()
    make_trainer(tmp_path, callbacks=[timer, ckpt], enable_checkpointing=True,
                 strategy=_SlowSaveStrategy()).fit(module, data)
    wall = time.perf_counter() - start
    saves = sorted((tmp_path / "ckpt").glob("*.ckpt"))
    assert len(saves) == 3
    assert 0 < timer.elapsed < wall - 0.5 * len(saves)
    # the clock a checkpoint carries counts the steps before it (its state is taken before the pause)
    clocks = [torch.load(p, weights_only=False)["callbacks"]["SpeedrunTimer"]["elapsed"] for p in saves]
    assert 0 < clocks[0] < clocks[1] < clocks[2] <= timer.elapsed
