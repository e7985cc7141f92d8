"""Hashed n-gram table: step cost against table size, and the bytes the sparse exchange moves.

Three parts, all in one run (each can be selected with --part):

1. **table** (CUDA, one device): a training step of the record-shaped GPT (RECORD §2:
   11 layers, 768 wide, value embeddings, n-gram injection at layers 1, 4, 5, 9) on
   ``--tokens`` tokens of real text, with the n-gram table at 1M rows (the baseline),
   20M rows, and the largest row count that fits the device next to the model (computed
   from the memory left after the 1M-row run; a row costs 768·2 B of bf16 table plus
   4 B of second moment and 4 B of last-event stamp). A step is: hash + pull of the
   unique rows, forward, full-softmax loss, backward, push of the compact gradient, and
   every 4th step the lazy row Adam event (RECORD §5 cadence), so the mean over 4-step
   cycles is the steady-state step. Dense optimizers are left out: they do not depend
   on the table size. Target (issue 6): step time grows < 5% from 1M to 20M rows. At
   1M rows the fixed-capacity exchange (no host sync, padded leaves) is measured too,
   as a ratio against the reference exchange.
2. **exchange** (CPU, 8 gloo processes): the same channels at the record's 84.6M rows
   (row width ``--exchange-dim`` to keep host memory small), small per-rank batches of
   real text, a 4-step cadence; every all_to_all / all_gather is counted per rank. Value
   bytes are also shown rescaled to 768-wide bf16 rows (the GPU wire format).
   Both exchanges run: ``reference`` (exact sizes) and ``fixed`` (fixed capacity, no
   host sync: every destination gets a slot of a fixed size, the request's expected share
   plus 10 standard deviations of the hashed rows' spread, so it sends more).
3. **model** (no device): bytes per rank per step for 8 GPUs at the record's batch
   (T = 49,152 tokens per rank, 2T row ids), from the unique-row fractions measured on
   real text (one batch for the per-step pull; four batches for the per-event push); and
   for the fixed exchange, whose bytes follow from its capacities alone.

Real text: the quickstart corpus (``nanogpt_pl.data.corpus``, Python's documentation,
built on first use in seconds). It is more repetitive than FineWeb, so its unique
fractions are lower than the record's data would give; ``--tokens-file`` takes any
.bin shard (e.g. a FineWeb shard) instead.

    python benchmarks/ngram_table.py            # about 1-2 minutes on an H200
    python benchmarks/ngram_table.py --quick    # smaller batch, fewer steps
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nanogpt_pl.distributed.ngram_shard import NgramShard  # noqa: E402
from nanogpt_pl.distributed.row_exchange import slot_capacity  # noqa: E402
from nanogpt_pl.distributed.sparse_channels import SparseChannels  # noqa: E402
from nanogpt_pl.distributed.value_embed_shard import ValueEmbedShard  # noqa: E402
from nanogpt_pl.model.embeddings import RECORD_NGRAM_ROWS, HashedNgramEmbedding, ngram_row_ids  # noqa: E402
from nanogpt_pl.optim.sparse_adam import SparseAdam  # noqa: E402

WORLD = 8  # RECORD §3: the table is sharded over 8 ranks
RECORD_T = 49_152  # RECORD §9: tokens per rank per step in stage 2
RECORD_DIM = 768  # RECORD §2
CADENCE = 4  # RECORD §5: one sparse event every 4 steps from step 336
VE_PLANES, VOCAB = 4, 50_304  # RECORD §2: value embeddings 4 × 50,304 rows
WINDOWS = (640, 1408)  # RECORD §9: stage-2 short/long windows in tokens
MAX_DOC = 2048  # attention segment cap for the benchmark batch (RECORD §1 uses 2560 in stage 2)
BOS = 50256
ROW_BYTES = RECORD_DIM * 2 + 4 + 4  # bf16 row + fp32 second moment + int32 last-event stamp
MEMORY_RESERVE_GIB = 6.0  # headroom kept free when sizing the largest table (allocator slack)


# -- real text --------------------------------------------------------------------------
def real_tokens(min_tokens: int, tokens_file: Optional[str]) -> tuple[np.ndarray, str]:
    """At least ``min_tokens`` tokens of real text (repeated if the source is shorter)."""
    if tokens_file:
        from nanogpt_pl.data.shards import open_shard

        toks, source = np.asarray(open_shard(tokens_file)), tokens_file
    else:
        try:
            from nanogpt_pl.data.corpus import build_corpus
            from nanogpt_pl.data.shards import open_shard

            info = build_corpus()
            toks = np.concatenate([np.asarray(open_shard(p)) for p in info.train_paths])
            source = f"quickstart corpus ({len(toks):,} tokens)"
        except Exception as e:  # no corpus module or no tokenizer cache: say so and use random ids
            print(f"# real text unavailable ({e}); using uniform random token ids", file=sys.stderr)
            toks = np.random.default_rng(0).integers(0, BOS, size=min_tokens, dtype=np.uint16)
            source = "uniform random ids"
    if len(toks) < min_tokens:
        toks = np.tile(toks, -(-min_tokens // len(toks)))
        source += " (repeated)"
    return toks.astype(np.int64), source


def cu_seqlens_of(ids: np.ndarray, max_doc: int) -> tuple[np.ndarray, int]:
    """Segment starts at every BOS, long documents split at ``max_doc`` tokens."""
    starts = [0] + [int(i) for i in np.flatnonzero(ids == BOS) if i > 0] + [len(ids)]
    cu = [0]
    for a, b in zip(starts[:-1], starts[1:]):
        cu += list(range(a + max_doc, b, max_doc)) + [b]
    cu = np.asarray(cu, dtype=np.int32)
    return cu, int(np.diff(cu).max())


# -- part 1: step time and memory against table size ------------------------------------
def build_model(device: torch.device):
    from nanogpt_pl.model.gpt import GPT, GPTConfig

    model = GPT(GPTConfig(ngram_rows=RECORD_NGRAM_ROWS)).to(device)
    roles = model.param_roles()
    for name in ("matrices", "embed", "lm_head", "value_embeds"):  # the module's CUDA dtype policy
        for p in roles[name]:
            p.data = p.data.to(torch.bfloat16)
    return model


def loss_of(model, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    try:
        from nanogpt_pl.ops.cross_entropy import lm_head_loss

        return lm_head_loss(hidden, model.lm_head, targets)
    except ImportError:
        logits = (hidden @ model.lm_head.t()).float()
        return torch.nn.functional.cross_entropy(logits, targets)


class ReadoutOnly(torch.nn.Module):
    """Fallback "model" when the GPT step cannot run here: x0_ngram + value rows -> a linear readout."""

    def __init__(self, model) -> None:
        super().__init__()
        self.ngram, self.value_embeds = model.ngram, model.value_embeds
        self.lm_head = model.lm_head

    def forward(self, ids, cu, max_len, windows, ngram, value_rows):
        x = self.ngram(ngram, torch.bfloat16) + torch.nn.functional.embedding(
            value_rows.index, value_rows.values.sum(0)).to(torch.bfloat16)
        return x


def table_step_times(model, rows: int, batches: list, steps: int, warmup: int, exchange: str = "reference") -> dict:
    device = model.lm_head.device
    shard = NgramShard(rows, RECORD_DIM, device=device, exchange=exchange)
    channels = SparseChannels(shard, ValueEmbedShard(list(model.value_embeds), exchange=exchange),
                              fixed_shapes=exchange == "fixed")
    opt = SparseAdam(channels.channels())
    opt.set_cadence_engaged(True)
    times, sparse_times = [], []
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    for i in range(warmup + steps):
        ids, targets, cu, max_len = batches[i % len(batches)]
        t0 = time.perf_counter()
        inputs = channels.inputs(ids, train=True)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        hidden = model(ids, cu, max_len, WINDOWS, **inputs)
        loss_of(model, hidden, targets).backward()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        channels.push_grads(inputs)
        if i % CADENCE == CADENCE - 1:
            opt.step()
        for p in model.parameters():
            p.grad = None
        torch.cuda.synchronize()
        t3 = time.perf_counter()
        if i >= warmup:
            times.append(t3 - t0)
            sparse_times.append((t1 - t0) + (t3 - t2))
    out = dict(rows=rows, step_ms=1e3 * statistics.mean(times), sparse_ms=1e3 * statistics.mean(sparse_times),
               peak_gib=torch.cuda.max_memory_allocated() / 2**30,
               table_gib=shard.weight.numel() * shard.weight.element_size() / 2**30)
    del channels, opt, shard, inputs, hidden
    torch.cuda.empty_cache()
    return out


def part_table(args, tokens: np.ndarray) -> None:
    if not torch.cuda.is_available():
        print("## table: skipped (needs a CUDA device)\n")
        return
    device = torch.device("cuda")
    T = args.tokens
    batches = []
    for b in range(4):
        window = tokens[b * (T + 1) : (b + 1) * (T + 1)]
        cu, max_len = cu_seqlens_of(window[:-1], MAX_DOC)
        batches.append((torch.tensor(window[:-1], dtype=torch.int32, device=device),
                        torch.tensor(window[1:], dtype=torch.int64, device=device),
                        torch.tensor(cu, device=device), max_len))
    model = build_model(device)
    steps, warmup = (8, 4) if args.quick else (16, 4)
    what = "record-shaped GPT in bf16 (eager)"
    try:
        results = [table_step_times(model, 1 << 20, batches, steps, warmup)]
    except Exception as e:  # keep the table numbers even if the full model cannot run on this stack
        print(f"# the GPT step failed ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
              "measuring the n-gram + value-embedding path with a readout instead")
        model, what = ReadoutOnly(model), "n-gram + value-embedding path only (GPT step failed, see above)"
        torch.cuda.empty_cache()
        results = [table_step_times(model, 1 << 20, batches, steps, warmup)]
    model_peak = results[0]["peak_gib"] - results[0]["table_gib"]
    total = torch.cuda.get_device_properties(device).total_memory / 2**30
    fit = int((total - model_peak - MEMORY_RESERVE_GIB) * 2**30 / ROW_BYTES) // 2 * 2
    for rows in (20_000_000, fit):
        try:
            results.append(table_step_times(model, rows, batches, steps, warmup))
        except (torch.OutOfMemoryError, RuntimeError) as e:
            print(f"# {rows:,} rows: {type(e).__name__}: {str(e).splitlines()[0]}")
    name = torch.cuda.get_device_name(device)
    print(f"## table: one training step vs n-gram table rows ({name}, torch {torch.__version__})")
    print(f"T = {T:,} tokens per step, {what}, value embeddings on the sparse path, "
          f"lazy row Adam every {CADENCE} steps; mean of {steps} steps after {warmup} warmup")
    print(f"model + activations without the table: {model_peak:.1f} GiB; device {total:.1f} GiB; "
          f"largest table = ({total:.1f} - {model_peak:.1f} - {MEMORY_RESERVE_GIB} reserve) GiB "
          f"/ {ROW_BYTES} B per row "
          f"= {fit:,} rows")
    print(f"{'rows':>14} {'table GiB':>10} {'step ms':>9} {'sparse ms':>10} {'peak GiB':>9} {'step / 1M':>10}")
    base = results[0]["step_ms"]
    for r in results:
        print(f"{r['rows']:>14,} {r['table_gib']:>10.2f} {r['step_ms']:>9.2f} {r['sparse_ms']:>10.2f} "
              f"{r['peak_gib']:>9.2f} {r['step_ms'] / base:>10.3f}")
    if len(results) > 1:
        growth = results[1]["step_ms"] / base - 1
        print(f"1M -> 20M rows: step time {growth:+.1%} (target < +5%): {'met' if growth < 0.05 else 'NOT met'}")
    fixed = table_step_times(model, 1 << 20, batches, steps, warmup, exchange="fixed")
    print(f"fixed exchange at {fixed['rows']:,} rows: step {fixed['step_ms']:.2f} ms "
          f"({fixed['step_ms'] / base:.3f} x reference), sparse {fixed['sparse_ms']:.2f} ms "
          f"({fixed['sparse_ms'] / results[0]['sparse_ms']:.3f} x reference), peak {fixed['peak_gib']:.2f} GiB")
    print("(sparse ms = hash + unique + pull, plus push and the amortized event; synchronized per phase)\n")


# -- part 2: bytes on the wire at 8 gloo ranks --------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _exchange_worker(rank: int, world: int, port: int, rows: int, dim: int, T: int, steps: int,
                     tokens_path: str, out_dir: str, exchange: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        tokens = np.load(tokens_path)
        shard = NgramShard(rows, dim, exchange=exchange)
        planes = [torch.nn.Parameter(torch.zeros(VOCAB, dim)) for _ in range(VE_PLANES)]
        channels = SparseChannels(shard, ValueEmbedShard(planes, exchange=exchange), fixed_shapes=exchange == "fixed")
        opt = SparseAdam(channels.channels())
        opt.set_cadence_engaged(True)
        embed = HashedNgramEmbedding(dim)
        gen = torch.Generator().manual_seed(rank)
        proj = torch.randn(dim, generator=gen)
        for step in range(steps):
            start = (step * world + rank) * T
            ids = torch.from_numpy(tokens[start : start + T])
            inputs = channels.inputs(ids, train=True)
            ve = inputs["value_rows"]
            x = embed(inputs["ngram"], torch.float32)
            x = x + torch.nn.functional.embedding(ve.index, ve.values.sum(0))
            (x @ proj).sin().sum().backward()
            channels.push_grads(inputs)
            if step % CADENCE == CADENCE - 1:
                opt.step()
        stats = {"ngram": (dict(shard.exchange.bytes_sent), dict(shard.exchange.bytes_received)),
                 "value_embeds": (dict(channels.value_embeds.exchange.bytes_sent),
                                  dict(channels.value_embeds.exchange.bytes_received))}
        torch.save(stats, Path(out_dir) / f"{exchange}-rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def part_exchange(args, tokens: np.ndarray) -> None:
    import torch.multiprocessing as mp

    T, steps, dim = args.exchange_tokens, 2 * CADENCE, args.exchange_dim
    rows = RECORD_NGRAM_ROWS if not args.quick else RECORD_NGRAM_ROWS // 8
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "tokens.npy")
        np.save(path, tokens[: steps * WORLD * T + 1])
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        stats, wall = {}, {}
        for exchange in ("reference", "fixed"):
            t0 = time.perf_counter()
            mp.spawn(_exchange_worker, args=(WORLD, _free_port(), rows, dim, T, steps, path, tmp, exchange),
                     nprocs=WORLD)
            wall[exchange] = time.perf_counter() - t0
            stats[exchange] = [torch.load(Path(tmp) / f"{exchange}-rank{r}.pt", weights_only=False)
                               for r in range(WORLD)]
    scale = RECORD_DIM * 2 / (dim * 4)  # fp32 rows of width dim -> bf16 rows of width 768
    print(f"## exchange: bytes per rank per step, measured at {WORLD} gloo ranks on CPU "
          f"({steps} steps, T = {T:,} tokens per rank, {rows:,} rows x {dim} fp32, cadence {CADENCE}; "
          f"reference {wall['reference']:.0f} s, fixed {wall['fixed']:.0f} s)")
    print(f"{'exchange':<10} {'channel':<13} {'kind':<14} {'sent B/step':>12} {'recv B/step':>12} "
          f"{'as 768-wide bf16':>17} {'sent / ref':>10}")
    for channel in ("ngram", "value_embeds"):
        kinds = sorted(set().union(*(s[channel][0].keys() for runs in stats.values() for s in runs)))
        for kind in kinds:
            base = statistics.mean(s[channel][0].get(kind, 0) for s in stats["reference"]) / steps
            for exchange, runs in stats.items():
                sent = statistics.mean(s[channel][0].get(kind, 0) for s in runs) / steps
                recv = statistics.mean(s[channel][1].get(kind, 0) for s in runs) / steps
                wide = sent * scale if kind.endswith("values") else sent
                ratio = f"{sent / base:>10.2f}" if base else f"{'-':>10}"
                print(f"{exchange:<10} {channel:<13} {kind:<14} {sent:>12,.0f} {recv:>12,.0f} {wide:>17,.0f} {ratio}")
    print()


# -- part 3: model for 8 GPUs at the record's batch ------------------------------------------
def unique_fractions(tokens: np.ndarray, T: int, per: int, rows: int) -> tuple[float, float]:
    """Mean unique fraction of n-gram rows (over 2·per·T ids) and of token ids (over per·T ids)."""
    fr, fv = [], []
    n = len(tokens) // (per * T)
    for k in range(max(1, min(n, 4))):
        ids = torch.from_numpy(tokens[k * per * T : (k + 1) * per * T])
        rows_ = torch.cat([ngram_row_ids(ids[j * T : (j + 1) * T], rows).flatten() for j in range(per)])
        fr.append(torch.unique(rows_).numel() / rows_.numel())
        fv.append(torch.unique(ids).numel() / ids.numel())
    return statistics.mean(fr), statistics.mean(fv)


def part_model(args, tokens: np.ndarray, source: str) -> None:
    T, D, W = RECORD_T, RECORD_DIM, WORLD
    remote = (W - 1) / W  # owners are spread evenly: 7/8 of a rank's rows live elsewhere
    u1, v1 = unique_fractions(tokens, T, 1, RECORD_NGRAM_ROWS)
    u4, v4 = unique_fractions(tokens, T, CADENCE, RECORD_NGRAM_ROWS)
    U1, U4, V4 = u1 * 2 * T, u4 * 2 * T * CADENCE, v4 * T * CADENCE
    row, rid = D * 2, 4  # bf16 row, int32 id
    lines = [
        ("ngram pull ids (each step)", U1 * remote * rid),
        ("ngram pull values (each step)", U1 * remote * row),
        ("ngram push ids (per event / 4)", U4 * remote * rid / CADENCE),
        ("ngram push values (per event / 4)", U4 * remote * row / CADENCE),
        ("VE push ids (per event / 4)", V4 * VE_PLANES * remote * rid / CADENCE),
        ("VE push values (per event / 4)", V4 * VE_PLANES * remote * row / CADENCE),
        ("VE all_gather (per event / 4)", VE_PLANES * VOCAB * row * remote / CADENCE),
    ]
    print(f"## model: bytes sent per rank per step, {W} GPUs, T = {T:,} tokens per rank, {RECORD_NGRAM_ROWS:,} rows, "
          f"cadence {CADENCE}")
    print(f"unique fractions on {source}: n-gram rows {u1:.3f} of 2T per step ({U1:,.0f} rows), "
          f"{u4:.3f} of 8T per cycle ({U4:,.0f}); token ids {v4:.3f} of 4T per cycle ({V4:,.0f})")
    total = 0.0
    for name, b in lines:
        total += b
        print(f"  {name:<36} {b / 2**20:>9.1f} MiB")
    print(f"  {'total':<36} {total / 2**20:>9.1f} MiB per rank per step (received: the same on average)")
    print("  (the record pulls once per cycle from a lookahead want-list instead of every step: "
          f"{U4 * remote * (row + rid) / CADENCE / 2**20:.1f} MiB/step for its pull)")
    # The fixed exchange (compiled or CUDA-graph runs; nanogpt_pl.distributed.row_exchange): every
    # destination gets a slot of S rows whatever the text, so the bytes follow from the capacities
    # alone: C = 2T rows a pull, CADENCE·2T queued rows an event, each with the hashed rows' slots
    # (row_exchange.slot_capacity); the value embeddings' whole blocks.
    C_pull, C_event = 2 * T, CADENCE * 2 * T
    per_rank = -(-RECORD_NGRAM_ROWS // W)
    bounds = [r * per_rank for r in range(W + 1)]
    S_pull, S_event = slot_capacity(C_pull, bounds), slot_capacity(C_event, bounds)
    fixed_lines = [
        ("ngram pull ids (each step)", (W - 1) * S_pull * rid),
        ("ngram pull values (each step)", (W - 1) * S_pull * row),
        ("ngram push ids (per event / 4)", (W - 1) * S_event * rid / CADENCE),
        ("ngram push values (per event / 4)", (W - 1) * S_event * row / CADENCE),
        ("VE push values (per event / 4)", VE_PLANES * VOCAB * row * remote / CADENCE),
        ("VE all_gather (per event / 4)", VE_PLANES * VOCAB * row * remote / CADENCE),
    ]
    print("fixed exchange (no host sync; what compiled and CUDA-graph runs use), from its capacities: "
          f"slots per destination {S_pull:,} of a pull's {C_pull:,} rows, {S_event:,} of an event's {C_event:,}")
    fixed_total = 0.0
    for name, b in fixed_lines:
        fixed_total += b
        print(f"  {name:<36} {b / 2**20:>9.1f} MiB")
    print(f"  {'total':<36} {fixed_total / 2**20:>9.1f} MiB per rank per step "
          f"({fixed_total / total:.1f} x the exact sizes above)\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller batch, fewer steps, 1/8-size exchange table")
    ap.add_argument("--part", choices=["all", "table", "exchange", "model"], default="all")
    ap.add_argument("--tokens", type=int, default=None, help="tokens per training step (default 49,152; quick 16,384)")
    ap.add_argument("--exchange-tokens", type=int, default=None, help="tokens per rank per step in the gloo run")
    ap.add_argument("--exchange-dim", type=int, default=8, help="row width of the CPU exchange run")
    ap.add_argument("--tokens-file", default=None, help="a .bin shard of real text to use instead of the corpus")
    args = ap.parse_args()
    args.tokens = args.tokens or (16_384 if args.quick else RECORD_T)
    args.exchange_tokens = args.exchange_tokens or (1024 if args.quick else 4096)
    need = max(4 * (args.tokens + 1), CADENCE * RECORD_T + 1, 2 * CADENCE * WORLD * args.exchange_tokens + 1)
    tokens, source = real_tokens(need, args.tokens_file)
    print(f"# n-gram table benchmark: text = {source}; torch {torch.__version__}\n")
    if args.part in ("all", "table"):
        part_table(args, tokens)
    if args.part in ("all", "model"):
        part_model(args, tokens, source)
    if args.part in ("all", "exchange"):
        part_exchange(args, tokens)


if __name__ == "__main__":
    main()
