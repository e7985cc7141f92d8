"""Training data loader: host cost per step, prefetch stalls, and the copy to the GPU.

At the record's per-rank shapes (RECORD §1, §9: T = 16,384 / 32,768 / 49,152 tokens per
micro-batch, document caps 896 / 2048 / 3072, the 2560 attention cap in stage 2) and
on a 100M-token shard (the FineWeb shard size; synthetic, FineWeb-like document
lengths unless --train-files names real shards), all rows measured in the same run:

- index: opening a shard (header, token-id check, BOS index): the first-step latency;
- baseline: the record's algorithm written plainly, one Python iteration per document
  piece, then ``torch.cat`` of the pieces (rank 0 of 8, one micro-batch per step);
- ours W=8: ``TrainStream`` producing rank 0's step synchronously (plan + gather + pack),
  and its ratio against the baseline;
- ours W=1 A=8: the single-GPU case (rank 0 walks and gathers all 8 micro-batches);
- stall: time the consumer waits in ``next()`` with the background prefetch, while it
  spends ``--step-ms`` per step (a stand-in for the GPU step: the record's ~33 ms);
- H2D: the non-blocking copy of a step's pinned tensors to the GPU (CUDA only).

Peak host memory (max RSS) and GPU memory are printed at the end.

    python benchmarks/data_loader.py            # ~1 min
    python benchmarks/data_loader.py --quick    # 20M-token shard, fewer steps
"""

from __future__ import annotations

import argparse
import platform
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nanogpt_pl.data.planning import BOS_ID, IndexedShard, ShardSet  # noqa: E402
from nanogpt_pl.data.shards import write_shard  # noqa: E402
from nanogpt_pl.data.stream import TrainStream  # noqa: E402
from nanogpt_pl.schedule import Schedule, Stage  # noqa: E402

SHARD_TOKENS = 100_000_000  # RECORD §1: tokens per FineWeb shard
WORLD = 8  # RECORD §1: the record's ranks
# RECORD §9: (name, global batch, tokens per rank, document cap); stage 2 also has the 2560 attention cap
STAGES = [("stage 0", 131_072, 16_384, 896), ("stage 1", 262_144, 32_768, 2048), ("stage 2", 393_216, 49_152, 3072)]
MEAN_DOC_TOKENS = 1100  # FineWeb-like mean document length for the synthetic shard


def synthetic_shard(path: Path, n_tokens: int, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, BOS_ID, size=n_tokens, dtype=np.uint16)
    # documents of geometric length: BOS positions as a Bernoulli process
    tokens[rng.random(n_tokens) < 1.0 / MEAN_DOC_TOKENS] = BOS_ID
    tokens[0] = BOS_ID
    return write_shard(path, tokens)


def record_style_step(shard: IndexedShard, tokens: torch.Tensor, idx: int, n_slices: int, T: int, cap: int, rank: int):
    """One step as the record's loader cuts it: a Python loop over pieces; returns rank's buffer."""
    bos, size = shard.bos, tokens.numel()
    n = bos.size
    mine = None
    for r in range(n_slices):
        starts, ends, cur_len = [], [], 0
        while cur_len <= T:
            cur = int(bos[idx])
            idx += 1
            end = min(int(bos[idx]) if idx < n else size, cur + cap, cur + T - cur_len + 1)
            starts.append(cur)
            ends.append(end)
            cur_len += end - cur
        if r == rank:
            mine = torch.cat([tokens[s:e] for s, e in zip(starts, ends)])
    return mine, idx


def schedule_for(batch: int, T: int, cap: int, steps: int) -> Schedule:
    return Schedule(stages=[Stage(steps=steps, batch_tokens=batch, seq_len=T, max_doc_len=cap)], untie_step=None)


def ms(samples: list[float]) -> str:
    return f"{statistics.median(samples) * 1e3:8.3f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="20M-token shard and fewer steps")
    ap.add_argument("--train-files", default=None, help="real shards (glob) instead of a synthetic one")
    ap.add_argument("--steps", type=int, default=None, help="steps measured per row")
    ap.add_argument("--step-ms", type=float, default=33.0, help="simulated consumer step time for the stall row")
    args = ap.parse_args()
    steps = args.steps or (15 if args.quick else 40)
    n_tokens = 20_000_000 if args.quick else SHARD_TOKENS
    cuda = torch.cuda.is_available()
    device = torch.cuda.get_device_name(0) if cuda else f"CPU ({platform.processor() or platform.machine()})"
    print(f"device: {device}; torch {torch.__version__}; host: {platform.node()}")

    with tempfile.TemporaryDirectory() as tmp:
        if args.train_files:
            files = args.train_files
            print(f"data: {files}")
        else:
            t0 = time.perf_counter()
            path = synthetic_shard(Path(tmp) / "synthetic_train_000001.bin", n_tokens)
            files = [str(path)]
            print(f"data: synthetic shard of {n_tokens:,} tokens, mean document {MEAN_DOC_TOKENS} tokens "
                  f"(written in {time.perf_counter() - t0:.1f} s)")

        rows = []
        t0 = time.perf_counter()
        shards = ShardSet(files)
        shard = shards.get(0)
        index_ms = (time.perf_counter() - t0) * 1e3
        rows.append(("index shard 0 (header, id check, BOS scan)", "-", f"{index_ms:8.1f}", "-", "-"))

        # the record reads the whole shard into memory; so does the baseline (untimed)
        in_memory = torch.from_numpy(np.array(shard.tokens))
        for name, batch, T, cap in STAGES:
            # baseline: the record's loop, rank 0 of 8
            idx, base = 0, []
            for _ in range(steps):
                t = time.perf_counter()
                _, idx = record_style_step(shard, in_memory, idx, WORLD, T, cap, rank=0)
                base.append(time.perf_counter() - t)
            # ours, synchronous production of rank 0's step (no prefetch thread involved)
            for world, label in ((WORLD, f"W={WORLD} A=1"), (1, "W=1 A=8")):
                sched = schedule_for(batch, T, cap, steps)
                stream = TrainStream(shards, sched, world_size=world, rank=0, pin_memory=cuda)
                cursor, ours = stream.cursor_at(0), []
                for s in range(steps):
                    t = time.perf_counter()
                    plan = stream.walker.plan(s, cursor)
                    stream.micro_batches(plan)
                    ours.append(time.perf_counter() - t)
                    cursor = plan.next_cursor
                ratio = statistics.median(ours) / statistics.median(base) if world == WORLD else float("nan")
                rows.append((f"{name} T={T} ours {label}", ms(base) if world == WORLD else "-", ms(ours),
                             f"{ratio:6.2f}" if world == WORLD else "-", "-"))

        # consumer stall with prefetch, and the H2D copy, at stage 2 on one GPU (the heaviest host load)
        name, batch, T, cap = STAGES[2]
        for world in (WORLD, 1):
            sched = schedule_for(batch, T, cap, steps + 1)
            stream = TrainStream(shards, sched, world_size=world, rank=0, prefetch=8, pin_memory=cuda)
            it = iter(stream)
            next(it)  # thread start and first step
            waits, copies = [], []
            for _ in range(steps):
                time.sleep(args.step_ms / 1e3)
                t = time.perf_counter()
                item = next(it)
                waits.append(time.perf_counter() - t)
                if cuda:
                    t = time.perf_counter()
                    on_gpu = [{k: v.to("cuda", non_blocking=True) if torch.is_tensor(v) else v for k, v in mb.items()}
                              for mb in item]
                    torch.cuda.synchronize()
                    copies.append(time.perf_counter() - t)
                    del on_gpu
            stream.close()
            rows.append((f"stage 2 stall in next(), W={world}, {args.step_ms:.0f} ms/step", "-", ms(waits), "-",
                         ms(copies) if copies else "n/a (no CUDA)"))
        shards.close()

    print()
    header = ("measurement (median per step)", "baseline ms", "ours ms", "ours/base", "H2D ms")
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(5)]
    print("  ".join(str(h).ljust(w) for h, w in zip(header, widths)))
    print("  ".join("-" * w for w in widths))
    for r in rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths)))
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"\npeak host RSS: {rss_mb:,.0f} MiB" + (f"; peak GPU memory allocated: "
          f"{torch.cuda.max_memory_allocated() / 2**20:,.1f} MiB" if cuda else ""))
    print(f"baseline = the record's per-piece Python loop + torch.cat for rank 0 of {WORLD}; "
          f"a step at the record's pace takes ~33 ms on 8 GPUs (RECORD §12: 39.9 s / 1194 steps)")


if __name__ == "__main__":
    main()
