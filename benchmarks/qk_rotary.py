"""The QK norm, rotary rotation and key offset of one attention layer, forward + backward, compiled.

Each layer kind of the record (RECORD §2) at a stage-1 micro-batch (32,768 tokens, RECORD §9),
6 heads, bf16; q and k are views of the packed QKV projection ``[N, 2·H·d_qk + H·d_v]``, as in
the model, and the step is ``torch.compile``d whole (the views, the op and the gradient's
concatenation into the packed tensor) with the gradient of the packed tensor as its output, and
replayed from a CUDA graph, as the training step runs it (``--no-graph`` times the calls as
launched; a layer's few kernels then take less GPU time than the host takes to launch them, and
the figures are the host's):

- ``reference``: ``model.backends.qk_rotary: reference``, the PyTorch expressions that inductor
  fuses;
- ``triton``: ``model.backends.qk_rotary: triton`` (``nanogpt_pl.ops.triton.qk_rotary``).

Layer kinds: ``paired narrow`` (d_qk 64, tables per token and head), ``dv64`` (64, per token),
``wide`` (128, per token, key offset). The floor is what a forward and backward must move: read
q and k and write the rotated pair, then read their gradients and the inputs and write the
packed tensor's gradient (all of its columns), at the copy bandwidth measured in the same run.

    python benchmarks/qk_rotary.py                   # about a minute on an H100 (three compiles)
    python benchmarks/qk_rotary.py --tokens 49152    # stage 2
    python benchmarks/qk_rotary.py --block-t 32,64,128
    python benchmarks/qk_rotary.py --no-graph        # launched from the host each call

Without a GPU it prints that nothing was timed.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from gpu_timing import copy_bandwidth, print_floor_table, time_replayed  # noqa: E402

from nanogpt_pl.model.attention import qk_norm_rotary  # noqa: E402

HEADS = 6  # RECORD §2
KINDS = {  # name: (d_qk, d_v, tables per head, key offset), RECORD §2 "Per-layer map"
    "paired narrow": (64, 128, True, False),
    "dv64": (64, 64, False, False),
    "wide": (128, 128, False, True),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=32768, help="tokens per micro-batch (stage 1: 32,768)")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--block-t", default="", help="also time these token tiles of the kernels (comma-separated)")
    ap.add_argument("--no-graph", action="store_true", help="launch every call from the host instead of a CUDA graph")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("benchmarks/qk_rotary.py: no CUDA device; nothing timed")
        return
    from nanogpt_pl.ops.triton import qk_rotary as kernels

    n, h = args.tokens, HEADS
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name, (d, d_v, per_head, key_offset) in KINDS.items():
        hq = h * d
        qkv = torch.randn(n, 2 * hq + h * d_v, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
        angles = torch.rand(*((n, h, d // 2) if per_head else (n, d // 2)), device="cuda", generator=gen) * 6.3
        cos, sin = angles.cos().bfloat16(), angles.sin().bfloat16()
        gq, gk = (torch.randn(n, h, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))

        def layer(x, backend):
            q, k = x[:, :hq].view(n, h, d), x[:, hq:2 * hq].view(n, h, d)
            return qk_norm_rotary(q, k, cos, sin, key_offset, backend)

        def timed(backend):
            fn = torch.compile(lambda x: layer(x, backend))

            def step():
                qo, ko = fn(qkv)
                torch.autograd.backward([qo, ko], [gq, gk])

            return time_replayed(step, [qkv], 3, args.iters, args.no_graph, f"{name} {backend}").median_ms

        times = {backend: timed(backend) for backend in ("reference", "triton")}
        kept = kernels.TILES[d]
        for block in [int(b) for b in args.block_t.split(",") if b]:
            kernels.TILES[d] = (block, kept[1])  # read at each launch: captured anew for each tile
            times[f"triton block_t {block}"] = timed("triton")
        kernels.TILES[d] = kept
        qk_bytes = n * 2 * hq * 2
        floor = 2 * qk_bytes + 2 * qk_bytes + qkv.numel() * 2  # fwd: read, write; bwd: read 2, write all columns
        print(f"\n{name}: {n} tokens, {h} heads, d_qk {d}, d_v {d_v}, tables per {'head' if per_head else 'token'}"
              f"{', key offset' if key_offset else ''}")
        print_floor_table(times, floor, copy_bandwidth(qkv.detach(), args.iters), args.iters)


if __name__ == "__main__":
    main()
