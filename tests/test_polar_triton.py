"""Triton kernels of the polar cascade against the PyTorch reference.

On CPU the kernels run under ``TRITON_INTERPRET=1`` in a subprocess (the variable must be
set before the kernels are defined), at tiny sizes that still cover partial tiles,
batches, strided inputs and both Gram orientations. On the GPU they run at the record's
shapes: 42 qk blocks of 256x768, 14 square 768x768, 22 tall 2816x768.

Tolerances: every kernel accumulates in fp32 and rounds once to bf16, so its error
against float64 is one bf16 rounding (relative 2⁻⁸) of the result; ``REL`` = 2⁻⁷ allows
for a different accumulation order near a rounding boundary.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REL = 2**-7
ROOT = Path(__file__).resolve().parents[1]


def _close_to_exact(out: torch.Tensor, exact: torch.Tensor, scale: torch.Tensor, what: str) -> None:
    """|out − exact| ≤ REL·scale elementwise, with ``scale`` the magnitude of the summed terms."""
    err = (out.double() - exact).abs()
    bound = REL * scale + 1e-30
    worst = (err / bound).max().item()
    assert worst <= 1.0, f"{what}: error {worst:.3f}x the bf16 bound (max abs err {err.max().item():.3e})"


def check_gram(device: str, shapes) -> None:
    from nanogpt_pl.ops.triton import polar as K

    for seed, shape in enumerate(shapes):
        g = torch.Generator(device="cpu").manual_seed(seed)
        x = torch.randn(shape, generator=g).to(device=device, dtype=torch.bfloat16)
        for transpose in (False, True):
            a = K.gram(x, transpose=transpose)
            xd = x.double()
            exact = xd.mT @ xd if transpose else xd @ xd.mT
            scale = xd.abs().mT @ xd.abs() if transpose else xd.abs() @ xd.abs().mT
            _close_to_exact(a, exact, scale, f"gram{' T' if transpose else ''} {shape}")
            # mirrored tiles are exact transposes; diagonal tiles may differ in the last bit
            assert (a.float() - a.float().mT).abs().max().item() <= 2 * REL * scale.max().item()
    # a strided (transposed view) input
    x = torch.randn(3, 40, 24).to(device=device, dtype=torch.bfloat16).mT
    exact = x.double() @ x.double().mT
    _close_to_exact(K.gram(x), exact, x.double().abs() @ x.double().abs().mT, "gram of a strided view")


def check_gram_mirror_exact(device: str) -> None:
    """Off-diagonal tiles are computed once and stored twice, so they are bit-exact transposes."""
    from nanogpt_pl.ops.triton import polar as K

    assert K.INTERPRET, "the interpreter's tile is 16; the GPU's is chosen by the autotuner"
    block = 16
    x = torch.randn(2, 48, 20).to(device=device, dtype=torch.bfloat16)
    for transpose in (False, True):
        a = K.gram(x.mT.contiguous() if transpose else x, transpose=transpose)
        for i in range(3):
            for j in range(i + 1, 3):
                up = a[:, i * block:(i + 1) * block, j * block:(j + 1) * block]
                low = a[:, j * block:(j + 1) * block, i * block:(i + 1) * block]
                assert torch.equal(up, low.mT)


def check_poly_square(device: str, sizes) -> None:
    from nanogpt_pl.ops.triton import polar as K

    for seed, (batch, n) in enumerate(sizes):
        g = torch.Generator(device="cpu").manual_seed(100 + seed)
        x = torch.randn(batch, n, n + 7, generator=g).double()
        a = (x @ x.mT / (n + 7)).to(device=device, dtype=torch.bfloat16)
        for b, c in [(-6.095026865488, 3.905234618423), (-2.166840097229, 0.929501253245)]:
            out = K.poly_square(a, b, c)
            ad = a.double()
            exact = b * ad + c * ad @ ad
            scale = abs(b) * ad.abs() + abs(c) * ad.abs() @ ad.abs()
            _close_to_exact(out, exact, scale, f"poly_square {batch}x{n}")
            if K.INTERPRET and n >= 32:  # 16-wide tiles: tile (0, 1) is stored once more as tile (1, 0)
                assert torch.equal(out[:, :16, 16:32], out[:, 16:32, :16].mT)


def check_matmul_add(device: str, cases) -> None:
    from nanogpt_pl.ops.triton import polar as K

    for seed, (batch, rows, cols) in enumerate(cases):
        g = torch.Generator(device="cpu").manual_seed(200 + seed)
        x = torch.randn(batch, rows, cols, generator=g).to(device=device, dtype=torch.bfloat16)
        tall = rows > cols
        n = cols if tall else rows
        bm = torch.randn(batch, n, n, generator=g)
        bm = ((bm + bm.mT) / 2 / math.sqrt(n)).to(device=device, dtype=torch.bfloat16)
        a = 3.9237
        out = K.matmul_add(x, bm, x, a) if tall else K.matmul_add(bm, x, x, a)
        xd, bd = x.double(), bm.double()
        exact = a * xd + (xd @ bd if tall else bd @ xd)
        scale = a * xd.abs() + (xd.abs() @ bd.abs() if tall else bd.abs() @ xd.abs())
        _close_to_exact(out, exact, scale, f"matmul_add {(batch, rows, cols)}")


def _controlled(shape, min_normalized: float, gen: torch.Generator) -> torch.Tensor:
    from nanogpt_pl.optim import polar as P

    rows, cols = shape[-2:]
    k = min(rows, cols)
    mats = []
    for _ in range(shape[0]):
        s = torch.exp(torch.empty(k, dtype=torch.float64).uniform_(0, math.log(8), generator=gen))
        q = min_normalized * P.NORM_MARGIN
        s[0] = q * s[1:].norm() / math.sqrt(1 - q * q)
        mats.append(P.random_with_singular_values(rows, cols, s, gen))
    return torch.stack(mats)


def check_cascade(device: str, shapes, tol: float) -> None:
    """Both cascades land in the envelope; on well-conditioned input they agree elementwise.

    With singular values down to 3e-3 of the largest, bf16 cannot resolve the weak directions
    (a rounding of a large entry is worth several percent of a weak component, which the maps
    then amplify by up to 643x), so two rounding sequences legitimately give different
    matrices there, each with singular values in the envelope. With the weakest singular
    value at 5% the two agree to a few bf16 ulps and match the exact polar factor.
    """
    from nanogpt_pl.optim import polar as P

    lo_exact, hi_exact = P.envelope_grid(points=20_001)
    for seed, shape in enumerate(shapes):
        gen = torch.Generator().manual_seed(300 + seed)
        hard = _controlled(shape, P.ENVELOPE_SIGMA_MIN, gen).float().to(device)
        for name in ("triton", "reference"):
            lo, hi = P.singular_value_range(P.polar_cascade(hard, backend=name).cpu())
            assert lo >= lo_exact - tol and hi <= hi_exact + tol, f"{name} {shape}: [{lo}, {hi}]"
        easy = _controlled(shape, 0.05, gen)
        u, _, vh = torch.linalg.svd(easy, full_matrices=False)
        polar = u @ vh
        xt = P.polar_cascade(easy.float().to(device), backend="triton").double().cpu()
        xr = P.polar_cascade(easy.float().to(device), backend="reference").double().cpu()
        scale = polar.abs().max().item()
        diff = (xt - xr).abs().max().item()
        assert diff <= 4 * REL * scale, f"triton vs reference cascade {shape}: {diff} (entries up to {scale})"
        for name, x in (("triton", xt), ("reference", xr)):
            err = (x - polar).abs().max().item()
            assert err <= 4 * REL * scale, f"{name} cascade {shape} vs exact polar factor: {err}"


def check_errors(device: str) -> None:
    from nanogpt_pl.ops.triton import polar as K

    x = torch.randn(16, 16).to(device=device, dtype=torch.bfloat16)
    for call in (lambda: K.poly_square(x, 1.0, 1.0, out=x), lambda: K.matmul_add(x, x, x, 1.0, out=x)):
        try:
            call()
        except ValueError as err:
            assert "alias" in str(err)
        else:
            raise AssertionError("aliasing output was accepted")


def run_interpreted_checks() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    from test_polar import BF16_TOL

    torch.set_num_threads(1)
    check_gram("cpu", [(3, 40, 50), (2, 50, 40), (37, 21), (1, 16, 16), (2, 17, 33)])
    check_gram_mirror_exact("cpu")
    check_poly_square("cpu", [(2, 40), (1, 16), (3, 21)])
    check_matmul_add("cpu", [(2, 24, 40), (2, 40, 24), (1, 33, 33), (3, 18, 50)])
    check_errors("cpu")
    check_cascade("cpu", [(2, 16, 24), (1, 24, 16)], BF16_TOL)


def test_kernels_and_cascade_under_interpreter() -> None:
    """One subprocess (TRITON_INTERPRET=1 must precede the kernel definitions) runs every CPU check."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]))
    proc = subprocess.run([sys.executable, __file__], env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"interpreted checks failed:\n{proc.stdout}\n{proc.stderr[-4000:]}"


cuda = pytest.mark.cuda  # skipped without a GPU (tests/conftest.py)

RECORD_SHAPES = [(42, 256, 768), (14, 768, 768), (22, 2816, 768)]


@pytest.mark.cuda
@cuda
def test_kernels_at_record_shapes() -> None:
    check_gram("cuda", RECORD_SHAPES)
    check_poly_square("cuda", [(42, 256), (14, 768), (22, 768)])
    check_matmul_add("cuda", RECORD_SHAPES)
    check_errors("cuda")


@pytest.mark.cuda
@cuda
def test_cascade_at_record_shapes() -> None:
    from test_polar import BF16_TOL

    check_cascade("cuda", [(6, 256, 768), (4, 768, 768), (3, 2816, 768)], BF16_TOL)


if __name__ == "__main__":
    run_interpreted_checks()
