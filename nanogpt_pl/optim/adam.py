"""Adam with decoupled weight decay for replicated parameters, gradients averaged over ranks.

Embeddings, the lm_head and the scalar parameters are small next to the compute of a
step, so every rank keeps a full copy and the optimizer averages their gradients with
one all-reduce per dtype over a flat buffer (RECORD §8: replicated groups
all_reduce(AVG) through one flat buffer per dtype). There is no DDP wrapper: this
optimizer owns the communication of its parameters.

Each param group may carry ``lr_mul`` and ``wd_mul`` (RECORD §8's per-label
multipliers) and ``initial_lr``, the lr before the schedule's multiplier; the schedule
sets ``lr`` every step. With ``cautious_wd`` the decay only shrinks coordinates whose
update points the same way as the weight (sign-aligned decay).
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch
import torch.distributed as dist
from torch import Tensor


def world_of(process_group: Optional[dist.ProcessGroup]) -> int:
    """Size of ``process_group`` (1 when torch.distributed is not initialized)."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(process_group)


def all_reduce_mean_(tensors: list[Tensor], process_group: Optional[dist.ProcessGroup]) -> None:
    """Average ``tensors`` over ranks in place, one flat all-reduce per dtype.

    Sums and divides rather than using ReduceOp.AVG, which gloo does not implement.
    """
    world = world_of(process_group)
    if world == 1 or not tensors:
        return
    by_dtype: dict[torch.dtype, list[Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for group in by_dtype.values():
        flat = torch.cat([t.reshape(-1) for t in group])
        dist.all_reduce(flat, group=process_group)
        flat.div_(world)
        offset = 0
        for t in group:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()


class DistAdam(torch.optim.Optimizer):
    """Adam with decoupled weight decay over replicated parameters.

    Args:
        params: parameters or param groups (groups may set lr, betas, eps, weight_decay,
            lr_mul, wd_mul).
        lr: base learning rate.
        betas: Adam's (beta1, beta2).
        eps: added to the root of the second moment.
        weight_decay: decoupled decay per unit lr (p -= lr·lr_mul·weight_decay·wd_mul·p).
        cautious_wd: decay only coordinates where the update and the weight share a sign.
        process_group: ranks to average gradients over (None: the default group, if any).
    """

    def __init__(
        self,
        params: Iterable,
        lr: float = 0.008,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-10,
        weight_decay: float = 0.0,
        cautious_wd: bool = False,
        process_group: Optional[dist.ProcessGroup] = None,
    ) -> None:
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, lr_mul=1.0, wd_mul=1.0,
                        cautious_wd=cautious_wd)
        super().__init__(params, defaults)
        for group in self.param_groups:
            group.setdefault("initial_lr", group["lr"])
        self.process_group = process_group

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        all_reduce_mean_([p.grad for p in params], self.process_group)
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr = group["lr"] * group["lr_mul"]
            decay = lr * group["weight_decay"] * group["wd_mul"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
                state["step"] += 1
                t = state["step"]
                g = p.grad.float()
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.lerp_(g, 1 - beta1)
                v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
                denom = (v / (1 - beta2**t)).sqrt_().add_(group["eps"])
                update = (m / (1 - beta1**t)).div_(denom).mul_(lr)
                p32 = p.float()
                if decay:
                    if group["cautious_wd"]:
                        update.addcmul_(p32, (update * p32 > 0).to(update.dtype), value=decay)
                    else:
                        update.add_(p32, alpha=decay)
                p.copy_(p32 - update)
        return loss
