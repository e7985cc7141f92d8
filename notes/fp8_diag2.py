"""GPU diagnosis 2: which way of writing the transposed e5m2 dpre tile is right, and how fast.

Variants of the dpre kernel (elementwise path): transposed store of the fp8 tile (the
original), of its uint8 bit pattern, a separate uint8 transpose kernel, and PyTorch's
transpose; tile shapes; sqrt_rn vs sqrt. Prints bytes-equal flags and median ms.
"""
import sys

import torch

from benchmarks.gpu_timing import time_cuda
import triton
import triton.language as tl

from nanogpt_pl.ops.triton.fp8_quant import to_fp8


@triton.jit
def dpre_kernel(dpl_ptr, post_ptr, row_ptr, t_ptr, post_scale_ptr, inv_scale_ptr, amax_ptr, m, n,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TMODE: tl.constexpr, SQRT_RN: tl.constexpr):
    offs_m = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_m < m)[:, None] & (offs_n < n)[None, :]
    idx = offs_m[:, None] * n + offs_n[None, :]
    dpl = tl.load(dpl_ptr + idx, mask=mask, other=0.0).to(tl.float32)
    post = tl.load(post_ptr + idx, mask=mask, other=0.0).to(tl.float32)
    if SQRT_RN:
        dpre = 2.0 * dpl * tl.sqrt_rn(post * tl.load(post_scale_ptr))
    else:
        dpre = 2.0 * dpl * tl.sqrt(post * tl.load(post_scale_ptr))
    tl.atomic_max(amax_ptr, tl.max(tl.max(tl.abs(dpre), axis=1), axis=0))
    q = to_fp8(dpre * tl.load(inv_scale_ptr), True)
    tl.store(row_ptr + idx, q, mask=mask)
    t_mask = (offs_n < n)[:, None] & (offs_m < m)[None, :]
    if TMODE == 1:  # fp8 tile transposed
        tl.store(t_ptr + offs_n[:, None] * m + offs_m[None, :], tl.trans(q), mask=t_mask)
    if TMODE == 2:  # its bit pattern transposed (t_ptr is a uint8 view)
        qb = q.to(tl.uint8, bitcast=True)
        tl.store(t_ptr + offs_n[:, None] * m + offs_m[None, :], tl.trans(qb), mask=t_mask)


@triton.jit
def transpose_u8_kernel(src_ptr, dst_ptr, m, n, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    offs_m = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_m < m)[:, None] & (offs_n < n)[None, :]
    v = tl.load(src_ptr + offs_m[:, None] * n + offs_n[None, :], mask=mask, other=0)
    t_mask = (offs_n < n)[:, None] & (offs_m < m)[None, :]
    tl.store(dst_ptr + offs_n[:, None] * m + offs_m[None, :], tl.trans(v), mask=t_mask)


def bench(fn, iters=20):
    return time_cuda(fn, 3, iters).median_ms


def main():
    n, h = int(sys.argv[1]) if len(sys.argv) > 1 else 49152, 2816
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    dpl = (torch.randn(n, h, device=dev, generator=g) * 1e-2).bfloat16()
    post = (torch.rand(n, h, device=dev, generator=g) * 100).to(torch.float8_e4m3fn)
    ps, inv = torch.ones(1, device=dev), torch.tensor([64.0], device=dev)
    amax = torch.zeros(1, device=dev)
    row = torch.empty(n, h, device=dev, dtype=torch.float8_e5m2)
    t = torch.empty(h, n, device=dev, dtype=torch.float8_e5m2)
    ref_row = None
    for bm, bn, warps in ((128, 128, 8), (64, 128, 4), (128, 64, 4), (64, 64, 4), (32, 128, 4)):
        for tmode in (0, 1, 2):
            for sqrt_rn in (True, False):
                if not sqrt_rn and (tmode != 2 or (bm, bn) != (64, 128)):
                    continue
                grid = (triton.cdiv(n, bm), triton.cdiv(h, bn))
                tt = t.view(torch.uint8) if tmode == 2 else t
                t.view(torch.uint8).fill_(0xAA)

                def run():
                    dpre_kernel[grid](dpl, post, row, tt, ps, inv, amax, n, h, BLOCK_M=bm, BLOCK_N=bn, TMODE=tmode,
                                      SQRT_RN=sqrt_rn, num_warps=warps)
                ms = bench(run)
                if ref_row is None:
                    ref_row = row.view(torch.uint8).clone()
                row_ok = bool((row.view(torch.uint8) == ref_row).all())
                t_ok = "-" if tmode == 0 else bool((t.view(torch.uint8) == ref_row.t().contiguous()).all())
                print(f"dpre tile {bm}x{bn} w{warps} tmode {tmode} sqrt_rn {sqrt_rn}: {ms:.3f} ms, row==ref {row_ok}, "
                      f"t==row.T {t_ok}", flush=True)
    src = ref_row
    dst = torch.empty(h, n, device=dev, dtype=torch.uint8)
    for bm, bn, warps in ((64, 64, 4), (128, 128, 8), (64, 128, 4), (128, 64, 4), (32, 32, 4)):
        grid = (triton.cdiv(n, bm), triton.cdiv(h, bn))
        ms = bench(lambda: transpose_u8_kernel[grid](src, dst, n, h, BLOCK_M=bm, BLOCK_N=bn, num_warps=warps))
        print(f"u8 transpose kernel {bm}x{bn} w{warps}: {ms:.3f} ms, ok {bool((dst == src.t().contiguous()).all())}")
    print(f"torch transpose of the e5m2 tile: {bench(lambda: row.t().contiguous()):.3f} ms")
    print(f"torch transpose as uint8: {bench(lambda: row.view(torch.uint8).t().contiguous()):.3f} ms")
    print(f"copy of the tile (bandwidth floor, 1 read + 1 write): {bench(lambda: dst.copy_(src.t().contiguous().view(h, n))):.3f} ms")
    print(f"plain copy row->row: {bench(lambda: src.clone()):.3f} ms")


if __name__ == "__main__":
    main()
