"""GPU diagnosis 3: tile shapes of the relu2 and quantize_dual kernels (bytes checked against the row-major copy)."""

import torch

from benchmarks.gpu_timing import time_cuda
from nanogpt_pl.ops.triton.fp8_mlp import dpre_quantize, relu2_quantize
from nanogpt_pl.ops.triton.fp8_quant import quantize_dual


def bench(fn, iters=20):
    return time_cuda(fn, 3, iters).median_ms


def same_t(t, row):
    return bool((t.view(torch.uint8) == row.t().contiguous().view(torch.uint8)).all())


dev = "cuda"
g = torch.Generator(device=dev).manual_seed(0)
n, d, h = 49152, 768, 2816
pre = torch.randn(n, h, device=dev, generator=g).bfloat16()
one, amax = torch.ones(1, device=dev), torch.zeros(1, device=dev)
for block in ((128, 128), (64, 128), (128, 64), (64, 64), (32, 128), (32, 64)):
    row, t = relu2_quantize(pre, one, amax, block=block)
    ms = bench(lambda: relu2_quantize(pre, one, amax, block=block))
    print(f"relu2 {block}: {ms:.3f} ms, t==row.T {same_t(t, row)}", flush=True)
dpl = (torch.randn(n, h, device=dev, generator=g) * 1e-2).bfloat16()
post = (torch.rand(n, h, device=dev, generator=g) * 100).to(torch.float8_e4m3fn)
for block in ((32, 128), (64, 64), (16, 256), (32, 256)):
    row, t = dpre_quantize(dpl, post, one, torch.tensor([64.0], device=dev), amax, block=block)
    ms = bench(lambda: dpre_quantize(dpl, post, one, torch.tensor([64.0], device=dev), amax, block=block))
    print(f"dpre+transpose {block}: {ms:.3f} ms, t==row.T {same_t(t, row)}", flush=True)
x = torch.nn.functional.rms_norm(torch.randn(n, d, device=dev, generator=g), (d,)).bfloat16()
inv = torch.tensor([16.0], device=dev)
for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
    for block in ((128, 128), (64, 128), (64, 64), (32, 128)):
        row, t, _ = quantize_dual(x, inv, dtype, block=block)
        ms = bench(lambda: quantize_dual(x, inv, dtype, block=block))
        print(f"quantize_dual {dtype} {block}: {ms:.3f} ms, t==row.T {same_t(t, row)}", flush=True)
