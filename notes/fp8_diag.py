"""GPU diagnosis: which FP8 buffer disagrees with its transpose / reference (poisoned allocator)."""
import torch

from nanogpt_pl.ops import fp8 as F8
from nanogpt_pl.ops.triton import fp8_mlp as K
from nanogpt_pl.ops.triton.fp8_quant import quantize_dual

torch.manual_seed(0)
dev = "cuda"


def poison():
    junk = torch.full((2**31,), 0xFF, dtype=torch.uint8, device=dev)  # NaN bytes for e4m3/e5m2
    del junk


def same(a, b):
    return bool((a.view(torch.uint8) == b.view(torch.uint8)).all())


for trial in range(2):
    poison()
    n, d, h = 4096, 768, 2816
    x = torch.nn.functional.rms_norm(torch.randn(n, d, device=dev), (d,)).bfloat16()
    inv = torch.tensor([16.0], device=dev)
    xq, xt, _ = quantize_dual(x, inv, torch.float8_e4m3fn)
    print("quantize_dual e4m3 t==row.T:", same(xt, xq.t().contiguous()))
    g = (torch.randn(n, d, device=dev) * 1e-2).bfloat16()
    gq, gt, _ = quantize_dual(g, torch.tensor([64.0], device=dev), torch.float8_e5m2)
    print("quantize_dual e5m2 t==row.T:", same(gt, gq.t().contiguous()))
    dpl = (torch.randn(n, h, device=dev) * 1e-2).bfloat16()
    post = (torch.rand(n, h, device=dev) * 100).to(torch.float8_e4m3fn)
    amax = torch.zeros(1, device=dev)
    row, t = K.dpre_quantize(dpl, post, torch.tensor([1.0], device=dev), torch.tensor([64.0], device=dev), amax)
    print("dpre_quantize e5m2 t==row.T:", same(t, row.t().contiguous()), "nan in t:", bool(t.float().isnan().any()))
    pre = torch.randn(n, h, device=dev).bfloat16()
    amax2 = torch.zeros(1, device=dev)
    prow, pt = K.relu2_quantize(pre, torch.tensor([1.0], device=dev), amax2)
    print("relu2_quantize e4m3 t==row.T:", same(pt, prow.t().contiguous()))
    # the dw1 GEMM as the MLP runs it, against float math on the same fp8 operands
    s1, s2 = torch.tensor([1 / 64.0], device=dev), torch.tensor([1 / 16.0], device=dev)
    dw1 = F8._FAST.mm(t, xt, s1, s2, torch.bfloat16, False)
    ref = (row.float().t() @ xq.float()) * (s1 * s2)
    print("dw1 rel err:", float((dw1.float() - ref).norm() / ref.norm()))
    dw1b = F8._FAST.mm(row.t().contiguous(), xq.t().contiguous(), s1, s2, torch.bfloat16, False)
    print("dw1 from explicit transposes rel err:", float((dw1b.float() - ref).norm() / ref.norm()))
    # gemm-epilogue dpre
    w2 = (torch.randn(h, d, device=dev) * 0.02)
    w2q, w2col, _ = quantize_dual(w2, torch.tensor([448 / w2.abs().max().item()], device=dev), torch.float8_e4m3fn)
    try:
        erow, et = K.fp8_gemm_dpre(gq, w2q, torch.tensor([1 / 64.0], device=dev),
                                   torch.tensor([w2.abs().max().item() / 448], device=dev), post,
                                   torch.tensor([1.0], device=dev), torch.tensor([64.0], device=dev),
                                   torch.zeros(1, device=dev))
        print("fp8_gemm_dpre t==row.T:", same(et, erow.t().contiguous()))
    except Exception as e:  # noqa: BLE001
        print("fp8_gemm_dpre call failed:", type(e).__name__, e)
