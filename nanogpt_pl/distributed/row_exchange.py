"""Sparse row traffic between ranks that own contiguous blocks of a row space.

Both sharded channels (``ngram_shard.NgramShard``, ``value_embed_shard.ValueEmbedShard``)
move rows the same way: a sorted unique row list is partitioned by owner with one
``searchsorted`` on the owner boundaries, then ``all_to_all`` calls move the counts, the
row ids (int32, RECORD §3) and the rows; a rank's own rows never travel (RECORD §3: own
count zeroed). :func:`merge_compact` segment-sums a cycle's queued compact gradients
into one buffer per unique row, so no table-sized buffer is ever built on the sender.
"""

from __future__ import annotations

from collections import Counter
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor


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


def merge_compact(entries: list[tuple[Tensor, Tensor]], empty_shape: tuple[int, ...], device: torch.device,
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
