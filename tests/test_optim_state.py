"""Optimizer state round trips for the parameter shapes the model has (0-d scalars included)."""

import copy

import torch

from nanogpt_pl.optim.adam import DistAdam
from nanogpt_pl.optim.combined import CombinedOptimizer


def _params(gen):
    return [torch.nn.Parameter(torch.randn((), generator=gen)), torch.nn.Parameter(torch.randn(3, generator=gen)),
            torch.nn.Parameter(torch.randn(4, 5, generator=gen))]


def _step(params, opt, gen):
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    opt.step()


def test_dist_adam_state_reload_with_scalars_is_exact():
    gen = torch.Generator().manual_seed(4)
    params = _params(gen)
    mk = lambda ps: CombinedOptimizer({"adam": DistAdam([dict(params=ps, lr_mul=2.0)], lr=1e-2, weight_decay=0.1,
                                                         cautious_wd=True, decay_lr_power=2)})
    opt = mk(params)
    for _ in range(3):
        _step(params, opt, gen)
    saved = copy.deepcopy(opt.state_dict())
    clone = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt2 = mk(clone)
    opt2.load_state_dict(saved)
    g_state = gen.get_state()
    _step(params, opt, gen)
    gen.set_state(g_state)
    _step(clone, opt2, gen)
    for a, b in zip(params, clone):
        assert torch.equal(a, b)
