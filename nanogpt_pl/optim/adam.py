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
passes a parameter; the replicated parameters take them together as ``torch._foreach_*``
calls, :meth:`DistAdam._foreach_update`) or one Triton pass a parameter
(``update_backend="triton"``, ``nanogpt_pl.ops.triton.adam_update``) with the same arithmetic.
The bias corrections are applied as products with their reciprocals, so the per-parameter and
the multi-tensor forms are the same arithmetic bit for bit.

On a GPU the replicated parameters' multi-tensor update is replayed from a CUDA graph
(``cuda_graph``; RECORD §11's optimizer-tail graphs): the step's learning rates, decays and bias
corrections reach it through a device buffer (:class:`~nanogpt_pl.optim.staging.ScalarStager`),
so the schedule needs no recapture. A layout's first step runs eagerly, the second eagerly and
then captures, replays from the same starting values and keeps the graph only if it wrote the
eager step's bytes; later steps replay. A layout is every address the update reads or writes
(parameters, gradients, moments), so a moved buffer is a new layout, never a stale replay.

Moments are fp32 whatever the parameter dtype. Checkpoints: replicated state is the same
on every rank. Sharded state is this rank's rows; :meth:`DistAdam.consolidate_state_dict`
(a collective, Lightning's protocol for sharded optimizers) makes the next ``state_dict()``
on rank ``to`` hold full rows, which load on any world size.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Iterable, Optional

import torch
import torch.distributed as dist
from torch import Tensor
from torch.autograd.graph import increment_version
from torch.profiler import record_function

from ..backends import resolve_fast_on_gpu
from ..capture import TailEntry, capture_checked
from .staging import ScalarStager

_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

_MOMENTS = ("exp_avg", "exp_avg_sq")
# the columns of a bucket's row of staged scalars (see DistAdam._bucket_scalars)
_LR, _DECAY, _INV_BC1, _INV_BC2 = range(4)


def resolve_update_backend(backend: str, device: torch.device) -> str:
    """``reference`` or ``triton`` for the dense Adam update (``model.backends.adam``); raises for an
    impossible choice. ``auto`` is the Triton pass on a GPU (timed faster in the step, BENCHMARKS.md)."""
    return resolve_fast_on_gpu("adam", backend, device, "the parameters are")


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


class UpdateGraphs:
    """An optimizer update as CUDA graph replays, one graph per layout key.

    ``run(key, work, written, params)``: ``work`` updates ``written`` in place (parameters and
    their state) from values it reads at addresses ``key`` pins.

    - A key's first visit runs ``work`` eagerly.
    - The second runs it eagerly (the step keeps that result), restores ``written`` to its
      values before the step, captures ``work`` on a side stream, replays it and compares all of
      ``written`` with the eager bytes. A difference or an exception is one warning and eager
      runs for that key from then on; the eager result stands either way.
    - Later visits replay. A replay runs no ATen operation, so it bumps the version counters of
      ``params`` itself (the FP8 weight caches see a changed weight by its counter).

    At most :attr:`MAX_KEYS` keys are kept (a new one past that drops them all): without
    persistent gradient buffers the gradients' addresses, part of the key, may keep changing.
    If :attr:`GIVE_UP_CAPTURES` captures have paid back fewer replays than that, the layouts
    are not repeating: one warning, and eager updates from then on.
    """

    MAX_KEYS = 8
    GIVE_UP_CAPTURES = 16

    def __init__(self) -> None:
        self.entries: dict[tuple, TailEntry] = {}
        self._stream: Optional[torch.cuda.Stream] = None
        self._pool = None
        self.replays = 0
        self.eager_runs = 0
        self.captures = 0
        self.enabled = True

    def captured(self) -> int:
        return sum(e.graph is not None for e in self.entries.values())

    def run(self, key: tuple, work: Callable[[], None], written: list[Tensor], params: list[Tensor]) -> None:
        if not self.enabled:
            self.eager_runs += 1
            work()
            return
        entry = self.entries.get(key)
        if entry is None:
            if len(self.entries) >= self.MAX_KEYS:
                self.entries.clear()
            entry = self.entries[key] = TailEntry()
        entry.visits += 1
        if entry.graph is not None:
            with record_function("graphs/adam_replay"):
                entry.graph.replay()
            increment_version(params)
            self.replays += 1
            return
        if entry.eager_only or entry.visits < 2:
            self.eager_runs += 1
            work()
            return
        if self.captures >= self.GIVE_UP_CAPTURES and self.replays < self.captures:
            warnings.warn(f"CUDA graphs: {self.captures} captures of the Adam update were replayed only "
                          f"{self.replays} times (its gradients keep moving in memory); it runs eagerly from now on")
            self.enabled = False
            self.entries.clear()
            self.eager_runs += 1
            work()
            return
        self.captures += 1
        self.eager_runs += 1
        entry.graph = capture_checked(self, written, work, f"Adam update of {len(written)} tensors")
        entry.eager_only = entry.graph is None


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
        cuda_graph: replay the replicated parameters' update (the ``reference`` backend's
            multi-tensor form) from CUDA graphs, one per layout (see the module docstring).
            None = on for CUDA parameters; CPU parameters and the ``triton`` backend run eagerly.
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
        cuda_graph: Optional[bool] = None,
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
        self._spare: dict[Tensor, dict[str, Tensor]] = {}  # moments a load left unused (load_state_dict)
        self.device = device
        on_cuda = device.type == "cuda"
        if cuda_graph and not on_cuda:
            warnings.warn("DistAdam: cuda_graph=True has no effect on CPU parameters")
        wanted = on_cuda and (cuda_graph is None or bool(cuda_graph)) and self.update_backend == "reference"
        self.graphs: Optional[UpdateGraphs] = UpdateGraphs() if wanted else None
        self._stagers: dict[int, ScalarStager] = {}  # by bucket count: a layout keeps its buffer's address

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
        self._update_replicated([(g, ps) for g, ps in replicated if ps])

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
            for name in _MOMENTS:
                state[name] = self._moment(p, name, target.shape, target.device).zero_()
            if rows is not None:
                state["rows"] = (rows[0], rows[1], p.shape[0])
        state["step"] += 1
        return state

    def _moment(self, p: Tensor, name: str, shape: torch.Size, device: torch.device) -> Tensor:
        """An fp32 tensor for ``p``'s moment ``name`` (contents undefined): the one a load left
        aside if it fits (the address the update graphs were captured with), else a new one."""
        old = self._spare.get(p, {}).pop(name, None)
        if old is not None and old.shape == shape and old.device == device:
            return old
        return torch.empty(shape, dtype=torch.float32, device=device)

    def _bucket_scalars(self, group: dict, t: int) -> list[float]:
        """A bucket's staged scalars: lr, decay, and the reciprocals of the bias corrections at step ``t``."""
        beta1, beta2 = group["betas"]
        lr, decay = self._rates(group)
        return [lr, decay, 1.0 / (1.0 - beta1**t), 1.0 / (1.0 - beta2**t)]

    @staticmethod
    def _decays(group: dict) -> bool:
        """Whether the group decays at all (its lr-dependent size is a staged scalar)."""
        return group["weight_decay"] * group["wd_mul"] != 0

    def _update_replicated(self, replicated: list[tuple[dict, list[Tensor]]]) -> None:
        """The update of every replicated parameter with a gradient: one Triton pass a parameter,
        or the multi-tensor form by step-count bucket, eagerly or from a CUDA graph."""
        if self.update_backend == "triton":
            for group, params in replicated:
                for p in params:
                    self._update(p, p.grad, group)
            return
        plan: list[tuple[dict, list[Tensor], int]] = []
        for group, params in replicated:
            buckets: dict[int, list[Tensor]] = {}
            for p in params:
                buckets.setdefault(self._state(p, p)["step"], []).append(p)
            plan += [(group, ps, t) for t, ps in buckets.items()]
        if not plan:
            return
        stager = self._stagers.get(len(plan))
        if stager is None:
            stager = self._stagers[len(plan)] = ScalarStager(len(plan), 4, self.device)
        scalars = stager.push([self._bucket_scalars(group, t) for group, _, t in plan])
        if self.graphs is None:
            self._foreach_update(plan, stager.cells)
            return
        key = [scalars.data_ptr()]
        params, written = [], []
        for group, ps, _ in plan:
            key.append((group["betas"], group["eps"], group["cautious_wd"], self._decays(group)))
            for p in ps:
                st = self.state[p]
                key += (p.data_ptr(), p.grad.data_ptr(), p.grad.dtype, st["exp_avg"].data_ptr(),
                        st["exp_avg_sq"].data_ptr())
                params.append(p)
                written += (p, st["exp_avg"], st["exp_avg_sq"])
        self.graphs.run(tuple(key), lambda: self._foreach_update(plan, stager.cells), written, params)

    def _foreach_update(self, plan: list[tuple[dict, list[Tensor], int]], cells: list[list[Tensor]]) -> None:
        """:meth:`_update`'s arithmetic, operation for operation, as ``torch._foreach_*`` calls over
        each bucket (a group's parameters that share a step count), reading the step's scalars
        from ``cells`` (the staged buffer's 0-d views, a row per bucket: :meth:`_bucket_scalars`):
        about fifteen launches a bucket instead of a dozen a parameter, and no Python number that
        changes between steps, so the same calls replay from a CUDA graph."""
        for i, (group, ps, _) in enumerate(plan):
            beta1, beta2 = group["betas"]
            s = cells[i]
            ms = [self.state[p]["exp_avg"] for p in ps]
            vs = [self.state[p]["exp_avg_sq"] for p in ps]
            gs = [p.grad.float() for p in ps]
            torch._foreach_lerp_(ms, gs, 1 - beta1)
            torch._foreach_mul_(vs, beta2)
            torch._foreach_addcmul_(vs, gs, gs, value=1 - beta2)
            del gs
            denom = torch._foreach_mul(vs, s[_INV_BC2])
            torch._foreach_sqrt_(denom)
            torch._foreach_add_(denom, group["eps"])
            update = torch._foreach_mul(ms, s[_INV_BC1])
            torch._foreach_div_(update, denom)
            del denom
            torch._foreach_mul_(update, s[_LR])
            p32 = [p.float() for p in ps]
            if self._decays(group):
                wd = torch._foreach_mul(p32, s[_DECAY])
                if group["cautious_wd"]:
                    torch._foreach_mul_(wd, [(u * w > 0).to(u.dtype) for u, w in zip(update, p32)])
                torch._foreach_add_(update, wd)
                del wd
            torch._foreach_sub_(p32, update)  # in place on an fp32 parameter itself
            pairs = [(p, q) for p, q in zip(ps, p32) if q is not p]
            if pairs:
                torch._foreach_copy_([p for p, _ in pairs], [q for _, q in pairs])

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
        denom = (v * (1.0 / (1.0 - beta2**t))).sqrt_().add_(group["eps"])
        update = (m * (1.0 / (1.0 - beta1**t))).div_(denom).mul_(lr)
        p32 = target.float()
        if self._decays(group):
            wd = p32 * decay
            if group["cautious_wd"]:
                wd.mul_((update * p32 > 0).to(update.dtype))
            update.add_(wd)
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

        Moments this optimizer already holds in the same shape are overwritten in place, so
        the update graphs, which read them by address, keep replaying after a load (the
        speedrun timer's reset after its warmup loads the state it saved before it). Those of
        parameters the loaded state has no moments for are kept aside and zeroed for their
        first step.
        """
        self._spare = {p: {name: s[name] for name in _MOMENTS if name in s} for p, s in self.state.items()}
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
                self.state[p][name] = self._moment(p, name, value.shape, p.device).copy_(value)
        # what is left waits for the first step of a parameter the state had no moments for
        self._spare = {p: moments for p, moments in self._spare.items() if moments and not self.state.get(p)}
