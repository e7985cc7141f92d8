"""Training step time of a config under Lightning, against a plain PyTorch loop, same run.

Both loops train the same model code, loss, optimizers and data stream on one device
for ``--warmup`` untimed steps then ``--steps`` timed steps, at one stage of the
config's schedule (its batch shape and windows, and its first candidate count, MTP weights and
prefix weight, held):

- **lightning**: ``Trainer.fit`` with the config's module and data module (loggers,
  checkpoints, validation and the config's callbacks off; the module applies the schedule);
- **plain**: a hand-written loop: ``next(stream)``, host-side candidate sets, copy to the
  device, ``SpeedrunModule.apply_schedule``, forward/backward/optimizer step through the same module
  methods, no Trainer.

The time of the timed steps is steady-state time: on a GPU, the stream time between a CUDA event
recorded as the first timed step begins (the queue is not drained first, so the host is as far
ahead as it is in a long run) and one after the last; the GPU's idle time while the host lags is
in it, the one-off filling of an empty queue is not. Where the queue was drained before the
clock (a synchronize, as with ``--profile``), the first step's host work on the batch runs with
the GPU idle and is on the clock (BENCHMARKS.md, "Steady-state timing" under "The amax atomics, ...").
Without a GPU it is the host's wall time. The plain loop freezes the garbage collector while its
clock runs, as ``SpeedrunTimer`` does in training (a collection of the live heap costs tens of ms).
Both loops size the step's inputs from the run's batch plan first, as the timer does before its
warmup (``SpeedrunModule.reserve_shapes``: the CUDA graphs' ``cu_seqlens`` and the value-embedding
leaf's rows).

It prints ms per step, tokens/s, MFU (the model's dense training FLOPs per token, full
vocabulary, times tokens/s, over 989 TFLOP/s bf16 dense) and the Lightning/plain ratio
(the Lightning overhead), plus peak memory. Unless ``--no-eager``, the plain loop also runs
with ``model.cuda_graphs=false`` ("plain-eager"), and the table gives captured/eager. With
graphs on it also says how many micro-batches of the timed steps were replayed, ran eagerly or
were captured: a key first met there puts its capture on the clock (raise ``--warmup``).
``--against OVERLAY`` also runs the plain loop with a config overlay layered on top (e.g.
``configs/ablations/plain_network.yaml``, the network before the record's parts), in the
same run, and gives config/overlay.

``--variant NAME KEY=VALUE ...`` (repeatable) also runs the plain loop with those overrides, each
variant in its own process of the same run, and gives plain/variant: a same-run A/B of backends or
switches, e.g. ``--variant anvil_triton model.backends.anvil=triton``. An override ``env:NAME=VALUE`` sets an
environment variable of that loop's process instead, e.g. ``--variant default_queues
env:CUDA_SCALE_LAUNCH_QUEUES=1x`` (every loop starts with the launch queues ``main.py`` uses,
``nanogpt_pl/launch_queues.py``, and cuBLASLt's workspace, ``nanogpt_pl/gemm_workspace.py``; the
report names both).

``--rounds R`` runs the whole sequence of loops R times, back to back (plain, its variants, plain,
...), and reports each loop's median round, every round's ms/step and each variant's ratio within
every round: one H100 gave the same code's plain loop 180 and 207 ms/step in two calls, and loops
of one call differed by several percent, so a single A/B of a few percent says little.

``--baseline TREE`` times a code change: the plain loop of another source tree of this project
(the revision before the change: ``git worktree add TREE REV``, or ``git archive REV | tar -x -C
TREE``) runs in its own process, started in that tree with its own code and configs, in every round
right after this tree's plain loop, and the report gives baseline / plain within every round.

``--profile DIR`` runs the plain loop's timed steps twice: unprofiled (its ms/step) and then as many
again under the torch profiler, so the profiler's own host work is not in the step time (an H100's
stage-0 profile held two of its "Buffer Flush" calls of about 98 ms, and two single gaps of 3-15 ms
where the host fell behind the GPU; BENCHMARKS.md, session 17). It writes a Chrome
trace per loop in DIR (open in chrome://tracing or Perfetto), every GPU kernel by its full name with
its launches and time per step in ``DIR/<loop>-kernels.tsv`` (``benchmarks/kernel_sources.py`` joins it with
the run's ``TORCH_LOGS=output_code`` log: what each inductor kernel fuses), the top operations on stderr,
per step the GPU's busy time (the union of its kernels and copies, profiled) against the unprofiled
and the profiled wall time (the table's "GPU busy" is of the unprofiled wall), and the
GPU time by kernel kind (cuBLAS GEMMs, attention, inductor's fused kernels, the project's Triton
kernels, unfused ATen elementwise kernels by operation, copies), and the host's side: per phase
of the step (``step/data`` with ``data/next``, the wait for the loader's thread, ``data/prepare``
and ``data/transfer``; ``step/sparse_pull`` with ``graphs/pull_replay`` where the pull is
captured; ``step/micro_batch`` with ``graphs/copy_in`` and ``graphs/replay``; ``step/sparse_push``,
``step/optimizer``, ``step/run_ahead_wait``), the loader thread's ``data/produce``, and per
blocking CUDA call (synchronizes, ``cudaFree``, ...), its host time and the GPU idle time it holds
(with ``--stacks``, also who made each blocking call: its Python callers).
``DIR/<loop>-idle.tsv`` groups the GPU's idle gaps by the work it waited for: the gaps between the
kernels of one graph launch, the start of a graph, or an eager launch by its op, phase and name.
``DIR/<loop>-launchers.tsv`` traces every GPU event back to the host operation that launched it (and
the operation around that, and the step's phase), with the memsets and small kernels on stderr: run
it with ``--set model.cuda_graphs=false``, since a replayed graph launches all its kernels at once.

    python benchmarks/step_time.py --config configs/speedrun_1gpu.yaml --stage 0 --steps 20
    python benchmarks/step_time.py --config configs/speedrun_1gpu.yaml --stage 2 --set model.gpt.ngram_rows=0
    python benchmarks/step_time.py --only plain --profile profiles --steps 4
    python benchmarks/step_time.py --config configs/speedrun_1gpu.yaml --stage 2 --only plain --no-eager \
        --against configs/ablations/plain_network.yaml
    python benchmarks/step_time.py --only plain --no-eager --rounds 2 --baseline ../before

Without FineWeb on the machine, ``--corpus quickstart`` (the default when the config's
files are missing) trains on the embedded corpus, repeated as needed.
"""

from __future__ import annotations

import argparse
import bisect
import datetime
import glob
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lightning as L  # noqa: E402

from callbacks.speedrun_timer import reserve_run_shapes  # noqa: E402
from nanogpt_pl.capture import FrozenGC  # noqa: E402
from nanogpt_pl.cli import cli_main  # noqa: E402
from nanogpt_pl.config_files import load_config  # noqa: E402
from nanogpt_pl.gemm_workspace import ENV as WORKSPACE_ENV  # noqa: E402
from nanogpt_pl.gemm_workspace import GemmWorkspaceError, set_cublaslt_workspace  # noqa: E402
from nanogpt_pl.launch_queues import LaunchQueueError, scale_launch_queues  # noqa: E402

ENV_PREFIX = "env:"  # a variant override that sets an environment variable of its loop
PEAK_BF16_FLOPS = 989e12  # H100/H200 dense bf16, vendor datasheet


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _peak() -> int:
    return torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0


def _reset_peak() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


class StreamClock:
    """Steady-state time of a span of steps: on a GPU the stream time between two CUDA events,
    the first recorded without draining the queue; without one the host's wall time."""

    def __init__(self) -> None:
        self.cuda = torch.cuda.is_available()
        self.t0 = None

    def start(self) -> None:
        if self.cuda:
            self.t0 = torch.cuda.Event(enable_timing=True)
            self.t0.record()
        else:
            self.t0 = time.perf_counter()

    def stop(self) -> float:
        """Seconds since ``start`` (waits for the GPU)."""
        if self.cuda:
            t1 = torch.cuda.Event(enable_timing=True)
            t1.record()
            t1.synchronize()
            return self.t0.elapsed_time(t1) / 1e3
        return time.perf_counter() - self.t0


class _Clock(L.Callback):
    """Steady-state time from the end of step ``start`` to the end of step ``stop`` (StreamClock)."""

    def __init__(self, start: int, stop: int) -> None:
        self.start, self.stop = start, stop
        self.clock = StreamClock()
        self.seconds = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step  # steps completed
        if step == self.start:
            self.clock.start()
        elif step == self.stop:
            self.seconds = self.clock.stop()


def parse_variants(variants: list[list[str]]) -> list[tuple[str, list[str]]]:
    """``--variant NAME KEY=VALUE ...`` arguments as (name, overrides); exits with one line if malformed."""
    out: list[tuple[str, list[str]]] = []
    for item in variants:
        name, sets = item[0], item[1:]
        if ("=" in name or not sets or any("=" not in kv for kv in sets)
                or any(kv.startswith(ENV_PREFIX) and not kv[len(ENV_PREFIX):].split("=", 1)[0] for kv in sets)):
            sys.exit(f"step_time: --variant {' '.join(item)}: give a name, then KEY=VALUE overrides or "
                     "env:NAME=VALUE variables (e.g. --variant anvil_triton model.backends.anvil=triton)")
        if name in {n for n, _ in out} or name in ("plain", "plain-eager", "lightning", "against"):
            sys.exit(f"step_time: --variant {name}: the name is taken; give each variant its own")
        out.append((name, sets))
    return out


def split_env(sets: list[str]) -> tuple[list[str], dict[str, str]]:
    """A variant's overrides as (config overrides, environment variables): ``env:NAME=VALUE`` is the latter."""
    config = [kv for kv in sets if not kv.startswith(ENV_PREFIX)]
    env = dict(kv[len(ENV_PREFIX):].split("=", 1) for kv in sets if kv.startswith(ENV_PREFIX))
    return config, env


def child_env(mode: str, variants: list[tuple[str, list[str]]]) -> Optional[dict[str, str]]:
    """The environment of one loop's process: this one's, with a variant's ``env:`` overrides (None: inherit)."""
    if not mode.startswith("variant "):
        return None
    _, env = split_env(dict(variants)[mode.split(" ", 1)[1]])
    return {**os.environ, **env} if env else None


def one_or_each(values: dict[str, str]) -> str:
    """A setting of every loop: the value once where all share it, else each loop's in turn."""
    if len(set(values.values())) == 1:
        return next(iter(values.values()))
    return ", ".join(f"{mode} {value}" for mode, value in values.items())


def combine_rounds(runs: dict[str, list[dict]]) -> dict[str, dict]:
    """Each loop's result over the rounds: its median round (the lower middle one for an even
    count), with every round's seconds under ``rounds``."""
    out = {}
    for mode, results in runs.items():
        middle = sorted(results, key=lambda r: r["seconds"])[(len(results) - 1) // 2]
        out[mode] = {**middle, "rounds": [r["seconds"] for r in results]}
    return out


def round_ratios(runs: dict[str, list[dict]], a: str, b: str) -> list[float]:
    """``a``'s time over ``b``'s within each round (the loops of one round ran back to back)."""
    return [ra["seconds"] / rb["seconds"] for ra, rb in zip(runs[a], runs[b])]


def without_option(argv: list[str], name: str) -> list[str]:
    """``argv`` less the option ``name`` and its value (``name VALUE`` or ``name=VALUE``)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == name:
            skip = True
        elif not arg.startswith(name + "="):
            out.append(arg)
    return out


def baseline_error(tree: str) -> Optional[str]:
    """The one-line error for a ``--baseline`` that is not a source tree of this project, else None."""
    if (Path(tree) / "benchmarks" / "step_time.py").is_file():
        return None
    return (f"step_time: --baseline {tree}: no benchmarks/step_time.py there (give the root of a source tree "
            "of this project, e.g. made with `git worktree add TREE REV`)")


def ratio_text(results: dict[str, dict], runs: dict[str, list[dict]], a: str, b: str) -> str:
    """``a``'s time over ``b``'s: the ratio of their median rounds and, over several rounds, the
    ratio within every round."""
    text = f"{results[a]['seconds'] / results[b]['seconds']:.3f}x"
    if len(runs[a]) > 1:
        text += " (medians; per round " + ", ".join(f"{x:.3f}x" for x in round_ratios(runs, a, b)) + ")"
    return text


def child_command(argv: list[str], mode: str, variants: list[tuple[str, list[str]]],
                  baseline: Optional[str] = None) -> list[str]:
    """The command line of one loop's process: this script's arguments, the loop, its own overrides.
    The ``baseline`` loop is the plain loop of the source tree ``baseline``, run by its own copy of
    this script (started in that tree, so its code, configs and relative paths are its own)."""
    if mode == "baseline":
        script = Path(baseline).resolve() / "benchmarks" / "step_time.py"
        return [sys.executable, str(script), *without_option(argv, "--baseline"), "--child", "plain",
                "--tag", "baseline"]
    if mode.startswith("variant "):
        name = mode.split(" ", 1)[1]
        cmd = [sys.executable, __file__, *argv, "--child", "plain", "--tag", f"variant-{name}"]
        for kv in split_env(dict(variants)[name])[0]:
            cmd += ["--set", kv]  # after the shared --set overrides, so these win
        return cmd
    cmd = [sys.executable, __file__, *argv, "--child", mode]
    if mode == "plain-eager":
        cmd += ["--set", "model.cuda_graphs=false"]
    return cmd


def _args_for(config: str, stage: int, steps: int, corpus: bool, overrides: list[str],
              overlay: Optional[str] = None) -> tuple[list[str], dict]:
    cfg = load_config(config)
    sched = dict(cfg.get("schedule") or {})
    stages = sched.get("stages")
    if not stages:
        import dataclasses

        from nanogpt_pl.schedule import _record_stages

        stages = [dataclasses.asdict(s) for s in _record_stages()]
    st = dict(stages[stage])
    st["steps"] = steps
    st["extension"] = False
    # One configuration key for every timed step: the stage's first MTP weights, prefix weight and
    # candidate count held (stretched over these few steps, a weight reaching zero or the next
    # value of a list would give the last steps a new key, and a capture on the clock, that the
    # real stage meets once).
    st["mtp_end"] = None
    for name in ("prefix_weight", "candidates"):
        if isinstance(st.get(name), list):
            st[name] = st[name][0]
    args = ["--config", config, *(["--config", overlay] if overlay else []),
            "--schedule.stages", json.dumps([st]),
            "--schedule.warmup_steps", "0", "--schedule.cooldown_frac", "0.0",
            "--schedule.sparse_cadence_start", "0", "--schedule.untie_step", "null",
            "--trainer.devices", "1", "--trainer.logger", "false", "--trainer.callbacks", "[]",
            "--trainer.enable_checkpointing", "false", "--trainer.limit_val_batches", "0",
            "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
            "--trainer.max_steps", str(steps)]
    return args + data_and_override_args(corpus, overrides), st


DEFAULT_WARMUP = 5


def fp8_bootstrap_steps(config: str, overrides: list[str]) -> Optional[tuple[int, int]]:
    """With the FP8 MLP, ``(first, done)``: the first step of lagged weight scales and the first
    step by which every refresh graph of that phase is captured; None without it.

    The MLP's weight scales are exact for its first ``EXACT_WEIGHT_REFRESHES`` (16) refreshes and
    lagged after (RECORD §7), a refresh a step (step 0's forward builds the first caches). The refresh
    graphs are keyed on that phase and on whether the Adam groups stepped, every ``adam_every`` steps
    (RECORD §8: 2), so the lagged phase's keys are met at steps 16 and 17 and captured on their
    second visits: replays from step 16 + 2 * adam_every. Timed steps in between hold eager refreshes
    and captures that a run meets once."""
    from nanogpt_pl.ops.fp8.formats import EXACT_WEIGHT_REFRESHES

    cfg = load_config(config)
    fp8_mlp = ((cfg.get("model") or {}).get("gpt") or {}).get("fp8_mlp", False)
    adam_every = (cfg.get("schedule") or {}).get("adam_every", 2)
    for item in overrides:
        key, value = item.split("=", 1)
        if key == "model.gpt.fp8_mlp":
            fp8_mlp = value.strip().lower() in ("true", "1", "yes")
        elif key == "schedule.adam_every":
            adam_every = int(value)
    return (EXACT_WEIGHT_REFRESHES, EXACT_WEIGHT_REFRESHES + 2 * adam_every) if fp8_mlp else None


def resolve_warmup(warmup: Optional[int], timed: int, bootstrap: Optional[tuple[int, int]]
                   ) -> tuple[int, Optional[str]]:
    """``--warmup`` as given, or its default (past the FP8 bootstrap where there is one), and a
    note where a given warmup puts the bootstrap's end among the ``timed`` steps."""
    if warmup is None:
        return (bootstrap[1] if bootstrap else DEFAULT_WARMUP), None
    if bootstrap and warmup < bootstrap[1] and warmup + timed > bootstrap[0]:
        return warmup, (f"step_time: --warmup {warmup}: the FP8 MLP's exact-scale bootstrap ends at step "
                        f"{bootstrap[0]}, inside the timed steps (with CUDA graphs, the refresh graphs after it are "
                        f"captured on the clock); give --warmup {bootstrap[1]} or more (or leave it out) to time "
                        "the lagged-scale steps a run spends most of its time in")
    return warmup, None


def config_train_files(config: str) -> Optional[str]:
    """The config's ``data.train_files`` glob (None when it sets none)."""
    return (load_config(config).get("data") or {}).get("train_files")


def embedded_corpus(config: str, choice: str) -> bool:
    """``--corpus``: ``quickstart``, or ``auto`` when the config's training files are missing."""
    train_glob = config_train_files(config)
    return choice == "quickstart" or (choice == "auto" and not (train_glob and glob.glob(train_glob)))


def data_and_override_args(corpus: bool, overrides: list[str]) -> list[str]:
    """Command-line options for the embedded corpus (repeated as needed) and ``KEY=VALUE`` overrides."""
    args = []
    if corpus:
        args += ["--data.train_files", "null", "--data.val_files", "null", "--data.corpus", "quickstart",
                 "--data.epochs", "100000"]
    for item in overrides:
        key, value = item.split("=", 1)
        args += [f"--{key}", value]
    return args


# Host calls that block until the GPU catches up (a synchronize, or an allocator call that implies one).
BLOCKING_CALLS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize", "cudaMemcpy",
                  "cudaFree", "cudaMalloc", "cudaHostAlloc", "cudaMallocHost", "cudaFreeHost")
# Prefixes of the record_function ranges the training step marks (SpeedrunModule.run_step,
# StepGraphs.run, this script's loop and the loader's prefetch thread, data/produce).
PHASE_PREFIXES = ("step/", "graphs/", "data/")


def profile_events(prof: Any) -> tuple[list[tuple[str, float, float]], list[tuple[str, float, float]]]:
    """Read a profile once (a long profile's event list is slow to build): ``(name, start, end)``
    in microseconds of every GPU kernel and copy, and of the host's phase ranges and blocking calls.

    The GPU-side copies of record_function ranges (``gpu_user_annotation``) are not GPU work and
    are left out: counted as kernels, they would fill the gaps inside every annotated range.
    """
    gpu, host = [], []
    cuda = torch.autograd.DeviceType.CUDA
    for e in prof.events():
        item = (e.name, e.time_range.start, e.time_range.end)
        if e.device_type == cuda:
            if not getattr(e, "is_user_annotation", False):
                gpu.append(item)
        elif e.name.startswith(PHASE_PREFIXES) or e.name in BLOCKING_CALLS:
            host.append(item)
    return gpu, host


def union_spans(spans: Any) -> list[tuple[float, float]]:
    """The union of ``(start, end)`` spans as sorted, disjoint spans (empty spans dropped)."""
    out: list[tuple[float, float]] = []
    for a, b in sorted(span for span in spans if span[1] > span[0]):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def gpu_idle_spans(events: list[tuple[str, float, float]], start: float, end: float) -> list[tuple[float, float]]:
    """The spans inside [start, end] where no GPU event of ``events`` runs, in time order."""
    idle, cursor = [], start
    for a, b in union_spans((a, b) for _, a, b in events):
        if a > cursor:
            idle.append((cursor, min(a, end)))
        cursor = max(cursor, b)
        if cursor >= end:
            break
    if cursor < end:
        idle.append((cursor, end))
    return [(a, b) for a, b in idle if b > a]


def overlap(spans: list[tuple[float, float]], a: float, b: float) -> float:
    """Length of [a, b] covered by ``spans`` (sorted, disjoint)."""
    i = max(bisect.bisect_right(spans, (a, float("inf"))) - 1, 0)
    total = 0.0
    while i < len(spans) and spans[i][0] < b:
        lo, hi = max(spans[i][0], a), min(spans[i][1], b)
        if hi > lo:
            total += hi - lo
        i += 1
    return total


def host_phases(gpu: list[tuple[str, float, float]], host: list[tuple[str, float, float]],
                start: float, end: float) -> dict[str, tuple[int, float, float]]:
    """Per host phase or blocking call: (calls, host time, GPU idle time inside it), microseconds.

    The GPU idle time a phase holds is where the host, not the GPU, set the pace; the row
    ``(no phase)`` is the idle time outside every phase (data, schedule, Python between them).
    """
    idle = gpu_idle_spans(gpu, start, end)
    out: dict[str, tuple[int, float, float]] = {}
    covered = []
    for name, a, b in host:
        n, t, i = out.get(name, (0, 0.0, 0.0))
        out[name] = (n + 1, t + (b - a), i + overlap(idle, a, b))
        if name.startswith("step/"):
            covered.append((a, b))
    total_idle = sum(b - a for a, b in idle)
    inside = sum(overlap(idle, a, b) for a, b in union_spans(covered))
    out["(no phase)"] = (0, 0.0, total_idle - inside)
    return out


def print_host_phases(gpu, host, steps: int, tag: str) -> None:
    if not gpu:
        return
    start = min(a for _, a, _ in gpu + host)
    end = max(b for _, _, b in gpu + host)
    rows = host_phases(gpu, host, start, end)
    print(f"{tag}: host phases and blocking calls, per step (calls, host ms, GPU idle ms inside):", file=sys.stderr)
    for name, (n, t, i) in sorted(rows.items(), key=lambda kv: -kv[1][2]):
        print(f"{tag}:   {name:<32} {n / steps:7.1f} {t / 1e3 / steps:9.2f} {i / 1e3 / steps:9.2f}", file=sys.stderr)


def gpu_busy_seconds(events: list[tuple[str, float, float]]) -> float:
    """Time the GPU was busy during a profile: the union of its kernel and copy intervals."""
    busy = sum(b - a for a, b in union_spans((a, b) for _, a, b in events))
    return busy * 1e-6  # the profiler's times are in microseconds


# Kernel kinds of a profile, first match wins (names as the CUDA profiler reports them).
_ATTENTION = ("flash", "_fwd_kernel", "_dq_kernel", "_dkdv_kernel", "_delta_kernel", "attention")
_PROJECT_TRITON = ("_softcap_ce", "quantize", "_transpose_bytes", "_fp8_gemm", "_refresh", "_gram_kernel",
                   "_poly_square", "_matmul_add")


def kernel_kind(name: str) -> str:
    """The kind of one GPU kernel or copy, for the profile's breakdown."""
    if name.startswith("Memcpy") or name.startswith("Memset") or name.startswith("memcpy"):
        return "copies and memsets"
    if any(k in name for k in _ATTENTION):  # before GEMMs: flash kernels name cutlass types
        return "attention"
    if "nvjet" in name or "gemm" in name.lower() or "cutlass" in name or "cublas" in name:
        return "GEMM (cuBLAS)"
    if name.startswith("triton_"):
        return "inductor (torch.compile) kernels"
    if any(k in name for k in _PROJECT_TRITON):
        return "project Triton (FP8, loss, optimizer)"
    if "elementwise_kernel" in name:
        return "ATen elementwise (unfused)"
    return "other"


def aten_functor(name: str) -> Optional[str]:
    """For an unfused ATen elementwise kernel, the operation it runs (add, fill, copy, mul, ...)."""
    if "elementwise_kernel" not in name:
        return None
    for pattern, op in (("FillFunctor", "fill"), ("CUDAFunctor_add", "add"), ("CUDAFunctorOnSelf_add", "add"),
                        ("copy_kernel", "copy"), ("MulFunctor", "mul"), ("DivFunctor", "div"),
                        ("where_kernel", "where"), ("pow_tensor", "pow"), ("lerp", "lerp"), ("addcmul", "addcmul")):
        if pattern in name:
            return op
    return "other"


def gpu_time_by_kind(kernels: list[tuple[str, float]]) -> tuple[dict[str, float], dict[str, tuple[int, float]]]:
    """GPU time (the durations' unit) by :func:`kernel_kind`, largest first, and the unfused ATen
    elementwise kernels' (launches, time) by operation."""
    kinds: dict[str, float] = {}
    ops: dict[str, tuple[int, float]] = {}
    for name, dur in kernels:
        kind = kernel_kind(name)
        kinds[kind] = kinds.get(kind, 0.0) + dur
        op = aten_functor(name)
        if op is not None:
            n, t = ops.get(op, (0, 0.0))
            ops[op] = (n + 1, t + dur)
    return (dict(sorted(kinds.items(), key=lambda kv: -kv[1])),
            dict(sorted(ops.items(), key=lambda kv: -kv[1][1])))


def print_gpu_breakdown(events: list[tuple[str, float, float]], steps: int, tag: str) -> None:
    kinds, ops = gpu_time_by_kind([(name, b - a) for name, a, b in events])
    total = sum(kinds.values()) or 1.0
    print(f"{tag}: GPU time by kind, ms per step: " + ", ".join(
        f"{k} {v / 1e3 / steps:.1f} ({100 * v / total:.0f}%)" for k, v in kinds.items()), file=sys.stderr)
    if ops:
        print(f"{tag}: unfused ATen elementwise by operation, per step: " + ", ".join(
            f"{k} {n / steps:.0f} launches {t / 1e3 / steps:.1f} ms" for k, (n, t) in ops.items()), file=sys.stderr)


def kernel_table(events: list[tuple[str, float, float]], steps: int) -> list[tuple[str, float, float, float, str]]:
    """Every GPU kernel and copy of a profile by its full name, largest total first: ``(kind, launches
    per step, ms per step, us per launch, name)``. The inductor kernels' names match the ``def``
    lines of ``TORCH_LOGS=output_code``, whose comments name the source operations they fuse."""
    by_name: dict[str, tuple[int, float]] = {}
    for name, a, b in events:
        n, t = by_name.get(name, (0, 0.0))
        by_name[name] = (n + 1, t + (b - a))
    rows = [(kernel_kind(name), n / steps, t / 1e3 / steps, t / n, name) for name, (n, t) in by_name.items()]
    return sorted(rows, key=lambda r: -r[2])


def write_kernel_table(events: list[tuple[str, float, float]], steps: int, path: Path) -> None:
    """:func:`kernel_table` as a tab-separated file (a header line, then one kernel a line)."""
    lines = ["kind\tlaunches_per_step\tms_per_step\tus_per_launch\tname"]
    lines += [f"{kind}\t{n:.2f}\t{ms:.4f}\t{us:.2f}\t{name}" for kind, n, ms, us, name in kernel_table(events, steps)]
    path.write_text("\n".join(lines) + "\n")


# Chrome-trace categories: the host calls that launch GPU work, and the GPU work itself.
_LAUNCH_CATS = ("cuda_runtime", "cuda_driver")
_GPU_CATS = ("kernel", "gpu_memset", "gpu_memcpy")
GRAPH_LAUNCHES = ("cudaGraphLaunch", "cuGraphLaunch")
_PROJECT_ROOTS = ("nanogpt_pl/", "callbacks/", "benchmarks/")
SMALL_KERNEL_US = 8.0  # "small": a launch gap (about a microsecond inside a graph) is a large share of it


def spans_around(spans: list[tuple], asked: list[tuple]) -> Iterator[tuple[tuple, list[tuple]]]:
    """For each query ``(time, ...)`` of ``asked``, in time order, the spans ``(start, end, ...)`` of one
    thread that hold its time, outermost first: one sweep over the spans, which nest."""
    todo = sorted(spans, key=lambda sp: (sp[0], -sp[1]))
    stack: list[tuple] = []
    i = 0
    for query in sorted(asked, key=lambda q: q[0]):
        ts = query[0]
        while i < len(todo) and todo[i][0] <= ts:
            while stack and stack[-1][1] < todo[i][0]:
                stack.pop()
            stack.append(todo[i])
            i += 1
        while stack and stack[-1][1] < ts:
            stack.pop()
        yield query, [sp for sp in stack if sp[1] >= ts]


def _traced_gpu_events(trace: dict) -> list[tuple[dict, Any, str, str, str, str]]:
    """Every GPU kernel, memset and copy of a Chrome trace with its launch: ``(event, correlation id,
    launching runtime call, launching op, the op around it, phase)`` (see :func:`trace_launches`)."""
    calls: dict[Any, tuple[Any, float, str]] = {}
    spans: dict[Any, list[tuple[float, float, str, bool]]] = {}
    gpu = []
    for e in trace.get("traceEvents", []):
        cat = e.get("cat", "")
        if cat in _LAUNCH_CATS:
            corr = e.get("args", {}).get("correlation")
            if corr is not None:
                calls[corr] = (e["tid"], float(e["ts"]), e.get("name", ""))
        elif cat == "cpu_op" or (cat == "user_annotation" and e["name"].startswith(PHASE_PREFIXES)):
            start = float(e["ts"])
            spans.setdefault(e["tid"], []).append((start, start + float(e.get("dur", 0.0)), e["name"], cat == "cpu_op"))
        elif cat in _GPU_CATS:
            gpu.append(e)
    # the enclosing spans of each launch: one sweep per thread over the spans (they nest) and the launches
    queries: dict[Any, list[tuple[float, Any]]] = {}
    for corr, (tid, ts, _) in calls.items():
        queries.setdefault(tid, []).append((ts, corr))
    chains: dict[Any, tuple[str, str, str]] = {}
    for tid, asked in queries.items():
        for (_, corr), around in spans_around(spans.get(tid, []), asked):
            ops = [name for _, _, name, is_op in around if is_op]
            phases = [name for _, _, name, is_op in around if not is_op]
            chains[corr] = (ops[-1] if ops else "?", ops[-2] if len(ops) > 1 else "", phases[-1] if phases else "?")
    out = []
    for e in gpu:
        corr = e.get("args", {}).get("correlation")
        op, around, phase = chains.get(corr, ("?", "", "?"))
        out.append((e, corr, calls[corr][2] if corr in calls else "?", op, around, phase))
    return out


def trace_launches(trace: dict) -> list[tuple[str, float, str, str, str]]:
    """Every GPU kernel, memset and copy of a Chrome trace (``export_chrome_trace``) with the host
    operation that launched it: ``(GPU event, duration us, launching op, the op around it, phase)``.

    The runtime call that launched a GPU event carries the same correlation id; the launching op is
    the innermost ``cpu_op`` on that call's thread whose span holds it, and the phase the innermost
    step range (``step/``, ``graphs/``, ``data/``). Run with the graphs off (``--set
    model.cuda_graphs=false``): a replayed graph's kernels all come from one ``cudaGraphLaunch``.
    A GPU event whose launch is not in the trace gets ``?``, and so does the phase of work autograd's
    own thread launches (the backward), which runs outside the step's ranges.
    """
    return [(e["name"], float(e.get("dur", 0.0)), op, around, phase)
            for e, _, _, op, around, phase in _traced_gpu_events(trace)]


def idle_gaps(trace: dict, steps: int) -> list[tuple[str, float, float, float]]:
    """Where the GPU waits: every gap between one GPU event's end (the latest end so far) and the
    next event's start, grouped by what the next event is, largest first: ``(where, gaps per step, idle
    us per step, largest gap us)``.

    - ``inside a graph [phase]``: both events come from one ``cudaGraphLaunch`` (its kernels, one after
      another: the device's own time between kernels, which only fewer kernels shorten);
    - ``graph start [phase]``: the first event of a graph launch after other work (the host's launch
      came late, or the driver's start of the graph);
    - ``<op> [phase] <event>``: an eagerly launched event, by the host op that launched it (``?`` for
      a Triton kernel, whose launch is no profiled op) and its name.

    The gaps inside a graph are the queue running as fast as it can; the others are where the host
    set the pace, and by which launch. Unlike the host phases' table, which names what the host was
    doing while the GPU waited, this names the work the GPU waited for.
    """
    events = sorted(((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)), corr, api, op, phase, e["name"])
                     for e, corr, api, op, _, phase in _traced_gpu_events(trace)), key=lambda r: r[0])
    groups: dict[str, tuple[int, float, float]] = {}
    cursor, last_corr = None, None
    for a, b, corr, api, op, phase, name in events:
        if cursor is not None and a > cursor:
            graph = api.startswith(GRAPH_LAUNCHES)
            if graph and corr == last_corr:
                where = f"inside a graph [{phase}]"
            elif graph:
                where = f"graph start [{phase}]"
            else:
                where = f"{op} [{phase}] {name}"
            n, total, top = groups.get(where, (0, 0.0, 0.0))
            groups[where] = (n + 1, total + (a - cursor), max(top, a - cursor))
        if cursor is None or b >= cursor:
            cursor, last_corr = b, corr
    rows = [(where, n / steps, total / steps, top) for where, (n, total, top) in groups.items()]
    return sorted(rows, key=lambda r: -r[2])


def write_idle_gaps(trace: dict, steps: int, path: Path, tag: str, top: int = 10) -> None:
    """:func:`idle_gaps` as a tab-separated file, and its largest rows on stderr."""
    rows = idle_gaps(trace, steps)
    lines = ["where\tgaps_per_step\tidle_us_per_step\tlargest_gap_us"]
    lines += [f"{where}\t{n:.2f}\t{us:.1f}\t{big:.1f}" for where, n, us, big in rows]
    path.write_text("\n".join(lines) + "\n")
    print(f"{tag}: GPU idle per step by the work it waited for (gaps, idle ms, largest gap us): {path}",
          file=sys.stderr)
    for where, n, us, big in rows[:top]:
        print(f"{tag}:   {n:8.1f} {us / 1e3:8.2f} {big:9.1f}  {where[:100]}", file=sys.stderr)


def launch_table(launches: list[tuple[str, float, str, str, str]], steps: int
                 ) -> list[tuple[str, float, float, str, str, str, str]]:
    """:func:`trace_launches` grouped by (launching op, the op around it, phase, GPU event), most
    launches first: ``(what, launches per step, us per step, op, around, phase, GPU event)`` with
    ``what`` one of memset, copy, small kernel (under :data:`SMALL_KERNEL_US`) or kernel."""
    groups: dict[tuple[str, str, str, str], tuple[int, float]] = {}
    for name, dur, op, around, phase in launches:
        n, total = groups.get((op, around, phase, name), (0, 0.0))
        groups[(op, around, phase, name)] = (n + 1, total + dur)
    rows = []
    for (op, around, phase, name), (n, total) in groups.items():
        if name.startswith("Memset") or name.startswith("memset"):
            what = "memset"
        elif name.startswith("Memcpy") or name.startswith("memcpy"):
            what = "copy"
        else:
            what = "small kernel" if total / n < SMALL_KERNEL_US else "kernel"
        rows.append((what, n / steps, total / steps, op, around, phase, name))
    return sorted(rows, key=lambda r: (-r[1], -r[2]))


def blocking_callers(trace: dict, steps: int, depth: int = 3) -> list[tuple[str, str, float, float]]:
    """Who made each blocking call of a trace recorded with Python stacks (``--stacks``): ``(call,
    callers, calls per step, host ms per step)``, most host time first.

    ``callers`` is the innermost ``depth`` Python frames around the call on its thread, innermost
    first, joined by `` <- ``; frames of this project (``nanogpt_pl/``, ``callbacks/``, ``benchmarks/``)
    are preferred, so a synchronize deep in torch reads as the project line that asked for it.
    """
    frames: dict[Any, list[tuple[float, float, str]]] = {}
    calls: dict[Any, list[tuple[float, float, str]]] = {}
    for e in trace.get("traceEvents", []):
        cat, name = e.get("cat", ""), e.get("name", "")
        if cat == "python_function":
            start = float(e["ts"])
            frames.setdefault(e["tid"], []).append((start, start + float(e.get("dur", 0.0)), name))
        elif cat in _LAUNCH_CATS and name in BLOCKING_CALLS:
            calls.setdefault(e["tid"], []).append((float(e["ts"]), float(e.get("dur", 0.0)), name))
    groups: dict[tuple[str, str], tuple[int, float]] = {}
    for tid, asked in calls.items():
        for (_, dur, name), spans in spans_around(frames.get(tid, []), asked):
            around = [f for _, _, f in reversed(spans)]
            ours = [f for f in around if any(root in f for root in _PROJECT_ROOTS)]
            callers = " <- ".join((ours or around)[:depth]) or "?"
            n, total = groups.get((name, callers), (0, 0.0))
            groups[(name, callers)] = (n + 1, total + dur)
    rows = [(name, callers, n / steps, total / 1e3 / steps) for (name, callers), (n, total) in groups.items()]
    return sorted(rows, key=lambda r: -r[3])


def write_launch_table(trace: dict, steps: int, path: Path, tag: str, top: int = 12) -> None:
    """The launch table of a trace as a tab-separated file, and its largest memset and
    small-kernel rows on stderr."""
    rows = launch_table(trace_launches(trace), steps)
    lines = ["what\tlaunches_per_step\tus_per_step\tlaunching_op\taround\tphase\tgpu_event"]
    lines += ["\t".join([what, f"{n:.2f}", f"{us:.1f}", op, around, phase, name])
              for what, n, us, op, around, phase, name in rows]
    path.write_text("\n".join(lines) + "\n")
    for what in ("memset", "small kernel"):
        picked = [r for r in rows if r[0] == what]
        print(f"{tag}: {what}s per step: {sum(r[1] for r in picked):.0f} launches, "
              f"{sum(r[2] for r in picked) / 1e3:.2f} ms; by launching op:", file=sys.stderr)
        for _, n, us, op, around, phase, name in picked[:top]:
            print(f"{tag}:   {n:7.1f} {us:8.1f} us  {op} <- {around or '-'} [{phase}] {name[:70]}", file=sys.stderr)
    print(f"{tag}: every GPU event by launching op: {path}", file=sys.stderr)


class _ReserveShapes(L.Callback):
    """What ``SpeedrunTimer`` does before its warmup (the timer is not in these runs): the step's
    input shapes sized from the run's batch plan (``reserve_run_shapes``)."""

    def on_train_start(self, trainer, pl_module) -> None:
        reserve_run_shapes(trainer, pl_module)


def run_lightning(args: list[str], warmup: int, steps: int) -> dict:
    cli = cli_main(args, run=False, save_config=False)
    clock = _Clock(warmup, warmup + steps)
    cli.trainer.callbacks.extend([_ReserveShapes(), clock])
    _reset_peak()
    cli.trainer.fit(cli.model, cli.datamodule)
    return {"seconds": clock.seconds, "peak": _peak(), "gpt": cli.model.gpt_config}


def run_plain(args: list[str], warmup: int, steps: int, profile: Optional[str] = None, cprofile: bool = False,
              tag: str = "plain", stacks: bool = False) -> dict:
    cli = cli_main(args, run=False, save_config=False)
    module, data = cli.model, cli.datamodule
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    data.prepare_data()
    data.setup("fit")
    module.prepare_for_training(device)
    module.to(device)
    opt = module.configure_optimizers()
    module.use_plain_optimizer(opt)
    module.train()
    # with a profile, the timed steps run twice: unprofiled (the step time) and then profiled (the
    # GPU's busy time); the profiler's own host work is in the second wall only
    total = warmup + (2 * steps if profile else steps)
    module.reserve_shapes(data.plan_bounds(total))  # as SpeedrunTimer does before its warmup
    stream = data.train_dataloader()
    it = iter(stream)
    _reset_peak()
    clock = StreamClock()
    frozen = FrozenGC()
    prof = cprof = None
    seconds = profiled_seconds = None
    for step in range(total):
        if step == warmup:
            frozen.pause()  # as in training: no garbage collection while the clock runs (SpeedrunTimer)
            clock.start()
            before = module.graph_counts()
            if cprofile:
                import cProfile

                cprof = cProfile.Profile()
                cprof.enable()
        if profile and step == warmup + steps:
            seconds = clock.stop()
            # started before its clock: the profiler's start-up (tens of ms) is not a step's time
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                      torch.profiler.ProfilerActivity.CUDA], with_stack=stacks)
            prof.__enter__()
            _sync()  # the trace holds the profiled steps only
            clock = StreamClock()
            clock.start()
        with torch.profiler.record_function("step/data"):
            with torch.profiler.record_function("data/next"):  # waits for the loader's prefetch thread
                batch = next(it)
            with torch.profiler.record_function("data/prepare"):  # candidate sets, prefix targets
                batch = module.prepare_batch(batch, step)
            with torch.profiler.record_function("data/transfer"):
                batch = module.transfer_batch_to_device(batch, device, 0)
        with torch.profiler.record_function("step/schedule"):
            module.apply_schedule(step)
        module.run_step(batch)
    if profile:
        profiled_seconds = clock.stop()
    else:
        seconds = clock.stop()
    frozen.resume()
    after = module.graph_counts()
    if cprof is not None:
        import pstats

        cprof.disable()
        stats = pstats.Stats(cprof, stream=sys.stderr)
        stats.sort_stats("tottime").print_stats(35)
        stats.sort_stats("cumulative").print_stats(45)
    busy = None
    if prof is not None:
        prof.__exit__(None, None, None)
        out = Path(profile)
        out.mkdir(parents=True, exist_ok=True)
        trace = out / f"{tag}-trace.json"
        prof.export_chrome_trace(str(trace))
        print(f"{tag}: trace {trace}", file=sys.stderr)
        if torch.cuda.is_available():
            events, host = profile_events(prof)
            busy = gpu_busy_seconds(events)
            window = 1e-6 * (max(b for _, _, b in events) - min(a for _, a, _ in events))
            print(f"{tag}: per step, GPU busy {1e3 * busy / steps:.1f} ms (profiled) of {1e3 * seconds / steps:.1f} ms "
                  f"unprofiled wall: {100 * (1 - busy / seconds):.1f}% idle; of the profiled steps' "
                  f"{1e3 * profiled_seconds / steps:.1f} ms wall: {100 * (1 - busy / profiled_seconds):.1f}% idle "
                  f"(the profiler's own host work included); {1e3 * window / steps:.1f} ms from the first kernel "
                  f"to the last ({100 * (1 - busy / window):.1f}% idle: the queue was drained before the profile, "
                  f"so the first step's host work is in the wall time only)", file=sys.stderr)
            print_gpu_breakdown(events, steps, tag)
            table = out / f"{tag}-kernels.tsv"
            write_kernel_table(events, steps, table)
            print(f"{tag}: every kernel, largest first: {table}", file=sys.stderr)
            traced = json.loads(trace.read_text())
            write_launch_table(traced, steps, out / f"{tag}-launchers.tsv", tag)
            write_idle_gaps(traced, steps, out / f"{tag}-idle.tsv", tag)
            if stacks:
                print(f"{tag}: blocking calls by their Python callers, per step (calls, host ms):", file=sys.stderr)
                for name, callers, n, ms in blocking_callers(traced, steps)[:12]:
                    print(f"{tag}:   {n:6.1f} {ms:8.2f}  {name}  {callers[:160]}", file=sys.stderr)
            print_host_phases(events, host, steps, tag)
        avg = prof.key_averages()
        sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
        print(avg.table(sort_by=sort, row_limit=30, max_name_column_width=60), file=sys.stderr)
        print(avg.table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=60), file=sys.stderr)
    stream.close()
    graphs = None
    if getattr(module, "_graphs", None) is not None:
        g = module._graphs.graphs
        checks = ", ".join(f"loss {c.loss_rel:.1e} grads {c.grad_rel:.1e}{'' if c.passed else ' FAILED'}"
                           for c in g.checks.values())
        graphs = (f"{tag}: CUDA graphs: {after['keys']} keys captured, {after['replays']} micro-batches replayed, "
                  f"{after['eager']} eager; self-checks (relative): {checks or 'none'}; keys differ in "
                  f"{g.key_differences() or 'nothing'}")
        timed = {k: after[k] - before[k] for k in after}
        # a key first seen or captured inside the timed steps puts its eager runs, capture and
        # self-check (and the device synchronize a capture starts with) on the clock
        graphs += ("; sparse pulls: " + (f"{after['pull_replays']} replayed, {after['pull_eager']} eager"
                                         if module._graphs.pulls is not None else "eager"))
        graphs += ("; FP8 refreshes: " + (f"{after['refresh_replays']} replayed, {after['refresh_eager']} eager"
                                          if module._graphs.refresh is not None else "eager"))
        graphs += (f"; in the timed steps: {timed['replays']} replayed, {timed['eager']} eager, "
                   f"{timed['keys']} keys captured, {timed['pull_replays']} pulls replayed, {timed['pull_eager']} "
                   f"eager, {timed['refresh_replays']} FP8 refreshes replayed, {timed['refresh_eager']} eager, "
                   f"{timed['adam_replays']} Adam updates replayed, {timed['adam_eager']} eager"
                   + (" (captures on the clock: raise --warmup)" if timed["eager"] or timed["keys"]
                      or timed["pull_eager"] or timed["refresh_eager"] or timed["adam_eager"] else ""))
    return {"seconds": seconds, "peak": _peak(), "gpt": module.gpt_config, "busy": busy, "graphs": graphs,
            "profiled_seconds": profiled_seconds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/speedrun_1gpu.yaml")
    ap.add_argument("--stage", type=int, default=0, help="index of the schedule stage whose shapes to time")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=None,
                    help=f"untimed steps first (default {DEFAULT_WARMUP}, or with the FP8 MLP past its exact-scale "
                         "bootstrap and the refresh graphs captured after it: 20 at the record's settings)")
    ap.add_argument("--corpus", choices=["auto", "quickstart", "config"], default="auto")
    ap.add_argument("--only", choices=["both", "lightning", "plain"], default="both")
    ap.add_argument("--child", choices=["lightning", "plain", "plain-eager", "against"], default=None,
                    help=argparse.SUPPRESS)
    ap.add_argument("--profile", nargs="?", const="profiles", default=None, metavar="DIR",
                    help="run the plain loops' timed steps again under the profiler: Chrome traces in DIR "
                         "(default ./profiles), top ops, GPU busy vs the unprofiled and profiled wall per step")
    ap.add_argument("--eager", action=argparse.BooleanOptionalAction, default=True,
                    help="also time the plain loop with model.cuda_graphs=false and print captured/eager")
    ap.add_argument("--stacks", action="store_true",
                    help="with --profile: record Python stacks and name the Python callers of every blocking call "
                         "(synchronizes, cudaFree, ...); the stacks slow the profiled steps")
    ap.add_argument("--cprofile", action="store_true",
                    help="Python profile (cProfile) of the plain loop's timed steps: where the host time goes")
    ap.add_argument("--against", default=None, metavar="OVERLAY",
                    help="also time the plain loop with this config overlay layered on --config (same run)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="config override, e.g. model.gpt.ngram_rows=0 (repeatable)")
    ap.add_argument("--variant", action="append", nargs="+", default=[], metavar="NAME KEY=VALUE",
                    help="also time the plain loop with these overrides (repeatable; same run, ratio to plain)")
    ap.add_argument("--baseline", default=None, metavar="TREE",
                    help="also time the plain loop of another source tree (its own code and configs, e.g. "
                         "from `git worktree add TREE REV`), in its own process; same run, ratio to plain")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run every loop this many times, interleaved; report the median round and each round")
    ap.add_argument("--tag", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    try:
        queues = scale_launch_queues()  # as main.py does, before anything initializes CUDA
        set_cublaslt_workspace()  # the loops' processes inherit it
    except (LaunchQueueError, GemmWorkspaceError) as exc:
        sys.exit(f"step_time: {exc}")
    if a.rounds < 1:
        sys.exit(f"step_time: --rounds {a.rounds}: give 1 or more")
    if a.stacks and not a.profile:
        sys.exit("step_time: --stacks names the callers in a profile: give --profile [DIR] too")
    variants = parse_variants(a.variant)
    if a.against and not Path(a.against).is_file():
        sys.exit(f"step_time: --against {a.against}: no such file (give a config overlay, e.g. "
                 "configs/ablations/plain_network.yaml)")
    if a.baseline and baseline_error(a.baseline):
        sys.exit(baseline_error(a.baseline))
    if not torch.cuda.is_available():
        print("no CUDA GPU: running on the CPU (for checking the script; the figures mean little)")
    timed = a.steps * (2 if a.profile else 1)  # a profile times the steps again, profiled
    a.warmup, note = resolve_warmup(a.warmup, timed, fp8_bootstrap_steps(a.config, a.set))
    if note and not a.child:
        print(note, flush=True)
    corpus = embedded_corpus(a.config, a.corpus)
    train_glob = config_train_files(a.config)
    total = a.warmup + timed
    args, stage = _args_for(a.config, a.stage, total, corpus, a.set,
                            overlay=a.against if a.child == "against" else None)

    if a.child:
        if a.child in ("plain", "plain-eager", "against"):
            result = run_plain(args, a.warmup, a.steps, profile=a.profile, cprofile=a.cprofile, tag=a.tag or a.child,
                               stacks=a.stacks)
        else:
            result = run_lightning(args, a.warmup, a.steps)
        print("RESULT " + json.dumps({"seconds": result["seconds"], "peak": result["peak"], "queues": queues,
                                      "busy": result.get("busy"), "graphs": result.get("graphs"),
                                      "flops_tok": result["gpt"].flops_per_token(
                                          stage["seq_len"], stage["window_short"], stage["window_long"])}))
        return

    # each loop in its own process, so neither sees the other's memory or compile caches
    runs: dict[str, list[dict]] = {}
    modes = ["plain", "lightning"] if a.only == "both" else [a.only]
    if a.eager and "plain" in modes:
        modes.insert(modes.index("plain") + 1, "plain-eager")
    if a.against:
        modes.append("against")
    if a.baseline:
        modes.append("baseline")
    modes += [f"variant {name}" for name, _ in variants]
    for rnd in range(a.rounds):
        for mode in modes:
            # the warmup as resolved here: a baseline tree's script may default to another
            cmd = child_command([*sys.argv[1:], "--warmup", str(a.warmup)], mode, variants, a.baseline)
            proc = subprocess.run(cmd, capture_output=True, text=True, env=child_env(mode, variants),
                                  cwd=a.baseline if mode == "baseline" else None)
            if (a.profile or a.cprofile) and mode != "lightning":
                print(proc.stderr[-40000:])
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            if proc.returncode != 0 or not lines:
                print(proc.stdout[-3000:], proc.stderr[-5000:])
                sys.exit(f"the {mode} loop failed (exit {proc.returncode})")
            r = json.loads(lines[-1][len("RESULT "):])
            runs.setdefault(mode, []).append(r)
            # each loop's figure as soon as it is in: a run cut short (a time limit) keeps what it measured
            graphs = f"; {r['graphs']}" if r.get("graphs") else ""
            which = f" (round {rnd + 1} of {a.rounds})" if a.rounds > 1 else ""
            print(f"{mode}{which}: {1e3 * r['seconds'] / a.steps:.1f} ms/step, "
                  f"{stage['batch_tokens'] * a.steps / r['seconds']:,.0f} tokens/s{graphs}", flush=True)
    results = combine_rounds(runs)
    tokens = stage["batch_tokens"]  # one device holds the whole global batch
    flops_tok = next(iter(results.values()))["flops_tok"]
    print(f"\nstep_time: {a.config} stage {a.stage} ({tokens} tokens/step, seq_len {stage['seq_len']}, "
          f"candidates {stage.get('candidates')}), {a.steps} timed steps after {a.warmup}, "
          f"data: {'embedded quickstart corpus' if corpus else train_glob}")
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(f"device: {device}  torch {torch.__version__}  "
          f"date {datetime.date.today().isoformat()}")
    scales = {mode: r.get("queues") or "driver default" for mode, r in results.items()}
    print(f"launch queues (CUDA_SCALE_LAUNCH_QUEUES): {one_or_each(scales)}")
    # what each loop's process read: its environment (a baseline tree too old to set one inherits this one's)
    sizes = {mode: (child_env(mode, variants) or os.environ).get(WORKSPACE_ENV) for mode in results}
    print("cuBLASLt workspace (CUBLASLT_WORKSPACE_SIZE): "
          + one_or_each({m: "PyTorch's default" if v is None else f"{v} KiB" for m, v in sizes.items()}))
    print(f"model FLOPs/token (dense, full vocab): {flops_tok / 1e9:.3f} GFLOP")
    print(f"{'loop':<12} {'ms/step':>9} {'tokens/s':>12} {'MFU':>7} {'peak GiB':>9} {'vs plain':>9} {'GPU busy':>9}")
    base = results.get("plain")
    for mode, r in results.items():
        ms = 1e3 * r["seconds"] / a.steps
        tps = tokens * a.steps / r["seconds"]
        mfu = flops_tok * tps / PEAK_BF16_FLOPS
        ratio = f"{r['seconds'] / base['seconds']:.3f}x" if base else "-"
        busy = f"{100 * r['busy'] / r['seconds']:.1f}%" if r.get("busy") is not None else "-"
        print(f"{mode:<12} {ms:9.1f} {tps:12,.0f} {100 * mfu:6.1f}% {r['peak'] / 2**30:9.1f} {ratio:>9} {busy:>9}")
    for r in results.values():
        if r.get("graphs"):
            print(r["graphs"])
    if a.rounds > 1:
        print(f"each loop's median of {a.rounds} rounds above; every round, ms/step:")
        for mode, r in results.items():
            print(f"  {mode:<12} " + ", ".join(f"{1e3 * sec / a.steps:.1f}" for sec in r["rounds"]))
    if "plain" in results and "plain-eager" in results:
        # the same loop and config with model.cuda_graphs=false: what the graphs buy (RECORD §11)
        print(f"captured/eager step time: {results['plain']['seconds'] / results['plain-eager']['seconds']:.3f}x "
              f"(speed-up {results['plain-eager']['seconds'] / results['plain']['seconds']:.2f}x)")
    if "plain" in results and "against" in results:
        print(f"{a.config} / {a.config} + {a.against} step time (plain loops): "
              f"{results['plain']['seconds'] / results['against']['seconds']:.3f}x")
    if "plain" in results and "baseline" in results:
        print(f"baseline ({a.baseline}) / plain step time: {ratio_text(results, runs, 'baseline', 'plain')}")
    for name, sets in variants:
        if "plain" in results and f"variant {name}" in results:
            print(f"plain / {name} ({' '.join(sets)}) step time: "
                  f"{ratio_text(results, runs, 'plain', f'variant {name}')}")


if __name__ == "__main__":
    main()
