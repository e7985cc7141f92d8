"""Every FP8 kernel's transposed copy holds exactly the bytes of its row-major copy."""

import pytest
import torch

from nanogpt_pl.ops.triton import fp8_mlp as K
from nanogpt_pl.ops.triton.fp8_quant import quantize_dual


def _same(t: torch.Tensor, row: torch.Tensor) -> bool:
    return bool((t.view(torch.uint8) == row.t().contiguous().view(torch.uint8)).all())


@pytest.mark.cuda
@pytest.mark.parametrize("seed", [0, 1])
def test_transposed_copies_match_row_major_on_gpu(seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    dev = "cuda"
    n, d, h = 4096, 768, 2816
    x = torch.nn.functional.rms_norm(torch.randn(n, d, device=dev, generator=gen), (d,)).bfloat16()
    for dtype, inv in ((torch.float8_e4m3fn, 16.0), (torch.float8_e5m2, 64.0)):
        row, t, _ = quantize_dual(x, torch.tensor([inv], device=dev), dtype)
        assert _same(t, row), dtype
    dpl = (1e-2 * torch.randn(n, h, device=dev, generator=gen)).bfloat16()
    post = (100 * torch.rand(n, h, device=dev, generator=gen)).to(torch.float8_e4m3fn)
    one = torch.ones(1, device=dev)
    row, t = K.dpre_quantize(dpl, post, one, torch.tensor([64.0], device=dev), torch.zeros(1, device=dev))
    assert _same(t, row)
    row, t = K.relu2_quantize(torch.randn(n, h, device=dev, generator=gen).bfloat16(), one, torch.zeros(1, device=dev))
    assert _same(t, row)
    g = (1e-2 * torch.randn(n, d, device=dev, generator=gen)).bfloat16()
    gq, _, _ = quantize_dual(g, torch.tensor([64.0], device=dev), torch.float8_e5m2)
    w = 0.02 * torch.randn(h, d, device=dev, generator=gen)
    wq, _, _ = quantize_dual(w, torch.tensor([448 / float(w.abs().max())], device=dev), torch.float8_e4m3fn)
    ws = torch.tensor([float(w.abs().max()) / 448], device=dev)
    row, t = K.fp8_gemm_dpre(gq, wq, torch.tensor([1 / 64.0], device=dev), ws, post, one,
                             torch.tensor([64.0], device=dev), torch.zeros(1, device=dev))
    assert _same(t, row)
    xq, _, _ = quantize_dual(x, torch.tensor([16.0], device=dev), torch.float8_e4m3fn)
    row, t = K.fp8_gemm_relu2(xq, wq, torch.tensor([1 / 16.0], device=dev), ws, one, torch.zeros(1, device=dev))
    assert _same(t, row)
