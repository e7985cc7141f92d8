"""Validation loss after a fixed number of steps: ANVIL II vs torch.optim.Muon vs AdamW on the hidden matrices.

The same model (``nanogpt_pl.model.gpt.GPT``, the quickstart shape by default), the same
initial weights, the same batches in the same order (the embedded quickstart corpus,
``nanogpt_pl.data.corpus``), the same Adam groups for embeddings, lm_head, value
embeddings and scalars (RECORD §8's betas and multipliers) and the same lr schedule
shape (``nanogpt_pl.schedule.Schedule``: constant, then a cooldown to 0.1); only the
optimizer of the hidden matrices changes:

* ``anvil``: ``nanogpt_pl.optim.anvil.Anvil`` with the record's settings (lr 0.023, wd 2.25,
  momentum 0.85 → 0.93 → 0.85, engage step scaled to the run: 514/1194 of the steps).
* ``muon``: ``torch.optim.Muon`` (2-D parameters only: the qk blocks are handed to it as
  separate matrices sharing the parameter's storage), lr 0.02, momentum 0.95, Nesterov.
* ``adamw``: ``DistAdam`` with decay_lr_power 1 (AdamW), lr 0.004, betas (0.9, 0.95).

Prints the final validation loss (mean full-softmax cross-entropy over a fixed set of
validation tokens) of each, the margins of ANVIL over the others, and the time per run.
A plain loop, no Lightning: this measures the optimizers, not the trainer.

With ``--sweep`` each optimizer runs at several multiples of its lr and the best of each is
compared (a fair comparison tunes every contender). ``--text installed`` trains on a larger
real-text corpus (the docstrings of every installed package too), so a long run does not
repeat the small quickstart corpus many times; ``--model small`` uses a 6-layer, 512-wide model.

Run: ``python benchmarks/optimizer_quality.py [--quick] [--steps N] [--model small] [--text installed]
[--sweep 0.5 1 2]`` (GPU; ``--device cpu`` works for a smoke test).
"""

from __future__ import annotations

import argparse
import math
import sys
import sysconfig
import time
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nanogpt_pl.data.corpus import build_corpus, stdlib_sources  # noqa: E402
from nanogpt_pl.data.planning import pack_cu_seqlens  # noqa: E402
from nanogpt_pl.data.shards import open_shard  # noqa: E402
from nanogpt_pl.model.gpt import GPT, GPTConfig  # noqa: E402
from nanogpt_pl.ops.cross_entropy import full_cross_entropy, lm_head_loss  # noqa: E402
from nanogpt_pl.optim.adam import DistAdam  # noqa: E402
from nanogpt_pl.optim.anvil import ENGAGE_STEP, Anvil  # noqa: E402
from nanogpt_pl.optim.groups import anvil_group  # noqa: E402
from nanogpt_pl.schedule import Schedule, Stage  # noqa: E402

BOS = 50256  # GPT-2's <|endoftext|>, the document separator of the shards (RECORD §1)
RECORD_STEPS = 1194  # RECORD §9: trained steps of the record; the engage step scales with the run
# RECORD §8 Adam table: (betas, lr_mul, wd_mul) per family; base lr 0.008, wd 0.005, eps 1e-10.
ADAM_FAMILIES = {
    "embed": ((0.5, 0.95), 1.0, 150.0),
    "lm_head": ((0.5, 0.95), 1.0, 150.0),
    "value_embeds": ((0.75, 0.95), 70.0, 5.0),
    "scalars": ((0.9, 0.99), 5.0, 0.0),
}
ADAM_LR, ADAM_WD, ADAM_EPS = 0.008, 0.005, 1e-10


def quickstart_config() -> GPTConfig:
    """The quickstart model (configs/quickstart.yaml)."""
    return GPTConfig(vocab_size=50304, num_layers=4, model_dim=128, num_heads=2, head_dim=64, mlp_hidden=512,
                     long_window_layers=[3], value_embed_layers=[1, 2], skip_from=1, skip_to=3)


def small_config() -> GPTConfig:
    """A 6-layer, 512-wide model (heads of 128 as the record; MLP 4x): matrices large enough
    for orthogonalized updates to matter, small enough for a sweep in minutes."""
    return GPTConfig(vocab_size=50304, num_layers=6, model_dim=512, num_heads=4, head_dim=128, mlp_hidden=2048,
                     long_window_layers=[2, 5], value_embed_layers=[1, 4], skip_from=1, skip_to=4)


MODELS = {"quickstart": quickstart_config, "small": small_config}


def installed_sources() -> list[tuple[str, bytes]]:
    """The standard library's sources plus every installed package's (``purelib``/``platlib``):
    the same docstring extraction as the quickstart corpus, about ten times the text where
    torch is installed. Machine-dependent, so only comparisons within one run are meaningful."""
    sources = stdlib_sources()
    seen = {rel for rel, _ in sources}
    for key in ("purelib", "platlib"):
        root = Path(sysconfig.get_paths()[key])
        if root.is_dir():
            for rel, src in stdlib_sources(root):
                if rel not in seen:
                    seen.add(rel)
                    sources.append((rel, src))
    return sources


class Batches:
    """Fixed, reproducible packed sequences from the corpus: step ``i`` reads window ``i`` of the stream."""

    def __init__(self, paths: list[Path], seq_len: int, device: torch.device) -> None:
        self.tokens = np.concatenate([np.asarray(open_shard(p)) for p in paths])
        self.seq_len, self.device = seq_len, device
        self.windows = (len(self.tokens) - 1) // seq_len
        if self.windows < 1:
            raise SystemExit(f"the corpus has {len(self.tokens)} tokens, fewer than one sequence of {seq_len}")

    def __call__(self, i: int) -> dict:
        start = (i % self.windows) * self.seq_len
        buf = self.tokens[start:start + self.seq_len + 1].astype(np.int64)
        inputs = buf[:-1]
        starts = np.flatnonzero(inputs == BOS)
        bounds = np.unique(np.concatenate([[0], starts, [self.seq_len]]))
        seg = np.diff(bounds)
        return {
            "inputs": torch.from_numpy(inputs.astype(np.int32)).to(self.device),
            "targets": torch.from_numpy(buf[1:]).to(self.device),
            "cu_seqlens": torch.from_numpy(pack_cu_seqlens(bounds, self.seq_len)).to(self.device),
            "max_seqlen": int(seg.max()),
        }


def build_model(cfg: GPTConfig, device: torch.device, seed: int) -> GPT:
    torch.manual_seed(seed)
    model = GPT(cfg).to(device)
    if device.type == "cuda":  # as SpeedrunModule: bf16 matrices and tables on the GPU
        roles = model.param_roles()
        for name in ("matrices", "embed", "lm_head", "value_embeds"):
            for p in roles[name]:
                p.data = p.data.to(torch.bfloat16)
    return model


def adam_groups(model: GPT) -> DistAdam:
    roles = model.param_roles()
    groups = [dict(params=roles[name], betas=betas, lr_mul=lr_mul, wd_mul=wd_mul)
              for name, (betas, lr_mul, wd_mul) in ADAM_FAMILIES.items() if roles[name]]
    return DistAdam(groups, lr=ADAM_LR, eps=ADAM_EPS, weight_decay=ADAM_WD, cautious_wd=True, decay_lr_power=2)


class MuonOn2D:
    """torch.optim.Muon over the hidden matrices, 3-D parameters split into their blocks.

    The blocks are parameters that share the model parameter's storage, so Muon's in-place
    update lands in the model; their gradients are views of the model gradient.
    """

    def __init__(self, params: list[torch.nn.Parameter], lr: float, blocks: list[tuple[int, int]]) -> None:
        self.pairs: list[tuple[torch.nn.Parameter, list[torch.nn.Parameter]]] = []
        flat: list[torch.nn.Parameter] = []
        for p, (rows, cols) in zip(params, blocks):
            if p.dim() == 2 and (rows, cols) == tuple(p.shape):
                flat.append(p)
                continue
            views = [torch.nn.Parameter(m) for m in p.data.view(-1, rows, cols)]
            assert all(v.data_ptr() == m.data_ptr() for v, m in zip(views, p.data.view(-1, rows, cols)))
            self.pairs.append((p, views))
            flat += views
        self.opt = torch.optim.Muon(flat, lr=lr, weight_decay=0.0, momentum=0.95, nesterov=True)
        self.param_groups = self.opt.param_groups

    def step(self) -> None:
        for p, views in self.pairs:
            grads = p.grad.view(len(views), *views[0].shape)
            for v, g in zip(views, grads):
                v.grad = g
        self.opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.opt.zero_grad(set_to_none=set_to_none)
        for p, _ in self.pairs:  # the blocks' gradients were views of these
            p.grad = None


def matrix_optimizer(kind: str, model: GPT, lr: float, args: argparse.Namespace, engage: int):
    group = anvil_group(model, model.cfg.head_dim)  # block shapes and lr multipliers by name
    mats = group["params"]
    if kind == "anvil":
        return Anvil([group], lr=lr, weight_decay=args.anvil_wd, engage_step=engage)
    if kind == "muon":
        if not hasattr(torch.optim, "Muon"):
            return None
        return MuonOn2D(mats, lr=lr, blocks=group["blocks"])
    if kind == "adamw":
        return DistAdam(mats, lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    raise ValueError(kind)


@torch.no_grad()
def evaluate(model: GPT, val: list[dict], windows: tuple[int, int]) -> float:
    model.eval()
    total, count = 0.0, 0
    for mb in val:
        hidden = model(mb["inputs"], mb["cu_seqlens"], mb["max_seqlen"], windows)
        loss = full_cross_entropy(hidden, model.lm_head, mb["targets"])
        total += loss.item() * mb["targets"].numel()
        count += mb["targets"].numel()
    model.train()
    return total / count


def train(kind: str, lr: float, args: argparse.Namespace, train_batches: Batches, val: list[dict],
          device: torch.device, log: Callable[[str], None]) -> Optional[dict]:
    cfg = MODELS[args.model]()
    model = build_model(cfg, device, args.seed)
    engage = max(1, round(args.steps * ENGAGE_STEP / RECORD_STEPS))
    sched = Schedule(stages=[Stage(steps=args.steps, batch_tokens=args.seq_len, seq_len=args.seq_len,
                                   max_doc_len=args.seq_len, window_short=args.windows[0],
                                   window_long=args.windows[1])],
                     cooldown_frac=0.6, final_lr_mul=0.1, momentum_warmup_steps=max(1, args.steps // 5),
                     momentum_cooldown_steps=max(1, args.steps // 24), anvil_engage_step=engage,
                     attention_cap=None, untie_step=None)
    mat = matrix_optimizer(kind, model, lr, args, engage)
    if mat is None:
        log(f"{kind}: not available in torch {torch.__version__}")
        return None
    adam = adam_groups(model)
    base_lrs = [[g["lr"] for g in o.param_groups] for o in (mat, adam)]
    windows = tuple(args.windows)
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for step in range(args.steps):
        s = sched.lr_mul(step)
        for o, lrs in zip((mat, adam), base_lrs):
            for g, group_lr in zip(o.param_groups, lrs):
                g["lr"] = group_lr * s
                if kind == "anvil" and "momentum" in g:
                    g["momentum"] = sched.momentum(step)
        mb = train_batches(step)
        hidden = model(mb["inputs"], mb["cu_seqlens"], mb["max_seqlen"], windows)
        loss = lm_head_loss(hidden, model.lm_head, mb["targets"])
        loss.backward()
        mat.step()
        adam.step()
        mat.zero_grad(set_to_none=True)
        adam.zero_grad(set_to_none=True)
        if not math.isfinite(loss.item()):
            log(f"{kind} lr {lr:g}: loss diverged at step {step}")
            return {"kind": kind, "lr": lr, "val": float("nan"), "seconds": time.perf_counter() - t0}
        if (step + 1) % max(1, args.steps // 5) == 0:
            log(f"{kind} lr {lr:g}: step {step + 1}/{args.steps} train loss {loss.item():.4f}")
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    return {"kind": kind, "lr": lr, "val": evaluate(model, val, windows), "seconds": seconds}


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="150 steps instead of 400")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--seq-len", type=int, default=16384, help="tokens per step (one packed sequence)")
    ap.add_argument("--windows", type=int, nargs=2, default=(256, 1024), help="short and long attention windows")
    ap.add_argument("--val-tokens", type=int, default=262_144)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--optimizers", nargs="+", default=["anvil", "muon", "adamw"])
    ap.add_argument("--model", choices=sorted(MODELS), default="quickstart", help="model shape")
    ap.add_argument("--text", choices=["stdlib", "installed"], default="stdlib",
                    help="stdlib: the quickstart corpus; installed: also every installed package's docstrings "
                         "(~10x the text, so a long run sees each token about once)")
    ap.add_argument("--sweep", type=float, nargs="+", default=[1.0],
                    help="multipliers of each optimizer's lr; the best run of each optimizer is compared")
    ap.add_argument("--anvil-lr", type=float, default=0.023)
    ap.add_argument("--anvil-wd", type=float, default=2.25)
    ap.add_argument("--muon-lr", type=float, default=0.02)
    ap.add_argument("--adamw-lr", type=float, default=0.004)
    args = ap.parse_args(argv)
    args.steps = args.steps or (150 if args.quick else 400)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA GPU here; pass --device cpu for a smoke test")

    t_build = time.perf_counter()
    info = build_corpus(progress=True, sources=installed_sources() if args.text == "installed" else None)
    train_batches = Batches(info.train_paths, args.seq_len, device)
    val_stream = Batches(info.val_paths, args.seq_len, device)
    val = [val_stream(i) for i in range(max(1, min(val_stream.windows, args.val_tokens // args.seq_len)))]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    seen = args.steps * args.seq_len
    print(f"device: {name}; torch {torch.__version__}; model {args.model}; {args.steps} steps x {args.seq_len} tokens "
          f"= {seen:,} tokens ({seen / info.train_tokens:.2f} epochs of {info.train_tokens:,}); "
          f"{len(val) * args.seq_len:,} validation tokens; corpus {info.key} ({args.text}, "
          f"{time.perf_counter() - t_build:.0f} s to load)")

    base_lr = {"anvil": args.anvil_lr, "muon": args.muon_lr, "adamw": args.adamw_lr}
    results = []
    for kind in args.optimizers:
        for mul in args.sweep:
            r = train(kind, base_lr[kind] * mul, args, train_batches, val, device,
                      lambda msg: print("  " + msg, flush=True))
            if r is not None:
                results.append(r)

    print()
    print(f"{'hidden-matrix optimizer':24s} {'lr':>8s} {'val loss':>9s} {'seconds':>8s}")
    for r in results:
        print(f"{r['kind']:24s} {r['lr']:8.4g} {r['val']:9.4f} {r['seconds']:8.1f}")
    best = {}
    for r in results:
        if math.isfinite(r["val"]) and (r["kind"] not in best or r["val"] < best[r["kind"]]["val"]):
            best[r["kind"]] = r
    print()
    for kind, r in best.items():
        edge = ""
        tried = sorted(x["lr"] for x in results if x["kind"] == kind)
        if len(tried) > 1 and r["lr"] in (tried[0], tried[-1]):
            edge = " (at the edge of the sweep: widen it)"
        print(f"best {kind}: lr {r['lr']:.4g}, val loss {r['val']:.4f}{edge}")
    anvil = best.get("anvil")
    if anvil is not None:
        for kind, r in best.items():
            if kind != "anvil":
                margin = r["val"] - anvil["val"]
                verdict = "ANVIL better" if margin > 0 else "ANVIL NOT better"
                print(f"margin of best ANVIL vs best {kind}: {margin:+.4f} nats ({verdict})")


if __name__ == "__main__":
    main()
