"""Adam for the sparse channels: lazy row-wise Adam for the n-gram table, shard Adam for value embeddings.

**Lazy row-wise Adam** (RECORD §4). The n-gram table (84.6M rows in the record) is
updated with Adam at β₁ = 0 and one second-moment value per row, the mean over the
row of the squared gradient. Event ``j`` (the j-th update, counted from 1) does, for
every row ``r`` that received a gradient ``g`` this cycle:

1. ``v_r ← v_r · ∏_{i = le_r + 1}^{j - 1} β₂⁽ⁱ⁾``: the decay of the events the row slept
   through, in closed form (``β₂^k`` while β₂ is constant; the exact product over the
   per-event values when β₂ changed, kept as a short list of constant segments);
2. ``v_r ← β₂ v_r + (1 - β₂)·mean_d(g_d²)``;
3. ``u = g / (√v_r + ε) · η·√(1 - β₂ʲ)`` (bias correction by the global event count ``j``
   and the current β₂, as the record does; β₁ = 0 needs no first-moment correction);
4. cautious decay ``u_d += η²·λ·p_d`` where ``u_d·p_d > 0`` (RECORD §4, §8: the effective
   decay is (lr·lr_mul)² · weight_decay · wd_mul);
5. ``p ← p - u``; ``le_r ← j``.

Why it is exact: with β₁ = 0 a row without gradient has ``u = 0``, so its cautious mask
is off and it does not move; it only owes the second-moment decay, which step 1
replays when the row is next touched. Hence this update equals dense Adam over the
whole table (zero gradient for untouched rows, the same row-mean second moment and the
same per-event bias correction) while reading and writing only the touched rows
(``tests/test_sparse_adam.py`` checks it in fp64).

**Shard Adam for value embeddings** (RECORD §5): ordinary Adam (β₁ = 0.75) over the rows
a rank owns; β₁ > 0 moves rows without gradient, so every owned row is updated. With the
reference exchange the gradient terms are added only at the touched rows; the fixed
exchange hands over the whole block's gradient from its cycle buffer (zero where
untouched), which gives the same numbers.

:class:`SparseAdam` is the ``sparse`` part of the
:class:`~nanogpt_pl.optim.combined.CombinedOptimizer`: its param groups carry lr,
betas and multipliers (so the schedule's lr scale reaches them) and its ``step`` runs
one event of each channel. From the cadence engage step (RECORD §5: 336) the channels
update every 4th step instead of every 2nd; each event then stands for twice as many
steps, so betas are squared and the weight-decay multiplier doubled (the per-event
equivalents of the per-step settings, RECORD §5), via :meth:`SparseAdam.set_cadence_engaged`.
"""

from __future__ import annotations

import math
from collections import OrderedDict, defaultdict
from typing import Any, Optional, Protocol

import torch
from torch import Tensor

from ..ops.triton import triton_usable

# RECORD §3 "LR multiplier 70" and §4/§5: the sparse channels' Adam settings.
SPARSE_LR_MUL = 70.0
NGRAM_BETA2 = 0.95  # RECORD §4: β₂ 0.95 (β₁ = 0 enforced)
VALUE_EMBED_BETAS = (0.75, 0.95)  # RECORD §5
SPARSE_WD_MUL = 5.0  # RECORD §4/§5: wd_mul 5, doubled to 10 when the cadence engages
SPARSE_EPS = 1e-10  # RECORD §4
# Rows updated per chunk by the value-embedding shard Adam, bounding its fp32 temporaries.
DENSE_CHUNK_ROWS = 1 << 16
# Gradient rows per chunk of a sparse event (the lazy n-gram update, the value embeddings' moment
# update): a stage-2 event on one GPU carries millions of padded rows of 768 channels, 9-18 GiB
# per fp32 temporary if done at once (it ran out of memory beside the CUDA graphs' pools); rows
# are unique, so the chunks are independent and the result is the same. The unfused segment
# update gathers its queued terms in chunks of as many, in order: the same sums.
SPARSE_CHUNK_ROWS = 1 << 18


class LazyRowAdam:
    """Row-wise Adam state of one table shard: a second moment and a last-event stamp per row.

    Args:
        num_rows: rows of the shard.
        device: where the state lives (the shard's device).
        dtype: dtype of the second moment and of the update arithmetic (fp32; fp64 in tests).
        fused: run each event as one Triton kernel (``nanogpt_pl.ops.triton.row_adam``); None
            (default) = wherever it can run (fp32 state on a GPU), False = always PyTorch.
    """

    def __init__(self, num_rows: int, device: Optional[torch.device] = None,
                 dtype: torch.dtype = torch.float32, fused: Optional[bool] = None) -> None:
        self.dtype = dtype
        self.fused = fused
        # One scratch row past the shard (index ``num_rows``): the fixed-capacity exchange
        # points its padding there (``nanogpt_pl.distributed.row_exchange``), so an update of
        # a padded row list needs no data-dependent mask. ``v`` and ``last_event`` exclude it.
        self._v = torch.zeros(num_rows + 1, dtype=dtype, device=device)
        # int32 as in the record: 4 bytes per row (42 MB for a record-size shard).
        self._last_event = torch.zeros(num_rows + 1, dtype=torch.int32, device=device)
        self.v, self.last_event = self._v[:num_rows], self._last_event[:num_rows]
        self.event = 0
        # (first event, β₂) of each run of events with the same β₂; replays multiply across runs.
        self.beta2_segments: list[tuple[int, float]] = []

    def _record_beta2(self, event: int, beta2: float) -> None:
        if not self.beta2_segments or self.beta2_segments[-1][1] != beta2:
            self.beta2_segments.append((event, float(beta2)))

    def decay_since(self, last_event: Tensor, event: int) -> Tensor:
        """∏ β₂⁽ⁱ⁾ over the events ``last_event + 1 .. event - 1`` each row slept through."""
        le = last_event.to(torch.int64)
        factor = torch.ones(le.shape, dtype=self.dtype, device=le.device)
        bounds = [s for s, _ in self.beta2_segments[1:]] + [event]
        for (start, beta2), next_start in zip(self.beta2_segments, bounds):
            lo = torch.clamp(le + 1, min=start)
            hi = min(event - 1, next_start - 1)
            n = torch.clamp(hi - lo + 1, min=0)
            # β^0 is exactly 1, so rows outside the run are unaffected (and no host sync is needed; a
            # Python-scalar base needs no host-to-device copy either).
            factor = factor * torch.pow(beta2, n.to(self.dtype))
        return factor

    @torch.no_grad()
    def update_(self, table: Tensor, rows: Tensor, grad: Tensor, lr: float, beta2: float, eps: float,
                weight_decay: float) -> None:
        """One event: update ``table[rows]`` with ``grad`` (rows unique, local to the shard).

        Args:
            table: the shard ``[num_rows, D]`` (updated in place; only ``rows`` are read or written),
                or ``[num_rows + 1, D]`` with the scratch row when ``rows`` holds padding.
            rows: unique local row indices ``[n]`` (int64); padding entries (any number) are
                ``num_rows``, the scratch row, whose values are meaningless.
            grad: the merged gradient of those rows ``[n, D]`` (already averaged over ranks).
            lr: η, the full learning rate (base lr · schedule · lr_mul).
            beta2: this event's β₂.
            eps: added to √v.
            weight_decay: λ = weight_decay · wd_mul; the decay per event is η²·λ.
        """
        if self._fused(table, grad):
            n = rows.numel()
            ident = torch.arange(n + 1, dtype=torch.int64, device=rows.device)
            self._fused_update_(table, rows, grad, ident[:n], ident, lr, beta2, eps, weight_decay)
            return
        j = self._begin_event(beta2)
        for a in range(0, rows.numel(), SPARSE_CHUNK_ROWS):
            r, gr = rows[a:a + SPARSE_CHUNK_ROWS], grad[a:a + SPARSE_CHUNK_ROWS]
            p = table.index_select(0, r).to(self.dtype)
            v = self._v.index_select(0, r) * self.decay_since(self._last_event.index_select(0, r), j)
            g = gr.to(self.dtype)
            v = beta2 * v + (1 - beta2) * g.square().mean(-1)
            u = (g / (v.sqrt() + eps).unsqueeze(-1)).mul_(lr * math.sqrt(1 - beta2**j))
            if weight_decay:
                u.add_(torch.where(u * p > 0, p * (lr * lr * weight_decay), 0.0))
            table.index_copy_(0, r, p.sub_(u).to(table.dtype))
            self._v.index_copy_(0, r, v)
            self._last_event.index_fill_(0, r, j)

    @torch.no_grad()
    def update_segments_(self, table: Tensor, rows: Tensor, src: Tensor, order: Tensor, offsets: Tensor,
                         slot: Tensor, lr: float, beta2: float, eps: float, weight_decay: float,
                         src2: Optional[Tensor] = None, grad_divisor: int = 1) -> None:
        """:meth:`update_` with the merge folded in: ``rows[i]``'s gradient is the sum of
        ``src[order[offsets[i]:offsets[i+1]]]`` in that order (``row_exchange.segments_fixed``;
        ``slot`` gives each entry of ``order`` its ``i``, ``len(rows)`` for entries of no row),
        divided by ``grad_divisor`` (the number of ranks whose terms it sums: their mean).

        ``src2`` (optional) holds more terms: ``order`` then indexes ``src ++ src2``, which is
        not built on a GPU (an owner's own request and its peers' rows, in two dtypes).

        On a GPU one Triton kernel sums each row's terms and updates it (no merged buffer, no
        atomics; the division is a multiplication by ``1/grad_divisor``, the same bits for a
        power of two); elsewhere the terms are summed into a buffer and :meth:`update_` runs.
        """
        if self._fused(table, src) and (src2 is None or src2.is_contiguous()):
            self._fused_update_(table, rows, src, order, offsets, lr, beta2, eps, weight_decay, src2=src2,
                                grad_scale=1.0 / grad_divisor)
            return
        merged = torch.zeros(rows.numel() + 1, src.shape[-1], dtype=torch.float32, device=src.device)
        n1 = src.shape[0]
        single = src if src2 is None or src2.shape[0] == 0 else src2 if n1 == 0 else None
        # the terms gathered in chunks, in order (an owner's queue is millions of rows: an fp32
        # copy of all of them, tens of GB)
        for a in range(0, order.numel(), SPARSE_CHUNK_ROWS):
            o = order[a:a + SPARSE_CHUNK_ROWS]
            if single is not None:
                terms = single.index_select(0, o).float()
            else:  # entries below n1 index src, the others src2; no host sync to split them
                terms = torch.where((o < n1).unsqueeze(1), src.index_select(0, o.clamp(max=n1 - 1)).float(),
                                    src2.index_select(0, (o - n1).clamp(min=0)).float())
            merged.index_add_(0, slot[a:a + SPARSE_CHUNK_ROWS], terms)
        if grad_divisor != 1:
            merged.div_(grad_divisor)
        self.update_(table, rows, merged[:-1], lr, beta2, eps, weight_decay)

    def _begin_event(self, beta2: float) -> int:
        j = self.event + 1
        self._record_beta2(j, beta2)
        self.event = j
        return j

    def _fused(self, table: Tensor, src: Tensor) -> bool:
        """Whether the Triton kernel runs this event (fp32 state on a device it can run on)."""
        if self.fused is False:
            return False
        return (self.dtype == torch.float32 and triton_usable(table.device) and src.is_contiguous()
                and table.is_contiguous())

    def _fused_update_(self, table: Tensor, rows: Tensor, src: Tensor, order: Tensor, offsets: Tensor, lr: float,
                       beta2: float, eps: float, weight_decay: float, src2: Optional[Tensor] = None,
                       grad_scale: float = 1.0) -> None:
        from ..ops.triton.row_adam import lazy_row_adam_

        j = self._begin_event(beta2)
        # the decay owed by a row last stamped at event e, for every e < j (the reference's numbers)
        decay = self.decay_since(torch.arange(j, dtype=torch.int32, device=table.device), j)
        lazy_row_adam_(table, self._v, self._last_event, rows, src, order, offsets, decay,
                       scratch=self._v.numel() - 1, event=j, beta2=beta2, step_size=lr * math.sqrt(1 - beta2**j),
                       eps=eps, decay_wd=lr * lr * weight_decay, src2=src2, grad_scale=grad_scale)

    @torch.no_grad()
    def replay_all_(self) -> None:
        """Bring every row's second moment to the current event (for inspection or export)."""
        if self.event:
            self.v.mul_(self.decay_since(self.last_event, self.event + 1))
            self.last_event.fill_(self.event)

    def state_dict(self) -> dict[str, Any]:
        return {"v": self.v, "last_event": self.last_event, "event": self.event,
                "beta2_segments": [list(s) for s in self.beta2_segments]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["v"].shape != self.v.shape:
            raise ValueError(f"row Adam state has {state['v'].shape[0]} rows, this shard {self.v.shape[0]}")
        self.v.copy_(state["v"])
        self.last_event.copy_(state["last_event"])
        self.event = int(state["event"])
        self.beta2_segments = [(int(s), float(b)) for s, b in state["beta2_segments"]]


@torch.no_grad()
def shard_adam_(param: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, rows: Tensor, grad: Tensor, step: int,
                lr: float, betas: tuple[float, float], eps: float, weight_decay: float) -> None:
    """Adam over every row of ``param`` with a gradient that is zero except at ``rows``.

    The record's Adam form (RECORD §8, the dense groups): m ← β₁m + (1-β₁)g,
    v ← β₂v + (1-β₂)g², u = m/(√v + ε)·lr·√(1-β₂ᵗ)/(1-β₁ᵗ), cautious decay lr²·λ where
    u·p > 0, p ← p - u. ``rows`` must be unique; ``grad`` is ``[len(rows), D]``.
    """
    _add_moments_(exp_avg, exp_avg_sq, rows, grad, betas)
    _apply_moments_(param, exp_avg, exp_avg_sq, step, lr, betas, eps, weight_decay)


def _add_moments_(exp_avg: Tensor, exp_avg_sq: Tensor, rows: Tensor, grad: Tensor,
                  betas: tuple[float, float]) -> None:
    """m += (1-β₁)g, v += (1-β₂)g² at ``rows`` (after the decay of every row).

    Gathered, added and written back rather than ``index_add_``: ``rows`` are unique but
    for repeats of a padding (scratch) row, whose moments are never read, and on a GPU
    ``index_add_`` would serialize those repeats on its atomics.
    """
    beta1, beta2 = betas
    exp_avg.mul_(beta1)
    exp_avg_sq.mul_(beta2)
    for a in range(0, rows.numel(), SPARSE_CHUNK_ROWS):
        r, g = rows[a:a + SPARSE_CHUNK_ROWS], grad[a:a + SPARSE_CHUNK_ROWS].to(exp_avg.dtype)
        exp_avg.index_copy_(0, r, exp_avg.index_select(0, r).add_(g, alpha=1 - beta1))
        exp_avg_sq.index_copy_(0, r, exp_avg_sq.index_select(0, r).add_(g * g, alpha=1 - beta2))


def _adam_step_size(lr: float, betas: tuple[float, float], step: int) -> float:
    """lr·√(1-β₂ᵗ)/(1-β₁ᵗ): the bias-corrected step of the record's Adam (RECORD §8)."""
    beta1, beta2 = betas
    return lr * math.sqrt(1 - beta2**step) / (1 - beta1**step)


def _apply_moments_(param: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, step: int, lr: float,
                    betas: tuple[float, float], eps: float, weight_decay: float) -> None:
    step_size = _adam_step_size(lr, betas, step)
    decay = lr * lr * weight_decay
    for a in range(0, param.shape[0], DENSE_CHUNK_ROWS):
        b = min(param.shape[0], a + DENSE_CHUNK_ROWS)
        p = param[a:b].to(exp_avg.dtype)
        u = exp_avg[a:b] / (exp_avg_sq[a:b].sqrt() + eps) * step_size
        if decay:
            u = u + torch.where(u * p > 0, p * decay, torch.zeros_like(p))
        param[a:b].copy_((p - u).to(param.dtype))


class ShardAdam:
    """Adam state of one rank's block of ``planes`` tables (first and second moments, step count).

    The state is allocated at the first update (fp32 ``[planes, rows, dim]`` each, plus one
    scratch row for the padding of :meth:`update_rows_`), so a channel that never updates
    costs nothing.

    Args:
        planes: tables sharing the block (the value-embedding planes).
        rows: rows of the block this rank owns.
        dim: row width.
        fused: run :meth:`update_dense_` as one Triton pass a plane; None (default) = wherever it
            can run (a GPU), False = always PyTorch.
    """

    def __init__(self, planes: int, rows: int, dim: int, fused: Optional[bool] = None) -> None:
        self.shape = (planes, rows, dim)
        self.fused = fused
        self.exp_avg: Optional[Tensor] = None
        self.exp_avg_sq: Optional[Tensor] = None
        self.step = 0

    def _ensure_state(self, device: torch.device) -> None:
        if self.exp_avg is None:
            planes, rows, dim = self.shape
            self._flat_avg = torch.zeros(planes * rows + 1, dim, dtype=torch.float32, device=device)
            self._flat_avg_sq = torch.zeros_like(self._flat_avg)
            self.exp_avg = self._flat_avg[:-1].view(self.shape)
            self.exp_avg_sq = self._flat_avg_sq[:-1].view(self.shape)

    @torch.no_grad()
    def update_(self, blocks: list[Tensor], plane: Tensor, rows: Tensor, grad: Tensor, lr: float,
                betas: tuple[float, float], eps: float, weight_decay: float) -> None:
        """One Adam step of every plane's block; ``grad[i]`` belongs to row ``rows[i]`` of plane ``plane[i]``."""
        self._ensure_state(blocks[0].device)
        self.step += 1
        for p, block in enumerate(blocks):
            sel = plane == p
            shard_adam_(block, self.exp_avg[p], self.exp_avg_sq[p], rows[sel], grad[sel], self.step, lr, betas, eps,
                        weight_decay)

    @torch.no_grad()
    def update_rows_(self, blocks: list[Tensor], flat_rows: Tensor, grad: Tensor, lr: float,
                     betas: tuple[float, float], eps: float, weight_decay: float) -> None:
        """:meth:`update_` for a padded row list: ``flat_rows = plane·rows + row``, padding = ``planes·rows``.

        No boolean selection, so no data-dependent size; the moments and the update are the
        same numbers as :meth:`update_`'s (each real row gets exactly its one gradient term).
        """
        self._ensure_state(blocks[0].device)
        self.step += 1
        _add_moments_(self._flat_avg, self._flat_avg_sq, flat_rows, grad, betas)
        for p, block in enumerate(blocks):
            _apply_moments_(block, self.exp_avg[p], self.exp_avg_sq[p], self.step, lr, betas, eps, weight_decay)

    @torch.no_grad()
    def update_dense_(self, blocks: list[Tensor], grad: Tensor, lr: float, betas: tuple[float, float], eps: float,
                      weight_decay: float) -> bool:
        """:meth:`update_` with the whole block's gradient ``[planes, rows, D]`` (zero where untouched).

        The same numbers as :meth:`update_` and :meth:`update_rows_`: an untouched row's moments
        get ``β·m + (1-β)·0 = β·m``, a touched row's the same operations in the same order. On a
        GPU one Triton pass a plane does it (``nanogpt_pl.ops.triton.row_adam.dense_adam_``, the
        same formulas, fp32 rounding may differ) and leaves ``grad`` zeroed. Returns whether
        ``grad`` was left zeroed (the PyTorch path leaves it as it was).
        """
        self._ensure_state(blocks[0].device)
        self.step += 1
        beta1, beta2 = betas
        if self.fused is not False and triton_usable(grad.device):
            from ..ops.triton.row_adam import dense_adam_

            step_size = _adam_step_size(lr, betas, self.step)
            for p, block in enumerate(blocks):  # one pass a plane; the gradient is left zeroed
                dense_adam_(block, self.exp_avg[p], self.exp_avg_sq[p], grad[p], beta1, beta2, step_size, eps,
                            lr * lr * weight_decay)
            return True
        for p, block in enumerate(blocks):
            m, v, g = self.exp_avg[p], self.exp_avg_sq[p], grad[p]
            for a in range(0, m.shape[0], DENSE_CHUNK_ROWS):
                ga = g[a:a + DENSE_CHUNK_ROWS]
                m[a:a + DENSE_CHUNK_ROWS].mul_(beta1).add_(ga, alpha=1 - beta1)
                v[a:a + DENSE_CHUNK_ROWS].mul_(beta2).add_(ga * ga, alpha=1 - beta2)
            _apply_moments_(block, m, v, self.step, lr, betas, eps, weight_decay)
        return False

    def reset_(self) -> None:
        self.exp_avg = self.exp_avg_sq = None
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq}

    def load_state_dict(self, state: dict[str, Any], device: Optional[torch.device] = None) -> None:
        """Load ``state``; the moments are allocated on ``device`` (the tables' device)."""
        self.step = int(state["step"])
        if state["exp_avg"] is None:
            self.exp_avg = self.exp_avg_sq = None
        else:
            self._ensure_state(device)
            self.exp_avg.copy_(state["exp_avg"])
            self.exp_avg_sq.copy_(state["exp_avg_sq"])


class SparseChannel(Protocol):
    """What :class:`SparseAdam` drives: an object with parameters and an event ``step``."""

    params: list

    def step(self, lr: float, betas: tuple[float, float], eps: float, weight_decay: float) -> None: ...


class SparseAdam(torch.optim.Optimizer):
    """The optimizer part of the sparse channels (n-gram table, value embeddings).

    Every ``step()`` is one event of every channel: the owner ranks merge the cycle's
    gradients and update their rows. Call it only on the schedule's sparse steps
    (``Schedule.sparse_step``); in between, the channels keep accumulating.

    Args:
        channels: name -> channel (``ngram``: an ``NgramShard``; ``value_embeds``: a ``ValueEmbedShard``).
        lr: base learning rate (RECORD §8: 0.008), scaled by the schedule through ``group['lr']``.
        eps: Adam's ε.
        weight_decay: decay per unit lr², times each group's ``wd_mul``.
        groups: name -> dict(lr_mul, betas, wd_mul) overriding the record's settings.
    """

    def __init__(self, channels: dict[str, SparseChannel], lr: float = 0.008, eps: float = SPARSE_EPS,
                 weight_decay: float = 0.005, groups: Optional[dict[str, dict]] = None) -> None:
        if not channels:
            raise ValueError("SparseAdam needs at least one channel")
        record = {"ngram": dict(lr_mul=SPARSE_LR_MUL, betas=(0.0, NGRAM_BETA2), wd_mul=SPARSE_WD_MUL),
                  "value_embeds": dict(lr_mul=SPARSE_LR_MUL, betas=VALUE_EMBED_BETAS, wd_mul=SPARSE_WD_MUL)}
        # Optimizer.__init__ is skipped on purpose (as in CombinedOptimizer): the state lives in
        # the channels, the n-gram group has no nn.Parameter at all, and the base class would
        # refuse that and pull in torch._dynamo for nothing.
        self.defaults = dict(lr=lr, eps=eps, weight_decay=weight_decay)
        self.state: defaultdict = defaultdict(dict)
        self.param_groups: list[dict[str, Any]] = []
        for name, channel in channels.items():
            group = dict(self.defaults, **record.get(name, record["value_embeds"]))
            group.update((groups or {}).get(name, {}))
            group.update(params=list(channel.params), name=name, betas=tuple(group["betas"]))
            group.setdefault("initial_lr", group["lr"])
            self.param_groups.append(group)
        for hooks in ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks", "_optimizer_state_dict_pre_hooks",
                      "_optimizer_state_dict_post_hooks", "_optimizer_load_state_dict_pre_hooks",
                      "_optimizer_load_state_dict_post_hooks"):
            setattr(self, hooks, OrderedDict())
        self.channels = dict(channels)
        self.cadence_engaged = False

    def set_cadence_engaged(self, engaged: bool) -> None:
        """Square the betas and double ``wd_mul`` from now on (RECORD §5)."""
        self.cadence_engaged = bool(engaged)

    def event_settings(self, group: dict) -> tuple[float, tuple[float, float], float]:
        """(lr, betas, weight_decay) one event of ``group`` uses now."""
        beta1, beta2 = group["betas"]
        wd_mul = group["wd_mul"]
        if self.cadence_engaged:
            beta1, beta2, wd_mul = beta1**2, beta2**2, 2 * wd_mul
        return group["lr"] * group["lr_mul"], (beta1, beta2), group["weight_decay"] * wd_mul

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, betas, wd = self.event_settings(group)
            self.channels[group["name"]].step(lr=lr, betas=betas, eps=group["eps"], weight_decay=wd)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to clear: the channels' gradient queues are consumed by ``step``."""

    def state_dict(self) -> dict:
        """Hyperparameters of the groups and the cadence flag; the channels' rank-local state is
        checkpointed separately (``nanogpt_pl.distributed.side_files.save_rank_local``)."""
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]
        return {"param_groups": groups, "cadence_engaged": self.cadence_engaged}

    def load_state_dict(self, state_dict: dict) -> None:
        saved = [g["name"] for g in state_dict["param_groups"]]
        mine = [g["name"] for g in self.param_groups]
        if saved != mine:
            raise ValueError(f"checkpoint sparse optimizer groups {saved} differ from this run's {mine}")
        for group, loaded in zip(self.param_groups, state_dict["param_groups"]):
            group.update({k: (tuple(v) if k == "betas" else v) for k, v in loaded.items()})
        self.cadence_engaged = bool(state_dict.get("cadence_engaged", False))
