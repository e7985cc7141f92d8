"""ANVIL's elementwise update as Triton kernels against the PyTorch functions of ``optim/anvil.py``.

``nanogpt_pl.ops.triton.anvil_update`` replaces ``rails_lookahead`` (before the cascade) and
``finish_update`` (after it). Compared on random inputs with fresh seeds:

- the rails and the lookahead, with the scalars before and after the engage step (both
  branches of torch's lerp formula are taken);
- lanes, decay and step for row lanes (rows >= cols) and column lanes, bf16 parameters with
  the mantissa sidecar and fp32 parameters, several matrices with their own lr multipliers;
- the whole optimizer with ``update_backend="triton"`` against ``"reference"`` over steps that
  cross the engage step.

The kernels do the reference's arithmetic in its order, but the lane sums are tree sums,
so the lane energies and the fp32 masters agree to a few fp32 roundings, not bit for bit.

On CPU the kernels run under ``TRITON_INTERPRET=1`` in a child process at small sizes; on
the GPU at the record's bank shapes.
"""

from __future__ import annotations

import pytest
import torch
from interpreter import INTERPRETED, interp, run_module_under_interpreter

import nanogpt_pl.optim.anvil as A
from nanogpt_pl.optim.anvil import Anvil, master_from_bf16, resolve_update_backend

SEEDS = [3, 17]


@pytest.mark.skipif(INTERPRETED, reason="already inside the interpreter run")
def test_kernel_suite_under_interpreter():
    run_module_under_interpreter(__file__)


def scalars(engaged: bool, lr: float = 0.0191, device: str = "cpu") -> torch.Tensor:
    """A group's step scalars in the optimizer's layout (anvil._group_scalars), record-like values."""
    s = [0.0] * A._N_SCALARS
    mu = 0.93 if engaged else 0.86
    s[A._S_ONE_MINUS_FAST] = 1.0 - (A.FAST_BETA_ENGAGED if engaged else mu)
    s[A._S_ONE_MINUS_SLOW] = 1.0 - A.SLOW_BETA
    s[A._S_BLEND] = A.BLEND if engaged else 1.0
    s[A._S_MU] = mu
    s[A._S_ONE_MINUS_LANE] = 1.0 - A.LANE_BETA2
    s[A._S_EPS] = A.LANE_EPS
    s[A._S_WD_LR] = A.ANVIL_WEIGHT_DECAY * lr
    s[A._S_LR] = lr
    return torch.tensor(s, dtype=torch.float32, device=device)


def rails_args(s: torch.Tensor) -> tuple:
    return s[A._S_ONE_MINUS_FAST], s[A._S_ONE_MINUS_SLOW], s[A._S_BLEND], s[A._S_MU]


def finish_args(s: torch.Tensor) -> tuple:
    return s[A._S_ONE_MINUS_LANE], s[A._S_EPS], s[A._S_WD_LR], s[A._S_LR]


def random_bank(n: int, rows: int, cols: int, dtype: torch.dtype, seed: int, device: str = "cpu") -> dict:
    """Everything one bank's update touches, drawn at random (the rails and energies as after some steps)."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device)

    lane_shape = (n, rows, 1) if rows >= cols else (n, 1, cols)
    bank = {
        "g": randn(n, rows, cols).to(dtype),
        "rails": randn(2, n, rows, cols) * 0.5,
        "x": (randn(n, rows, cols) * 0.05).to(torch.bfloat16),  # the cascade's output is bf16
        "lane_energy": randn(*lane_shape).square() * 2e-3,
        "lr_mul": 1.0 + torch.rand(n, 1, 1, generator=gen, device=device),
        "params": (randn(n, rows, cols) * 0.02).to(dtype),
        "sidecar": (torch.randint(-2**15, 2**15, (n, rows, cols), generator=gen, device=device).to(torch.int16)
                    if dtype == torch.bfloat16 else None),
    }
    if n > 1:
        bank["lane_energy"][0].zero_()  # a matrix on its first step: energies still at their zero init
    bank["rails"][1, 0, 0].zero_()  # a slow rail at exactly zero: the decay still applies (v_s·θ >= 0)
    return bank


def master(params: torch.Tensor, sidecar) -> torch.Tensor:
    # a copy either way (``float()`` of an fp32 tensor is the tensor itself)
    return params.clone() if sidecar is None else master_from_bf16(params.view(torch.int16), sidecar)


def clone(bank: dict) -> dict:
    return {k: (v.clone() if v is not None else None) for k, v in bank.items()}


def check_rails(device: str, n: int, rows: int, cols: int, dtype: torch.dtype, seed: int, engaged: bool) -> None:
    from nanogpt_pl.ops.triton.anvil_update import rails_lookahead_

    s = scalars(engaged, device=device)
    ref, fast = random_bank(n, rows, cols, dtype, seed, device), random_bank(n, rows, cols, dtype, seed, device)
    u_ref = A.rails_lookahead(ref["g"], ref["rails"], s)
    v0 = fast["rails"]._version
    u = rails_lookahead_(fast["g"], fast["rails"], *rails_args(s))
    assert fast["rails"]._version > v0  # the kernel's writes bump the counter (autograd sees none)
    torch.testing.assert_close(fast["rails"], ref["rails"], rtol=2e-6, atol=1e-7)
    torch.testing.assert_close(u, u_ref, rtol=2e-6, atol=1e-7)
    assert u.dtype == torch.float32 and not torch.equal(fast["rails"], random_bank(n, rows, cols, dtype, seed,
                                                                                   device)["rails"])


def check_finish(device: str, n: int, rows: int, cols: int, dtype: torch.dtype, seed: int, engaged: bool) -> None:
    from nanogpt_pl.ops.triton.anvil_update import finish_update_

    s = scalars(engaged, device=device)
    lane_dim = -1 if rows >= cols else -2
    ref, fast = random_bank(n, rows, cols, dtype, seed, device), random_bank(n, rows, cols, dtype, seed, device)
    before = master(ref["params"], ref["sidecar"])
    slow = ref["rails"][1]
    A.finish_update(ref["x"], ref["lane_energy"], slow, ref["params"], ref["sidecar"], ref["lr_mul"], s, lane_dim)
    v0 = fast["params"]._version
    finish_update_(fast["x"], fast["lane_energy"], slow, fast["params"], fast["sidecar"], fast["lr_mul"],
                   *finish_args(s), lane_dim)
    assert fast["params"]._version > v0  # the FP8 weight caches see a changed weight by its counter
    torch.testing.assert_close(fast["lane_energy"], ref["lane_energy"], rtol=1e-5, atol=1e-12)
    want, got = master(ref["params"], ref["sidecar"]), master(fast["params"], fast["sidecar"])
    step = (want - before).abs()
    assert step.max() > 0
    # each element's step agrees to a few fp32 roundings of the step itself (the lane sums' order)
    assert ((got - want).abs() <= 1e-5 * step + 4e-7 * want.abs()).all(), (got - want).abs().max()


SHAPES = [(3, 40, 24), (2, 24, 40), (1, 33, 33), (2, 8, 96)]  # row lanes, column lanes, square, wide


@interp
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rails_and_lookahead_equal_the_reference(seed: int, shape: tuple, dtype: torch.dtype) -> None:
    for engaged in (False, True):
        check_rails("cpu", *shape, dtype, seed, engaged)


@interp
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_lanes_decay_and_step_equal_the_reference(seed: int, shape: tuple, dtype: torch.dtype) -> None:
    for engaged in (False, True):
        check_finish("cpu", *shape, dtype, seed, engaged)


def make_params(seed: int, dtype: torch.dtype, device: str = "cpu") -> list[torch.nn.Parameter]:
    """A qk-like [2, 16, 12] in 8x12 blocks (column lanes), square v, a tall fc (row lanes), proj at lr x2."""
    g = torch.Generator().manual_seed(seed)
    qk = torch.nn.Parameter((torch.randn(2, 16, 12, generator=g) * 0.2).to(device, dtype))
    qk.anvil_block = (8, 12)
    v = torch.nn.Parameter((torch.randn(12, 12, generator=g) * 0.2).to(device, dtype))
    fc = torch.nn.Parameter((torch.randn(24, 12, generator=g) * 0.2).to(device, dtype))
    proj = torch.nn.Parameter((torch.randn(24, 12, generator=g) * 0.2).to(device, dtype))
    proj.anvil_lr_mul = 2.0
    return [qk, v, fc, proj]


def run_optimizer(update_backend: str, dtype: torch.dtype, seed: int, steps: int = 4) -> list[list[torch.Tensor]]:
    params = make_params(seed, dtype)
    opt = Anvil(params, engage_step=2, update_backend=update_backend)
    out = []
    for step in range(steps):
        opt.param_groups[0]["lr"] = 0.023 * (1.0 - 0.1 * step)
        opt.param_groups[0]["momentum"] = 0.85 + 0.02 * step
        g = torch.Generator().manual_seed(1000 * seed + step)
        for p in params:
            p.grad = torch.randn(p.shape, generator=g).to(dtype)
        opt.step()
        out.append([s["theta"] for s in opt_masters(opt, params)])
    return out


def opt_masters(opt: Anvil, params: list[torch.Tensor]) -> list[dict]:
    masters = []
    for bank in opt._banks:  # one rank: the bank owns every matrix, so a piece's slots start at its index
        for p, start, n in bank.pieces:
            m, side = bank.matrices(p), bank.sidecar
            masters.append({"theta": m.clone() if side is None else master_from_bf16(m.view(torch.int16),
                                                                                     side[start:start + n])})
    return masters


@interp
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_optimizer_with_the_kernels_follows_the_reference_across_the_engage_step(seed: int,
                                                                                 dtype: torch.dtype) -> None:
    ref, fast = run_optimizer("reference", dtype, seed), run_optimizer("triton", dtype, seed)
    start = [m["theta"] for m in opt_masters(Anvil(make_params(seed, dtype)), make_params(seed, dtype))]
    for step, (want, got) in enumerate(zip(ref, fast)):
        for w, g, s in zip(want, got, start):
            moved = (w - s).abs().max()
            assert moved > 1e-4
            # the cascade amplifies last-bit differences of its input; relative to the total move
            assert (g - w).abs().max() <= 1e-4 * moved, (step, (g - w).abs().max().item(), moved.item())


@pytest.mark.skipif(INTERPRETED, reason="checks the CPU choice without the interpreter")
def test_backend_choices_and_errors() -> None:
    assert resolve_update_backend("auto", torch.device("cpu")) == "reference"
    assert resolve_update_backend("auto", torch.device("cuda")) == "triton"  # timed faster in the step (BENCHMARKS.md)
    assert resolve_update_backend("reference", torch.device("cpu")) == "reference"
    with pytest.raises(ValueError, match=r"model.backends.anvil='fused': choose one of auto, reference, triton"):
        resolve_update_backend("fused", torch.device("cpu"))
    with pytest.raises(RuntimeError, match=r"model.backends.anvil='triton' needs a CUDA device"):
        Anvil(make_params(0, torch.float32), update_backend="triton")


# -- the GPU, at the record's bank shapes ---------------------------------------------------
RECORD_BANKS = [(22, 2816, 768), (22, 768, 2816), (44, 256, 768), (22, 768, 768)]  # fc, proj^T, qk blocks, v/o


@pytest.mark.cuda
@pytest.mark.parametrize("shape", RECORD_BANKS)
def test_gpu_kernels_equal_the_reference_at_record_bank_shapes(shape: tuple) -> None:
    for engaged in (False, True):
        check_rails("cuda", *shape, torch.bfloat16, 5, engaged)
        check_finish("cuda", *shape, torch.bfloat16, 5, engaged)
