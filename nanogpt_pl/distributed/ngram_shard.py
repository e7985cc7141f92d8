"""Row-sharded sparse channels: the n-gram table and the value embeddings, with sparse row exchange.

The record's n-gram table (RECORD §3: 84,602,880 rows × 768, 15.13 GiB per rank at 8
ranks) is split into contiguous row blocks, one per rank; no rank holds a replica.
Each micro-batch reads only a few hundred thousand rows, so a step costs what it
touches, not what the table holds:

* **pull** (:meth:`NgramShard.pull`): the caller hashes its tokens, takes the sorted
  unique rows, and asks their owners for them: the rows are partitioned by owner with
  one ``searchsorted`` on the owner boundaries, then three ``all_to_all`` calls move
  the counts, the row ids and the rows; the rank's own rows are read locally.
* **push** (:meth:`NgramShard.push`): after backward the compact ``[U, D]`` gradient of the
  micro-batch is queued. Nothing is communicated.
* **event** (:meth:`NgramShard.step`, on the schedule's sparse steps): the cycle's queued
  gradients are segment-summed into one compact buffer per unique row (never a
  table-sized buffer on the sender), sent to the owners (counts, int32 ids, values),
  and each owner sums what it received into its touched rows only, averages over
  ranks, and runs the lazy row Adam (``nanogpt_pl.optim.sparse_adam``) on exactly
  those rows.

World size 1 runs the same code path without a single collective.

Value embeddings (:class:`ValueEmbedShard`, RECORD §5) are replicated on every rank
(the model's ``value_embeds`` parameters, 4 × 50,304 × 768 in the record) but get the
same compact gradient path: their gradients are exchanged as compact rows to the
owner of each token-id block, the owner runs Adam (β₁ = 0.75) over its block, and the
updated blocks are all-gathered into every replica. (The record instead pulls only the
rows the next cycle reads, which needs the loader's lookahead; the all-gather costs
~300 MB per event at the record's size, i.e. every 4th step.)

Who builds what: the module creates the channels in ``setup`` (through
:func:`build_sparse_channels`) on the strategy's device and process group
(``SpeedrunStrategy.process_group``); the strategy writes their per-rank state to side
files ``<ckpt>.ngram-rank<r>.pt`` (:func:`save_rank_local` / :func:`load_rank_local`) so a
record-size shard never passes through rank 0. With one rank and a small state the
state stays inline in the checkpoint.
"""

from __future__ import annotations

import os
from collections import Counter
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from ..model.embeddings import (
    CompactRows,
    NgramInput,
    check_ngram_rows,
    compact_rows,
    ngram_row_ids,
    ngram_sign_rows,
    padded_leaf,
)
from ..optim.sparse_adam import LazyRowAdam, shard_adam_

# Entry of the checkpoint dict that holds rank-local state (see save_rank_local).
RANK_LOCAL_KEY = "sparse_rank_local"
# Up to this size, a single rank's state stays inline in the main checkpoint file.
INLINE_STATE_LIMIT_BYTES = 256 << 20
STATE_FORMAT = 1


def dist_world_rank(process_group: Optional[dist.ProcessGroup] = None) -> tuple[int, int]:
    """(world size, rank) of ``process_group``; (1, 0) without torch.distributed."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1, 0
    return dist.get_world_size(process_group), dist.get_rank(process_group)


class RowExchange:
    """Sparse row traffic between ranks that own contiguous blocks of a row space.

    Args:
        boundaries: ``world + 1`` increasing row ids; rank r owns ``[boundaries[r], boundaries[r+1])``.
        process_group: the ranks (None = the default group).

    Attributes:
        bytes_sent: bytes this rank sent to other ranks, by kind (for the benchmark).
        bytes_received: bytes this rank received from other ranks, by kind.
    """

    def __init__(self, boundaries: list[int], process_group: Optional[dist.ProcessGroup] = None) -> None:
        self.world, self.rank = dist_world_rank(process_group)
        if len(boundaries) != self.world + 1:
            raise ValueError(f"{len(boundaries)} boundaries for {self.world} ranks")
        self.group = process_group
        self.boundaries = [int(b) for b in boundaries]
        self.start, self.stop = self.boundaries[self.rank], self.boundaries[self.rank + 1]
        # RECORD §3: row ids travel as int32 (the record's 84.6M rows fit easily).
        self.id_dtype = torch.int32 if self.boundaries[-1] < 2**31 else torch.int64
        self.bytes_sent: Counter = Counter()
        self.bytes_received: Counter = Counter()
        self._bounds: dict[torch.device, Tensor] = {}

    def owner_counts(self, rows: Tensor) -> list[int]:
        """Rows per owner of a sorted row list (one searchsorted on the owner boundaries)."""
        bounds = self._bounds.get(rows.device)
        if bounds is None:
            bounds = self._bounds[rows.device] = torch.tensor(self.boundaries, dtype=torch.int64, device=rows.device)
        cut = torch.searchsorted(rows, bounds)
        return (cut[1:] - cut[:-1]).tolist()

    def _exchange_counts(self, send_counts: list[int], device: torch.device, kind: str) -> list[int]:
        send = torch.tensor(send_counts, dtype=torch.int64, device=device)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)
        self.bytes_sent[kind + "_counts"] += 8 * (self.world - 1)
        self.bytes_received[kind + "_counts"] += 8 * (self.world - 1)
        return recv.tolist()

    def _all_to_all(self, send: Tensor, send_counts: list[int], recv_counts: list[int], kind: str) -> Tensor:
        recv = torch.empty((sum(recv_counts), *send.shape[1:]), dtype=send.dtype, device=send.device)
        dist.all_to_all_single(recv, send.contiguous(), recv_counts, send_counts, group=self.group)
        self.bytes_sent[kind] += send.numel() * send.element_size()
        self.bytes_received[kind] += recv.numel() * recv.element_size()
        return recv

    def _plan(self, rows: Tensor, kind: str) -> tuple[int, int, list[int], list[int]]:
        counts = self.owner_counts(rows)
        lo = sum(counts[: self.rank])
        hi = lo + counts[self.rank]
        counts[self.rank] = 0  # own rows never travel (RECORD §3: own count zeroed)
        return lo, hi, counts, self._exchange_counts(counts, rows.device, kind)

    def pull(self, rows: Tensor, read_local: Callable[[Tensor], Tensor]) -> Tensor:
        """Values of ``rows`` (sorted, unique, global) from their owners, in the order of ``rows``.

        ``read_local(local_rows)`` returns this rank's rows ``[n, D]`` for local indices.
        Collective: every rank of the group must call it (possibly with no rows).
        """
        if self.world == 1:
            return read_local(rows - self.start)
        lo, hi, send_counts, recv_counts = self._plan(rows, "pull")
        send_ids = torch.cat([rows[:lo], rows[hi:]]).to(self.id_dtype)
        wanted = self._all_to_all(send_ids, send_counts, recv_counts, "pull_ids")
        served = read_local(wanted.long() - self.start)
        got = self._all_to_all(served, recv_counts, send_counts, "pull_values")
        own = read_local(rows[lo:hi] - self.start)
        return torch.cat([got[:lo], own.to(got.dtype), got[lo:]])

    def reduce_to_owners(self, rows: Tensor, values: Tensor,
                         wire_dtype: Optional[torch.dtype] = None) -> tuple[Tensor, Tensor]:
        """Sum every rank's ``values`` of ``rows`` at the rows' owners.

        ``rows`` are sorted and unique on each rank; returns this rank's touched rows as
        sorted unique *local* indices and their fp32 sums over ranks. Collective.
        """
        if self.world == 1:
            return rows - self.start, values.float()
        lo, hi, send_counts, recv_counts = self._plan(rows, "push")
        wire = wire_dtype or values.dtype
        send_ids = torch.cat([rows[:lo], rows[hi:]]).to(self.id_dtype)
        send_vals = torch.cat([values[:lo], values[hi:]]).to(wire)
        recv_ids = self._all_to_all(send_ids, send_counts, recv_counts, "push_ids")
        recv_vals = self._all_to_all(send_vals, send_counts, recv_counts, "push_values")
        local = torch.cat([rows[lo:hi], recv_ids.long()]) - self.start
        vals = torch.cat([values[lo:hi].float(), recv_vals.float()])
        unique, inverse = torch.unique(local, sorted=True, return_inverse=True)
        merged = torch.zeros(unique.numel(), values.shape[-1], dtype=torch.float32, device=values.device)
        merged.index_add_(0, inverse, vals)
        return unique, merged

    def reset_counters(self) -> None:
        self.bytes_sent.clear()
        self.bytes_received.clear()


def _merge_compact(entries: list[tuple[Tensor, Tensor]], empty_shape: tuple[int, ...], device: torch.device,
                   row_dim: int = 0) -> tuple[Tensor, Tensor]:
    """Segment-sum queued (rows, grad) pairs into (sorted unique rows, fp32 sums along ``row_dim``)."""
    if not entries:
        return torch.zeros(0, dtype=torch.int64, device=device), torch.zeros(empty_shape, device=device)
    if len(entries) == 1:  # already one compact buffer (a single micro-batch, or the merged queue)
        rows, grads = entries[0]
        return rows, grads.float()
    rows = torch.cat([r for r, _ in entries])
    grads = torch.cat([g.float() for _, g in entries], dim=row_dim)
    unique, inverse = torch.unique(rows, sorted=True, return_inverse=True)
    shape = list(grads.shape)
    shape[row_dim] = unique.numel()
    merged = torch.zeros(shape, dtype=torch.float32, device=grads.device)
    merged.index_add_(row_dim, inverse, grads)
    return unique, merged


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
    """

    def __init__(self, ngram_rows: int, dim: int, process_group: Optional[dist.ProcessGroup] = None,
                 device: Optional[torch.device | str] = None, dtype: Optional[torch.dtype] = None,
                 grad_wire_dtype: Optional[torch.dtype] = None, state_dtype: torch.dtype = torch.float32) -> None:
        check_ngram_rows(ngram_rows)
        self.ngram_rows, self.dim = ngram_rows, dim
        self.world, self.rank = dist_world_rank(process_group)
        device = torch.device(device if device is not None else "cpu")
        if dtype is None:
            dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        self.rows_per_rank = -(-ngram_rows // self.world)
        self.exchange = RowExchange([r * self.rows_per_rank for r in range(self.world + 1)], process_group)
        self.start = self.exchange.start
        try:
            # RECORD §2 "Initialization": the n-gram table starts at zero.
            self.weight = torch.zeros(self.rows_per_rank, dim, dtype=dtype, device=device)
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
        self._queue: list[tuple[Tensor, Tensor]] = []

    @property
    def device(self) -> torch.device:
        return self.weight.device

    # -- per micro-batch -----------------------------------------------------------
    def pull(self, rows: Tensor) -> Tensor:
        """Current values ``[U, D]`` (table dtype) of sorted unique global ``rows``. Collective."""
        return self.exchange.pull(rows.to(self.device), lambda local: self.weight.index_select(0, local))

    def push(self, rows: Tensor, grad: Tensor) -> None:
        """Queue a micro-batch's compact gradient (``grad[:len(rows)]`` belongs to ``rows``)."""
        n = rows.numel()
        if grad.shape[0] < n or grad.shape[-1] != self.dim:
            raise ValueError(f"gradient of shape {tuple(grad.shape)} for {n} rows of width {self.dim}")
        self._queue.append((rows.to(self.device), grad[:n].detach()))

    def prepare(self, input_ids: Tensor, requires_grad: bool = True, pad_to: Optional[int] = None,
                leaf_dtype: torch.dtype = torch.float32) -> NgramInput:
        """Hash ``input_ids``, pull the unique rows and wrap them as the model's :class:`NgramInput`."""
        row_ids = ngram_row_ids(input_ids, self.ngram_rows)
        unique, index = compact_rows(row_ids, pad_to)
        values = padded_leaf(self.pull(unique), pad_to, leaf_dtype).requires_grad_(requires_grad)
        return NgramInput(values=values, index=index, sign_rows=ngram_sign_rows(input_ids), rows=unique)

    # -- event ---------------------------------------------------------------------
    def pending_rows(self) -> int:
        """Queued gradient rows (with repeats) waiting for the next event."""
        return sum(r.numel() for r, _ in self._queue)

    def merged_gradient(self) -> tuple[Tensor, Tensor]:
        """The cycle's queued gradients segment-summed: (sorted unique global rows, fp32 ``[U, D]``)."""
        rows, grads = _merge_compact(self._queue, (0, self.dim), self.device)
        self._queue = [(rows, grads)] if rows.numel() else []
        return rows, grads

    @torch.no_grad()
    def step(self, lr: float, betas: tuple[float, float], eps: float, weight_decay: float) -> None:
        """One event: send the cycle's gradient to the owners and update the touched rows. Collective."""
        if betas[0] != 0.0:
            raise ValueError(
                f"the n-gram table's lazy row Adam needs beta1 = 0 (RECORD §4), got betas={tuple(betas)}; "
                "set model.optim.ngram.betas to [0.0, beta2]"
            )
        rows, grads = self.merged_gradient()
        local, merged = self.exchange.reduce_to_owners(rows, grads, self.grad_wire_dtype)
        if self.world > 1:
            merged.div_(self.world)  # the mean over ranks, as the dense optimizers average gradients
        self.adam.update_(self.weight, local, merged, lr=lr, beta2=betas[1], eps=eps, weight_decay=weight_decay)
        self._queue = []

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
        self.adam = LazyRowAdam(self.rows_per_rank, self.device, self.adam.dtype)
        self._queue = []

    def state_dict(self) -> dict[str, Any]:
        rows, grads = self.merged_gradient()
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
        rows = state["pending_rows"].to(self.device)
        self._queue = [(rows, state["pending_grad"].to(self.device))] if rows.numel() else []


class ValueEmbedShard:
    """Value-embedding planes: replicated tables, compact gradients, owner-sharded Adam.

    Row ``x·P + p`` stands for token ``x`` of plane ``p`` (P planes), so the owner of token
    block ``[r·c, (r+1)·c)`` (``c = ceil(V / W)``) owns one contiguous block of that row space.

    Args:
        tables: the P value-embedding tables ``[V, D]`` (the model's parameters; updated in place).
        process_group: ranks sharing them.
        grad_wire_dtype: dtype of gradient rows on the wire (default: the tables' dtype).
    """

    def __init__(self, tables: list[Tensor], process_group: Optional[dist.ProcessGroup] = None,
                 grad_wire_dtype: Optional[torch.dtype] = None) -> None:
        if not tables:
            raise ValueError("ValueEmbedShard needs at least one table")
        shapes = {tuple(t.shape) for t in tables}
        if len(shapes) != 1:
            raise ValueError(f"value-embedding tables differ in shape: {sorted(shapes)}")
        self.params = list(tables)
        self.planes = len(tables)
        self.vocab, self.dim = tables[0].shape
        self.world, self.rank = dist_world_rank(process_group)
        self.tokens_per_rank = -(-self.vocab // self.world)
        self.lo = min(self.vocab, self.rank * self.tokens_per_rank)
        self.hi = min(self.vocab, self.lo + self.tokens_per_rank)
        self.exchange = RowExchange(
            [r * self.tokens_per_rank * self.planes for r in range(self.world + 1)], process_group
        )
        self.grad_wire_dtype = grad_wire_dtype
        self.exp_avg: Optional[Tensor] = None  # [P, hi - lo, D] fp32, allocated at the first event
        self.exp_avg_sq: Optional[Tensor] = None
        self.step_count = 0
        self._queue: list[tuple[Tensor, Tensor]] = []

    @property
    def device(self) -> torch.device:
        return self.params[0].device

    def prepare(self, input_ids: Tensor, requires_grad: bool = True, pad_to: Optional[int] = None,
                leaf_dtype: torch.dtype = torch.float32) -> CompactRows:
        """Gather every plane at the unique ids of ``input_ids`` as the model's :class:`CompactRows`."""
        ids, index = compact_rows(input_ids.long(), pad_to)
        values = torch.stack([t.detach().index_select(0, ids) for t in self.params])
        return CompactRows(values=padded_leaf(values, pad_to, leaf_dtype).requires_grad_(requires_grad),
                           index=index, ids=ids)

    def push(self, ids: Tensor, grad: Tensor) -> None:
        """Queue a micro-batch's compact gradient ``[P, U (+ padding), D]`` of the sorted unique ``ids``."""
        n = ids.numel()
        if grad.shape[0] != self.planes or grad.shape[1] < n:
            raise ValueError(f"gradient of shape {tuple(grad.shape)} for {self.planes} planes x {n} ids")
        self._queue.append((ids.to(self.device), grad[:, :n].detach()))

    def merged_gradient(self) -> tuple[Tensor, Tensor]:
        ids, grads = _merge_compact(self._queue, (self.planes, 0, self.dim), self.device, row_dim=1)
        self._queue = [(ids, grads)] if ids.numel() else []
        return ids, grads

    def _ensure_state(self) -> None:
        if self.exp_avg is None:
            shape = (self.planes, self.hi - self.lo, self.dim)
            self.exp_avg = torch.zeros(shape, dtype=torch.float32, device=self.device)
            self.exp_avg_sq = torch.zeros(shape, dtype=torch.float32, device=self.device)

    @torch.no_grad()
    def step(self, lr: float, betas: tuple[float, float], eps: float, weight_decay: float) -> None:
        """One event: owners merge the cycle's rows, run Adam over their block, share it. Collective."""
        ids, grads = self.merged_gradient()
        rows = (ids[:, None] * self.planes + torch.arange(self.planes, device=ids.device)).reshape(-1)
        values = grads.permute(1, 0, 2).reshape(-1, self.dim)
        local, merged = self.exchange.reduce_to_owners(rows, values, self.grad_wire_dtype)
        if self.world > 1:
            merged.div_(self.world)
        self._ensure_state()
        self.step_count += 1
        plane, token = local % self.planes, local // self.planes
        for p, table in enumerate(self.params):
            sel = plane == p
            shard_adam_(table.data[self.lo : self.hi], self.exp_avg[p], self.exp_avg_sq[p], token[sel], merged[sel],
                        self.step_count, lr, betas, eps, weight_decay)
        self._queue = []
        if self.world > 1:
            self._share_blocks()

    def _share_blocks(self) -> None:
        c = self.tokens_per_rank
        own = torch.zeros(self.planes, c, self.dim, dtype=self.params[0].dtype, device=self.device)
        for p, table in enumerate(self.params):
            own[p, : self.hi - self.lo] = table.data[self.lo : self.hi]
        blocks = [torch.empty_like(own) for _ in range(self.world)]
        dist.all_gather(blocks, own, group=self.exchange.group)
        self.exchange.bytes_sent["gather_values"] += own.numel() * own.element_size() * (self.world - 1)
        self.exchange.bytes_received["gather_values"] += own.numel() * own.element_size() * (self.world - 1)
        for r, block in enumerate(blocks):
            lo, hi = min(self.vocab, r * c), min(self.vocab, (r + 1) * c)
            if r != self.rank and hi > lo:
                for p, table in enumerate(self.params):
                    table.data[lo:hi].copy_(block[p, : hi - lo])

    def pristine(self) -> bool:
        """No event has run and nothing is queued (the tables themselves belong to the model)."""
        return self.step_count == 0 and not self._queue

    @torch.no_grad()
    def reset_(self) -> None:
        """Drop the Adam state and queued gradients (the tables belong to the model)."""
        self.exp_avg = self.exp_avg_sq = None
        self.step_count = 0
        self._queue = []

    def state_dict(self) -> dict[str, Any]:
        ids, grads = self.merged_gradient()
        return {"format": STATE_FORMAT, "world_size": self.world, "rank": self.rank, "step": self.step_count,
                "exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq, "pending_ids": ids, "pending_grad": grads}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["world_size"] != self.world:
            raise ValueError(
                f"checkpoint value-embedding Adam state is sharded over {state['world_size']} ranks, this run has "
                f"{self.world}; resume with the same number of devices"
            )
        self.step_count = int(state["step"])
        if state["exp_avg"] is None:
            self.exp_avg = self.exp_avg_sq = None
        else:
            self._ensure_state()
            self.exp_avg.copy_(state["exp_avg"])
            self.exp_avg_sq.copy_(state["exp_avg_sq"])
        ids = state["pending_ids"].to(self.device)
        self._queue = [(ids, state["pending_grad"].to(self.device))] if ids.numel() else []


class SparseChannels:
    """The module's view of the sparse channels: per-micro-batch inputs and gradient hand-back.

    Args:
        ngram: this rank's n-gram shard (None = no n-gram channel).
        value_embeds: the value-embedding channel (None = value embeddings take the dense path).
        fixed_shapes: pad the compact leaves to their upper bound (2T n-gram rows, min(T, V)
            ids) so a compiled model sees one shape per sequence length.
    """

    def __init__(self, ngram: Optional[NgramShard] = None, value_embeds: Optional[ValueEmbedShard] = None,
                 fixed_shapes: bool = False) -> None:
        self.ngram = ngram
        self.value_embeds = value_embeds
        self.fixed_shapes = fixed_shapes

    def channels(self) -> dict[str, Any]:
        """name -> channel, for :class:`~nanogpt_pl.optim.sparse_adam.SparseAdam`."""
        out: dict[str, Any] = {}
        if self.ngram is not None:
            out["ngram"] = self.ngram
        if self.value_embeds is not None:
            out["value_embeds"] = self.value_embeds
        return out

    def inputs(self, input_ids: Tensor, train: bool) -> dict[str, Any]:
        """Keyword arguments of ``GPT.forward`` for one micro-batch (``ngram``, ``value_rows``). Collective."""
        n = input_ids.numel()
        out: dict[str, Any] = {}
        with torch.no_grad():
            if self.ngram is not None:
                pad = 2 * n if (train and self.fixed_shapes) else None
                out["ngram"] = self.ngram.prepare(input_ids, requires_grad=train, pad_to=pad)
            if self.value_embeds is not None:
                pad = min(n, self.value_embeds.vocab) if (train and self.fixed_shapes) else None
                out["value_rows"] = self.value_embeds.prepare(input_ids, requires_grad=train, pad_to=pad)
        return out

    def push_grads(self, inputs: dict[str, Any]) -> None:
        """Queue the compact gradients the last backward left on the inputs' leaves."""
        ngram: Optional[NgramInput] = inputs.get("ngram")
        if ngram is not None and ngram.values.grad is not None:
            self.ngram.push(ngram.rows, ngram.values.grad)
        rows: Optional[CompactRows] = inputs.get("value_rows")
        if rows is not None and rows.values.grad is not None:
            self.value_embeds.push(rows.ids, rows.values.grad)

    def pristine(self) -> bool:
        """Whether every channel is in its initial state (nothing to save for a reset)."""
        return all(channel.pristine() for channel in self.channels().values())

    def reset_(self) -> None:
        """Return every channel to its initial state (zero table, no optimizer state, empty queues)."""
        for channel in self.channels().values():
            channel.reset_()

    def state_dict(self) -> dict[str, Any]:
        return {name: channel.state_dict() for name, channel in self.channels().items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if set(state) != set(self.channels()):
            raise ValueError(
                f"checkpoint sparse channels {sorted(state)} differ from this run's {sorted(self.channels())}; "
                "model.gpt.ngram_rows and model.optim.sparse_value_embeds must match the checkpoint's"
            )
        for name, channel in self.channels().items():
            channel.load_state_dict(state[name])


def build_sparse_channels(model: torch.nn.Module, process_group: Optional[dist.ProcessGroup],
                          device: torch.device, sparse_value_embeds: bool = True,
                          fixed_shapes: bool = False) -> Optional[SparseChannels]:
    """The channels a GPT needs (None when it has neither an n-gram table nor sparse value embeddings)."""
    cfg = model.cfg
    ngram = NgramShard(cfg.ngram_rows, cfg.model_dim, process_group, device) if cfg.ngram_rows else None
    ve = None
    if sparse_value_embeds and len(model.value_embeds):
        ve = ValueEmbedShard(list(model.value_embeds), process_group)
    if ngram is None and ve is None:
        return None
    return SparseChannels(ngram, ve, fixed_shapes)


# -- per-rank checkpoint side files ---------------------------------------------------
def rank_file(filepath: str | os.PathLike, rank: int) -> str:
    """The side file holding rank ``rank``'s sparse state next to checkpoint ``filepath``."""
    return f"{os.fspath(filepath)}.ngram-rank{rank}.pt"


def _tensor_bytes(obj: Any) -> int:
    if isinstance(obj, Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


def save_rank_local(checkpoint: dict[str, Any], filepath: str | os.PathLike, rank: int, world_size: int,
                    inline_limit: Optional[int] = None) -> dict[str, Any]:
    """Write this rank's ``checkpoint[RANK_LOCAL_KEY]`` to its side file; return the dict for the main file.

    Called on every rank. With one rank and a state under ``inline_limit`` bytes the
    state stays inline; otherwise each rank writes ``<filepath>.ngram-rank<r>.pt`` itself
    and the main checkpoint keeps only a marker with the world size. ``inline_limit``
    defaults to :data:`INLINE_STATE_LIMIT_BYTES`.
    """
    state = checkpoint.get(RANK_LOCAL_KEY)
    limit = INLINE_STATE_LIMIT_BYTES if inline_limit is None else inline_limit
    if state is None or (world_size == 1 and _tensor_bytes(state) <= limit):
        return checkpoint
    path = rank_file(filepath, rank)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    torch.save(state, tmp)
    os.replace(tmp, path)
    out = dict(checkpoint)
    out[RANK_LOCAL_KEY] = {"side_files": True, "world_size": world_size}
    return out


def load_rank_local(checkpoint: dict[str, Any], filepath: str | os.PathLike, rank: int,
                    world_size: int) -> dict[str, Any]:
    """Put this rank's side-file state back into ``checkpoint[RANK_LOCAL_KEY]`` (no-op for inline state)."""
    entry = checkpoint.get(RANK_LOCAL_KEY)
    if not (isinstance(entry, dict) and entry.get("side_files")):
        return checkpoint
    if entry["world_size"] != world_size:
        raise ValueError(
            f"checkpoint {filepath} holds sparse state sharded over {entry['world_size']} ranks; this run has "
            f"{world_size}. Resume with --trainer.devices/num_nodes giving {entry['world_size']} ranks"
        )
    path = rank_file(filepath, rank)
    if not os.path.exists(path):
        real = rank_file(os.path.realpath(filepath), rank)  # a 'last' link points at the real file
        if not os.path.exists(real):
            raise FileNotFoundError(
                f"checkpoint {filepath} keeps rank {rank}'s n-gram/value-embedding state in {path}, which is "
                "missing; copy every .ngram-rank*.pt file along with the checkpoint"
            )
        path = real
    out = dict(checkpoint)
    out[RANK_LOCAL_KEY] = torch.load(path, map_location="cpu", weights_only=True)
    return out


def remove_rank_local(filepath: str | os.PathLike, rank: int) -> None:
    """Delete this rank's side file of ``filepath`` if it exists."""
    path = rank_file(filepath, rank)
    if os.path.exists(path):
        os.remove(path)
