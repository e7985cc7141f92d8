"""Optimizer step time of ANVIL II at the record's matrix shapes on one GPU, against Muon and AdamW.

What is measured (bf16 parameters, random bf16 gradients, one process, no communication):

* **all matrices**: the record model's hidden matrices on one GPU: qk 7 x [2, 768, 768] seen
  as 42 blocks of 256x768, v/o 14 x 768x768, MLP fc/proj 22 x 2816x768 (11 MLPs including
  the parallel one; RECORD §8 "Banks and sharding").
* **rank share at world 8**: the matrices one of 8 ranks owns and updates in the record
  (6 qk blocks, 2 v/o, 3 MLP; RECORD §8), i.e. the per-GPU optimizer compute of the record,
  without the reduce-scatter/all-gather (those overlap the work in the real run).
* ANVIL paths: the default on a GPU (PyTorch cascade, the elementwise update as Triton kernels,
  ``nanogpt_pl.ops.triton.anvil_update``, each bank's work replayed from a CUDA graph), the same
  with the PyTorch update (``update_backend="reference"``; its ratio to the default is printed),
  the PyTorch update eagerly, the Triton cascade with and without the graph, and (full run only)
  the torch.compile'd elementwise parts; ``torch.optim.Muon`` (2-D parameters only, so the
  qk blocks are separate 256x768 parameters; 5 Newton-Schulz steps) and fused AdamW over
  the same matrices, in the same run.
* the cascade alone per bank shape, Triton vs PyTorch.
* the dense Adam groups of the record network on one GPU (``DistAdam``, RECORD §8's Adam
  table without the sparse channels): embed and lm_head (bf16 50,304 x 768) and the small
  fp32 gates, lambdas and scalars, PyTorch update against one Triton pass a parameter
  (``update_backend``; the ratio is printed).

Each row: median and p90 ms per ``step()`` over the timed steps (CUDA events), peak GPU
memory during the steps (parameters, gradients, optimizer state and temporaries), the
ratio to Muon and AdamW, and the share of a 45 ms training step (RECORD §11: stage 2
runs at ~45-47 ms/step on 8xH100). The target is ANVIL <= 5% of a training step.

Run: ``python benchmarks/optimizer_step.py [--quick]`` on a CUDA machine.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.gpu_timing import time_cuda  # noqa: E402
from nanogpt_pl.model.gpt import GPT, GPTConfig  # noqa: E402
from nanogpt_pl.optim.adam import DistAdam  # noqa: E402
from nanogpt_pl.optim.anvil import Anvil  # noqa: E402
from nanogpt_pl.optim.groups import adam_families  # noqa: E402
from nanogpt_pl.optim.polar import polar_cascade  # noqa: E402

RECORD_STEP_MS = 45.0  # RECORD §11: stage-2 step time of the record, ~45-47 ms
TARGET_FRACTION = 0.05  # the task's target: the ANVIL step costs at most 5% of a training step
# RECORD §2/§8: 7 attention layers, 11 MLPs (incl. the parallel one), model dim 768, MLP 2816,
# heads of 128 grouped in pairs for the qk blocks.
ATTN_LAYERS, MLPS, DIM, HIDDEN, QK_BLOCK = 7, 11, 768, 2816, 256
# RECORD §8: one of 8 ranks owns 6 qk blocks (one layer's qk_w), 2 v/o and 3 MLP matrices.
SHARE = dict(attn_layers=1, fc=2, proj=1)


def record_matrices(attn_layers: int, fc: int, proj: int, device: torch.device) -> list[torch.nn.Parameter]:
    g = torch.Generator(device="cpu").manual_seed(0)

    def param(*shape: int) -> torch.nn.Parameter:
        return torch.nn.Parameter((torch.randn(*shape, generator=g) * 0.02).to(device, torch.bfloat16))

    out = []
    for _ in range(attn_layers):
        qk = param(2, DIM, DIM)
        qk.anvil_block = (QK_BLOCK, DIM)
        out += [qk, param(DIM, DIM), param(DIM, DIM)]
    out += [param(HIDDEN, DIM) for _ in range(fc)]
    for _ in range(proj):
        p = param(HIDDEN, DIM)
        p.anvil_lr_mul = 2.0  # RECORD §8: MLP c_proj at lr x2
        out.append(p)
    return out


def as_2d(params: list[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    """The same matrices as 2-D parameters (Muon takes nothing else): qk blocks split out."""
    out = []
    for p in params:
        block = getattr(p, "anvil_block", None)
        if block is None:
            out.append(torch.nn.Parameter(p.detach().clone()))
        else:
            out += [torch.nn.Parameter(m.clone()) for m in p.detach().view(-1, *block)]
    return out


def fill_grads(params: list[torch.nn.Parameter]) -> None:
    g = torch.Generator(device=params[0].device).manual_seed(1)
    for p in params:
        p.grad = torch.randn(p.shape, device=p.device, generator=g).to(p.dtype)


def time_fn(fn: Callable[[], None], warmup: int, steps: int) -> tuple[float, float, float]:
    """(median ms, p90 ms, peak MiB) of ``fn`` after ``warmup`` untimed calls; the peak counts
    everything allocated (parameters, gradients, optimizer state, temporaries)."""
    t = time_cuda(fn, warmup, steps, absolute_peak=True)
    return t.median_ms, t.p90_ms, t.peak_bytes / 2**20


def optimizer_row(name: str, build: Callable[[], tuple[torch.optim.Optimizer, list]], warmup: int, steps: int,
                  schedule: bool) -> dict:
    torch.cuda.empty_cache()
    opt, params = build()
    fill_grads(params)
    step = [0]

    def run() -> None:
        if schedule:
            group = opt.param_groups[0]
            group["lr"], group["momentum"] = 0.023, 0.93
        opt.step()
        step[0] += 1

    median, p90, peak = time_fn(run, warmup, steps)
    return dict(name=name, median=median, p90=p90, peak=peak)


def dense_adam_params(device: torch.device) -> list[dict]:
    """The record network's dense Adam groups (the families the sparse channels leave to DistAdam),
    embed and lm_head in bf16 as on the GPU (``SpeedrunModule.setup_device``), the rest fp32."""
    with torch.device("meta"):
        model = GPT(GPTConfig())
    g = torch.Generator(device="cpu").manual_seed(2)
    groups = []
    for name, params in adam_families(model).items():
        if name == "value_embeds":  # a sparse channel in the speedrun configs
            continue
        dtype = torch.bfloat16 if name in ("embed", "lm_head") else torch.float32
        made = [torch.nn.Parameter((torch.randn(p.shape, generator=g) * 0.02).to(device, dtype)) for p in params]
        groups.append(dict(params=made, betas=(0.9, 0.99), sharded=name in ("embed", "lm_head")))
    return groups


def dense_adam_row(name: str, update: str, warmup: int, steps: int) -> dict:
    def build():
        groups = dense_adam_params(torch.device("cuda"))
        opt = DistAdam(groups, lr=0.008, eps=1e-10, weight_decay=0.005, cautious_wd=True, decay_lr_power=2,
                       update_backend=update)
        return opt, [p for group in groups for p in group["params"]]
    return optimizer_row(name, build, warmup, steps, False)


def cascade_row(name: str, shape: tuple[int, int, int], backend: str, warmup: int, steps: int) -> dict:
    g = torch.randn(*shape, device="cuda")
    median, p90, peak = time_fn(lambda: polar_cascade(g, backend=backend), warmup, steps)
    return dict(name=name, median=median, p90=p90, peak=peak)


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="fewer steps, no torch.compile'd ANVIL variants")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps (compile, autotune)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per row")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/optimizer_step.py measures GPU time: run it on a CUDA machine")
    warmup = args.warmup or (3 if args.quick else 10)
    steps = args.steps or (10 if args.quick else 50)
    dev = torch.device("cuda")
    name = torch.cuda.get_device_name(dev)
    print(f"device: {name}; torch {torch.__version__}; warmup {warmup}, timed steps {steps}")

    rows: list[dict] = []
    for scope, kw in (("all matrices", dict(attn_layers=ATTN_LAYERS, fc=MLPS, proj=MLPS)),
                      ("rank share at world 8", SHARE)):
        def anvil(backend: str, compile: Optional[bool], graph: Optional[bool], update: str) -> Callable:
            def build():
                params = record_matrices(device=dev, **kw)
                return Anvil(params, backend=backend, update_backend=update, compile=compile, cuda_graph=graph,
                             engage_step=0), params
            return build

        def muon():
            params = as_2d(record_matrices(device=dev, **kw))
            return torch.optim.Muon(params, lr=0.023, weight_decay=0.0, momentum=0.95), params

        def adamw():
            params = record_matrices(device=dev, **kw)
            return torch.optim.AdamW(params, lr=3e-3, betas=(0.9, 0.95), weight_decay=0.0, fused=True), params

        # (label, backend, compile, cuda_graph, update_backend); the first is what Anvil() does by default on a GPU
        variants = [("default (triton update, reference cascade, CUDA graph)", "auto", None, None, "auto"),
                    ("reference update, reference cascade, CUDA graph", "auto", None, None, "reference"),
                    ("reference update and cascade, eager", "reference", False, False, "reference"),
                    ("triton cascade, CUDA graph", "triton", False, True, "auto"),
                    ("triton cascade, eager", "triton", False, False, "auto"),
                    ("reference cascade + compile, eager", "reference", True, False, "reference")]
        if args.quick:  # compiled variants cost compile time
            variants = variants[:4]
        scoped = [optimizer_row(f"{scope}: ANVIL {label}", anvil(backend, comp, graph, update), warmup, steps, True)
                  for label, backend, comp, graph, update in variants]
        base = {}
        if hasattr(torch.optim, "Muon"):
            base["muon"] = optimizer_row(f"{scope}: torch.optim.Muon", muon, warmup, steps, False)
        base["adamw"] = optimizer_row(f"{scope}: torch AdamW (fused)", adamw, warmup, steps, False)
        for r in scoped + list(base.values()):
            r["vs_muon"] = r["median"] / base["muon"]["median"] if "muon" in base else float("nan")
            r["vs_adamw"] = r["median"] / base["adamw"]["median"]
            r["of_step"] = r["median"] / RECORD_STEP_MS
        rows += scoped + list(base.values())

    cascade = []
    for shape in ((42, QK_BLOCK, DIM), (14, DIM, DIM), (22, HIDDEN, DIM), (6, QK_BLOCK, DIM), (3, HIDDEN, DIM)):
        t = cascade_row(f"cascade {shape[0]}x{shape[1]}x{shape[2]}: triton", shape, "triton", warmup, steps)
        r = cascade_row(f"cascade {shape[0]}x{shape[1]}x{shape[2]}: reference", shape, "reference", warmup, steps)
        t["vs_torch"] = t["median"] / r["median"]
        r["vs_torch"] = 1.0
        cascade += [t, r]

    adam = [dense_adam_row(f"dense Adam groups: {u}", u, warmup, steps) for u in ("reference", "triton")]

    print()
    print(f"{'optimizer step (bf16 matrices)':62s} {'median ms':>9s} {'p90 ms':>8s} {'peak MiB':>9s} "
          f"{'x Muon':>7s} {'x AdamW':>8s} {'% of 45ms':>9s}")
    for r in rows:
        print(f"{r['name']:62s} {r['median']:9.3f} {r['p90']:8.3f} {r['peak']:9.0f} {r['vs_muon']:7.2f} "
              f"{r['vs_adamw']:8.2f} {100 * r['of_step']:8.2f}%")
    print()
    print(f"{'cascade alone (6 maps, bf16)':62s} {'median ms':>9s} {'p90 ms':>8s} {'peak MiB':>9s} {'x torch':>7s}")
    for r in cascade:
        print(f"{r['name']:62s} {r['median']:9.3f} {r['p90']:8.3f} {r['peak']:9.0f} {r['vs_torch']:7.2f}")
    print()
    print(f"{'dense Adam (embed, lm_head, gates, scalars)':62s} {'median ms':>9s} {'p90 ms':>8s} {'peak MiB':>9s}")
    for r in adam:
        print(f"{r['name']:62s} {r['median']:9.3f} {r['p90']:8.3f} {r['peak']:9.0f}")
    print(f"dense Adam: triton {adam[1]['median']:.3f} ms vs reference {adam[0]['median']:.3f} ms: "
          f"{adam[0]['median'] / adam[1]['median']:.2f}x")
    share = next(r for r in rows if r["name"].startswith("rank share at world 8: ANVIL default"))
    full = next(r for r in rows if r["name"].startswith("all matrices: ANVIL default"))
    print()
    for scope, default in (("all matrices", full), ("rank share at world 8", share)):
        plain = next(r for r in rows if r["name"].startswith(f"{scope}: ANVIL reference update, reference cascade"))
        print(f"{scope}: the default's triton update {default['median']:.3f} ms vs the reference update "
              f"{plain['median']:.3f} ms: {plain['median'] / default['median']:.2f}x")
    print(f"target: ANVIL <= {100 * TARGET_FRACTION:.0f}% of a {RECORD_STEP_MS:.0f} ms step. "
          f"Rank share at world 8: {100 * share['of_step']:.2f}% "
          f"({'met' if share['of_step'] <= TARGET_FRACTION else 'NOT met'}); "
          f"all matrices on one GPU: {100 * full['of_step']:.2f}% "
          f"({'met' if full['of_step'] <= TARGET_FRACTION else 'NOT met'}).")


if __name__ == "__main__":
    main()
