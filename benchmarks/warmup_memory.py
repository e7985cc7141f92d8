"""GPU memory after the speedrun timer's untimed warmup, for each order of its steps, same run.

The warmup (``callbacks/speedrun_timer.py``) runs a real training step at each of about 37
schedule steps, so every configuration key of the run is seen twice and its CUDA graphs are
captured off the clock. The micro-batch graphs of all keys share one memory pool. This script
runs that warmup (the same steps, the state copy it holds and the restore at its end) for a
config, once per order of its steps (``largest_first``: the runs of
steps with the longest micro-batch first; ``schedule``: step order, as the record lists
them), each in its own process, and prints per order the steps it ran, its seconds, the peak
allocated memory, the reserved memory after it and the part of that in CUDA graph pools, or
the step at which it ran out of memory. The ratio row is schedule / largest_first.

    python benchmarks/warmup_memory.py --config configs/speedrun_1gpu.yaml
    python benchmarks/warmup_memory.py --config configs/speedrun_1gpu.yaml --set model.gpt.ngram_rows=10575360

Without FineWeb on the machine it trains on the embedded corpus (``--corpus quickstart``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from step_time import data_and_override_args, embedded_corpus  # noqa: E402  (this folder is on sys.path)

from callbacks.speedrun_timer import WARMUP_ORDERS, default_warmup_steps  # noqa: E402
from nanogpt_pl.capture import gpu_memory_gib  # noqa: E402
from nanogpt_pl.cli import cli_main  # noqa: E402

MARK = "WARMUP_MEMORY "


def cli_args(config: str, corpus: bool, overrides: list[str]) -> list[str]:
    return ["--config", config, "--trainer.devices", "1", "--trainer.logger", "false",
            "--trainer.callbacks", "[]", "--trainer.enable_checkpointing", "false",
            "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
            *data_and_override_args(corpus, overrides)]


def child(order: str, args: list[str], limit: int) -> dict:
    cli = cli_main(args, run=False, save_config=False)
    module, data = cli.model, cli.datamodule
    device = torch.device("cuda")
    data.prepare_data()
    data.setup("fit")
    module.prepare_for_training(device)
    module.to(device)
    module.use_plain_optimizer(module.configure_optimizers())
    module.train()
    steps = default_warmup_steps(module.schedule, limit, order)
    torch.cuda.reset_peak_memory_stats(device)
    start, done, failed = time.perf_counter(), 0, None
    previous = 0
    try:
        snapshot = module.capture_state()  # as SpeedrunTimer.run_warmup: it holds this copy through the warmup
        for step in steps:
            batch = module.prepare_batch(data.batch_at(step), step)
            batch = module.transfer_batch_to_device(batch, device, 0)
            module.apply_schedule(step, previous_step=previous)
            module.run_step(batch)
            previous = step
            done += 1
            torch.cuda.synchronize(device)
            m = gpu_memory_gib(device)
            print(f"[{order}] step {done}/{len(steps)} (schedule step {step}) after "
                  f"{time.perf_counter() - start:.0f} s: {m['reserved']:.2f} GiB reserved, "
                  f"{m['graph_pools']:.2f} GiB in graph pools", file=sys.stderr, flush=True)
        module.restore_state(snapshot)
        torch.cuda.synchronize(device)
    except torch.OutOfMemoryError as err:
        failed = f"out of memory at warmup step {done + 1} of {len(steps)} (schedule step {steps[done]}): " \
                 f"{str(err).splitlines()[0][:160]}"
    seconds = time.perf_counter() - start
    graphs = getattr(module, "_graphs", None)
    keys = len(graphs.graphs.captured_keys()) if graphs is not None else 0
    return {"order": order, "steps": done, "planned": len(steps), "seconds": seconds, "keys": keys,
            "failed": failed, **gpu_memory_gib(device)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="configs/speedrun_1gpu.yaml")
    ap.add_argument("--corpus", choices=["auto", "quickstart", "config"], default="auto")
    ap.add_argument("--limit", type=int, default=40, help="the timer's warmup_limit")
    ap.add_argument("--orders", nargs="+", choices=WARMUP_ORDERS, default=list(WARMUP_ORDERS))
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a config override")
    ap.add_argument("--child", choices=WARMUP_ORDERS, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("warmup_memory.py: needs a CUDA GPU (CUDA graph pools are what it measures)")
    corpus = embedded_corpus(a.config, a.corpus)
    args = cli_args(a.config, corpus, a.set)
    if a.child:
        print(MARK + json.dumps(child(a.child, args, a.limit)), flush=True)
        return
    results = {}
    for order in a.orders:
        cmd = [sys.executable, __file__, "--config", a.config, "--limit", str(a.limit), "--child", order,
               "--corpus", "quickstart" if corpus else "config"] + [x for s in a.set for x in ("--set", s)]
        out = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True)  # its progress goes to stderr
        lines = [ln for ln in out.stdout.splitlines() if ln.startswith(MARK)]
        if not lines:
            results[order] = None
            continue
        results[order] = json.loads(lines[-1][len(MARK):])
    print(f"\nwarmup_memory: {a.config}{' ' + ' '.join(a.set) if a.set else ''}, warmup limit {a.limit}, "
          f"data: {'embedded quickstart corpus' if corpus else 'the config files'}")
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  date {datetime.date.today()}")
    print(f"{'order':<14} {'steps':>7} {'seconds':>8} {'keys':>5} {'peak alloc GiB':>15} {'reserved GiB':>13} "
          f"{'graph pools GiB':>16}  outcome")
    for order, r in results.items():
        if r is None:
            print(f"{order:<14} its process failed (its output is above)")
            continue
        print(f"{order:<14} {r['steps']:>3}/{r['planned']:<3} {r['seconds']:>8.1f} {r['keys']:>5} "
              f"{r['peak_allocated']:>15.2f} {r['reserved']:>13.2f} {r['graph_pools']:>16.2f}  "
              f"{r['failed'] or 'ok'}")
    a_, b_ = results.get("schedule"), results.get("largest_first")
    if a_ and b_ and not a_["failed"] and not b_["failed"]:
        print(f"schedule / largest_first: peak allocated {a_['peak_allocated'] / b_['peak_allocated']:.3f}x, "
              f"reserved {a_['reserved'] / b_['reserved']:.3f}x, graph pools "
              f"{a_['graph_pools'] / max(b_['graph_pools'], 1e-9):.3f}x")


if __name__ == "__main__":
    main()
