"""The run's batch plan walked for its shape bounds, and the value-embedding leaf it sizes.

Before its warmup the speedrun timer walks the whole batch plan once
(``SpeedrunDataModule.plan_bounds``): per sequence length T, the longest ``cu_seqlens`` and the
most distinct input tokens of any micro-batch, which size the CUDA graphs' inputs and the
value-embedding leaf (``model.optim.value_rows_from_plan``). Rows, all in one run:

- walk: the plans and the ``cu_seqlens`` bound only, no tokens read (the walk before the leaf
  was sized from the plan);
- memory-map slices: each slice's tokens sliced from the shard's memory map one document piece
  at a time and concatenated (as the loader did), then counted;
- one gather: each slice's tokens in one fancy-index gather, then counted;
- ``plan_bounds``: the pieces sliced from a plain view of the shard (``slice_tokens``), then counted.

Then the bounds per T, the leaf's rows (rounded up to 64) against min(T, V), and its size per
micro-batch at the config's value-embedding layers and width (fp32).

    python benchmarks/plan_bounds.py                                   # speedrun_1gpu.yaml, embedded corpus
    python benchmarks/plan_bounds.py --train-files 'data/fineweb10B/fineweb_train_*.bin'
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nanogpt_pl.config_files import load_config  # noqa: E402
from nanogpt_pl.data import stream as stream_mod  # noqa: E402
from nanogpt_pl.data.datamodule import SpeedrunDataModule  # noqa: E402
from nanogpt_pl.data.planning import distinct_tokens, slice_tokens  # noqa: E402
from nanogpt_pl.data.stream import PlanBounds  # noqa: E402
from nanogpt_pl.distributed.sparse_channels import reserved_value_rows  # noqa: E402
from nanogpt_pl.schedule import Schedule  # noqa: E402


def memmap_slices(shard, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The loader's gather before: each piece sliced from the shard's memory map itself."""
    return np.concatenate([shard.tokens[s : s + n] for s, n in zip(starts.tolist(), lengths.tolist())])


def one_gather(shard, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """All pieces in one fancy-index gather."""
    starts, lengths = np.asarray(starts, dtype=np.int64), np.asarray(lengths, dtype=np.int64)
    shift = np.repeat(starts - (np.cumsum(lengths) - lengths), lengths)
    return np.asarray(shard.tokens[shift + np.arange(shift.size)])


def no_tokens(shard, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    return np.zeros(1, dtype=np.uint16)


def timed_bounds(stream, stop: int, gather, count=distinct_tokens) -> tuple[float, PlanBounds]:
    """``TrainStream.plan_bounds`` with ``gather`` and ``count`` in place of the stream's own
    ``slice_tokens`` and ``distinct_tokens``: seconds and bounds."""
    saved = stream_mod.slice_tokens, stream_mod.distinct_tokens
    stream_mod.slice_tokens, stream_mod.distinct_tokens = gather, count
    try:
        t0 = time.perf_counter()
        bounds = stream.plan_bounds(0, stop)
        return time.perf_counter() - t0, bounds
    finally:
        stream_mod.slice_tokens, stream_mod.distinct_tokens = saved


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/speedrun_1gpu.yaml")
    ap.add_argument("--train-files", default=None, help="training shards (glob); default: the embedded corpus")
    ap.add_argument("--steps", type=int, default=None, help="plan this many steps (default: the schedule's)")
    ap.add_argument("--world-size", type=int, default=1)
    args = ap.parse_args()

    cfg = load_config(args.config)
    schedule = Schedule(**(cfg.get("schedule") or {}))
    gpt = cfg.get("model", {}).get("gpt", {})
    data = SpeedrunDataModule(train_files=args.train_files, val_files=None,
                              corpus=None if args.train_files else "quickstart", epochs=100_000, schedule=schedule)
    data.world_size = args.world_size
    stop = min(args.steps or schedule.total_steps, schedule.total_steps)
    print(f"{platform.node()} ({platform.processor() or platform.machine()}), {args.config}, "
          f"{args.train_files or 'embedded corpus'}, {stop} steps at {args.world_size} rank(s)")

    stream = data._probe_stream()
    stream.plan_bounds(0, 1)  # opens the first shard outside the timed rows
    rows = [("walk (cu_seqlens only)", *timed_bounds(stream, stop, no_tokens, lambda tokens: 0)),
            ("memory-map slices + count", *timed_bounds(stream, stop, memmap_slices)),
            ("one gather + count", *timed_bounds(stream, stop, one_gather)),
            ("plan_bounds (plain-view slices + count)", *timed_bounds(stream, stop, slice_tokens))]
    base = rows[1][1]
    print("\n| row | s | memory-map slices / row |\n|---|---|---|")
    for name, seconds, _ in rows:
        print(f"| {name} | {seconds:.2f} | {base / seconds:.2f}x |")
    bounds = rows[3][2]
    for _, _, other in rows[1:3]:  # every way of reading the tokens counts the same
        assert other == bounds, (other, bounds)

    vocab = int(gpt.get("vocab_size", 50304))
    planes, dim = len(gpt.get("value_embed_layers", [])), int(gpt.get("model_dim", 768))
    print(f"\nvalue-embedding leaf ({planes} planes x {dim}, fp32), per micro-batch:\n"
          "| T | most distinct tokens | leaf rows | min(T, V) | MiB | MiB at min(T, V) | min(T, V) / rows |\n"
          "|---|---|---|---|---|---|---|")
    for T in sorted(bounds.distinct_tokens):
        most = bounds.distinct_tokens[T]
        full = min(T, vocab)
        leaf = reserved_value_rows(most, full)
        mib = planes * dim * 4 / 2**20
        print(f"| {T:,} | {most:,} | {leaf:,} | {full:,} | {leaf * mib:.1f} | {full * mib:.1f} | {full / leaf:.2f}x |")


if __name__ == "__main__":
    main()
