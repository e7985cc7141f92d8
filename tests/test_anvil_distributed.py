"""ANVIL and its Adam groups sharded over 2 and 4 gloo ranks on CPU equal one process.

Every rank holds its own gradients; the world-size-1 run gets their average. The
gradients are small integers times 2⁻⁸, so every partial sum of up to four ranks is
exact in bf16 and fp32 and the average (a division by a power of two) is exact too: the
sharded run sees bit-identical gradients, and the tolerance below is zero. The banks are
5, 3 and 2 matrices, so every world size pads and some ranks own nothing in a bank.

Every rank's parameters are views of their banks (``bank_views``), gathered into in place; a
second optimizer that copies them instead gives the same bits on every rank.

Checkpoints: each rank's own shard (``state_dict()``) resumes bit-exactly on the same
rank, and the consolidated state (``consolidate_state_dict()`` then ``state_dict()`` on
rank 0) resumes on a single process.

The same processes run ``DistAdam`` with a sharded group (an lm_head-like 13x6 matrix,
rows not divisible by the world size) next to a replicated one (RECORD §8's Adam table).
"""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from gloo_group import init_gloo, leave, spawn_ranks, store_path

from nanogpt_pl.optim.adam import DistAdam
from nanogpt_pl.optim.anvil import Anvil

STEPS = 5
RESUME_AT = 3
ENGAGE = 2
DTYPES = (torch.float32, torch.bfloat16)


def make_params(dtype: torch.dtype) -> list[torch.nn.Parameter]:
    """Banks of 5 wide (8x12), 3 square (12x12) and 2 tall (24x12) matrices; one has dead rows."""
    g = torch.Generator().manual_seed(1234)

    def param(*shape: int) -> torch.nn.Parameter:
        return torch.nn.Parameter((torch.randn(*shape, generator=g) * 0.2).to(dtype))

    qk = param(2, 16, 12)
    qk.anvil_block = (8, 12)
    with torch.no_grad():
        qk.view(4, 8, 12)[:, 6:] = 0
    extra = param(8, 12)
    squares = [param(12, 12) for _ in range(3)]
    fc, proj = param(24, 12), param(24, 12)
    proj.anvil_lr_mul = 2.0
    return [qk, extra, *squares, fc, proj]


def rank_grads(params: list[torch.Tensor], rank: int, step: int) -> list[torch.Tensor]:
    """Integer multiples of 2⁻⁸ in [-32, 32]: exact in bf16, and so are sums of up to eight of them."""
    g = torch.Generator().manual_seed(100 * step + rank)
    out = []
    for p in params:
        t = torch.randint(-32, 33, p.shape, generator=g).float() / 256
        if tuple(p.shape) == (2, 16, 12):  # the qk parameter's dead rows
            t.view(4, 8, 12)[:, 6:] = 0
        out.append(t)
    return out


def mean_grads(params: list[torch.Tensor], world: int, step: int) -> list[torch.Tensor]:
    per_rank = [rank_grads(params, r, step) for r in range(world)]
    return [sum(gs) / world for gs in zip(*per_rank)]


def schedule(opt: Anvil, step: int) -> None:
    opt.param_groups[0]["lr"] = 0.05 * (1 - 0.1 * step)
    opt.param_groups[0]["momentum"] = 0.85 + 0.02 * step


def run_steps(opt: Anvil, params: list[torch.Tensor], steps: range, grads_of) -> None:
    for step in steps:
        schedule(opt, step)
        for p, g in zip(params, grads_of(step)):
            p.grad = g.to(p.dtype)
        opt.step()


def to_bytes(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def from_bytes(data: bytes):
    return torch.load(io.BytesIO(data), weights_only=False)


def make_adam_params() -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(99)
    return [torch.nn.Parameter(torch.randn(13, 6, generator=g)), torch.nn.Parameter(torch.randn(5, generator=g))]


def make_adam(params: list[torch.Tensor]) -> DistAdam:
    return DistAdam([dict(params=params[:1], sharded=True, betas=(0.5, 0.95), wd_mul=150.0),
                     dict(params=params[1:], betas=(0.9, 0.99), lr_mul=5.0)],
                    lr=0.008, weight_decay=0.005, cautious_wd=True, decay_lr_power=2)


def run_adam(opt: DistAdam, params: list[torch.Tensor], steps: range, grads_of) -> None:
    for step in steps:
        for p, g in zip(params, grads_of(step)):
            p.grad = g.clone()
        opt.step()


def _adam_worker(rank: int, world: int) -> dict:
    params = make_adam_params()
    opt = make_adam(params)

    def grads_of(step: int) -> list[torch.Tensor]:
        return rank_grads(params, rank, 50 + step)

    run_adam(opt, params, range(RESUME_AT), grads_of)
    local = to_bytes(opt.state_dict())
    weights = [p.detach().clone() for p in params]
    opt.consolidate_state_dict(to=0)
    full = to_bytes(opt.state_dict()) if rank == 0 else None  # serialized now: state_dict holds live tensors
    run_adam(opt, params, range(RESUME_AT, STEPS), grads_of)
    again = make_adam_params()
    with torch.no_grad():
        for p, w in zip(again, weights):
            p.copy_(w)
    opt2 = make_adam(again)
    opt2.load_state_dict(from_bytes(local))
    run_adam(opt2, again, range(RESUME_AT, STEPS), grads_of)
    for a, b in zip(params, again):
        assert torch.equal(a.detach(), b.detach()), f"rank {rank}: Adam local-shard resume diverged"
    return {"params": [p.detach().clone() for p in params], "weights_at_resume": weights, "full_state": full}


def _worker(rank: int, world: int, store: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    init_gloo(rank, world, store)
    try:
        results = {"adam": _adam_worker(rank, world)}
        for dtype in DTYPES:
            params = make_params(dtype)
            opt = Anvil(params, engage_step=ENGAGE, backend="reference", compile=False)  # default group
            assert opt.world_size == world and opt.rank == rank

            def grads_of(step: int) -> list[torch.Tensor]:
                return rank_grads(params, rank, step)

            run_steps(opt, params, range(RESUME_AT), grads_of)
            local = to_bytes(opt.state_dict())
            weights = [p.detach().clone() for p in params]
            opt.consolidate_state_dict(to=0)
            full = to_bytes(opt.state_dict()) if rank == 0 else None
            run_steps(opt, params, range(RESUME_AT, STEPS), grads_of)

            # resume this rank's shard into a fresh optimizer
            again = make_params(dtype)
            with torch.no_grad():
                for p, w in zip(again, weights):
                    p.copy_(w)
            opt2 = Anvil(again, engage_step=ENGAGE, backend="reference", compile=False)
            sd = from_bytes(local)
            assert sd["format"] == "anvil-local" and sd["rank"] == rank
            opt2.load_state_dict(sd)
            run_steps(opt2, again, range(RESUME_AT, STEPS), grads_of)
            for a, b in zip(params, again):
                assert torch.equal(a.detach(), b.detach()), f"rank {rank}: local-shard resume diverged"
            # the parameters are views of their banks, gathered into in place; copying them gives the same bits
            assert all(bank.views_intact() and "gathered" not in bank.buffers for bank in opt._banks)
            copies = make_params(dtype)
            opt3 = Anvil(copies, engage_step=ENGAGE, backend="reference", compile=False, bank_views=False)
            run_steps(opt3, copies, range(STEPS), lambda step: rank_grads(copies, rank, step))
            for a, b in zip(params, copies):
                assert torch.equal(a.detach(), b.detach()), f"rank {rank}: bank views differ from copies"
            results[str(dtype)] = {
                "params": [p.detach().clone() for p in params],
                "full_state": full,
                "weights_at_resume": weights,
                "views_equal_copies": True,
            }
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
        dist.barrier()  # no rank tears the group down while a peer still talks to it (gloo aborts)
    finally:
        dist.destroy_process_group()
    leave()  # only reached when the work above succeeded


def single_process(dtype: torch.dtype, world: int, steps: range, params=None, state=None):
    params = make_params(dtype) if params is None else params
    opt = Anvil(params, engage_step=ENGAGE, backend="reference", compile=False)
    if state is not None:
        opt.load_state_dict(state)
    run_steps(opt, params, steps, lambda step: mean_grads(params, world, step))
    return params


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4, 8])
def test_sharded_equals_single_process(world: int, tmp_path: Path) -> None:
    spawn_ranks(_worker, (world, store_path(tmp_path), str(tmp_path)), world)
    per_rank = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]
    for dtype in DTYPES:
        key = str(dtype)
        reference = single_process(dtype, world, range(STEPS))
        assert all(per_rank[r][key]["views_equal_copies"] for r in range(world))
        for r in range(world):
            for got, want in zip(per_rank[r][key]["params"], reference):
                # exact: the sharded run sees bit-identical gradients (see the module docstring)
                assert torch.equal(got, want.detach()), f"world {world}, rank {r}, {dtype}: differs from 1 process"
        # the consolidated state resumes on a single process
        full = from_bytes(per_rank[0][key]["full_state"])
        assert full["format"] == "anvil-full" and full["step"] == RESUME_AT
        params = make_params(dtype)
        with torch.no_grad():
            for p, w in zip(params, per_rank[0][key]["weights_at_resume"]):
                p.copy_(w)
        resumed = single_process(dtype, world, range(RESUME_AT, STEPS), params=params, state=full)
        for got, want in zip(resumed, reference):
            assert torch.equal(got.detach(), want.detach()), f"world {world}, {dtype}: consolidated resume differs"

    # Adam: the sharded and the replicated group equal one process fed the mean gradient
    adam_params = make_adam_params()
    adam = make_adam(adam_params)
    run_adam(adam, adam_params, range(STEPS), lambda step: mean_grads(adam_params, world, 50 + step))
    for r in range(world):
        for got, want in zip(per_rank[r]["adam"]["params"], adam_params):
            assert torch.equal(got, want.detach()), f"world {world}, rank {r}: DistAdam differs from 1 process"
    full = from_bytes(per_rank[0]["adam"]["full_state"])
    assert full["state"][0]["rows"] == (0, 13, 13) and full["state"][0]["exp_avg"].shape == (13, 6)
    again = make_adam_params()
    with torch.no_grad():
        for p, w in zip(again, per_rank[0]["adam"]["weights_at_resume"]):
            p.copy_(w)
    resumed = make_adam(again)
    resumed.load_state_dict(full)
    run_adam(resumed, again, range(RESUME_AT, STEPS), lambda step: mean_grads(again, world, 50 + step))
    for got, want in zip(again, adam_params):
        assert torch.equal(got.detach(), want.detach()), f"world {world}: DistAdam consolidated resume differs"
