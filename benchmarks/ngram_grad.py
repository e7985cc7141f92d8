"""The n-gram channel's read of a micro-batch's compact leaf, forward + backward, compiled.

The model reads each token's bigram and trigram rows from the micro-batch's compact fp32 leaf
``[R, D]`` and sums them with their ±1 signs (``x0_ngram``, RECORD §3). The backward sums every
row's signed token gradients into the leaf's gradient. Rows (``HashedNgramEmbedding``, each
inside ``torch.compile``):

- ``reference``: autograd's backward, which inductor compiles to a zero fill of the ``[R, D]``
  gradient and one atomic add per element (``2·T·D`` of them);
- ``triton``: ``model.backends.ngram_rows: triton`` (``nanogpt_pl.ops.triton.ngram_grad``): the
  entries sorted by row, each row's sum stored once, the rows no entry reads stored as zeros.

The tokens are drawn with Zipf frequencies over the GPT-2 vocabulary (exponent 1.0, as text),
hashed into the one-GPU table (10,575,360 rows), and the leaf holds ``2T`` rows, as the fixed
exchange pads it. The floor is the bytes a forward and backward must move (read the leaf rows
and write the bf16 output; read the output's gradient and write the fp32 leaf gradient) over
the copy bandwidth measured in the same run. Also printed: the largest difference of the
triton row's leaf gradient from the reference's.

    python benchmarks/ngram_grad.py                  # stage 2: 49,152 tokens
    python benchmarks/ngram_grad.py --tokens 16384   # stage 0

Without a GPU it prints that nothing was timed.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpu_timing import copy_bandwidth, print_floor_table, time_cuda  # noqa: E402

from nanogpt_pl.distributed.row_exchange import unique_fixed  # noqa: E402
from nanogpt_pl.model.embeddings import HashedNgramEmbedding, NgramInput, ngram_row_ids, ngram_sign_rows  # noqa: E402

DIM, VOCAB, TABLE = 768, 50_257, 10_575_360  # the model width; the one-GPU table (configs/speedrun_1gpu.yaml)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=49_152, help="tokens per micro-batch (default: stage 2's)")
    ap.add_argument("--exponent", type=float, default=1.0, help="Zipf exponent of the token frequencies")
    ap.add_argument("--iters", type=int, default=50)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing timed (tests/test_ngram_grad_triton.py checks the kernel on CPU)")
        return

    gen = torch.Generator().manual_seed(0)
    weights = torch.arange(1, VOCAB + 1, dtype=torch.float64).pow(-args.exponent)
    device = torch.device("cuda")
    ids = torch.multinomial(weights, args.tokens, replacement=True, generator=gen).to(device)
    rows = 2 * args.tokens
    unique, index = unique_fixed(ngram_row_ids(ids, TABLE).reshape(-1), rows, TABLE)
    distinct = int((unique < TABLE).sum())
    dgen = torch.Generator(device=device).manual_seed(1)
    leaf = (torch.randn(rows, DIM, generator=dgen, device=device) * 0.02).requires_grad_()
    ngram = NgramInput(values=leaf, index=index.view(2, -1), sign_rows=ngram_sign_rows(ids))
    grad = torch.randn(args.tokens, DIM, generator=dgen, device=device, dtype=torch.bfloat16)

    times, results = {}, {}
    for backend in ("reference", "triton"):
        fn = torch.compile(HashedNgramEmbedding(DIM, backend).to(device))

        def step(fn=fn):
            fn(ngram, torch.bfloat16).backward(grad)

        leaf.grad = None
        step()
        results[backend] = leaf.grad.clone()
        times[backend] = time_cuda(step, 5, args.iters, [leaf]).median_ms

    bandwidth = copy_bandwidth(grad, args.iters)
    floor_bytes = 2 * 2 * grad.numel() * grad.element_size() + 2 * leaf.numel() * 4  # out + its grad; leaf + its grad
    ref = results["reference"]
    diff = float((results["triton"] - ref).abs().max() / ref.abs().max())

    print(f"n-gram rows' read, forward + backward, compiled: {args.tokens} tokens x {DIM}, {distinct} distinct "
          f"table rows of {2 * args.tokens} entries (Zipf {args.exponent} tokens), leaf {rows} rows")
    print_floor_table(times, floor_bytes, bandwidth, args.iters)
    print(f"triton against reference: largest difference of the leaf gradient {diff:.2e} of its largest value")


if __name__ == "__main__":
    main()
