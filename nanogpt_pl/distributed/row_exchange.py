"""Sparse row traffic between ranks that own contiguous blocks of a row space.

Both sharded channels (``ngram_shard.NgramShard``, ``value_embed_shard.ValueEmbedShard``)
move rows the same way: a sorted unique row list is partitioned by owner with one
``searchsorted`` on the owner boundaries, then ``all_to_all`` calls move the counts, the
row ids (int32, RECORD §3) and the rows; a rank's own rows never travel (RECORD §3: own
count zeroed). :func:`merge_compact` segment-sums a cycle's queued compact gradients
into one buffer per unique row, so no table-sized buffer is ever built on the sender.

Two exchanges do this:

* ``reference`` (:meth:`RowExchange.pull`, :meth:`RowExchange.reduce_to_owners`,
  :func:`merge_compact`): exact sizes. ``torch.unique`` and the per-owner counts are
  read on the host to size the ``all_to_all`` splits, which forces a device -> host
  sync per call.
* ``fixed`` (:meth:`RowExchange.pull_fixed`, :meth:`RowExchange.reduce_to_owners_fixed` and
  :meth:`RowExchange.send_to_owners_fixed`, :func:`merge_compact_fixed`): every buffer has a
  capacity known from the batch plan before the step runs, so nothing is read back.
  Deduplication is a sort plus segment marks (:func:`unique_fixed`) into a buffer of that
  capacity, padded with a sentinel row id that sorts after every real row and belongs to
  no owner. Each destination gets
  a slot of ``S`` rows, so every ``all_to_all`` has equal, host-known splits. By default
  ``S = C`` (a rank can ask one owner for at most all of its ``C`` rows). Where the row
  ids are hashes (the n-gram table, RECORD §3: ``spread="hashed"``), a request's
  distinct rows fall on the owners' blocks as a binomial draw, and ``S`` is
  :func:`slot_capacity`: the largest block's share of ``C`` plus :data:`SLOT_SIGMAS`
  standard deviations (at 8 ranks and ``C = 2T`` at stage 2, 13,389 slots instead of
  98,304). A request that overflows a slot stops the run with a device-side assert that
  names the fix (never a dropped row). The receiver maps
  the sentinel to its local *scratch row* (index = its block size), one spare row the
  shard and its optimizer state keep past their block, so padded entries read, add and
  write somewhere harmless without a data-dependent mask. Real rows come out bit for bit
  as in ``reference``: the same values move, and every row's gradient terms are added in
  the same order (own rows first, then the peers in rank order).

  Memory bound of the fixed exchange, per call and per direction: ``W·S`` ids and
  ``W·S`` rows of ``D`` values (``C`` = capacity from the plan, ``S`` the slot, W ranks),
  never anything sized by the table. For the n-gram pull ``C = 2T`` (T tokens of the
  rank's micro-batch; RECORD §9: T = 49,152 in stage 2, so 8 · 13,389 · 768 bf16 = 165 MB
  at the record's size, against 1.2 GB with full slots); for an event ``C`` is the
  cycle's merged rows.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Callable, NamedTuple, Optional

import torch
import torch.distributed as dist
from torch import Tensor

# Ways to move rows (see the module docstring); "reference" keeps exact sizes.
EXCHANGES = ("reference", "fixed")
# How a request's rows fall on the owners: "any" (a rank may ask one owner for everything) or
# "hashed" (uniform over the row space, as hashed n-gram rows are: slots of slot_capacity).
SPREADS = ("any", "hashed")
# A hashed request's slot per destination: the largest block's mean share plus this many standard
# deviations of a binomial draw, plus SLOT_MARGIN. The chance that one draw passes 10 deviations
# is below 1e-23, so a run's millions of draws never reach it unless the rows are not hashes.
SLOT_SIGMAS = 10.0
SLOT_MARGIN = 64
OVERFLOW_MESSAGE = ("fixed row exchange: one rank's request overflowed its slot at an owner (its rows are "
                    "not spread as hashes); set model.optim.sparse_exchange: reference (exact sizes)")


def check_spread(spread: str) -> None:
    if spread not in SPREADS:
        raise ValueError(f"row exchange spread={spread!r}: choose one of {SPREADS}")


def slot_capacity(capacity: int, boundaries: list[int], spread: str = "hashed") -> int:
    """Slots per destination for a request of at most ``capacity`` distinct rows.

    ``spread="any"``: ``capacity`` (one owner may get all of it). ``"hashed"``: the rows are
    uniform over ``[boundaries[0], boundaries[-1])``, so owner r gets Binomial(n, p_r) of n ≤
    ``capacity`` rows (p_r its block's share); the slot is the largest block's mean share of
    ``capacity`` plus :data:`SLOT_SIGMAS` standard deviations and :data:`SLOT_MARGIN`, at most
    ``capacity``. One rank: ``capacity``.
    """
    check_spread(spread)
    world = len(boundaries) - 1
    if spread == "any" or world == 1 or capacity == 0:
        return capacity
    share = max(b - a for a, b in zip(boundaries, boundaries[1:])) / (boundaries[-1] - boundaries[0])
    sd = math.sqrt(capacity * share * (1.0 - share))
    return min(capacity, math.ceil(capacity * share + SLOT_SIGMAS * sd) + SLOT_MARGIN)


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
        device: where the rows live (the owner boundaries are put there once, so no step
            copies them from the host).
        spread: how requests fall on the owners, for the fixed exchange's slots
            (:func:`slot_capacity`): ``"any"`` (full slots) or ``"hashed"``.

    Attributes:
        bytes_sent: bytes this rank sent to other ranks, by kind (for the benchmark).
        bytes_received: bytes this rank received from other ranks, by kind.
    """

    def __init__(self, boundaries: list[int], process_group: Optional[dist.ProcessGroup] = None,
                 device: Optional[torch.device] = None, spread: str = "any") -> None:
        check_spread(spread)
        self.spread = spread
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
        if device is not None:
            device = torch.device(device)
            self._bounds[device] = torch.tensor(self.boundaries, dtype=torch.int64, device=device)

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

    # -- fixed-capacity exchange (no host sync) ---------------------------------------
    @property
    def sentinel(self) -> int:
        """Padding row id: sorts after every real row and belongs to no rank."""
        return self.boundaries[-1]

    @property
    def scratch(self) -> int:
        """Local index the sentinel maps to at every owner: one spare row past this rank's block."""
        return self.stop - self.start

    def slots(self, capacity: int) -> int:
        """Slots per destination of the fixed exchange for a request of ``capacity`` rows."""
        return slot_capacity(capacity, self.boundaries, self.spread)

    def _slots(self, rows: Tensor) -> tuple[Tensor, Tensor, Tensor, int]:
        """(owner, destination slot in a ``[W·S]`` send buffer, valid, S) of sorted sentinel-padded ``rows``.

        Padding gets slot ``W·S``, one past the buffer (callers allocate one spare entry). A real
        row past its owner's ``S`` slots trips a device-side assert (:data:`OVERFLOW_MESSAGE`);
        it is sent nowhere meanwhile.
        """
        bounds = self._bounds.get(rows.device)
        if bounds is None:
            bounds = self._bounds[rows.device] = torch.tensor(self.boundaries, dtype=torch.int64, device=rows.device)
        per = self.slots(rows.numel())
        owner = torch.searchsorted(bounds[1:], rows, right=True)  # == W for the sentinel
        valid = owner < self.world
        owner = owner.clamp(max=self.world - 1)
        cut = torch.searchsorted(rows, bounds[:-1])  # first position of each owner's rows (rows are sorted)
        pos = torch.arange(rows.numel(), device=rows.device) - cut.index_select(0, owner)
        if per < rows.numel():
            fits = pos < per
            torch._assert_async(~(valid & ~fits).any(), OVERFLOW_MESSAGE)
            valid = valid & fits
        slot = torch.where(valid, owner * per + pos, torch.full_like(pos, self.world * per))
        return owner, slot, valid, per

    def _scatter_to_slots(self, slot: Tensor, src: Tensor, fill: float | int, per: int) -> Tensor:
        """``[W·S, ...]`` buffer with ``src[i]`` at ``slot[i]`` and ``fill`` elsewhere (padding dropped)."""
        buf = torch.full((self.world * per + 1, *src.shape[1:]), fill, dtype=src.dtype, device=src.device)
        buf.index_copy_(0, slot, src)  # every padding entry lands on the spare last entry
        return buf[:-1]

    def _count(self, kind: str, buf: Tensor) -> None:
        # what leaves the rank: every slot but its own
        peer = buf.numel() * buf.element_size() * (self.world - 1) // self.world
        self.bytes_sent[kind] += peer
        self.bytes_received[kind] += peer

    def pull_fixed(self, rows: Tensor, read_local: Callable[[Tensor], Tensor]) -> Tensor:
        """Values ``[C, D]`` of sorted sentinel-padded ``rows`` ``[C]``; zeros at the padding. Collective.

        ``read_local(local_rows)`` returns this rank's rows ``[n, D]`` for local indices.
        No device -> host sync: every size is ``C`` or ``W·S``.
        """
        if self.world == 1:
            valid = rows < self.stop
            values = read_local(torch.where(valid, rows - self.start, torch.zeros_like(rows)))
            return torch.where(valid.unsqueeze(-1), values, torch.zeros((), dtype=values.dtype, device=values.device))
        _, slot, valid, per = self._slots(rows)
        send_ids = self._scatter_to_slots(slot, rows.to(self.id_dtype), -1, per)
        wanted = torch.empty_like(send_ids)
        dist.all_to_all_single(wanted, send_ids, group=self.group)
        self._count("pull_ids", send_ids)
        asked = wanted >= 0
        local = torch.where(asked, wanted.long() - self.start, torch.zeros_like(wanted, dtype=torch.int64))
        served = read_local(local).contiguous()
        got = torch.empty_like(served)
        dist.all_to_all_single(got, served, group=self.group)
        self._count("pull_values", served)
        values = got.index_select(0, slot.clamp(max=self.world * per - 1))
        return torch.where(valid.unsqueeze(-1), values, torch.zeros((), dtype=values.dtype, device=values.device))

    def reduce_to_owners_fixed(self, rows: Tensor, values: Tensor,
                               wire_dtype: Optional[torch.dtype] = None) -> tuple[Tensor, Tensor]:
        """Sum every rank's ``values`` ``[C, D]`` of sorted sentinel-padded ``rows`` ``[C]`` at the owners.

        Returns ``(local, sums)``, ``[C + W·S]`` and ``[C + W·S, D]`` fp32 (``[C]`` on one rank):
        this rank's touched rows as sorted unique local indices, padded with :attr:`scratch`,
        and their sums over ranks. Collective; no device -> host sync.
        """
        if self.world == 1:
            local = torch.where(rows < self.stop, rows - self.start, torch.full_like(rows, self.scratch))
            return local, values.float()
        local, own, received = self.send_to_owners_fixed(rows, values, wire_dtype)
        return merge_compact_fixed([(local, torch.cat([own.float(), received.float()]))], self.scratch, force=True)

    def send_to_owners_fixed(self, rows: Tensor, values: Tensor,
                             wire_dtype: Optional[torch.dtype] = None) -> tuple[Tensor, Tensor, Tensor]:
        """The terms of :meth:`reduce_to_owners_fixed` at the owner, not yet summed. Collective.

        Returns ``(local [C + W·S], own [C, D], received [W·S, D])``: ``local[i]`` is the local
        row (or :attr:`scratch`, a term of no row) of the ``i``-th term of ``own`` followed by
        ``received``. ``own`` is this rank's whole request at full precision (rows of other
        owners point at the scratch row); ``received`` is every rank's slot for this owner in
        rank order, in the wire dtype, with this rank's own slot pointing at the scratch row (its
        terms are the ``own`` ones). Summing each row's terms in this order (own first, then the
        peers by rank) gives :meth:`reduce_to_owners`'s sums bit for bit; a consumer that sums
        them itself (``LazyRowAdam.update_segments_``) needs no summed buffer and no copy.
        """
        owner, slot, _, per = self._slots(rows)
        wire = wire_dtype or values.dtype
        send_ids = self._scatter_to_slots(slot, rows.to(self.id_dtype), -1, per)
        send_vals = self._scatter_to_slots(slot, values.to(wire), 0, per)
        recv_ids, recv_vals = torch.empty_like(send_ids), torch.empty_like(send_vals)
        dist.all_to_all_single(recv_ids, send_ids, group=self.group)
        dist.all_to_all_single(recv_vals, send_vals, group=self.group)
        self._count("push_ids", send_ids)
        self._count("push_values", send_vals)
        # the whole own request stands in for the own slot: rows of other owners go to the scratch row
        mine = owner.eq(self.rank) & (rows < self.sentinel)
        own_local = (rows - self.start).masked_fill(~mine, self.scratch)
        peer_local = (recv_ids.long() - self.start).masked_fill(recv_ids < 0, self.scratch)
        peer_local.view(self.world, per)[self.rank].fill_(self.scratch)  # the own slot: already in ``own``
        return torch.cat([own_local, peer_local]), values, recv_vals

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


INT32_MAX = torch.iinfo(torch.int32).max


def sort_values(values: Tensor, fill: int) -> tuple[Tensor, Tensor]:
    """``torch.sort(values, stable=True)`` of 1-D row ids no larger than ``fill``, keys as narrow as fit.

    The sort is a radix sort on the GPU, one pass per 8 bits of the key: int64 ids whose
    largest value ``fill`` fits in int32 (every table here) sort as int32 keys in half the
    passes, to the same order. The sorted values come back in int32 then (the caller widens
    what it keeps); ``values`` must not be below -2**31.
    """
    if values.dtype == torch.int64 and fill <= INT32_MAX:
        values = values.to(torch.int32)
    return torch.sort(values, stable=True)


def unique_fixed(values: Tensor, capacity: int, fill: int) -> tuple[Tensor, Tensor]:
    """Sorted unique entries of 1-D ``values`` in a ``[capacity]`` buffer padded with ``fill``, and the inverse.

    The device-side counterpart of ``torch.unique(sorted=True, return_inverse=True)``: a
    sort, a mark at every new value and a cumulative sum give each entry its segment, so
    no output size is read back. ``fill`` must be larger than every real value (the
    padding then stays at the end), and ``capacity`` at least the number of distinct values.

    The ``fill`` entries are dealt round the slots after the real values', one each while
    they last: a merge adds every entry's row into its slot with ``index_add_``, and on a
    GPU hundreds of thousands of padding rows added into one slot serialize on its atomics
    (the padded value-embedding and n-gram queues are mostly padding). The real values'
    slots and the contents of ``unique`` do not change. With fill entries present,
    ``capacity`` must exceed the number of distinct real values.
    """
    sorted_, order = sort_values(values, fill)
    is_fill = sorted_ == fill
    new = torch.ones_like(sorted_, dtype=torch.bool)
    new[1:] = (sorted_[1:] != sorted_[:-1]) | is_fill[1:]
    segment = torch.cumsum(new, 0) - 1
    # the padding's slots run from the first one after the real values to the last one, dealt in turn
    first_fill = (new & ~is_fill).sum()
    spare = (capacity - first_fill).clamp(min=1)
    segment = torch.where(is_fill, first_fill + (segment - first_fill) % spare, segment)
    unique = torch.full((capacity,), fill, dtype=values.dtype, device=values.device)
    unique.scatter_(0, segment, sorted_.to(values.dtype))  # repeats write the same value
    inverse = torch.empty_like(segment)
    inverse.scatter_(0, order, segment)
    return unique, inverse


class Segments(NamedTuple):
    """A padded list's entries grouped by value (:func:`segments_fixed`)."""

    unique: Tensor  # [capacity] sorted distinct real values, then ``fill``
    order: Tensor  # [M] entry positions sorted by value, stable (so each group keeps input order)
    offsets: Tensor  # [capacity + 1]: unique[i]'s entries are order[offsets[i]:offsets[i + 1]]; empty for fill
    slot: Tensor  # [M] slot of each entry of ``order`` (``capacity`` for fill entries)


def segments_fixed(values: Tensor, capacity: int, fill: int) -> Segments:
    """Group 1-D ``values`` by value into ``capacity`` slots, without a device -> host sync.

    The merge of a padded queue without a merged buffer: a consumer sums each slot's
    entries itself (``nanogpt_pl.ops.triton.row_adam`` does, in the order given). ``fill``
    entries belong to no slot; ``fill`` must exceed every real value and ``capacity`` be at
    least the number of distinct real values.
    """
    sorted_, order = sort_values(values, fill)
    real = sorted_ != fill
    new = real.clone()
    new[1:] &= sorted_[1:] != sorted_[:-1]
    slot = torch.where(real, torch.cumsum(new, 0) - 1, capacity)
    dump = torch.full_like(slot, capacity + 1)
    first = torch.where(new, slot, dump)  # a group's first entry marks where its slot starts
    # every slot starts (and an empty one also ends) after the last real entry, unless marked
    offsets = real.sum().expand(capacity + 2).clone()
    offsets.scatter_(0, first, torch.arange(values.numel(), device=values.device))
    unique = torch.full((capacity + 2,), fill, dtype=values.dtype, device=values.device)
    unique.scatter_(0, first, sorted_.to(values.dtype))
    return Segments(unique[:capacity], order, offsets[: capacity + 1], slot)


def merge_compact_fixed(entries: list[tuple[Tensor, Tensor]], fill: int, row_dim: int = 0,
                        capacity: Optional[int] = None, force: bool = False) -> tuple[Tensor, Tensor]:
    """:func:`merge_compact` with a fixed capacity: (sorted unique rows padded with ``fill``, fp32 sums).

    ``entries`` are sentinel-padded (rows, grad) pairs; the result has ``capacity`` rows
    (default: all queued rows, the bound from the plan). Every row's terms are added in
    queue order, as in :func:`merge_compact`. A single entry is already merged unless
    ``force`` (entries with repeats, as at an owner).
    """
    if len(entries) == 1:
        rows, grads = entries[0][0], entries[0][1].float()  # read as they are: a cat of one is a copy
        if not force:
            return rows, grads
    else:
        rows = torch.cat([r for r, _ in entries])
        grads = torch.cat([g.float() for _, g in entries], dim=row_dim)
    unique, inverse = unique_fixed(rows, capacity or rows.numel(), fill)
    shape = list(grads.shape)
    shape[row_dim] = unique.numel()
    merged = torch.zeros(shape, dtype=torch.float32, device=grads.device)
    merged.index_add_(row_dim, inverse, grads)
    return unique, merged


def pad_to_common(rows: Tensor, grads: Tensor, fill: int, process_group: Optional[dist.ProcessGroup] = None,
                  row_dim: int = 0) -> tuple[Tensor, Tensor]:
    """Pad a compact (rows, grads) pair with ``fill`` rows and zero gradients to the longest over the group.

    The fixed exchange needs the same buffer sizes on every rank; a checkpoint keeps each
    rank's real pending rows only, so loading one pads them back to a common length.
    Collective (all ranks load together); reads the lengths on the host, once per load.
    """
    n = rows.numel()
    if dist_world_rank(process_group)[0] > 1:
        longest = torch.tensor([n], dtype=torch.int64, device=rows.device)
        dist.all_reduce(longest, op=dist.ReduceOp.MAX, group=process_group)
        n = int(longest.item())
    if n == rows.numel():
        return rows, grads
    pad = [0, 0] * (grads.dim() - 1 - row_dim) + [0, n - rows.numel()]
    rows = torch.cat([rows, torch.full((n - rows.numel(),), fill, dtype=rows.dtype, device=rows.device)])
    return rows, torch.nn.functional.pad(grads, pad)
