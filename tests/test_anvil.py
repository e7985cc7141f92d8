"""ANVIL II on one process: each stage of the update against a float64 hand-written reference.

The reference below restates RECORD.md §8 per matrix; the optimizer under test works on
stacked banks with fused functions, so agreement checks the banking, the scalar plumbing
(engage step, blend, schedules) and the math together. The cascade itself is tested in
test_polar.py; here its recorded inputs and outputs tie the stages together.
"""

from __future__ import annotations

import copy
import io
import math

import pytest
import torch

import nanogpt_pl.optim.anvil as anvil_mod
from nanogpt_pl.optim.anvil import Anvil
from nanogpt_pl.optim.polar import ANVIL_MAPS

SEEDS = [0, 1, 2]


pytestmark = pytest.mark.usefixtures("one_thread")


def make_params(seed: int, dtype: torch.dtype = torch.float32) -> list[torch.nn.Parameter]:
    """A miniature of the record's matrices: a qk-like [2, 16, 12] in 8x12 blocks, square v/o,
    a tall fc and proj (proj with lr multiplier 2)."""
    g = torch.Generator().manual_seed(seed)
    qk = torch.nn.Parameter((torch.randn(2, 16, 12, generator=g) * 0.2).to(dtype))
    qk.anvil_block = (8, 12)
    v = torch.nn.Parameter((torch.randn(12, 12, generator=g) * 0.2).to(dtype))
    o = torch.nn.Parameter((torch.randn(12, 12, generator=g) * 0.2).to(dtype))
    fc = torch.nn.Parameter((torch.randn(24, 12, generator=g) * 0.2).to(dtype))
    proj = torch.nn.Parameter((torch.randn(24, 12, generator=g) * 0.2).to(dtype))
    proj.anvil_lr_mul = 2.0
    return [qk, v, o, fc, proj]


def set_grads(params: list[torch.Tensor], seed: int, step: int) -> None:
    g = torch.Generator().manual_seed(1000 * seed + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype)


def schedule(step: int) -> tuple[float, float]:
    """(lr, momentum) of a made-up schedule that changes every step."""
    return 0.023 * (1.0 - 0.05 * step), 0.85 + 0.01 * step


class Recorder:
    """Wraps polar_cascade to keep each call's input and output."""

    def __init__(self) -> None:
        self.calls: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.real = anvil_mod.polar_cascade

    def __call__(self, u, maps, backend="auto"):
        out = self.real(u, maps, backend=backend)
        self.calls.append((u.detach().clone(), out.detach().clone()))
        return out


def snapshot(opt: Anvil) -> list[dict]:
    out = []
    for bank in opt._banks:
        theta = torch.cat([bank.matrices(p).detach().double() for p, _, _ in bank.pieces])
        if bank.sidecar is not None:
            bits = torch.cat([bank.matrices(p).detach().view(torch.int16) for p, _, _ in bank.pieces])
            theta = anvil_mod.master_from_bf16(bits, bank.sidecar).double()
        grad = torch.cat([p.grad.reshape(-1, bank.rows, bank.cols).double() for p, _, _ in bank.pieces])
        out.append(dict(theta=theta, grad=grad, rails=bank.rails.double().clone(),
                        lanes=bank.lane_energy.double().clone(), lr_mul=bank.lr_mul.double().clone(),
                        slow32=bank.rails[1].clone(), theta32=theta.float()))
    return out


def ref_rails(pre: dict, group: dict, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Fast and slow rails after the step, and the Nesterov lookahead (RECORD §8 steps 1-2)."""
    mu = group["momentum"]
    engaged = step >= group["engage_step"]
    beta_f = group["fast_beta_engaged"] if engaged else mu
    w = group["blend"] if engaged else 1.0
    g = pre["grad"]
    fast = pre["rails"][0] + (1 - beta_f) * (g - pre["rails"][0])
    slow = pre["rails"][1] + (1 - group["slow_beta"]) * (g - pre["rails"][1])
    m = w * fast + (1 - w) * slow
    u = (1 - mu) * g + mu * m
    return torch.stack([fast, slow]), u


def ref_finish(pre: dict, x: torch.Tensor, group: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Lane equalization, cautious decay and the step (RECORD §8 steps 4-5) in float64."""
    v = x.double()
    rows, cols = v.shape[-2:]
    dim = -1 if rows >= cols else -2
    length = v.shape[dim]
    power = v.square().mean(dim=dim, keepdim=True)
    pre_norm = (power.sum(dim=(-2, -1), keepdim=True) * length).sqrt()
    lanes = pre["lanes"] + (1 - group["lane_beta2"]) * (power - pre["lanes"])
    gain = lanes.clamp_min(group["lane_eps"]).rsqrt()
    post_norm = (power * length * gain.square()).sum(dim=(-2, -1), keepdim=True).sqrt()
    v = v * gain * pre_norm / post_norm.clamp_min(group["lane_eps"])
    lr = group["lr"]
    lr_eff = pre["lr_mul"] * lr
    # the gate compares signs in fp32, as the optimizer does (an fp64 product could differ only by underflow)
    aligned = ((pre["slow32"] * pre["theta32"]) >= 0).double()
    theta = pre["theta"] - aligned * pre["theta"] * (group["weight_decay"] * lr) * lr_eff - lr_eff * v
    return theta, lanes


def snapshot_params_only(opt: Anvil) -> list[dict]:
    out = []
    for bank in opt._banks:
        if bank.sidecar is not None:
            bits = torch.cat([bank.matrices(p).detach().view(torch.int16) for p, _, _ in bank.pieces])
            theta = anvil_mod.master_from_bf16(bits, bank.sidecar).double()
        else:
            theta = torch.cat([bank.matrices(p).detach().double() for p, _, _ in bank.pieces])
        out.append(dict(theta=theta))
    return out


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_step_matches_reference(seed: int, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    rec = Recorder()
    monkeypatch.setattr(anvil_mod, "polar_cascade", rec)
    params = make_params(seed, dtype)
    opt = Anvil(params, engage_step=3, backend="reference", compile=False)
    group = opt.param_groups[0]
    assert [(b.rows, b.cols, b.count) for b in opt._banks] == [(8, 12, 4), (12, 12, 2), (24, 12, 2)]
    for step in range(6):
        group["lr"], group["momentum"] = schedule(step)
        set_grads(params, seed, step)
        pre = snapshot(opt)
        rec.calls.clear()
        opt.step()
        assert len(rec.calls) == len(opt._banks)
        after = snapshot_params_only(opt)
        for bank, before, (u, x), snap in zip(opt._banks, pre, rec.calls, after):
            rails, u_ref = ref_rails(before, group, step)
            torch.testing.assert_close(bank.rails.double(), rails, rtol=1e-6, atol=1e-7)
            torch.testing.assert_close(u.double(), u_ref, rtol=1e-6, atol=1e-7)
            # the decay gate reads the slow rail after this step's gradient (RECORD §8: rails, then decay)
            theta_ref, lanes_ref = ref_finish(before | {"slow32": bank.rails[1]}, x, group)
            torch.testing.assert_close(bank.lane_energy.double(), lanes_ref, rtol=1e-5, atol=1e-12)
            torch.testing.assert_close(snap["theta"], theta_ref, rtol=1e-6, atol=1e-7)
    assert opt.step_count == 6


def test_slow_rail_is_zero_init_ema_from_step_zero() -> None:
    params = make_params(3)
    opt = Anvil(params, engage_step=100, backend="reference", compile=False)
    grads = []
    for step in range(5):
        set_grads(params, 3, step)
        grads.append(torch.cat([p.grad.reshape(-1, 24, 12) for p in params[3:]]).double())
        opt.step()
    beta = 0.98
    expect = sum((1 - beta) * beta ** (4 - i) * g for i, g in enumerate(grads))
    torch.testing.assert_close(opt._banks[2].rails[1].double(), expect, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("seed", SEEDS)
def test_slow_rail_only_matters_from_the_engage_step(seed: int) -> None:
    """Before the engage step the update ignores the slow rail (wd = 0 removes the gate); after it, it does not."""
    runs = []
    for slow_beta in (0.98, 0.5):
        params = make_params(seed)
        opt = Anvil(params, engage_step=3, slow_beta=slow_beta, weight_decay=0.0, backend="reference", compile=False)
        history = []
        for step in range(5):
            set_grads(params, seed, step)
            opt.step()
            history.append([p.detach().clone() for p in params])
        runs.append(history)
    for step in range(3):
        for a, b in zip(runs[0][step], runs[1][step]):
            assert torch.equal(a, b), f"step {step}: slow rail leaked into the update before the engage step"
    for step in (3, 4):
        assert any(not torch.equal(a, b) for a, b in zip(runs[0][step], runs[1][step]))


def test_group_step_overrides_the_internal_counter() -> None:
    a_params, b_params = make_params(7), make_params(7)
    a = Anvil(a_params, engage_step=514, backend="reference", compile=False)
    b = Anvil(b_params, engage_step=514, backend="reference", compile=False)
    b.param_groups[0]["step"] = 514
    set_grads(a_params, 7, 0)
    set_grads(b_params, 7, 0)
    a.step()
    b.step()
    # engaged from its first step: fast rail on beta 0.85 instead of the scheduled momentum
    g = a_params[1].grad.double()
    torch.testing.assert_close(b._banks[1].rails[0][0].double(), 0.15 * g, rtol=1e-6, atol=0)
    torch.testing.assert_close(a._banks[1].rails[0][0].double(), (1 - 0.85) * g, rtol=1e-6, atol=0)
    a.param_groups[0]["momentum"] = 0.9
    b.param_groups[0]["momentum"] = 0.9
    set_grads(a_params, 7, 1)
    set_grads(b_params, 7, 1)
    a.step()
    b.step()
    assert not torch.allclose(a._banks[1].rails[0], b._banks[1].rails[0])


@pytest.mark.parametrize("seed", SEEDS)
def test_cautious_decay_masks_disagreeing_signs(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    rec = Recorder()
    monkeypatch.setattr(anvil_mod, "polar_cascade", rec)
    params = make_params(seed)
    opt = Anvil(params, lr=0.05, weight_decay=20.0, backend="reference", compile=False)
    group = opt.param_groups[0]
    set_grads(params, seed, 0)
    opt.step()
    set_grads(params, seed, 1)
    pre = snapshot(opt)
    rec.calls.clear()
    opt.step()
    for bank, before, (_, x) in zip(opt._banks, pre, rec.calls):
        gated = ref_finish(before | {"slow32": bank.rails[1]}, x, group)[0]
        # slow = θ makes every product θ² >= 0: plain (ungated) decoupled decay
        ungated = ref_finish(before | {"slow32": before["theta32"]}, x, group)[0]
        theta = torch.cat([bank.matrices(p).detach().double() for p, _, _ in bank.pieces])
        torch.testing.assert_close(theta, gated, rtol=1e-6, atol=1e-7)
        mask = (bank.rails[1] * before["theta32"]) >= 0
        assert mask.any() and (~mask).any(), "test data must have both gated and ungated entries"
        # ungated entries moved by the update alone; decaying them too would not match
        assert not torch.allclose(theta, ungated, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("rows,cols", [(24, 12), (8, 20), (12, 12)])
def test_lanes_equal_after_first_step(rows: int, cols: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """At step 0 E = 0.1·P, so every lane gets the same RMS and the Frobenius norm is the cascade's."""
    rec = Recorder()
    monkeypatch.setattr(anvil_mod, "polar_cascade", rec)
    for seed in SEEDS:
        g = torch.Generator().manual_seed(seed)
        p = torch.nn.Parameter(torch.randn(3, rows, cols, generator=g))
        p.anvil_block = (rows, cols)
        before = p.detach().clone()
        opt = Anvil([p], lr=0.01, weight_decay=0.0, backend="reference", compile=False)
        # uneven lanes in the gradient so the equalization has work to do
        scale = torch.rand(rows if rows >= cols else cols, generator=g) * 10 + 0.1
        grad = torch.randn(3, rows, cols, generator=g)
        p.grad = grad * (scale[:, None] if rows >= cols else scale[None, :])
        rec.calls.clear()
        opt.step()
        lr_eff = 0.01 * math.sqrt(max(1.0, rows / cols))
        v = (before - p.detach()).double() / lr_eff
        x = rec.calls[0][1].double()
        dim = -1 if rows >= cols else -2
        rms = v.square().mean(dim=dim).sqrt()
        torch.testing.assert_close(rms, rms.mean(dim=-1, keepdim=True).expand_as(rms), rtol=2e-4, atol=0)
        torch.testing.assert_close(v.norm(dim=(-2, -1)), x.norm(dim=(-2, -1)), rtol=2e-4, atol=0)
        # and the lane energies hold 0.1·P of the cascade output
        power = x.square().mean(dim=dim, keepdim=True)
        torch.testing.assert_close(opt._banks[0].lane_energy.double(), 0.1 * power, rtol=1e-5, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dead_rows_stay_exactly_zero(dtype: torch.dtype) -> None:
    """Rows that are zero with zero gradient (the record's narrow heads) never move."""
    for seed in SEEDS:
        params = make_params(seed, dtype)
        qk, fc = params[0], params[3]
        with torch.no_grad():
            qk.view(-1, 8, 12)[:, 4:] = 0  # each 8-row block keeps only its first 4 rows live
            fc[10:15] = 0
        opt = Anvil(params, engage_step=2, backend="reference", compile=False)
        before = [p.detach().clone() for p in params]
        for step in range(5):
            set_grads(params, seed, step)
            with torch.no_grad():
                qk.grad.view(-1, 8, 12)[:, 4:] = 0
                fc.grad[10:15] = 0
            opt.step()
        assert torch.equal(qk.detach().view(-1, 8, 12)[:, 4:], torch.zeros(4, 4, 12, dtype=dtype))
        assert torch.equal(fc.detach()[10:15], torch.zeros(5, 12, dtype=dtype))
        assert not torch.equal(qk.detach(), before[0]) and not torch.equal(fc.detach(), before[3])


@pytest.mark.parametrize("seed", SEEDS)
def test_bf16_master_equals_fp32_run(seed: int) -> None:
    """With bf16-exact gradients the bf16 run's fp32 master is bit-identical to an fp32 run, and the
    visible bf16 weight is that master truncated."""
    p16 = make_params(seed, torch.bfloat16)
    p32 = [torch.nn.Parameter(p.detach().float()) for p in p16]
    for a, b in zip(p16, p32):
        for attr in ("anvil_block", "anvil_lr_mul"):
            if hasattr(a, attr):
                setattr(b, attr, getattr(a, attr))
    o16 = Anvil(p16, engage_step=2, backend="reference", compile=False)
    o32 = Anvil(p32, engage_step=2, backend="reference", compile=False)
    for step in range(5):
        set_grads(p16, seed, step)
        for a, b in zip(p16, p32):
            b.grad = a.grad.float()
        o16.step()
        o32.step()
    for bank16, bank32 in zip(o16._banks, o32._banks):
        master = snapshot_params_only(o16)[o16._banks.index(bank16)]["theta"].float()
        ref = torch.cat([bank32.matrices(p).detach() for p, _, _ in bank32.pieces])
        assert torch.equal(master.view(torch.int32), ref.view(torch.int32))
        vis = torch.cat([bank16.matrices(p).detach() for p, _, _ in bank16.pieces]).float()
        trunc = (ref.view(torch.int32) & -65536).view(torch.float32)
        assert torch.equal(vis, trunc)
        assert bank16.sidecar is not None and bank32.sidecar is None
        assert bank16.sidecar.ne(0).any()


def test_shape_lr_and_matrix_lr_multiplier(monkeypatch: pytest.MonkeyPatch) -> None:
    params = make_params(4)
    params[1].anvil_lr_mul = 0.0  # v frozen: no update and no decay
    opt = Anvil(params, backend="reference", compile=False)
    muls = [b.lr_mul.flatten().tolist() for b in opt._banks]
    tall = math.sqrt(24 / 12)
    assert muls[0] == [1.0] * 4
    assert muls[1] == [0.0, 1.0]
    assert muls[2] == pytest.approx([tall, 2 * tall])
    frozen = params[1].detach().clone()
    set_grads(params, 4, 0)
    opt.step()
    assert torch.equal(params[1].detach(), frozen)


def test_anvil_block_equals_separate_matrices() -> None:
    g = torch.Generator().manual_seed(11)
    whole = torch.nn.Parameter(torch.randn(2, 32, 16, generator=g))
    whole.anvil_block = (16, 16)
    parts = [torch.nn.Parameter(m.clone()) for m in whole.detach().view(4, 16, 16)]
    oa = Anvil([whole], engage_step=1, backend="reference", compile=False)
    ob = Anvil(parts, engage_step=1, backend="reference", compile=False)
    for step in range(3):
        grad = torch.randn(2, 32, 16, generator=g)
        whole.grad = grad
        for p, m in zip(parts, grad.view(4, 16, 16)):
            p.grad = m.clone()
        oa.step()
        ob.step()
    assert torch.equal(whole.detach().view(4, 16, 16), torch.stack([p.detach() for p in parts]))


def test_missing_gradients() -> None:
    params = make_params(8)
    opt = Anvil(params, backend="reference", compile=False)
    before = [p.detach().clone() for p in params]
    set_grads(params, 8, 0)
    params[0].grad = None  # the whole qk bank: skipped
    params[1].grad = None  # half of the v/o bank: counts as zero
    opt.step()
    assert torch.equal(params[0].detach(), before[0])
    assert opt._banks[0].rails.abs().sum() == 0
    assert opt._banks[1].rails[:, 0].abs().sum() == 0 and opt._banks[1].rails[:, 1].abs().sum() > 0
    # a zero gradient gives a zero lookahead, the cascade maps 0 to 0, and a zero slow rail
    # passes the gate: v only decays
    group = opt.param_groups[0]
    decayed = before[1].double() * (1 - group["weight_decay"] * group["lr"] * group["lr"])
    torch.testing.assert_close(params[1].detach().double(), decayed, rtol=1e-6, atol=0)


def _views_run(params: list[torch.nn.Parameter], opt: Anvil, seed: int, steps: range, repoint_at: int = -1) -> None:
    group = opt.param_groups[0]
    for step in steps:
        if step == repoint_at:  # something outside the optimizer gives one matrix new storage
            params[3].data = params[3].data.clone()
        group["lr"], group["momentum"] = schedule(step)
        set_grads(params, seed, step)
        before = [p._version for p in params]
        opt.step()
        # the FP8 weight caches see a changed weight by its own version counter, views or not
        assert all(p._version > b for p, b in zip(params, before)), step


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bank_views_update_the_parameters_in_place_like_the_copies(dtype: torch.dtype, random_seed: int) -> None:
    """With ``bank_views`` the parameters are views of their bank's one tensor and the step updates
    them there; the values are the copying step's, bit for bit, across the engage step, and a
    parameter re-pointed mid-run makes only its own bank fall back to copying."""
    views, copies = make_params(random_seed, dtype), make_params(random_seed, dtype)
    start = [p.detach().clone() for p in views]
    opt_v = Anvil(views, engage_step=3, backend="reference", compile=False)
    opt_c = Anvil(copies, engage_step=3, backend="reference", compile=False, bank_views=False)
    for p, s in zip(views, start):  # re-pointed, values unchanged
        assert torch.equal(p.detach(), s)
    for bank in opt_v._banks:
        assert bank.views_intact()
        for p, first, n in bank.pieces:
            assert p.data_ptr() == bank.storage[first].data_ptr() and p.is_contiguous()
    assert all(b.storage is None and not b.views_intact() for b in opt_c._banks)
    _views_run(views, opt_v, random_seed, range(4))
    _views_run(copies, opt_c, random_seed, range(4))
    assert "own" not in opt_v._banks[0].buffers  # one rank: nothing copied out of the parameters
    for a, b in zip(views, copies):
        assert torch.equal(a.detach(), b.detach())
    _views_run(views, opt_v, random_seed, range(4, 7), repoint_at=5)
    _views_run(copies, opt_c, random_seed, range(4, 7))
    assert [b.views_intact() for b in opt_v._banks] == [True, True, False]  # params[3] is in the (24, 12) bank
    for a, b in zip(views, copies):
        assert torch.equal(a.detach(), b.detach())
    for a, b in zip(opt_v.state_dict()["banks"], opt_c.state_dict()["banks"]):
        assert torch.equal(a["rails"], b["rails"]) and torch.equal(a["lane_energy"], b["lane_energy"])


def _save_load(sd: dict) -> dict:
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_dict_resumes_bit_exactly(dtype: torch.dtype) -> None:
    seed = 9
    straight = make_params(seed, dtype)
    opt = Anvil(straight, engage_step=4, backend="reference", compile=False)
    for step in range(7):
        opt.param_groups[0]["lr"], opt.param_groups[0]["momentum"] = schedule(step)
        set_grads(straight, seed, step)
        opt.step()

    first = make_params(seed, dtype)
    opt1 = Anvil(first, engage_step=4, backend="reference", compile=False)
    for step in range(3):
        opt1.param_groups[0]["lr"], opt1.param_groups[0]["momentum"] = schedule(step)
        set_grads(first, seed, step)
        opt1.step()
    saved = _save_load(opt1.state_dict())
    weights = [p.detach().clone() for p in first]
    assert saved["format"] == "anvil-full" and saved["step"] == 3

    resumed = make_params(seed + 1, dtype)  # different values, overwritten below
    with torch.no_grad():
        for p, w in zip(resumed, weights):
            p.copy_(w)
    opt2 = Anvil(resumed, engage_step=4, lr=1.0, backend="reference", compile=False)
    opt2.load_state_dict(saved)
    assert opt2.step_count == 3
    for step in range(3, 7):
        opt2.param_groups[0]["lr"], opt2.param_groups[0]["momentum"] = schedule(step)
        set_grads(resumed, seed, step)
        opt2.step()
    for a, b in zip(straight, resumed):
        assert torch.equal(a.detach(), b.detach())
    for ba, bb in zip(opt._banks, opt2._banks):
        assert torch.equal(ba.rails, bb.rails) and torch.equal(ba.lane_energy, bb.lane_energy)
        assert (ba.sidecar is None and bb.sidecar is None) or torch.equal(ba.sidecar, bb.sidecar)


def speedrun_banks() -> dict[str, tuple[int, int, int]]:
    """The ANVIL banks of the model configs/speedrun.yaml builds: name -> (rows, cols, matrices).

    The vocabulary is shrunk and the n-gram table left out: neither is a matrix ANVIL updates.
    """
    from pathlib import Path

    import yaml

    from nanogpt_pl.model.gpt import GPT, GPTConfig
    from nanogpt_pl.optim.groups import anvil_group

    root = Path(__file__).resolve().parents[1]
    gpt = yaml.safe_load((root / "configs" / "speedrun.yaml").read_text())["model"]["gpt"]
    gpt.update(vocab_size=128, ngram_rows=0)
    model = GPT(GPTConfig(**gpt))
    # the groups the module hands ANVIL: Q and K split into head-pair blocks (optim/groups.py)
    opt = Anvil([anvil_group(model, model.cfg.head_dim)], backend="reference", compile=False)
    names = {(256, 768): "qk", (768, 768): "vo", (2816, 768): "mlp"}
    return {names[(b.rows, b.cols)]: (b.rows, b.cols, b.count) for b in opt._banks}


def test_record_banks_split_like_the_record_at_world_8() -> None:
    """RECORD §8: qk_bank holds 42 live (256, 768) groups, vo_bank 14 live (768, 768) pairs; at 8 ranks
    each owns 6 qk, 2 vo and 3 mlp matrices (banks padded to 48, 16, 24)."""
    from nanogpt_pl.optim.adam import row_range

    banks = speedrun_banks()
    assert banks["qk"] == (256, 768, 42) and banks["vo"] == (768, 768, 14)
    # the MLP bank: two matrices per MLP layer of the config and two of layer 8's parallel MLP
    assert banks["mlp"] == (2816, 768, 22)
    for name, per in (("qk", 6), ("vo", 2), ("mlp", 3)):
        count = banks[name][2]
        spans = [row_range(count, 8, r) for r in range(8)]
        assert all(p == per for _, _, p in spans), name
        assert [i for lo, hi, _ in spans for i in range(lo, hi)] == list(range(count))
    for count in (1, 2, 3, 5, 7):
        for world in (2, 4, 8):
            spans = [row_range(count, world, r) for r in range(world)]
            assert [i for lo, hi, _ in spans for i in range(lo, hi)] == list(range(count))
            assert spans[0][2] * world >= count


def test_mlp_bank_has_the_records_live_matrices() -> None:
    """RECORD §8: mlp_bank (12, 2, 2816, 768), 24 matrices; slot 7 is dead, slot 11 is layer 8's parallel MLP."""
    assert speedrun_banks()["mlp"][2] == 24 - 2


def test_initial_lr_and_schedule_hooks() -> None:
    opt = Anvil(make_params(0), lr=0.023, backend="reference", compile=False)
    group = opt.param_groups[0]
    assert group["initial_lr"] == 0.023 and group["momentum"] == 0.85
    for key, value in dict(weight_decay=2.25, lane_beta2=0.9, lane_eps=1e-10, slow_beta=0.98, blend=0.4385,
                           fast_beta_engaged=0.85, engage_step=514).items():
        assert group[key] == value
    assert opt.maps == ANVIL_MAPS


def test_bad_input_raises_clear_errors() -> None:
    with pytest.raises(ValueError, match="1-D parameters"):
        Anvil([torch.nn.Parameter(torch.randn(5))])
    with pytest.raises(ValueError, match="float32 and bfloat16"):
        Anvil([torch.nn.Parameter(torch.randn(4, 4).half())])
    for block in ((4, 6), (5, 3)):  # rows crossing the leading dim; columns cut mid-row
        p = torch.nn.Parameter(torch.randn(2, 10, 6))
        p.anvil_block = block
        with pytest.raises(ValueError, match="does not tile"):
            Anvil([p])
    with pytest.raises(RuntimeError, match="model.backends.polar='triton'"):
        Anvil([torch.nn.Parameter(torch.randn(4, 4))], backend="triton")
    with pytest.raises(ValueError, match="momentum"):
        Anvil([torch.nn.Parameter(torch.randn(4, 4))], momentum=1.5)
    opt = Anvil(make_params(0), backend="reference", compile=False)
    other = Anvil([torch.nn.Parameter(torch.randn(4, 4))], backend="reference", compile=False)
    with pytest.raises(ValueError, match="param groups|banks"):
        opt.load_state_dict(other.state_dict())
    local = copy.deepcopy(opt.state_dict()) | {"format": "anvil-local", "world_size": 2, "rank": 1}
    with pytest.raises(ValueError, match="rank 1's shard of a 2-rank run"):
        opt.load_state_dict(local)
    with pytest.raises(ValueError, match="not an Anvil state dict"):
        opt.load_state_dict({"state": {}, "param_groups": []})


cuda = pytest.mark.cuda  # skipped without a GPU (tests/conftest.py)


def record_matrices(device: str) -> list[torch.nn.Parameter]:
    """Two layers of the record's matrices in bf16: qk [2, 768, 768] in 256x768 blocks (one with the
    narrow heads' dead rows), v and o 768x768, MLP fc and proj 2816x768 (proj at lr x2)."""
    g = torch.Generator(device="cpu").manual_seed(0)
    out = []
    for layer in range(2):
        qk = torch.nn.Parameter((torch.rand(2, 768, 768, generator=g) * 0.0625 - 0.03125).to(device, torch.bfloat16))
        qk.anvil_block = (256, 768)
        if layer == 0:
            with torch.no_grad():
                qk.view(6, 2, 128, 768)[:, :, 64:] = 0  # narrow heads use rows 0..63 of each 128
        v = torch.nn.Parameter((torch.randn(768, 768, generator=g) * 0.02).to(device, torch.bfloat16))
        o = torch.nn.Parameter(torch.zeros(768, 768, device=device, dtype=torch.bfloat16))
        fc = torch.nn.Parameter((torch.randn(2816, 768, generator=g) * 0.02).to(device, torch.bfloat16))
        proj = torch.nn.Parameter(torch.zeros(2816, 768, device=device, dtype=torch.bfloat16))
        proj.anvil_lr_mul = 2.0
        out += [qk, v, o, fc, proj]
    return out


def _masters(opt: Anvil) -> list[torch.Tensor]:
    return [s["theta"] for s in snapshot_params_only(opt)]


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("fast", [dict(backend="triton", compile=True), dict(backend="reference", compile=True),
                                  dict(backend="triton", compile=False),
                                  dict(backend="reference", update_backend="triton"),
                                  dict(backend="triton", update_backend="triton")])
def test_gpu_paths_match_eager_torch_at_record_shapes(fast: dict) -> None:
    """Triton kernels (cascade, elementwise update) and torch.compile'd elementwise parts against the
    eager PyTorch path."""
    runs = []
    for kwargs in (fast, dict(backend="reference", update_backend="reference", compile=False, cuda_graph=False)):
        params = record_matrices("cuda")
        opt = Anvil(params, engage_step=2, **kwargs)
        start = _masters(opt)
        for step in range(4):
            opt.param_groups[0]["lr"], opt.param_groups[0]["momentum"] = schedule(step)
            g = torch.Generator(device="cuda").manual_seed(step)
            for i, p in enumerate(params):
                p.grad = torch.randn(p.shape, device="cuda", generator=g).to(torch.bfloat16)
                if i == 0:
                    p.grad.view(6, 2, 128, 768)[:, :, 64:] = 0
            opt.step()
        torch.cuda.synchronize()
        runs.append(([m - s for m, s in zip(_masters(opt), start)], params))
    (fast_delta, fast_params), (ref_delta, _) = runs
    for a, b in zip(fast_delta, ref_delta):
        rel = ((a - b).norm() / b.norm()).item()
        # bf16 cascades along different rounding paths differ by ~0.6% (bf16 vs fp32 measured on CPU)
        assert rel < 0.03, f"{fast}: relative difference of the update {rel:.4f}"
    assert torch.equal(fast_params[0].detach().view(6, 2, 128, 768)[:, :, 64:],
                       torch.zeros(6, 2, 64, 768, device="cuda", dtype=torch.bfloat16))


def _gpu_run(params: list[torch.nn.Parameter], opt: Anvil, steps: range, move_at: int = -1) -> None:
    for step in steps:
        if step == move_at:  # the parameters' storage moves: the graphs must be recaptured
            for p in params:
                p.data = p.data.clone()
        opt.param_groups[0]["lr"], opt.param_groups[0]["momentum"] = schedule(step)
        g = torch.Generator(device="cuda").manual_seed(100 + step)
        for p in params:
            p.grad = torch.randn(p.shape, device="cuda", generator=g).to(torch.bfloat16)
        opt.step()
    torch.cuda.synchronize()


@cuda
def test_gpu_graph_replays_bump_the_versions_of_the_matrices() -> None:
    """A replay runs no ATen operation, so autograd's version counters would not move; ANVIL bumps
    them for the matrices it wrote (the FP8 weight caches see a changed weight by its counter)."""
    params = record_matrices("cuda")
    opt = Anvil(params, engage_step=3, cuda_graph=True)
    for step in range(5):  # 0 eager (warm-up), 1 captures, then replays only
        before = [p._version for p in params]
        _gpu_run(params, opt, range(step, step + 1))
        assert all(p._version > b for p, b in zip(params, before)), step
    assert all(b.graph is not None for b in opt._banks)


@cuda
@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("update_backend", ["reference", "triton"])
def test_gpu_cuda_graph_equals_eager_bit_for_bit(backend: str, update_backend: str) -> None:
    """Replaying the captured bank work gives exactly the eager arithmetic: across the engage step,
    with the lr and momentum changing every step, after the parameters' storage moved, and after
    a state_dict round trip. The graphed run's matrices are views of their banks (``bank_views``)
    until the move, the eager run's are copied in and out."""
    runs = []
    for graph in (True, False):
        params = record_matrices("cuda")
        opt = Anvil(params, engage_step=3, backend=backend, update_backend=update_backend, cuda_graph=graph,
                    bank_views=graph)
        assert opt.cuda_graph is graph
        _gpu_run(params, opt, range(0, 4))
        assert all(b.views_intact() is graph for b in opt._banks)
        _gpu_run(params, opt, range(4, 5), move_at=4)
        assert not any(b.views_intact() for b in opt._banks)
        sd = copy.deepcopy(opt.state_dict())
        opt.load_state_dict(sd)  # copies into the captured state tensors
        _gpu_run(params, opt, range(5, 8))
        if graph:
            assert all(b.graph is not None for b in opt._banks), "every bank should be replaying a graph"
        runs.append((params, _masters(opt), opt.state_dict()))
    (p_graph, m_graph, sd_graph), (p_eager, m_eager, sd_eager) = runs
    for a, b in zip(p_graph, p_eager):
        assert torch.equal(a, b)
    for a, b in zip(m_graph, m_eager):
        assert torch.equal(a, b)
    for a, b in zip(sd_graph["banks"], sd_eager["banks"]):
        assert torch.equal(a["rails"], b["rails"]) and torch.equal(a["lane_energy"], b["lane_energy"])
