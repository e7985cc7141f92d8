"""FlashAttention 3 and 4 as optional attention backends (``model.backends.attention: fa3 | fa4``).

Neither installs on the machines these tests run on (FA3 needs its Hopper build, FA4 the CuTe
DSL; the project's GPU machine has neither), so on CPU the tests check what the project itself
does: the choice and its one-line errors, and the call into the library's varlen function. For
the call, a stand-in module implements ``flash_attn_varlen_func`` as FlashAttention documents it
(query i of a segment attends keys ``[i - window_size[0], i + window_size[1]]``, both inclusive,
and with ``causal`` none after i; each segment of ``cu_seqlens`` apart), in float64 and without
any of this project's code; ``packed_attention`` through it must equal ``dense_reference`` on
fresh random inputs. FA3's older interface returns ``(out, lse)``, FA4's stand-in ``out`` alone.

On a GPU where a library imports, ``@pytest.mark.cuda`` compares it with the Triton kernel at
a stage-2 micro-batch; it skips where the library is missing.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch
from seeds import fresh_seed

from nanogpt_pl.model import attention
from nanogpt_pl.model.attention import FLASH_MODULES, _flash_fn, dense_reference, packed_attention, resolve_backend


def documented_varlen(q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                      softmax_scale=None, causal=False, window_size=(-1, -1), **unused):
    """FlashAttention's documented varlen function, segment by segment in float64."""
    assert torch.equal(cu_seqlens_q, cu_seqlens_k) and cu_seqlens_q.dtype == torch.int32
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[-1], dtype=torch.float64)
    cu = cu_seqlens_q.tolist()
    for start, end in zip(cu[:-1], cu[1:]):
        if end <= start:
            continue
        assert end - start <= max_seqlen_q
        i = torch.arange(end - start)[:, None]
        j = torch.arange(end - start)[None, :]
        left, right = window_size
        keep = torch.ones(end - start, end - start, dtype=torch.bool)
        if left >= 0:
            keep &= j >= i - left
        if right >= 0:
            keep &= j <= i + right
        if causal:
            keep &= j <= i
        for h in range(q.shape[1]):
            s = (q[start:end, h].double() @ k[start:end, h].double().T) * softmax_scale
            p = torch.softmax(s.masked_fill(~keep, float("-inf")), dim=-1)
            out[start:end, h] = p @ v[start:end, h].double()
    return out.to(q.dtype)


@pytest.fixture(autouse=True)
def fresh_lookup(monkeypatch):
    """Each test looks the libraries up again (the model looks each up once)."""
    monkeypatch.setattr(attention, "_flash_fns", {})
    monkeypatch.setattr(attention, "_flash_errors", {})


@pytest.fixture
def stand_ins(monkeypatch):
    """FA3's module returning (out, lse), as its older interface does; FA4's returning out."""
    fa3 = types.ModuleType("flash_attn_interface")
    fa3.flash_attn_varlen_func = lambda *a, **kw: (documented_varlen(*a, **kw), None)
    flash_attn = types.ModuleType("flash_attn")
    cute = types.ModuleType("flash_attn.cute")
    cute.flash_attn_varlen_func = documented_varlen
    flash_attn.cute = cute
    monkeypatch.setitem(sys.modules, "flash_attn_interface", fa3)
    monkeypatch.setitem(sys.modules, "flash_attn", flash_attn)
    monkeypatch.setitem(sys.modules, "flash_attn.cute", cute)


@pytest.mark.parametrize("backend", ["fa3", "fa4"])
@pytest.mark.parametrize("d_qk,d_v", [(64, 64), (32, 64)])
def test_the_call_is_the_function_of_the_other_kernels(stand_ins, backend, d_qk, d_v):
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    n, h, window, scale = 97, 2, 13, 0.3
    cu = torch.tensor([0, 5, 40, 41, 97, 97], dtype=torch.int32)  # short, long, one-token segments; padded
    q, k = (torch.randn(n, h, d_qk, generator=gen) for _ in range(2))
    v = torch.randn(n, h, d_v, generator=gen)
    got = packed_attention(q, k, v, cu, 56, window, scale, backend)
    want = dense_reference(q, k, v, cu, window, scale).float()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"{backend}, seed {seed}")


def test_choice_and_errors_are_one_line(monkeypatch):
    for backend in ("fa3", "fa4"):
        with pytest.raises(RuntimeError, match=rf"^model\.backends\.attention='{backend}' needs a CUDA GPU"):
            resolve_backend(backend, torch.device("cpu"))
        module, _ = FLASH_MODULES[backend]
        monkeypatch.setitem(sys.modules, module, None)  # as if not installed, whatever this machine has
        attention._flash_fns.clear()
        if backend == "fa4":
            monkeypatch.setitem(sys.modules, "flash_attn", None)
        assert _flash_fn(backend) is None
        with pytest.raises(RuntimeError, match=rf"^model\.backends\.attention='{backend}' needs FlashAttention "
                                               rf".*`import {module}` failed \(ModuleNotFoundError: .*\); install "
                                               rf"it, or use 'triton' or 'auto'$"):
            resolve_backend(backend, torch.device("cuda"))


def test_where_installed_the_choice_stands(stand_ins):
    for backend in ("fa3", "fa4"):
        assert resolve_backend(backend, torch.device("cuda")) == backend
        assert resolve_backend(backend, torch.device("cuda"), same_head_dims=False) == backend
    assert resolve_backend("auto", torch.device("cpu")) == "reference"


@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["fa3", "fa4"])
def test_gpu_matches_the_triton_kernel_at_stage_2(backend):
    if _flash_fn(backend) is None:
        pytest.skip(f"{FLASH_MODULES[backend][1]} is not installed")
    from nanogpt_pl.ops.triton.attention import triton_packed_attention

    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    n, h, d, window, scale = 49152, 6, 128, 1408, 0.12  # RECORD §2 wide layers, §9 stage 2
    cu = torch.tensor([0, 700, 3260, 3300, 9000, 20000, 22560, 30000, 49152], dtype=torch.int32, device="cuda")
    q, k, v, g = (torch.randn(n, h, d, generator=gen).to("cuda", torch.bfloat16) for _ in range(4))
    results = []
    for fn in (lambda a, b, c: packed_attention(a, b, c, cu, 2560, window, scale, backend),
               lambda a, b, c: triton_packed_attention(a, b, c, cu, 2560, window, scale)):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        out = fn(*leaves)
        out.backward(g)
        results.append([out.detach()] + [x.grad for x in leaves])
    for name, a, b in zip(("out", "dq", "dk", "dv"), *results):
        err = (a.float() - b.float()).abs().max().item()
        assert err <= 8 * 2**-8 * b.float().abs().max().item(), f"{backend} {name}, seed {seed}: {err:.3e}"


def test_a_compiled_model_calls_fa4_outside_its_graph_and_fa3_inside(stand_ins, monkeypatch):
    """FA4 (CuTe DSL, no torch op) runs across a graph break under ``torch.compile``; FA3 (torch
    ops) is traced. Through the compiled function both return the stand-in's output, and its gradient
    reaches the leaf."""
    seen = {}
    for name, module in (("fa3", "flash_attn_interface"), ("fa4", "flash_attn.cute")):
        def traced_varlen(*a, name=name, **kw):
            seen[name] = torch.compiler.is_compiling()
            return torch.zeros(a[0].shape[0], a[0].shape[1], a[2].shape[-1], dtype=a[0].dtype) + a[2].mean(0)
        monkeypatch.setattr(sys.modules[module], "flash_attn_varlen_func", traced_varlen)
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    n, h, d = 24, 2, 8
    cu = torch.tensor([0, 10, 24], dtype=torch.int32)
    q, k, v = (torch.randn(n, h, d, generator=gen) for _ in range(3))
    for backend in ("fa3", "fa4"):
        attention._flash_fns.clear()
        torch._dynamo.reset()
        def model(a, b, c, backend=backend):
            return packed_attention(a, b, c, cu, 14, 5, 0.3, backend) * 2

        compiled = torch.compile(model, backend="eager")
        leaf = v.clone().requires_grad_()
        out = compiled(q, k, leaf)
        out.sum().backward()
        torch.testing.assert_close(out, 2 * v.mean(0).expand(n, h, d), msg=f"{backend}, seed {seed}")
        torch.testing.assert_close(leaf.grad, torch.full_like(v, 2.0), msg=f"{backend}, seed {seed}")
    assert seen == {"fa3": True, "fa4": False}


def test_a_library_whose_import_raises_is_unavailable_with_its_reason(monkeypatch, tmp_path):
    """FA4's CuTe DSL raises RuntimeError at import where no toolkit flavour suits the driver: the
    backend is then unavailable (``benchmarks/attention.py`` goes on without its row) and choosing
    it is one line that carries the library's own first line."""
    package = tmp_path / "flash_attn"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "cute.py").write_text('raise RuntimeError("None of the installed toolkit flavors (cu13) are '
                                     'compatible with the CUDA driver\\nsecond line")\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("flash_attn", "flash_attn.cute"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    assert _flash_fn("fa4") is None
    with pytest.raises(RuntimeError) as err:
        resolve_backend("fa4", torch.device("cuda"))
    assert str(err.value) == (
        "model.backends.attention='fa4' needs FlashAttention 4 (flash-attn's CuTe interface, package fa4): "
        "`import flash_attn.cute` failed (RuntimeError: None of the installed toolkit flavors (cu13) are compatible "
        "with the CUDA driver); install it, or use 'triton' or 'auto'")
