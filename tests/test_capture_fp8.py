"""FP8 caches held at fixed addresses for CUDA graphs, on the fast path (Triton kernels under the
interpreter): the fast path keeps a separate column-major copy and refreshes the MLP in one fused
pass, so ``keep_addresses`` copies both layouts. Held and plain states must compute the same bits.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from interpreter import INTERPRETED, interp, run_module_under_interpreter


@pytest.mark.skipif(INTERPRETED, reason="already inside the interpreter run")
def test_held_fp8_caches_under_interpreter():
    run_module_under_interpreter(__file__)


def _ptrs(state) -> list[int]:
    return [t.data_ptr() for t in state.cache_tensors()]


@interp
@pytest.mark.parametrize("relu2_kernel", ["elementwise", "gemm_epilogue"])
def test_fast_mlp_held_cache_equals_plain(relu2_kernel):
    from nanogpt_pl.ops import fp8 as f8

    gen = torch.Generator().manual_seed(3)
    n, d, h = 48, 64, 96
    w10 = (0.1 * torch.randn(h, d, generator=gen)).bfloat16()
    w20 = (0.1 * torch.randn(h, d, generator=gen)).bfloat16()
    runs = []
    for held in (True, False):
        w1, w2 = torch.nn.Parameter(w10.clone()), torch.nn.Parameter(w20.clone())
        state = f8.Fp8MLPState(backend="reference", relu2_kernel=relu2_kernel)
        state._kernels_override = f8._FAST
        state.hold_cache_addresses(held)
        out, ptrs = [], None
        for step in range(3):
            if held:
                state.refresh_cache()  # what the graphs do before a replay
                if step:
                    assert _ptrs(state) == ptrs
            g = torch.Generator().manual_seed(10 + step)
            x = F.rms_norm(torch.randn(n, d, generator=g), (d,)).bfloat16().requires_grad_()
            y = f8.fp8_mlp(x, w1, w2, state)
            y.backward(torch.randn(n, d, generator=g).bfloat16())
            ptrs = _ptrs(state)
            out.append([y.detach(), x.grad, w1.grad.clone(), w2.grad.clone(), state.post_scale.clone(),
                        state.dpre_scale.clone(), state.w1_scale.clone(), state.w2_amax.clone()])
            w1.grad = w2.grad = None
            with torch.no_grad():
                w1.mul_(1.02)
                w2.mul_(0.98)
        if held:  # the fast path's column-major copy is its own tensor, refreshed in place too
            rows, cols = state.cache_tensors()[0], state.cache_tensors()[1]
            assert rows.untyped_storage().data_ptr() != cols.untyped_storage().data_ptr()
        runs.append(out)
    for a, b in zip(*runs):
        for u, v in zip(a, b):
            assert torch.equal(u, v)


@interp
def test_fast_linear_held_cache_equals_plain():
    from nanogpt_pl.ops import fp8 as f8

    gen = torch.Generator().manual_seed(4)
    n, d = 40, 64
    qk0, v0 = 0.1 * torch.randn(2, 32, d, generator=gen), 0.1 * torch.randn(32, d, generator=gen)
    runs = []
    for held in (True, False):
        qk, v = torch.nn.Parameter(qk0.clone()), torch.nn.Parameter(v0.clone())
        state = f8.Fp8LinearState(backend="reference")
        state._kernels_override = f8._FAST
        state.hold_cache_addresses(held)
        out, ptrs = [], None
        for step in range(3):
            if held:
                assert state.refresh_cache() == (step > 0)
                if step:
                    assert _ptrs(state) == ptrs
            g = torch.Generator().manual_seed(20 + step)
            x = F.rms_norm(torch.randn(n, d, generator=g), (d,)).requires_grad_()
            y = f8.fp8_linear(x, (qk.flatten(0, 1), v), state)
            y.backward(0.01 * torch.randn(n, 96, generator=g))
            ptrs = _ptrs(state)
            out.append([y.detach(), x.grad, qk.grad.clone(), v.grad.clone(), state.w_scale.clone()])
            qk.grad = v.grad = None
            with torch.no_grad():
                qk.mul_(1.05)
                v.mul_(0.95)
        runs.append(out)
    for a, b in zip(*runs):
        for u, v in zip(a, b):
            assert torch.equal(u, v)
