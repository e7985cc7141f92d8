"""The row-sharded n-gram table with sparse row exchange.

The record's n-gram table (RECORD §3: 84,602,880 rows × 768, 15.13 GiB per rank at 8
ranks) is split into contiguous row blocks, one per rank; no rank holds a replica.
Each micro-batch reads only a few hundred thousand rows, so a step costs what it
touches, not what the table holds:

* **pull** (:meth:`NgramShard.pull`): the caller hashes its tokens, takes the sorted
  unique rows, and asks their owners for them (:class:`~.row_exchange.RowExchange`);
  the rank's own rows are read locally.
* **push** (:meth:`NgramShard.push`): after backward the compact ``[U, D]`` gradient of the
  micro-batch is queued. Nothing is communicated.
* **event** (:meth:`NgramShard.step`, on the schedule's sparse steps): the cycle's queued
  gradients are segment-summed into one compact buffer per unique row (never a
  table-sized buffer on the sender), sent to the owners (counts, int32 ids, values),
  and each owner sums what it received into its touched rows only, averages over
  ranks, and runs the lazy row Adam (``nanogpt_pl.optim.sparse_adam``) on exactly
  those rows. With the fixed exchange the owner groups the received terms by row
  (``row_exchange.segments_fixed``) and the row update sums each row's terms itself, as on
  one rank.

World size 1 runs the same code path without a single collective.

``exchange="fixed"`` runs all three without a device -> host sync (no ``torch.unique``,
no counts read back; see ``row_exchange``): a micro-batch of T tokens asks for a
sentinel-padded list of ``2T`` rows (its bigram and trigram rows, the most it can
touch), the leaf keeps that shape, and the event merges the cycle's padded lists into
one of their total length. On one rank there is nothing to exchange, so the event groups the
queue by row (``row_exchange.segments_fixed``) and the row update sums each row's terms itself
(on a GPU one Triton kernel, ``nanogpt_pl.ops.triton.row_adam``); the leaf is gathered straight
from the shard. ``reference`` (exact sizes, host-side counts) is the default;
``sparse_channels.SparseChannels`` picks ``fixed`` with fixed leaf shapes (compiled runs). The module creates
the shard in ``setup`` (``sparse_channels.build_sparse_channels``); its per-rank state
goes to a checkpoint side file (``side_files``).
"""

from __future__ import annotations

from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from ..model.embeddings import (
    NgramInput,
    check_ngram_rows,
    compact_rows,
    gather_rows_,
    ngram_hashes,
    padded_leaf,
    resolve_hash_backend,
)
from ..optim.sparse_adam import LazyRowAdam
from .row_exchange import (
    EXCHANGES,
    RowExchange,
    dist_world_rank,
    merge_compact,
    merge_compact_fixed,
    pad_to_common,
    segments_fixed,
    unique_fixed,
)
from .side_files import STATE_FORMAT


class GradientQueue:
    """A cycle's queued ``(rows, grad)`` pairs, laid end to end in one buffer that is kept.

    Each append copies its pair into the next free slice: a copy is needed anyway (under CUDA
    graphs the gradient is the graph's buffer, which the next replay overwrites), and the
    event then reads the whole cycle as one pair (:meth:`whole`) instead of concatenating the
    queue, which at the record's stage 2 is 32 micro-batches x 98,304 rows x 768 fp32 (9.7 GB
    a cycle, read and written again, and held twice while the concatenation runs).

    The buffer grows inside a cycle (to the larger of what is needed and 1.25x, copying what
    it holds) and, when a cycle ends, is cut back to exactly what that cycle used, so a run of
    equal cycles (a stage's) allocates once. Its dtype is the promotion of every gradient
    appended (float32 from the model's fp32 leaves), so the stored values are exact.
    """

    GROWTH = 1.25

    def __init__(self) -> None:
        self._rows: Optional[Tensor] = None
        self._grads: Optional[Tensor] = None
        self._lengths: list[int] = []
        self._used = 0

    def __len__(self) -> int:
        return len(self._lengths)

    def __bool__(self) -> bool:
        return bool(self._lengths)

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        """The queued pairs in push order (views into the buffer)."""
        start = 0
        for n in self._lengths:
            yield self._rows[start:start + n], self._grads[start:start + n]
            start += n

    @property
    def capacity(self) -> int:
        return 0 if self._rows is None else self._rows.numel()

    def append(self, rows: Tensor, grad: Tensor) -> None:
        """Copy one pair (``grad.shape[0] == rows.numel()``) behind the queued ones."""
        n = rows.numel()
        if grad.shape[0] != n:
            raise ValueError(f"gradient of {grad.shape[0]} rows for {n} row ids")
        self._reserve(self._used + n, rows, grad)
        self._rows[self._used:self._used + n].copy_(rows)
        self._grads[self._used:self._used + n].copy_(grad)
        self._used += n
        self._lengths.append(n)

    def whole(self) -> tuple[Tensor, Tensor]:
        """Every queued pair as one ``(rows, grads)`` pair, in push order (views, no copy)."""
        if self._rows is None:
            raise RuntimeError("GradientQueue.whole: nothing was ever queued")
        return self._rows[:self._used], self._grads[:self._used]

    def replace(self, rows: Tensor, grad: Tensor) -> None:
        """Hold ``(rows, grad)`` as the only pair (a merged cycle); nothing if ``rows`` is empty."""
        if self._rows is not None and rows.numel() == self._used and self._used > 0 \
                and rows.data_ptr() == self._rows.data_ptr() and grad.data_ptr() == self._grads.data_ptr():
            self._lengths = [self._used]  # already where it would be copied to
            return
        self._lengths, self._used = [], 0
        if rows.numel():
            self.append(rows, grad)

    def clear(self, trim: bool = True) -> None:
        """Empty the queue (the buffer stays); with ``trim``, cut the buffer back to this cycle's use."""
        used = self._used
        self._lengths, self._used = [], 0
        if trim and used and self.capacity > used:
            shape, dtypes, device = self._grads.shape[1:], (self._rows.dtype, self._grads.dtype), self._rows.device
            self._rows = self._grads = None  # released before the smaller buffer is taken
            self._rows = torch.empty(used, dtype=dtypes[0], device=device)
            self._grads = torch.empty(used, *shape, dtype=dtypes[1], device=device)

    def _reserve(self, total: int, rows: Tensor, grad: Tensor) -> None:
        if self._grads is not None and self._grads.shape[1:] != grad.shape[1:]:
            raise ValueError(f"gradient rows of shape {tuple(grad.shape[1:])}; the queue holds "
                             f"{tuple(self._grads.shape[1:])}")
        grads_dtype = grad.dtype if self._grads is None else torch.promote_types(self._grads.dtype, grad.dtype)
        rows_dtype = rows.dtype if self._rows is None else torch.promote_types(self._rows.dtype, rows.dtype)
        if (self._rows is not None and total <= self.capacity and self._rows.device == rows.device
                and (rows_dtype, grads_dtype) == (self._rows.dtype, self._grads.dtype)):
            return
        capacity = max(total, int(self.GROWTH * self.capacity))
        new_rows = torch.empty(capacity, dtype=rows_dtype, device=rows.device)
        new_grads = torch.empty(capacity, *grad.shape[1:], dtype=grads_dtype, device=rows.device)
        if self._used:
            new_rows[:self._used].copy_(self._rows[:self._used])
            new_grads[:self._used].copy_(self._grads[:self._used])
        self._rows, self._grads = new_rows, new_grads


class NgramShard:
    """This rank's block of the hashed n-gram table, its row Adam state and the row exchange.

    Rank r owns rows ``[r·R/W, (r+1)·R/W)`` with ``R`` padded up to a multiple of the world
    size W (padding rows are never addressed).

    Args:
        ngram_rows: rows of the whole table (``model.gpt.ngram_rows``).
        dim: row width (the model dim).
        process_group: ranks sharing the table (None = default group; none at all = one rank).
        device: where the shard lives.
        dtype: table dtype (default bf16 on CUDA as in the record, fp32 on CPU).
        grad_wire_dtype: dtype of gradient rows on the wire (default: the table dtype;
            the record sends bf16).
        state_dtype: dtype of the row Adam state and arithmetic.
        exchange: ``"reference"`` (exact sizes, host-side counts) or ``"fixed"`` (fixed
            capacity from the batch, no host sync; see the module docstring).
        hash_backend: how a micro-batch's tokens are hashed to rows (``model.backends.ngram``:
            ``auto``, ``reference`` or ``triton``; ``model.embeddings.resolve_hash_backend``).
    """

    def __init__(self, ngram_rows: int, dim: int, process_group: Optional[dist.ProcessGroup] = None,
                 device: Optional[torch.device | str] = None, dtype: Optional[torch.dtype] = None,
                 grad_wire_dtype: Optional[torch.dtype] = None, state_dtype: torch.dtype = torch.float32,
                 exchange: str = "reference", hash_backend: str = "auto") -> None:
        check_ngram_rows(ngram_rows)
        if exchange not in EXCHANGES:
            raise ValueError(f"n-gram exchange={exchange!r}: choose one of {EXCHANGES}")
        self.fixed = exchange == "fixed"
        self.ngram_rows, self.dim = ngram_rows, dim
        self.world, self.rank = dist_world_rank(process_group)
        device = torch.device(device if device is not None else "cpu")
        self.hash_backend = resolve_hash_backend(hash_backend, device)
        if dtype is None:
            dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        self.rows_per_rank = -(-ngram_rows // self.world)
        # the rows are hashes (RECORD §3), spread evenly over the owners: the fixed exchange's slots
        # per destination are a binomial bound, not the whole request (row_exchange.slot_capacity)
        self.exchange = RowExchange([r * self.rows_per_rank for r in range(self.world + 1)], process_group, device,
                                    spread="hashed")
        self.start = self.exchange.start
        try:
            # RECORD §2 "Initialization": the n-gram table starts at zero. One scratch row past the
            # block takes the padding of the fixed exchange (RowExchange.scratch); ``weight`` excludes it.
            self._rows = torch.zeros(self.rows_per_rank + 1, dim, dtype=dtype, device=device)
            self.weight = self._rows[: self.rows_per_rank]
        except (torch.OutOfMemoryError, RuntimeError) as e:
            if not isinstance(e, torch.OutOfMemoryError) and "memory" not in str(e):
                raise
            gib = self.rows_per_rank * dim * torch.finfo(dtype).bits / 8 / 2**30
            raise RuntimeError(
                f"model.gpt.ngram_rows={ngram_rows:,}: this rank's shard needs {gib:.1f} GiB on {device}; "
                f"lower ngram_rows or use more ranks"
            ) from e
        self.adam = LazyRowAdam(self.rows_per_rank, device, state_dtype)
        self.grad_wire_dtype = grad_wire_dtype or dtype
        self.params: list = []  # the table is deliberately not an nn.Parameter: it never gets a .grad
        self._queue = GradientQueue()

    @property
    def device(self) -> torch.device:
        return self.weight.device

    # -- per micro-batch -----------------------------------------------------------
    def pull(self, rows: Tensor, fixed: Optional[bool] = None) -> Tensor:
        """Current values ``[U, D]`` (table dtype) of sorted unique global ``rows``. Collective.

        With the fixed exchange (``fixed``, default: the shard's) ``rows`` are sentinel-padded
        and the padding reads zeros.
        """
        pull = self.exchange.pull_fixed if (self.fixed if fixed is None else fixed) else self.exchange.pull
        return pull(rows.to(self.device), lambda local: self.weight.index_select(0, local))

    def push(self, rows: Tensor, grad: Tensor) -> None:
        """Queue a micro-batch's compact gradient (``grad[:len(rows)]`` belongs to ``rows``)."""
        n = rows.numel()
        if grad.shape[0] < n or grad.shape[-1] != self.dim:
            raise ValueError(f"gradient of shape {tuple(grad.shape)} for {n} rows of width {self.dim}")
        # copied into the cycle's queue: under CUDA graphs the gradient is the graph's buffer,
        # which the next replay overwrites
        self._queue.append(rows.to(self.device), grad[:n].detach())

    def prepare(self, input_ids: Tensor, requires_grad: bool = True, pad_to: Optional[int] = None,
                leaf_dtype: torch.dtype = torch.float32) -> NgramInput:
        """Hash ``input_ids``, pull the unique rows and wrap them as the model's :class:`NgramInput`.

        With the fixed exchange only training reads (``requires_grad``) take the fixed path:
        their buffers must be the same size on every rank, which the plan guarantees for
        training batches; evaluation reads keep exact sizes and may differ across ranks.
        """
        row_ids, sign_rows = ngram_hashes(input_ids, self.ngram_rows, self.hash_backend)
        fixed = self.fixed and requires_grad
        if fixed:
            bound = min(row_ids.numel(), self.ngram_rows)  # the most distinct rows T tokens can touch
            if pad_to is not None and pad_to < bound:
                raise ValueError(f"pad_to={pad_to} is below the {bound} rows a batch of {input_ids.numel()} tokens "
                                 "can touch; the fixed n-gram exchange needs room for all of them")
            unique, index = unique_fixed(row_ids.reshape(-1), pad_to or bound, self.exchange.sentinel)
            index = index.view(row_ids.shape)
        else:
            unique, index = compact_rows(row_ids, pad_to)
        if fixed and self.world == 1:
            # one rank reads its own shard: the fp32 leaf straight from the table (zeros at the padding)
            values = torch.empty(unique.numel(), self.dim, dtype=leaf_dtype, device=self.device)
            gather_rows_(values, self.weight, unique.to(self.device) - self.start, self.rows_per_rank)
            values.requires_grad_(requires_grad)
        else:
            values = padded_leaf(self.pull(unique, fixed), pad_to, leaf_dtype).requires_grad_(requires_grad)
        return NgramInput(values=values, index=index, sign_rows=sign_rows, rows=unique)

    # -- event ---------------------------------------------------------------------
    def pending_rows(self) -> int:
        """Queued gradient rows (with repeats, without padding) waiting for the next event."""
        return sum(int((r < self.exchange.sentinel).sum()) for r, _ in self._queue)

    def merged_gradient(self) -> tuple[Tensor, Tensor]:
        """The cycle's queued gradients segment-summed: (sorted unique global rows, fp32 ``[U, D]``).

        With the fixed exchange the rows are padded with the sentinel to the queue's total length.
        """
        rows, grads = self._merged()
        self._queue.replace(rows, grads)
        return rows, grads

    def _merged(self) -> tuple[Tensor, Tensor]:
        """:meth:`merged_gradient` without holding the result as the queue (the event's use)."""
        if self.fixed and self._queue:
            # the queue read as one padded list: a single micro-batch is merged already
            return merge_compact_fixed([self._queue.whole()], self.exchange.sentinel, force=len(self._queue) > 1)
        return merge_compact(list(self._queue), (0, self.dim), self.device)

    @torch.no_grad()
    def step(self, lr: float, betas: tuple[float, float], eps: float, weight_decay: float) -> None:
        """One event: send the cycle's gradient to the owners and update the touched rows. Collective."""
        if betas[0] != 0.0:
            raise ValueError(
                f"the n-gram table's lazy row Adam needs beta1 = 0 (RECORD §4), got betas={tuple(betas)}; "
                "set model.optim.ngram.betas to [0.0, beta2]"
            )
        if self.fixed and self.world == 1 and self._queue:
            # one rank: no exchange, so the merge folds into the update (each row sums its own
            # terms from the sorted queue; no merged buffer, no atomics)
            rows, src = self._queue.whole()  # the cycle end to end, no concatenation
            seg = segments_fixed(rows, rows.numel(), self.exchange.sentinel)
            local = torch.where(seg.unique < self.exchange.stop, seg.unique - self.start,
                                torch.full_like(seg.unique, self.exchange.scratch))
            self.adam.update_segments_(self._rows, local, src, seg.order, seg.offsets, seg.slot, lr=lr,
                                       beta2=betas[1], eps=eps, weight_decay=weight_decay)
            self._queue.clear()
            return
        rows, grads = self._merged()
        if self.fixed and rows.numel():
            # several ranks: each owner gets every rank's terms of its rows and the row update sums
            # them itself (own request first, then the peers by rank, as the reference adds them),
            # so no summed buffer of W times the queue is built; the mean over ranks is folded in
            local, own, received = self.exchange.send_to_owners_fixed(rows, grads, self.grad_wire_dtype)
            seg = segments_fixed(local, local.numel(), self.exchange.scratch)
            self.adam.update_segments_(self._rows, seg.unique, own, seg.order, seg.offsets, seg.slot, lr=lr,
                                       beta2=betas[1], eps=eps, weight_decay=weight_decay, src2=received,
                                       grad_divisor=self.world)
            self._queue.clear()
            return
        local, merged = self.exchange.reduce_to_owners(rows, grads, self.grad_wire_dtype)
        if self.world > 1:
            merged.div_(self.world)  # the mean over ranks, as the dense optimizers average gradients
        self.adam.update_(self._rows, local, merged, lr=lr, beta2=betas[1], eps=eps, weight_decay=weight_decay)
        self._queue.clear()

    # -- whole-table helpers ---------------------------------------------------------
    def full_table(self) -> Tensor:
        """The whole table ``[ngram_rows, D]`` on every rank (tests and small tables only). Collective."""
        if self.world == 1:
            return self.weight[: self.ngram_rows].clone()
        parts = [torch.empty_like(self.weight) for _ in range(self.world)]
        dist.all_gather(parts, self.weight.contiguous(), group=self.exchange.group)
        return torch.cat(parts)[: self.ngram_rows]

    def pristine(self) -> bool:
        """No event has run and nothing is queued: the table is still all zeros."""
        return self.adam.event == 0 and not self._queue

    @torch.no_grad()
    def reset_(self) -> None:
        """Zero the table and its Adam state (a fresh start, e.g. after untimed warmup steps)."""
        self.weight.zero_()
        self.adam = LazyRowAdam(self.rows_per_rank, self.device, self.adam.dtype, self.adam.fused)
        self._queue.clear(trim=False)

    def state_dict(self) -> dict[str, Any]:
        rows, grads = self.merged_gradient()
        if self.fixed:  # the checkpoint holds the real rows only (a host sync is fine here)
            n = int((rows < self.exchange.sentinel).sum())
            rows, grads = rows[:n], grads[:n]
        return {"format": STATE_FORMAT, "ngram_rows": self.ngram_rows, "world_size": self.world,
                "rank": self.rank, "weight": self.weight, "adam": self.adam.state_dict(),
                "pending_rows": rows, "pending_grad": grads}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["ngram_rows"] != self.ngram_rows or state["world_size"] != self.world:
            raise ValueError(
                f"checkpoint n-gram shard: {state['ngram_rows']:,} rows over {state['world_size']} ranks; this run "
                f"has {self.ngram_rows:,} rows over {self.world} ranks. Resume with the same model.gpt.ngram_rows "
                "and the same number of devices"
            )
        self.weight.copy_(state["weight"])
        self.adam.load_state_dict(state["adam"])
        rows, grads = state["pending_rows"].to(self.device), state["pending_grad"].to(self.device)
        if self.fixed:
            rows, grads = pad_to_common(rows, grads, self.exchange.sentinel, self.exchange.group)
        self._queue.replace(rows, grads)
