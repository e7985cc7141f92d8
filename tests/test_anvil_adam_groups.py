"""The Adam groups that run beside ANVIL (RECORD §8 "Adam parameter groups"), on one process.

``DistAdam`` with ``decay_lr_power=1`` and no cautious mask is AdamW: it must match
``torch.optim.AdamW``. With ``decay_lr_power=2`` and the cautious mask it is the record's
update, checked against a float64 restatement. Checkpoints keep the moments in fp32 for
bf16 parameters. The multi-rank (sharded lm_head/embed) behaviour is tested in
``test_anvil_distributed.py``.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
from seeds import fresh_seed

from nanogpt_pl.optim.adam import DistAdam, row_range

SEEDS = [0, 1, 2]


pytestmark = pytest.mark.usefixtures("one_thread")


def make(seed: int, dtype=torch.float32) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter((torch.randn(*s, generator=g) * 0.5).to(dtype)) for s in ((13, 6), (6,), (4, 3, 2))]


def grads(params, seed: int, step: int) -> None:
    g = torch.Generator().manual_seed(10_000 + 97 * seed + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype)


@pytest.mark.parametrize("seed", SEEDS)
def test_power_one_without_mask_is_adamw(seed: int) -> None:
    ours, ref = make(seed), make(seed)
    a = DistAdam(ours, lr=0.01, betas=(0.8, 0.95), eps=1e-8, weight_decay=0.1)
    b = torch.optim.AdamW(ref, lr=0.01, betas=(0.8, 0.95), eps=1e-8, weight_decay=0.1)
    for step in range(6):
        grads(ours, seed, step)
        grads(ref, seed, step)
        a.step()
        b.step()
    for x, y in zip(ours, ref):
        torch.testing.assert_close(x.detach(), y.detach(), rtol=1e-5, atol=1e-7)


def reference(params64, grads64, steps, lr, lr_mul, wd, wd_mul, betas, eps):
    """RECORD §8 Adam: bias-corrected moments, decay (lr·lr_mul)²·wd·wd_mul where update·θ > 0."""
    b1, b2 = betas
    m = [torch.zeros_like(p) for p in params64]
    v = [torch.zeros_like(p) for p in params64]
    for t in range(1, steps + 1):
        for i, p in enumerate(params64):
            g = grads64[t - 1][i]
            m[i] = b1 * m[i] + (1 - b1) * g
            v[i] = b2 * v[i] + (1 - b2) * g * g
            eta = lr * lr_mul
            u = eta * (m[i] / (1 - b1**t)) / ((v[i] / (1 - b2**t)).sqrt() + eps)
            u = u + (u * p > 0) * eta * eta * wd * wd_mul * p
            params64[i] = p - u
    return params64


@pytest.mark.parametrize("seed", SEEDS)
def test_record_update_with_cautious_squared_lr_decay(seed: int) -> None:
    params = make(seed)
    start = [p.detach().double().clone() for p in params]
    opt = DistAdam([dict(params=params, lr_mul=5.0, wd_mul=150.0)], lr=0.008, betas=(0.5, 0.95), eps=1e-10,
                   weight_decay=0.005, cautious_wd=True, decay_lr_power=2)
    history = []
    for step in range(5):
        grads(params, seed, step)
        history.append([p.grad.double() for p in params])
        opt.step()
    want = reference(start, history, 5, 0.008, 5.0, 0.005, 150.0, (0.5, 0.95), 1e-10)
    for p, w in zip(params, want):
        torch.testing.assert_close(p.detach().double(), w, rtol=1e-5, atol=1e-7)


def test_bf16_checkpoint_keeps_fp32_moments_and_resumes_exactly() -> None:
    straight = make(4, torch.bfloat16)
    a = DistAdam(straight, lr=0.01, weight_decay=0.005, cautious_wd=True, decay_lr_power=2, sharded=True)
    for step in range(6):
        grads(straight, 4, step)
        a.step()
    first = make(4, torch.bfloat16)
    b = DistAdam(first, lr=0.01, weight_decay=0.005, cautious_wd=True, decay_lr_power=2, sharded=True)
    for step in range(3):
        grads(first, 4, step)
        b.step()
    buf = io.BytesIO()
    torch.save(b.state_dict(), buf)
    buf.seek(0)
    resumed = make(4, torch.bfloat16)
    with torch.no_grad():
        for p, q in zip(resumed, first):
            p.copy_(q)
    c = DistAdam(resumed, lr=0.01, weight_decay=0.005, cautious_wd=True, decay_lr_power=2, sharded=True)
    c.load_state_dict(torch.load(buf, weights_only=False))
    for p in resumed:
        assert c.state[p]["exp_avg"].dtype == torch.float32 and c.state[p]["exp_avg_sq"].dtype == torch.float32
    for step in range(3, 6):
        grads(resumed, 4, step)
        c.step()
    for x, y in zip(straight, resumed):
        assert torch.equal(x.detach(), y.detach())


@pytest.mark.parametrize("resume_at", [0, 2])
def test_a_reload_keeps_the_moments_addresses_and_resumes_exactly(resume_at: int) -> None:
    """The speedrun timer's reset loads the state saved before its warmup (empty at step 0):
    the moments keep their addresses, which the update graphs' keys hold, and the steps after
    the load are the steps a fresh start takes."""
    seed = fresh_seed()
    kw = dict(lr=0.01, weight_decay=0.005, cautious_wd=True, decay_lr_power=2)
    straight = make(seed)
    a = DistAdam(straight, **kw)
    for step in range(resume_at + 3):
        grads(straight, seed, step)
        a.step()
    params = make(seed)
    b = DistAdam(params, **kw)
    for step in range(resume_at):
        grads(params, seed, step)
        b.step()
    saved = copy.deepcopy(b.state_dict())
    start = [p.detach().clone() for p in params]
    for step in range(4):  # the warmup: other gradients, then back
        grads(params, seed + 1, step)
        b.step()
    held = {i: (b.state[p]["exp_avg"].data_ptr(), b.state[p]["exp_avg_sq"].data_ptr()) for i, p in enumerate(params)}
    with torch.no_grad():
        for p, x in zip(params, start):
            p.copy_(x)
    b.load_state_dict(saved)
    assert all(bool(b.state.get(p)) == (resume_at > 0) for p in params)
    for step in range(resume_at, resume_at + 3):
        grads(params, seed, step)
        b.step()
    for i, p in enumerate(params):
        assert (b.state[p]["exp_avg"].data_ptr(), b.state[p]["exp_avg_sq"].data_ptr()) == held[i]
        assert b.state[p]["step"] == a.state[straight[i]]["step"] == resume_at + 3
    for x, y in zip(straight, params):
        assert torch.equal(x.detach(), y.detach())


def test_row_range_covers_rows_once() -> None:
    for rows in (1, 7, 13, 16, 50304):
        for world in (1, 2, 3, 4, 8):
            spans = [row_range(rows, world, r)[:2] for r in range(world)]
            covered = [i for lo, hi in spans for i in range(lo, hi)]
            assert covered == list(range(rows))


def test_rejects_bad_power_and_foreign_shard() -> None:
    with pytest.raises(ValueError, match="decay_lr_power"):
        DistAdam(make(0), decay_lr_power=3)
    params = make(0)
    opt = DistAdam(params, sharded=True)
    grads(params, 0, 0)
    opt.step()
    sd = opt.state_dict()
    sd["state"][0] = dict(sd["state"][0]) | {"rows": (7, 13, 13),
                                             "exp_avg": torch.zeros(6, 6), "exp_avg_sq": torch.zeros(6, 6)}
    with pytest.raises(ValueError, match="one rank's shard"):
        DistAdam(make(0), sharded=True).load_state_dict(sd)


def check_grouped(device: str, cautious: bool, power: int) -> None:
    """``_foreach_update`` (the replicated parameters as ``torch._foreach_*`` calls reading staged
    scalars) against ``_update`` on each parameter in turn: bit for bit, over bf16 and fp32
    parameters, a group without decay, a changing lr, and a parameter that skips a step (its own
    step count, so its own bucket)."""
    seed = fresh_seed()

    def on(params: list[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
        return [torch.nn.Parameter(q.detach().to(device)) for q in params]

    def build() -> tuple[DistAdam, list[torch.nn.Parameter]]:
        a, b, c = on(make(seed)), on(make(seed + 1, torch.bfloat16)), on(make(seed + 2))
        groups = [dict(params=a, lr_mul=5.0, wd_mul=150.0), dict(params=b, lr_mul=1.0, wd_mul=1.0),
                  dict(params=c, weight_decay=0.0, betas=(0.8, 0.99))]
        # the PyTorch update named: on a GPU ``auto`` is the Triton pass, which has no grouped form
        return DistAdam(groups, lr=0.008, betas=(0.5, 0.95), eps=1e-10, weight_decay=0.005,
                        cautious_wd=cautious, decay_lr_power=power, cuda_graph=False,
                        update_backend="reference"), a + b + c

    grouped, ps = build()
    single, qs = build()
    single._update_replicated = lambda replicated: [single._update(p, p.grad, g) for g, ps in replicated for p in ps]
    assert grouped.graphs is None  # eager here; the CUDA graph form is test_capture_gpu.py's
    for step in range(4):
        for opt in (grouped, single):
            for group in opt.param_groups:
                group["lr"] = group["initial_lr"] * (1.0 - 0.15 * step)
        for params in (ps, qs):
            g = torch.Generator().manual_seed(10_000 + 97 * seed + step)
            for q in params:
                q.grad = torch.randn(q.shape, generator=g).to(device=device, dtype=q.dtype)
            if step == 1:
                params[1].grad = None  # skips this step: one step behind the others from here
        grouped.step()
        single.step()
    assert grouped.state[ps[1]]["step"] == 3 and grouped.state[ps[0]]["step"] == 4
    for p, q in zip(ps, qs):
        assert p.dtype == q.dtype and torch.equal(p, q), (seed, (p.float() - q.float()).abs().max())
        for name in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(grouped.state[p][name], single.state[q][name]), (seed, name)
    assert not torch.equal(ps[0].cpu(), make(seed)[0])


@pytest.mark.parametrize("cautious,power", [(False, 1), (True, 2)])
def test_grouped_update_equals_the_per_parameter_formula(cautious: bool, power: int) -> None:
    check_grouped("cpu", cautious, power)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("cautious,power", [(False, 1), (True, 2)])
def test_grouped_update_equals_the_per_parameter_formula_on_the_gpu(cautious: bool, power: int) -> None:
    check_grouped("cuda", cautious, power)  # torch's multi-tensor kernels against its single-tensor ones


def test_the_cuda_graph_option_on_cpu_parameters_warns_and_the_update_runs_eagerly() -> None:
    with pytest.warns(UserWarning, match="cuda_graph=True has no effect on CPU parameters"):
        opt = DistAdam(make(0), cuda_graph=True)
    assert opt.graphs is None
    assert DistAdam(make(0)).graphs is None  # the default is on for CUDA parameters only


def test_staged_scalars_keep_their_buffer_and_refuse_another_shape() -> None:
    from nanogpt_pl.optim.staging import ScalarStager

    seed = fresh_seed()
    values = torch.rand(3, 4, generator=torch.Generator().manual_seed(seed)).tolist()
    stager = ScalarStager(3, 4, torch.device("cpu"))
    first = stager.push(values)
    again = stager.push([[v * 2 for v in row] for row in values])
    assert first.data_ptr() == again.data_ptr()
    assert torch.equal(again, torch.tensor(values, dtype=torch.float32) * 2)
    with pytest.raises(ValueError, match=r"values of shape \(2, 4\), holds \(3, 4\)"):
        stager.push(values[:2])
