"""The value planes' gather from a micro-batch's compact leaf, forward + backward, compiled.

The model reads its four value-embedding planes as ``values[p, index]`` (``[P, U, D]`` fp32
leaf, ``[T]`` rows) in bf16. The backward sums every row's token gradients into the leaf's
gradient. Rows (``nanogpt_pl.model.embeddings.gather_planes``, each inside ``torch.compile``):

- ``reference``: autograd's backward, which inductor compiles to one atomic add per element
  (``P·T·D`` of them; the stage-2 profile of BENCHMARKS.md shows it at 627 µs a micro-batch);
- ``triton``: ``model.backends.value_rows: triton``, the sorted segment sum
  (``nanogpt_pl.ops.triton.row_sum``): the tokens sorted by row, one atomic add per run of
  equal rows in a chunk of 64; ``--tiles`` adds rows with other chunk x column tiles
  (``triton 32x128``: 32 sorted positions by 128 columns a program).

The token rows are drawn with Zipf frequencies (rank r ∝ r^-exponent over the GPT-2 vocabulary;
exponent 1.0 gives about 12.6k distinct tokens and a most frequent token of 8.7% in 49,152
draws, as text does), so frequent rows take thousands of terms. The floor is the bytes a
forward and backward must move (write the bf16 planes, read their gradients, write the fp32
leaf gradient) over the copy bandwidth measured in the same run. Also printed: the largest
difference of the triton row's leaf gradient from the reference's.

    python benchmarks/value_rows.py                  # stage 2: 49,152 tokens, about 20 s on an H100
    python benchmarks/value_rows.py --tokens 16384   # stage 0
    python benchmarks/value_rows.py --tiles 64x128,32x128,128x64

Without a GPU it prints that nothing was timed.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpu_timing import copy_bandwidth, print_floor_table, time_cuda  # noqa: E402

import nanogpt_pl.ops.triton.row_sum as row_sum  # noqa: E402
from nanogpt_pl.distributed.sparse_channels import reserved_value_rows  # noqa: E402
from nanogpt_pl.model.embeddings import gather_planes  # noqa: E402

PLANES, DIM, VOCAB = 4, 768, 50_257  # RECORD §2: four value-embedding planes of the model width


def zipf_rows(n: int, exponent: float, seed: int) -> tuple[torch.Tensor, int, int]:
    """``(index [n] into the distinct tokens, distinct count, count of the most frequent token)``."""
    gen = torch.Generator().manual_seed(seed)
    weights = torch.arange(1, VOCAB + 1, dtype=torch.float64).pow(-exponent)
    tokens = torch.multinomial(weights, n, replacement=True, generator=gen)
    distinct, index, counts = torch.unique(tokens, return_inverse=True, return_counts=True)
    return index, distinct.numel(), int(counts.max())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=49_152, help="tokens per micro-batch (default: stage 2's)")
    ap.add_argument("--exponent", type=float, default=1.0, help="Zipf exponent of the token frequencies")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--tiles", default=f"{row_sum.CHUNK}x{row_sum.BLOCK_D}",
                    help="the triton rows' CHUNKxBLOCK_D tiles, comma-separated (powers of two, at least 16)")
    args = ap.parse_args()
    tiles = []
    for tile in args.tiles.split(","):
        chunk, _, block = tile.partition("x")
        if not (chunk.isdigit() and block.isdigit()) or min(int(chunk), int(block)) < 16 \
                or int(chunk) & (int(chunk) - 1) or int(block) & (int(block) - 1):
            ap.error(f"--tiles {tile!r}: give CHUNKxBLOCK_D, powers of two of at least 16, e.g. 64x128")
        tiles.append((int(chunk), int(block)))
    if not torch.cuda.is_available():
        print("no CUDA device: nothing timed (tests/test_value_rows_triton.py checks the kernel on CPU)")
        return

    index, distinct, top = zipf_rows(args.tokens, args.exponent, seed=0)
    rows = reserved_value_rows(distinct, min(args.tokens, VOCAB))  # the leaf's rows, as the plan reserves them
    device = torch.device("cuda")
    index = index.to(device)
    gen = torch.Generator(device=device).manual_seed(1)
    leaf = (torch.randn(PLANES, rows, DIM, generator=gen, device=device) * 0.02).requires_grad_()
    grads = [torch.randn(args.tokens, DIM, generator=gen, device=device, dtype=torch.bfloat16)
             for _ in range(PLANES)]

    times, results = {}, {}
    for name, backend, tile in [("reference", "reference", None)] + [
            (f"triton {c}x{b}", "triton", (c, b)) for c, b in tiles]:
        if tile is not None:
            row_sum.CHUNK, row_sum.BLOCK_D = tile
        fn = torch.compile(lambda v, backend=backend: gather_planes(v, index, torch.bfloat16, backend))

        def step(fn=fn):
            torch.autograd.backward(fn(leaf), grads)

        leaf.grad = None
        step()
        results[name] = leaf.grad.clone()
        times[name] = time_cuda(step, 5, args.iters, [leaf]).median_ms

    bandwidth = copy_bandwidth(grads[0], args.iters)
    plane_bytes = PLANES * args.tokens * DIM * 2
    floor_bytes = 2 * plane_bytes + 2 * leaf.numel() * 4  # planes written + gradients read; leaf read + grad written
    ref = results["reference"]
    diff = max(float((r - ref).abs().max() / ref.abs().max()) for n, r in results.items() if n != "reference")

    print(f"value planes' gather, forward + backward, compiled: {args.tokens} tokens, {PLANES} planes x {DIM}, "
          f"{distinct} distinct tokens (Zipf {args.exponent}; the most frequent {top} times), leaf {rows} rows")
    print_floor_table(times, floor_bytes, bandwidth, args.iters)
    print(f"triton rows against reference: largest difference of the leaf gradient {diff:.2e} of its largest value")


if __name__ == "__main__":
    main()
