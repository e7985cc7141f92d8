"""Checkpoint stall: a training run saving the n-gram shard synchronously vs asynchronously.

Three Lightning runs of the same config in one process: no checkpoints (the baseline),
``ModelCheckpoint(every_n_train_steps=N)`` with the strategy's synchronous save
(``torch.save`` of the side file and the main file inside the step), and the same with
``SpeedrunStrategy(async_checkpoint=True)`` (snapshot, then a background thread writes).
Each step's wall time is taken from one ``on_train_batch_start`` to the next, so a save
made in ``on_train_batch_end`` counts in its step. Printed per mode:

* step: the median step without a save;
* stall: the mean over saves of (save step - median step), the time the training loop
  lost to a save (synchronous: the whole write; asynchronous: the snapshot);
* during write: the mean step while an asynchronous write is still running (the
  background thread shares the machine with training), against the baseline median;
* ratio: async stall / sync stall, measured in the same run.

The n-gram table is ``--ngram-rows`` x model dim; a record rank holds 84,602,880 / 8 rows
of 768 bf16 (RECORD §3, 15.13 GiB): on one GPU, ``--config configs/speedrun_1gpu.yaml
--ngram-rows 10575360`` saves exactly one record rank's shard.

    python benchmarks/checkpoint.py                 # CPU, quickstart model, 512 MiB table
    python benchmarks/checkpoint.py --config configs/speedrun_1gpu.yaml --ngram-rows 10575360 \\
        --set model.compile=false --steps 40 --every 10
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import lightning as L
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nanogpt_pl.cli import cli_main  # noqa: E402


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class _StepClock(L.Callback):
    """Wall time of every step, save included, and which steps saved or ran beside a write."""

    def __init__(self) -> None:
        self.starts: list[float] = []
        self.saved: set[int] = set()
        self.writing: set[int] = set()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        _sync()
        self.starts.append(time.perf_counter())
        writer = getattr(trainer.strategy, "_writer", None)
        if writer is not None and writer.busy():
            self.writing.add(len(self.starts) - 1)

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        self.saved.add(len(self.starts) - 1)

    def on_train_end(self, trainer, pl_module) -> None:
        _sync()
        self.starts.append(time.perf_counter())

    def steps(self) -> list[float]:
        return [b - a for a, b in zip(self.starts, self.starts[1:])]


def run(base: list[str], mode: str, folder: Path, every: int, skip: int) -> dict:
    args = list(base)
    if mode != "none":
        callback = {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                    "init_args": {"dirpath": str(folder / mode), "every_n_train_steps": every, "save_top_k": 1}}
        args += ["--trainer.enable_checkpointing", "true", "--trainer.callbacks", json.dumps([callback])]
        strategy = {"class_path": "nanogpt_pl.distributed.strategy.SpeedrunStrategy",
                    "init_args": {"async_checkpoint": mode == "async"}}
        args += ["--trainer.strategy", json.dumps(strategy)]
    cli = cli_main(args, run=False, save_config=False)
    clock = _StepClock()
    cli.trainer.callbacks.append(clock)
    cli.trainer.fit(cli.model, cli.datamodule)  # teardown waits for the last write
    times = clock.steps()
    plain = [t for i, t in enumerate(times) if i >= skip and i not in clock.saved and i not in clock.writing]
    median = statistics.median(plain)
    saves = [times[i] - median for i in sorted(clock.saved) if i >= skip]
    beside = [times[i] for i in sorted(clock.writing) if i >= skip and i not in clock.saved]
    shard = cli.model.sparse_channels.ngram
    return {"median": median, "stall": statistics.mean(saves) if saves else 0.0, "saves": len(saves),
            "beside": statistics.mean(beside) if beside else None, "beside_n": len(beside),
            "shard_gib": shard.weight.numel() * shard.weight.element_size() / 2**30, "device": str(shard.device)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/quickstart.yaml")
    ap.add_argument("--ngram-rows", type=int, default=1 << 20, help="rows of the n-gram table")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--every", type=int, default=5, help="ModelCheckpoint every_n_train_steps")
    ap.add_argument("--skip", type=int, default=3, help="first steps left out of the statistics")
    ap.add_argument("--batch-tokens", type=int, default=1024)
    ap.add_argument("--set", action="append", default=[], help="extra override key=value (e.g. model.compile=false)")
    a = ap.parse_args()
    stage = {"steps": a.steps, "batch_tokens": a.batch_tokens, "seq_len": a.batch_tokens, "max_doc_len": 1024,
             "window_short": 128, "window_long": 384, "candidates": None}
    if "quickstart" not in a.config:
        stage.update(seq_len=16384, batch_tokens=max(a.batch_tokens, 16384))
    base = ["--config", a.config, "--model.gpt.ngram_rows", str(a.ngram_rows), "--model.gpt.ngram_layers", "[1]",
            "--schedule.stages", json.dumps([stage]), "--schedule.warmup_steps", "0",
            "--schedule.sparse_cadence_start", "0", "--schedule.untie_step", "null",
            "--trainer.devices", "1", "--trainer.logger", "false", "--trainer.callbacks", "[]",
            "--trainer.enable_checkpointing", "false", "--trainer.limit_val_batches", "0",
            "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
            "--trainer.max_steps", str(a.steps),
            "--data.train_files", "null", "--data.val_files", "null", "--data.corpus", "quickstart",
            "--data.epochs", "100000"]
    for item in a.set:
        key, value = item.split("=", 1)
        base += [f"--{key}", value]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in ("none", "sync", "async"):
            start = time.perf_counter()
            results[mode] = run(base, mode, Path(tmp), a.every, a.skip)
            shutil.rmtree(Path(tmp) / mode, ignore_errors=True)  # a record-size shard is 15 GiB per save
            print(f"  {mode}: {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    r0 = results["none"]
    print(f"checkpoint stall: {a.config}, n-gram shard {r0['shard_gib']:.2f} GiB on {r0['device']}, "
          f"{a.steps} steps, a save every {a.every}")
    print(f"{'mode':<6} {'step (median)':>14} {'stall per save':>15} {'saves':>6} {'step during write':>18}")
    for mode, r in results.items():
        beside = "-" if r["beside"] is None else f"{r['beside'] * 1e3:.1f} ms ({r['beside_n']})"
        print(f"{mode:<6} {r['median'] * 1e3:>11.1f} ms {r['stall'] * 1e3:>12.1f} ms {r['saves']:>6} {beside:>18}")
    sync, asyn = results["sync"]["stall"], results["async"]["stall"]
    print(f"async / sync stall: {asyn / sync:.3f}" if sync > 0 else "sync stall not measurable")
    if results["async"]["beside"] is not None:
        print(f"step during an async write / baseline step: {results['async']['beside'] / r0['median']:.2f}")


if __name__ == "__main__":
    main()
