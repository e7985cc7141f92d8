"""Adam with decoupled weight decay for the record's Adam groups, gradients averaged over ranks.

Two kinds of groups (RECORD §8, "Adam parameter groups"):

* **Replicated** (the default; scalars, gates, lambdas): every rank keeps a full copy and
  the optimizer averages their gradients with one all-reduce per dtype over a flat
  buffer (RECORD §8: replicated groups all_reduce(AVG) through one flat buffer per
  dtype), then every rank applies the same update.
* **Sharded** (``sharded=True`` on the group; the record's lm_head and embed): the
  gradient is reduce-scattered along dim 0 (rows padded to a multiple of the world
  size), each rank runs Adam on its own rows only (so it keeps the moments of those
  rows only), and the updated rows are all-gathered back into every rank's copy. With
  one rank a sharded group is simply replicated.

There is no DDP wrapper: this optimizer owns the communication of its parameters.

Each param group may carry ``lr_mul`` and ``wd_mul`` (RECORD §8's per-label
multipliers) and ``initial_lr``, the lr before the schedule's multiplier; the schedule
sets ``lr`` every step. The decay is ``(lr·lr_mul)^decay_lr_power · weight_decay · wd_mul``
per step: power 1 is ordinary decoupled decay (AdamW), power 2 is the record's
``eff_wd = (lr·lr_mul)²·0.005·wd_mul`` (RECORD §8). With ``cautious_wd`` the decay only
shrinks coordinates whose update points the same way as the weight (sign-aligned decay).

The update itself is either the PyTorch reference (:meth:`DistAdam._update`, about a dozen
passes a parameter; a group's replicated parameters take them together as ``torch._foreach_*``
calls, :meth:`DistAdam._update_many`) or one Triton pass a parameter (``update_backend="triton"``,
``nanogpt_pl.ops.triton.adam_update``) with the same arithmetic.

Moments are fp32 whatever the parameter dtype. Checkpoints: replicated state is the same
on every rank. Sharded state is this rank's rows; :meth:`DistAdam.consolidate_state_dict`
(a collective, Lightning's protocol for sharded optimizers) makes the next ``state_dict()``
on rank ``to`` hold full rows, which load on any world size.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from ..backends import resolve_opt_in

_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

_MOMENTS = ("exp_avg", "exp_avg_sq")


def resolve_update_backend(backend: str, device: torch.device) -> str:
    """``reference`` or ``triton`` for the dense Adam update (``model.backends.adam``); raises for an
    impossible choice. ``auto`` picks PyTorch until the Triton pass is timed against it on a GPU."""
    return resolve_opt_in("adam", backend, device, "the parameters are")


def world_of(process_group: Optional[dist.ProcessGroup]) -> int:
    """Size of ``process_group`` (1 when torch.distributed is not initialized)."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(process_group)


def rank_of(process_group: Optional[dist.ProcessGroup]) -> int:
    """This process's rank in ``process_group`` (0 when torch.distributed is not initialized)."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0
    return dist.get_rank(process_group)


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


def row_range(rows: int, world: int, rank: int) -> tuple[int, int, int]:
    """(first row, end row, rows per rank) that ``rank`` owns when ``rows`` are split over ``world``."""
    per = -(-rows // world)
    return min(rank * per, rows), min((rank + 1) * per, rows), per


class DistAdam(torch.optim.Optimizer):
    """Adam with decoupled weight decay over replicated or row-sharded parameters.

    Args:
        params: parameters or param groups (groups may set lr, betas, eps, weight_decay,
            lr_mul, wd_mul, sharded).
        lr: base learning rate.
        betas: Adam's (beta1, beta2).
        eps: added to the root of the second moment.
        weight_decay: decoupled decay coefficient (see ``decay_lr_power``).
        cautious_wd: decay only coordinates where the update and the weight share a sign.
        process_group: ranks to average gradients over (None: the default group, if any).
        decay_lr_power: the decay per step is ``(lr·lr_mul)^power · weight_decay · wd_mul``
            (times the weight): 1 for AdamW, 2 for the record's Adam groups (RECORD §8).
        sharded: default of the per-group ``sharded`` flag: reduce-scatter the gradient along
            dim 0, update this rank's rows, all-gather them (RECORD §8: lm_head and embed).
        update_backend: the update of each parameter: ``reference`` (PyTorch), ``triton`` (one
            pass a parameter) or ``auto`` (see :func:`resolve_update_backend`), resolved on the
            device of the first parameter.
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
        decay_lr_power: int = 1,
        sharded: bool = False,
        update_backend: str = "auto",
    ) -> None:
        if decay_lr_power not in (1, 2):
            raise ValueError(f"decay_lr_power must be 1 (AdamW) or 2 (the record's Adam groups), got {decay_lr_power}")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, lr_mul=1.0, wd_mul=1.0,
                        cautious_wd=cautious_wd, sharded=sharded)
        super().__init__(params, defaults)
        for group in self.param_groups:
            group.setdefault("initial_lr", group["lr"])
        self.process_group = process_group
        self.decay_lr_power = decay_lr_power
        first = next((p for g in self.param_groups for p in g["params"]), None)
        device = first.device if first is not None else torch.device("cpu")
        self.update_backend = resolve_update_backend(update_backend, device)
        self._consolidated: Optional[dict[Tensor, dict]] = None

    # -- the step ----------------------------------------------------------------------
    def _is_sharded(self, group: dict, world: int) -> bool:
        return bool(group.get("sharded")) and world > 1

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        pg = self.process_group
        world, rank = world_of(pg), rank_of(pg)

        # 1. launch the reduce-scatters of the sharded parameters (they run under step 2)
        scatters = []
        for group in self.param_groups:
            if not self._is_sharded(group, world):
                continue
            for p in group["params"]:
                if p.grad is None:
                    continue
                rows = p.shape[0]
                lo, hi, per = row_range(rows, world, rank)
                grad = p.grad.reshape(rows, -1)
                if per * world != rows:
                    padded = grad.new_zeros(per * world, grad.shape[1])
                    padded[:rows].copy_(grad)
                    grad = padded
                shard = grad.new_empty(per, grad.shape[1])
                avg = grad.is_cuda  # NCCL averages; gloo sums and we divide
                op = dist.ReduceOp.AVG if avg else dist.ReduceOp.SUM
                work = _reduce_scatter(shard, grad.contiguous(), op=op, group=pg, async_op=True)
                scatters.append((group, p, shard, work, avg, lo, hi, per))

        # 2. replicated parameters: one flat all-reduce per dtype, then the update
        replicated = [(g, [p for p in g["params"] if p.grad is not None]) for g in self.param_groups
                      if not self._is_sharded(g, world)]
        all_reduce_mean_([p.grad for _, params in replicated for p in params], pg)
        for group, params in replicated:
            self._update_many(group, params)

        # 3. sharded parameters: own rows, then all-gather
        gathers = []
        for group, p, shard, work, avg, lo, hi, per in scatters:
            work.wait()
            if not avg:
                shard.div_(world)
            rows_view = p.view(p.shape[0], -1)
            own = rows_view[lo:hi]
            self._update(own, shard[: hi - lo], group, param=p, rows=(lo, hi))
            send = own.new_zeros(per, own.shape[1])
            send[: hi - lo].copy_(own)
            full = own.new_empty(per * world, own.shape[1])
            gathers.append((p, full, _all_gather(full, send, group=pg, async_op=True)))
        for p, full, work in gathers:
            work.wait()
            p.view(p.shape[0], -1).copy_(full[: p.shape[0]])
        return loss

    def _rates(self, group: dict) -> tuple[float, float]:
        """The group's step size and decay factor this step."""
        lr = group["lr"] * group["lr_mul"]
        return lr, lr**self.decay_lr_power * group["weight_decay"] * group["wd_mul"]

    def _state(self, p: Tensor, target: Tensor, rows: Optional[tuple[int, int]] = None) -> dict:
        """``p``'s state, made at its first step (fp32 moments of ``target``'s shape), its step counted."""
        state = self.state[p]
        if not state:
            state["step"] = 0
            state["exp_avg"] = torch.zeros(target.shape, dtype=torch.float32, device=target.device)
            state["exp_avg_sq"] = torch.zeros(target.shape, dtype=torch.float32, device=target.device)
            if rows is not None:
                state["rows"] = (rows[0], rows[1], p.shape[0])
        state["step"] += 1
        return state

    def _update_many(self, group: dict, params: list[Tensor]) -> None:
        """:meth:`_update` of a group's replicated parameters. The reference runs the same
        arithmetic, operation for operation, as ``torch._foreach_*`` calls over the parameters
        that share a step count: about fifteen launches a group instead of a dozen a parameter
        (the host issues every one of them, and a short step waits on the host)."""
        if self.update_backend == "triton":
            for p in params:
                self._update(p, p.grad, group)
            return
        beta1, beta2 = group["betas"]
        lr, decay = self._rates(group)
        buckets: dict[int, list[Tensor]] = {}
        for p in params:
            buckets.setdefault(self._state(p, p)["step"], []).append(p)
        for t, ps in buckets.items():
            ms = [self.state[p]["exp_avg"] for p in ps]
            vs = [self.state[p]["exp_avg_sq"] for p in ps]
            gs = [p.grad.float() for p in ps]
            torch._foreach_lerp_(ms, gs, 1 - beta1)
            torch._foreach_mul_(vs, beta2)
            torch._foreach_addcmul_(vs, gs, gs, value=1 - beta2)
            denom = torch._foreach_div(vs, 1 - beta2**t)
            torch._foreach_sqrt_(denom)
            torch._foreach_add_(denom, group["eps"])
            update = torch._foreach_div(ms, 1 - beta1**t)
            torch._foreach_div_(update, denom)
            torch._foreach_mul_(update, lr)
            p32 = [p.float() for p in ps]
            if decay:
                if group["cautious_wd"]:
                    signs = [(u * w > 0).to(u.dtype) for u, w in zip(update, p32)]
                    torch._foreach_addcmul_(update, p32, signs, value=decay)
                else:
                    torch._foreach_add_(update, p32, alpha=decay)
            torch._foreach_copy_(ps, torch._foreach_sub(p32, update))

    def _update(self, target: Tensor, grad: Tensor, group: dict, param: Optional[Tensor] = None,
                rows: Optional[tuple[int, int]] = None) -> None:
        """One Adam step of ``target`` (the parameter, or its own rows) with ``grad``."""
        p = target if param is None else param
        beta1, beta2 = group["betas"]
        lr, decay = self._rates(group)
        state = self._state(p, target, rows)
        t = state["step"]
        m, v = state["exp_avg"], state["exp_avg_sq"]
        if self.update_backend == "triton" and target.is_contiguous() and m.is_contiguous() and v.is_contiguous():
            from ..ops.triton.adam_update import adam_update_

            adam_update_(target, grad.contiguous(), m, v, beta1, beta2, t, group["eps"], lr, decay,
                         group["cautious_wd"])
            return
        g = grad.float()
        m.lerp_(g, 1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        denom = (v / (1 - beta2**t)).sqrt_().add_(group["eps"])
        update = (m / (1 - beta1**t)).div_(denom).mul_(lr)
        p32 = target.float()
        if decay:
            if group["cautious_wd"]:
                update.addcmul_(p32, (update * p32 > 0).to(update.dtype), value=decay)
            else:
                update.add_(p32, alpha=decay)
        target.copy_(p32 - update)

    # -- checkpoints -------------------------------------------------------------------
    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather the sharded moments into full rows on rank ``to`` (a collective: every rank calls it).

        The next ``state_dict()`` on rank ``to`` then holds full rows for every sharded
        parameter and loads on any world size. Lightning's strategies call this for
        sharded optimizers.
        """
        pg = self.process_group
        world, rank = world_of(pg), rank_of(pg)
        if world == 1:
            return
        full: dict[Tensor, dict] = {}
        for group in self.param_groups:
            if not self._is_sharded(group, world):
                continue
            for p in group["params"]:
                state = self.state.get(p)
                if not state:
                    continue
                rows = p.shape[0]
                lo, hi, per = row_range(rows, world, rank)
                entry = {"step": state["step"], "rows": (0, rows, rows)}
                for name in _MOMENTS:
                    mine = state[name]
                    send = mine.new_zeros(per, mine.shape[1])
                    send[: hi - lo].copy_(mine)
                    out = mine.new_empty(per * world, mine.shape[1])
                    _all_gather(out, send, group=pg)
                    entry[name] = out[:rows]
                full[p] = entry
        self._consolidated = full if rank == to else None

    def state_dict(self) -> dict[str, Any]:
        sd = super().state_dict()
        if self._consolidated:
            index = {id(p): i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}
            for p, entry in self._consolidated.items():
                sd["state"][index[id(p)]] = entry
        self._consolidated = None
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state saved on any world size (sharded rows re-split), keeping the moments fp32.

        A sharded state that holds only some rows (a rank's shard, saved without
        :meth:`consolidate_state_dict`) loads only on the rank that owns the same rows.
        """
        pg = self.process_group
        world, rank = world_of(pg), rank_of(pg)
        params = [(g, p) for g in self.param_groups for p in g["params"]]
        state = dict(state_dict["state"])
        for i, entry in state.items():
            if i >= len(params):
                continue
            group, p = params[i]
            entry = dict(entry)
            saved_rows = entry.pop("rows", None)
            rows = p.shape[0] if p.dim() > 0 else 1  # 0-d scalars (gates, lambdas) count as one row
            full = saved_rows is None or (saved_rows[0], saved_rows[1]) == (0, rows)
            if self._is_sharded(group, world):
                lo, hi, _ = row_range(rows, world, rank)
                if full:
                    for name in _MOMENTS:
                        if name in entry:
                            entry[name] = entry[name].reshape(rows, -1)[lo:hi]
                elif (saved_rows[0], saved_rows[1]) != (lo, hi):
                    raise ValueError(
                        f"DistAdam state for a sharded parameter of shape {tuple(p.shape)} holds rows "
                        f"{saved_rows[0]}:{saved_rows[1]}, but this rank owns {lo}:{hi}; save with "
                        f"consolidate_state_dict() (full rows) to resume on another rank or world size"
                    )
                entry["rows"] = (lo, hi, rows)
            elif not full:
                raise ValueError(
                    f"DistAdam state for a parameter of shape {tuple(p.shape)} holds only rows "
                    f"{saved_rows[0]}:{saved_rows[1]} (one rank's shard); save with consolidate_state_dict()"
                )
            else:
                for name in _MOMENTS:
                    if name in entry:
                        entry[name] = entry[name].reshape(p.shape)
            state[i] = entry
        moments = {i: {k: entry[k] for k in _MOMENTS if k in entry} for i, entry in state.items()}
        super().load_state_dict({**state_dict, "state": state})
        # Optimizer.load_state_dict casts floating state to the parameter's dtype; the moments stay fp32
        for i, saved in moments.items():
            if i >= len(params):
                continue
            p = params[i][1]
            for name, value in saved.items():
                self.state[p][name] = value.to(device=p.device, dtype=torch.float32, copy=True)
