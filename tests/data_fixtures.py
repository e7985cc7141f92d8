"""Helpers for the data tests: random documents in shards, small schedules, a plain reference loader."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from nanogpt_pl.data.shards import write_shard
from nanogpt_pl.schedule import Schedule, Stage

BOS = 50256


def random_documents(rng: np.random.Generator, n_docs: int, mean_len: float, vocab: int = 50256) -> list[np.ndarray]:
    """Documents of geometric lengths (>= 1 token after the BOS), ids in [0, vocab) without BOS."""
    docs = []
    for _ in range(n_docs):
        n = int(rng.geometric(1.0 / mean_len))
        body = rng.integers(0, vocab, size=n, dtype=np.int64)
        body[body == BOS] = BOS - 1
        docs.append(np.concatenate([[BOS], body]).astype(np.uint16))
    return docs


def write_random_shards(
    directory: Path, seed: int, n_shards: int, docs_per_shard: int, mean_len: float, name: str = "rand"
) -> list[Path]:
    """``n_shards`` train shards of random documents; the first shard may start mid-document."""
    rng = np.random.default_rng(seed)
    paths = []
    for i in range(n_shards):
        tokens = np.concatenate(random_documents(rng, docs_per_shard, mean_len))
        if i == 1:
            # a shard that starts inside a document (as when a document straddles shards)
            tokens = np.concatenate([rng.integers(0, BOS, size=7).astype(np.uint16), tokens])
        paths.append(write_shard(directory / f"{name}_train_{i + 1:06d}.bin", tokens))
    return paths


def small_schedule(stages: list[tuple[int, int, int, int]], attention_cap=None) -> Schedule:
    """A schedule of (steps, batch_tokens, seq_len, max_doc_len) stages."""
    return Schedule(
        stages=[Stage(steps=s, batch_tokens=b, seq_len=t, max_doc_len=m) for s, b, t, m in stages],
        attention_cap=attention_cap,
        untie_step=None,
    )


def read_tokens(path: Path) -> np.ndarray:
    raw = np.fromfile(path, dtype=np.uint16)
    return raw[512:]  # 1024-byte header = 512 uint16


def reference_slices(shard_tokens: list[np.ndarray], schedule: Schedule, steps: int):
    """Plain-Python walk of the record's loop: per step, the list of (tokens, piece lengths) slices.

    Every slice takes documents from the next unused BOS; a piece ends at the next BOS, the
    document cap, or the tokens still needed; when a shard runs out the step restarts in the
    next shard.
    """
    shard_i, idx = 0, 0
    out = []
    for step in range(steps):
        T = schedule.seq_len(step)
        n = schedule.batch_tokens(step) // T
        cap = schedule.max_doc_len(step)
        while True:
            tokens = shard_tokens[shard_i]
            bos = [int(i) for i in np.flatnonzero(tokens == BOS)]
            j, slices, ok = idx, [], True
            for _ in range(n):
                pieces, lens, cur = [], [], 0
                while cur <= T:
                    if j >= len(bos):
                        ok = False
                        break
                    b = bos[j]
                    j += 1
                    end = min(bos[j] if j < len(bos) else len(tokens), b + cap, b + T - cur + 1)
                    pieces.append(tokens[b:end])
                    lens.append(end - b)
                    cur += end - b
                if not ok:
                    break
                slices.append((np.concatenate(pieces), lens))
            if ok:
                idx = j
                out.append(slices)
                break
            shard_i, idx = shard_i + 1, 0
            if shard_i >= len(shard_tokens):
                raise RuntimeError("reference: data exhausted")
    return out
