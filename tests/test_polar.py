"""The polar cascade: the coefficient table's promise, and what fp32 and bf16 arithmetic deliver.

Measured on CPU (torch 2.13) over the matrices of ``test_cascade_maps_singular_values_into_the_envelope``
(shapes ``SHAPES``, seeds 0-5, smallest normalized singular value 3e-3 or 1e-2):

==========  ==============================  ================================
arithmetic  singular values after cascade   RECORD §8 promise (exact maps)
==========  ==============================  ================================
exact       [0.995067, 1.000401]            [0.99507, 1.00040]
fp32        [0.995067, 1.000387]
bf16        [0.99159, 1.00555]
==========  ==============================  ================================

fp32 agrees with the exact composite map to ~1e-7, so the cascade code is the map. bf16
widens the envelope by 0.0035 below and 0.0051 above, the rounding of the maps' bf16
outputs (one bf16 ulp at 1.0 is 2⁻⁷ = 0.0078 above 1 and 2⁻⁸ below): the bf16 bound
asserted here is the exact envelope widened by ``BF16_TOL`` = 1.5·2⁻⁷ = 0.0117 on each
side, fp32's by ``FP32_TOL`` = 2e-6.
"""

from __future__ import annotations

import math

import pytest
import torch

from nanogpt_pl.optim import polar as P

FP32_TOL = 2e-6  # fp32 rounding through six maps, measured ~1e-7
BF16_TOL = 1.5 * 2**-7
SHAPES = [(64, 96), (96, 64), (80, 80), (32, 96), (3, 48, 40)]
SEEDS = range(6)
EXACT = P.envelope_grid(points=20_001)  # the composite map's range on [3e-3, 1/1.05], float64


pytestmark = pytest.mark.usefixtures("one_thread")


def controlled(shape: tuple[int, ...], gen: torch.Generator, min_normalized: float) -> torch.Tensor:
    """Random matrices whose smallest singular value after the cascade's normalization is ``min_normalized``."""
    *lead, rows, cols = shape
    out = []
    for _ in range(math.prod(lead) if lead else 1):
        k = min(rows, cols)
        s = torch.exp(torch.empty(k, dtype=torch.float64).uniform_(0, math.log(8), generator=gen))
        # σ_min / (1.05·‖σ‖) = q  ⇔  σ_min = q'·‖σ_rest‖/√(1 − q'²) with q' = 1.05·q
        q = min_normalized * P.NORM_MARGIN
        s[0] = q * s[1:].norm() / math.sqrt(1 - q * q)
        out.append(P.random_with_singular_values(rows, cols, s, gen))
    return torch.stack(out).reshape(*lead, rows, cols).float() if lead else out[0].float()


def normalized_min_sigma(g: torch.Tensor) -> float:
    g64 = g.double().reshape(-1, *g.shape[-2:])
    s = torch.linalg.svdvals(g64)
    d = g64.square().sum(dim=(-2, -1), keepdim=True).sqrt().squeeze(-1) * P.NORM_MARGIN + P.NORM_EPS
    return (s / d).min().item()


def test_table_is_the_record_table() -> None:
    assert len(P.ANVIL_MAPS) == 6
    assert P.ANVIL_MAPS[0] == (3.923798038567, -6.095026865488, 3.905234618423)
    assert P.ANVIL_MAPS[-1] == (2.256537145403, -2.166840097229, 0.929501253245)
    assert P.tail_gain() == pytest.approx(643.13, abs=5e-3)


def test_composite_map_envelope_is_the_promised_one() -> None:
    lo, hi = EXACT
    assert lo == pytest.approx(P.ENVELOPE[0], abs=5e-6)
    assert hi == pytest.approx(P.ENVELOPE[1], abs=5e-6)
    # and the map is odd and fixes 0: signs of singular values never flip
    s = torch.linspace(-1, 1, 101, dtype=torch.float64)
    torch.testing.assert_close(P.composite_map(-s), -P.composite_map(s))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, FP32_TOL), (torch.bfloat16, BF16_TOL)])
def test_cascade_maps_singular_values_into_the_envelope(shape, dtype, tol) -> None:
    lo_seen, hi_seen = math.inf, -math.inf
    for seed in SEEDS:
        gen = torch.Generator().manual_seed(seed)
        for min_normalized in (P.ENVELOPE_SIGMA_MIN, 1e-2):
            g = controlled(shape, gen, min_normalized)
            assert normalized_min_sigma(g) >= 0.999 * P.ENVELOPE_SIGMA_MIN
            x = P.polar_cascade(g, backend="reference", dtype=dtype)
            assert x.dtype == dtype and x.shape == g.shape
            lo, hi = P.singular_value_range(x)
            lo_seen, hi_seen = min(lo_seen, lo), max(hi_seen, hi)
    lo_exact, hi_exact = EXACT
    assert lo_seen >= lo_exact - tol, f"{dtype}: smallest singular value {lo_seen}"
    assert hi_seen <= hi_exact + tol, f"{dtype}: largest singular value {hi_seen}"


@pytest.mark.parametrize("seed", SEEDS)
def test_cascade_keeps_singular_vectors(seed: int) -> None:
    """The output is the polar factor U·Vᵀ up to the envelope: compare with the SVD's."""
    gen = torch.Generator().manual_seed(seed)
    g = controlled((40, 56), gen, 1e-2)
    u, _, vh = torch.linalg.svd(g.double(), full_matrices=False)
    polar = u @ vh
    x = P.polar_cascade(g, backend="reference", dtype=torch.float32).double()
    assert (x - polar).abs().max().item() < 1e-3  # measured <= 1.4e-4
    x16 = P.polar_cascade(g, backend="reference").double()
    assert (x16 - polar).abs().max().item() < 1e-2  # measured <= 5.2e-3


def test_cascade_scale_invariance_and_zero() -> None:
    gen = torch.Generator().manual_seed(3)
    g = torch.randn(2, 24, 40, generator=gen)
    a = P.polar_cascade(g, backend="reference", dtype=torch.float32)
    b = P.polar_cascade(g * 1e4, backend="reference", dtype=torch.float32)
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    z = P.polar_cascade(torch.zeros(2, 8, 12), backend="reference")
    assert torch.equal(z, torch.zeros(2, 8, 12, dtype=torch.bfloat16))


@pytest.mark.parametrize("seed", SEEDS[:3])
def test_reference_kernels(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 20, 28, generator=gen, dtype=torch.float64)
    torch.testing.assert_close(P.gram_reference(x), torch.einsum("bik,bjk->bij", x, x))
    torch.testing.assert_close(P.gram_reference(x, transpose=True), torch.einsum("bki,bkj->bij", x, x))
    a = P.gram_reference(x)
    torch.testing.assert_close(P.poly_square_reference(a, -2.5, 1.5),
                               -2.5 * a + 1.5 * torch.einsum("bij,bjk->bik", a, a))
    torch.testing.assert_close(P.matmul_add_reference(a, x, x, 3.0), 3.0 * x + torch.einsum("bij,bjk->bik", a, x))
    torch.testing.assert_close(P.poly_square_reference(a[0], 2.0, -1.0), 2.0 * a[0] - a[0] @ a[0])


def test_backend_choice() -> None:
    assert P.resolve_backend("auto", torch.device("cpu")) == "reference"
    assert P.resolve_backend("reference", torch.device("cpu")) == "reference"
    with pytest.raises(ValueError, match="choose one of"):
        P.resolve_backend("cuda", torch.device("cpu"))
    # the former name of the plain path points to the new one, in one line
    with pytest.raises(ValueError, match=r"^model\.backends\.polar='torch' \(the plain-PyTorch path is 'reference'\)"):
        P.resolve_backend("torch", torch.device("cpu"))
    import os

    if os.environ.get("TRITON_INTERPRET") != "1":
        with pytest.raises(RuntimeError, match=r"model\.backends\.polar='triton' needs a CUDA device"):
            P.polar_cascade(torch.randn(4, 4), backend="triton")
    with pytest.raises(ValueError, match="matrix"):
        P.polar_cascade(torch.randn(5))
