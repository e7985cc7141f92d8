"""The post-loop MUDD mix (RECORD §2) compiled, forward + backward, against its memory floor.

``Mudd.final`` mixes ten cached streams into the output, per channel group, with coefficients
from a 64-wide hidden of the stream: ``x + Σ_k (μ_k + δ_{k,g})·src_k``. It reads ten
``[N, 768]`` bf16 streams and writes one forward, and in the backward writes ten gradients and
reads the streams again (the gradient of each coefficient is a per-group dot product): about
2.6 GB a stage-2 micro-batch, a millisecond at an H100's copy bandwidth. In the stage-2 profile
(BENCHMARKS.md, 2026-12-05) its compiled kernels (``..._bmm_mul_permute_stack_sum`` forward,
``..._bmm_expand_mul_permute_squeeze_stack_sum`` backward, named by ``TORCH_COMPILE_DEBUG=1``'s
output code) took 0.8-1.0 ms each, once a micro-batch.

Rows (each compiled with ``torch.compile``, one forward + backward to x, the ten sources and the
mix's weights, the same random inputs):

- ``reference``: ``Mudd.final_reference``, the formula as it reads (the sources stacked into
  ``[N, K, D]``, times the coefficients, summed over the sources; the per-group deltas as an
  einsum);
- ``model``: ``Mudd.final``, as the model runs it: the deltas as one plain matmul of the hidden
  (``[N, 64] x [64, K·G]``) and the sources summed one by one in fp32, with no stack.

The floor is the bytes the backward and forward must move over the copy bandwidth measured in
the same run (a ``[N, 768]`` bf16 ``copy_``, read + write). Also printed: the largest
difference of the model row from the reference row (output and every gradient, relative to the
largest value).

    python benchmarks/mudd_final.py                 # 49,152 tokens (stage 2), about 20 s on an H100
    python benchmarks/mudd_final.py --tokens 16384  # stage 0

Without a GPU it checks the model row against the reference at a small size and times nothing.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpu_timing import copy_bandwidth, print_floor_table, time_cuda  # noqa: E402

from nanogpt_pl.model.mudd import FINAL_MIX_SOURCES, Mudd  # noqa: E402

DIM, HEADS = 768, 6  # RECORD §2


def make_inputs(n: int, device: torch.device, dtype: torch.dtype, seed: int):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    mudd = Mudd(DIM, HEADS)
    with torch.no_grad():  # the zero-initialized delta weights random, so every term matters
        mudd.final_mix.w2g.normal_(0.0, 0.02, generator=gen)
        mudd.final_mix.w2.normal_(0.0, 0.02, generator=gen)
    mudd = mudd.to(device=device, dtype=dtype)
    x = torch.randn(n, DIM, generator=gen).to(device=device, dtype=dtype).requires_grad_()
    sources = [torch.randn(n, DIM, generator=gen).to(device=device, dtype=dtype).requires_grad_()
               for _ in FINAL_MIX_SOURCES]
    grad = torch.randn(n, DIM, generator=gen).to(device=device, dtype=dtype)
    return mudd, x, sources, grad


def run_once(fn: Callable, mudd: Mudd, x, sources, grad) -> list[torch.Tensor]:
    """Output and gradients (x, sources, then the mix's weights) of one forward + backward."""
    leaves = [x, *sources, *mudd.final_mix.parameters()]
    for t in leaves:
        t.grad = None
    out = fn(mudd, x, sources)
    out.backward(grad)
    return [out.detach().float(), *[t.grad.float() for t in leaves]]


def largest_difference(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((p - q).abs().max() / q.abs().max().clamp_min(1e-30)) for p, q in zip(a, b))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=49_152, help="tokens per micro-batch (default: stage 2's)")
    ap.add_argument("--iters", type=int, default=30)
    args = ap.parse_args()

    if not torch.cuda.is_available():
        mudd, x, sources, grad = make_inputs(256, torch.device("cpu"), torch.float32, seed=0)
        diff = largest_difference(run_once(lambda m, a, s: m.final(a, s), mudd, x, sources, grad),
                                  run_once(lambda m, a, s: m.final_reference(a, s), mudd, x, sources, grad))
        print(f"no CUDA device: model against reference at 256 tokens (fp32, eager): largest relative "
              f"difference {diff:.2e}; nothing timed")
        return

    device = torch.device("cuda")
    mudd, x, sources, grad = make_inputs(args.tokens, device, torch.bfloat16, seed=0)
    rows = {
        "reference": torch.compile(lambda m, a, s: m.final_reference(a, s)),
        "model": torch.compile(lambda m, a, s: m.final(a, s)),
    }
    results, times = {}, {}
    params = [x, *sources, *mudd.final_mix.parameters()]
    for name, fn in rows.items():
        results[name] = run_once(fn, mudd, x, sources, grad)
        times[name] = time_cuda(lambda fn=fn: fn(mudd, x, sources).backward(grad), 5, args.iters, params).median_ms

    stream_bytes = x.numel() * x.element_size()
    bandwidth = copy_bandwidth(x, args.iters)
    k = len(sources)
    # forward: read x and the K sources, write the output; backward: read the output gradient and
    # the K sources, write the K source gradients and x's
    floor_bytes = stream_bytes * ((k + 2) + (k + 1 + k + 1))

    print(f"MUDD final mix, forward + backward, compiled: {args.tokens} tokens x {DIM}, {k} sources, bf16")
    print_floor_table(times, floor_bytes, bandwidth, args.iters)
    diff = largest_difference(results["model"], results["reference"])
    print(f"model against reference: largest relative difference {diff:.2e} (output and gradients, bf16)")


if __name__ == "__main__":
    main()
