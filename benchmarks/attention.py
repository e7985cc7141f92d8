"""Packed-document sliding-window attention, forward + backward, per backend, in one run.

Shapes: 49,152 tokens per micro-batch (stage 2, RECORD §9), 6 heads (RECORD §2), bf16, and
the record's layer kinds (RECORD §2, windows from §9 stage 2):

- wide (d_qk 128, d_v 128), long window 1408;
- narrow (64, 128), short window 640;
- dv64 (64, 64), short window 640;
- paired narrow (64, 128): the sequence doubled to 98,304 slots of 3 heads, the same 640
  token window (RECORD §2, paired-head layers).

Documents: lengths drawn from a log-normal (median ``--median-doc``), capped at the stage's
max document length 3072 and cut into attention segments of at most 2560 tokens (the
virtual cap, RECORD §1).

Backends: ``flex`` (compiled ``flex_attention``; its block mask is built once per layout,
outside the timing, as a model would share it across layers), ``varlen`` (FlashAttention
varlen through torch, only where d_qk == d_v), ``triton`` (ours; its per-call
``cu_seqlens`` preprocessing is inside the timing), and ``fa3`` / ``fa4`` (FlashAttention 3 / 4's
varlen kernels, ``model.backends.attention: fa3 | fa4``) where they import.

Every call is replayed from a CUDA graph, as the captured training step runs it, so the figures
are the GPU's time. Launched from the host (``--no-graph``), a call also counts the host's
launches: on an H100 (2026-12-07), the Triton forward + backward through autograd took 2.04 ms
so, against 0.38 + 1.13 ms for its forward and backward operators called alone.

Printed per row: median ms of forward+backward (CUDA events), of the forward alone, TFLOP/s
counting only visible query-key pairs (forward 2 matmuls, backward 5; FlashAttention-2's
convention), and the speed ratio against flex in the same run. Target (issue 13): triton >=
1.6x flex for wide at window 1408.

    python benchmarks/attention.py            # about a minute on an H200
    python benchmarks/attention.py --quick    # 16,384 tokens, fewer repetitions
    python benchmarks/attention.py --sweep    # also time tile configurations of the triton kernels
    python benchmarks/attention.py --no-graph # every call launched from the host
"""

from __future__ import annotations

import argparse
import itertools
import sys
import traceback
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.gpu_timing import time_replayed  # noqa: E402
from nanogpt_pl.model.attention import (  # noqa: E402
    FLASH_MODULES,
    _flash_fn,
    attention_flash,
    attention_varlen,
    flash_import_failure,
    segment_ids,
)

N_TOKENS = 49152  # RECORD §9: stage-2 tokens per rank
HEADS = 6  # RECORD §2
MAX_DOC_LEN = 3072  # RECORD §9: stage-2 max document length
VIRTUAL_SEQ_CAP = 2560  # RECORD §1: longer documents are cut into attention segments of this length
SHORT_WINDOW, LONG_WINDOW = 640, 1408  # RECORD §9: stage-2 windows (5, 11) blocks of 128
MEDIAN_DOC = 500  # tokens; a FineWeb-like long tail (many short documents, a few capped ones)
SCALE = 0.12  # inside the record's attention-scale range 0.085..0.19 (RECORD §2)

# (name, d_qk, d_v, window, token factor, heads)
CASES = [
    ("wide", 128, 128, LONG_WINDOW, 1, HEADS),
    ("narrow", 64, 128, SHORT_WINDOW, 1, HEADS),
    ("dv64", 64, 64, SHORT_WINDOW, 1, HEADS),
    ("paired narrow", 64, 128, SHORT_WINDOW, 2, HEADS // 2),
]


def document_cu_seqlens(n: int, median: float, seed: int, factor: int = 1) -> torch.Tensor:
    """cu_seqlens of long-tailed documents filling ``n // factor`` tokens, each cut at the virtual
    cap; with ``factor`` 2 every boundary is doubled (the paired-head layout)."""
    rng = np.random.default_rng(seed)
    tokens = n // factor
    lengths = []
    total = 0
    while total < tokens:
        doc = int(min(MAX_DOC_LEN, max(1, round(rng.lognormal(np.log(median), 1.0)))))
        doc = min(doc, tokens - total)
        while doc > 0:  # the virtual cap: consecutive segments of at most 2560 tokens
            piece = min(doc, VIRTUAL_SEQ_CAP)
            lengths.append(piece)
            doc -= piece
            total += piece
    cu = np.concatenate([[0], np.cumsum(lengths)]) * factor
    return torch.tensor(cu, dtype=torch.int32)


def visible_pairs(cu: torch.Tensor, n: int, window: int) -> float:
    seg = segment_ids(cu, n)
    pos = torch.arange(n, device=cu.device)
    first = torch.maximum(cu.long()[seg], pos - window)
    return float((pos - first + 1).sum())


def flex_call(cu: torch.Tensor, n: int, window: int) -> Optional[Callable]:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    seg = segment_ids(cu, n)

    def mask_mod(b, h, qi, ki):
        return (seg[qi] == seg[ki]) & (qi >= ki) & (qi - ki <= window)

    # built by a compiled pass, as the model builds it: the eager build holds an N x N mask (72 GiB at
    # the paired layers' 98,304 slots, more than an 80 GB card has)
    block_mask = create_block_mask(mask_mod, None, None, n, n, device=cu.device, _compile=True)
    compiled = torch.compile(flex_attention, dynamic=False)

    def call(q, k, v):
        out = compiled(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                       block_mask=block_mask, scale=SCALE)
        return out[0].transpose(0, 1)

    return call


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="16,384 tokens and fewer repetitions")
    ap.add_argument("--tokens", type=int, default=None, help=f"tokens per micro-batch (default {N_TOKENS})")
    ap.add_argument("--median-doc", type=float, default=MEDIAN_DOC)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sweep", action="store_true", help="also time tile configurations of the triton kernels")
    ap.add_argument("--sweep-kernels", default="fwd,dkdv,dq",
                    help="with --sweep: the kernels whose tiles to time (fwd is timed forward only)")
    ap.add_argument("--no-graph", action="store_true",
                    help="launch every call from the host instead of replaying it from a CUDA graph")
    ap.add_argument("--cases", default=",".join(c[0] for c in CASES),
                    help="comma-separated subset of: " + ", ".join(c[0] for c in CASES))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/attention.py needs a CUDA GPU")
    import triton

    from nanogpt_pl.ops.triton.attention import triton_packed_attention

    n = args.tokens or (16384 if args.quick else N_TOKENS)
    warmup, iters = (2, 5) if args.quick else (3, 20)
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    print(f"packed attention forward+backward: {n} tokens, bf16, scale {SCALE}")
    print(f"device: {props.name}; torch {torch.__version__}, triton {triton.__version__}; "
          f"median of {iters} after {warmup} warmup")
    for flash, (_, package) in FLASH_MODULES.items():  # a missing row says why
        if _flash_fn(flash) is None:
            print(f"{flash}: no rows, {package}: {flash_import_failure(flash)}")
    hdr = (f"{'case':<14} {'d_qk':>4} {'d_v':>4} {'window':>6} {'N':>6} {'H':>2} {'backend':<8} "
           f"{'fwd+bwd ms':>10} {'fwd ms':>7} {'TFLOP/s':>8} {'vs flex':>8}")
    summary = []
    wanted = [c.strip() for c in args.cases.split(",")]
    unknown = set(wanted) - {c[0] for c in CASES}
    if unknown:
        raise SystemExit(f"--cases: unknown {sorted(unknown)}; choose from {[c[0] for c in CASES]}")
    for name, d_qk, d_v, window, factor, heads in (c for c in CASES if c[0] in wanted):
        nn_ = n * factor  # paired layers hold two slots per token
        cu = document_cu_seqlens(nn_, args.median_doc, args.seed, factor).to(dev)
        segs = cu.numel() - 1
        pairs = visible_pairs(cu, nn_, window)
        fwd_flop = 2 * pairs * heads * (d_qk + d_v)
        total_flop = fwd_flop + 2 * pairs * heads * (3 * d_qk + 2 * d_v)
        gen = torch.Generator(device="cpu").manual_seed(args.seed)
        q = torch.randn(nn_, heads, d_qk, generator=gen).to(dev, torch.bfloat16).requires_grad_()
        k = torch.randn(nn_, heads, d_qk, generator=gen).to(dev, torch.bfloat16).requires_grad_()
        v = torch.randn(nn_, heads, d_v, generator=gen).to(dev, torch.bfloat16).requires_grad_()
        g = torch.randn(nn_, heads, d_v, generator=gen).to(dev, torch.bfloat16)
        max_seqlen = int((cu[1:] - cu[:-1]).max())
        backends: list[tuple[str, Optional[Callable]]] = [("flex", None), ("triton", None)]
        try:
            backends[0] = ("flex", flex_call(cu, nn_, window))
        except Exception:
            traceback.print_exc()
        backends[1] = ("triton", lambda a, b, c: triton_packed_attention(a, b, c, cu, max_seqlen, window, SCALE))
        if d_qk == d_v:
            backends.insert(1, ("varlen", lambda a, b, c: attention_varlen(a, b, c, cu, max_seqlen, window, SCALE)))
        for flash in FLASH_MODULES:  # FlashAttention 3 / 4 where installed (a build may reject d_qk != d_v)
            if _flash_fn(flash) is not None:
                backends.append((flash, lambda a, b, c, f=flash: attention_flash(a, b, c, cu, max_seqlen, window,
                                                                                  SCALE, f)))
        print()
        print(f"{name}: {segs} segments, max {max_seqlen} tokens, {pairs / nn_:.0f} visible keys per query")
        print(hdr)
        print("-" * len(hdr))
        flex_ms = None
        outs = {}
        for backend, fn in backends:
            if fn is None:
                print(f"{name:<14} {backend:<8} skipped: unavailable")
                continue
            try:
                def step(fn=fn):
                    out = fn(q, k, v)
                    out.backward(g)
                    return out

                def fwd(fn=fn):
                    with torch.no_grad():
                        return fn(q, k, v)

                outs[backend] = fwd().float()
                t = time_replayed(step, [q, k, v], warmup, iters, args.no_graph, f"{name} {backend}")
                tf = time_replayed(fwd, [], warmup, iters, args.no_graph, f"{name} {backend} forward")
            except Exception as e:
                if backend == "triton":
                    raise
                print(f"{name:<14} {backend:<8} skipped: {type(e).__name__}: {str(e)[:80]}")
                continue
            if backend == "flex":
                flex_ms = t.median_ms
            ratio = f"{flex_ms / t.median_ms:>7.2f}x" if flex_ms else f"{'-':>8}"
            print(f"{name:<14} {d_qk:>4} {d_v:>4} {window:>6} {nn_:>6} {heads:>2} {backend:<8} "
                  f"{t.median_ms:>10.3f} {tf.median_ms:>7.3f} {total_flop / t.median_ms / 1e9:>8.0f} {ratio}")
            if backend == "triton":
                summary.append((name, window, t.median_ms, flex_ms))
        for backend in outs:  # every backend's output against flex, the reference of the tests
            if backend != "flex" and "flex" in outs:
                diff = (outs["flex"] - outs[backend]).abs().max().item()
                print(f"max |{backend} - flex| of the output: {diff:.2e}")
        if args.sweep:
            sweep(q, k, v, g, cu, max_seqlen, window, d_qk, d_v, warmup, iters, args.sweep_kernels.split(","),
                  args.no_graph)
    print()
    for name, window, ms, flex_ms in summary:
        if flex_ms:
            met = "MET" if name == "wide" and flex_ms / ms >= 1.6 else ("NOT MET" if name == "wide" else "")
            print(f"{name} window {window}: triton {flex_ms / ms:.2f}x flex {met}".rstrip())


def sweep(q, k, v, g, cu, max_seqlen, window, d_qk, d_v, warmup, iters, kinds: list[str], no_graph: bool) -> None:
    """Time each kernel's tile options in turn, the others at their defaults: the forward's alone,
    the backward kernels' as forward + backward. The default's row comes first."""
    from nanogpt_pl.ops.triton import attention as A

    wide = max(d_qk, d_v) > 64
    options = {
        "fwd": [(128, 64), (128, 128), (64, 64), (64, 128), (64, 32), (128, 32)],
        "dkdv": [(64, 128), (32, 128), (64, 64), (128, 128), (32, 64)],
        "dq": [(128, 64), (128, 32), (64, 64), (128, 128)],
    }
    unknown = set(kinds) - set(options)
    if unknown:
        raise SystemExit(f"--sweep-kernels: unknown {sorted(unknown)}; choose from {sorted(options)}")
    print(f"tile sweep (d_qk {d_qk}, d_v {d_v}): kernel block_m block_n warps stages -> ms "
          f"(fwd: forward alone; dkdv, dq: forward + backward)")
    for kind in kinds:
        default = A.TILES[(kind, wide)]
        reference = None  # the default tile's forward output
        configs = [default] + [(bm, bn, w, st) for (bm, bn), w, st in itertools.product(options[kind], (4, 8), (2, 3))
                               if (bm, bn, w, st) != default]
        for bm, bn, warps, stages in configs:
            A.TILES[(kind, wide)] = (bm, bn, warps, stages)
            try:
                def step():
                    if kind == "fwd":
                        with torch.no_grad():
                            return A.triton_packed_attention(q, k, v, cu, max_seqlen, window, SCALE)
                    out = A.triton_packed_attention(q, k, v, cu, max_seqlen, window, SCALE)
                    out.backward(g)
                mark = " (default)" if (bm, bn, warps, stages) == default else ""
                if kind == "fwd":  # the output against the default tile's
                    out = step().float()
                    reference = out if reference is None else reference
                    mark += f"  max |out - default's| {(out - reference).abs().max().item():.1e}"
                t = time_replayed(step, [] if kind == "fwd" else [q, k, v], 2, max(5, iters // 2), no_graph,
                          f"{kind} {bm} x {bn}")
                print(f"  {kind:<5} {bm:>4} {bn:>4} {warps:>2} {stages:>2} {t.median_ms:8.3f}{mark}")
            except Exception as e:  # a tile too large for shared memory fails to launch
                print(f"  {kind:<5} {bm:>4} {bn:>4} {warps:>2} {stages:>2} failed: {type(e).__name__}")
        A.TILES[(kind, wide)] = default


if __name__ == "__main__":
    main()
