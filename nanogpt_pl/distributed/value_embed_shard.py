"""Value embeddings as a sparse channel: replicated tables, compact gradients, owner-sharded Adam.

Value embeddings (RECORD §5) are replicated on every rank (the model's ``value_embeds``
parameters, 4 × 50,304 × 768 in the record) but get the same compact gradient path as
the n-gram table: their gradients are exchanged as compact rows to the owner of each
token-id block (:class:`~.row_exchange.RowExchange`), the owner runs Adam (β₁ = 0.75,
state in ``nanogpt_pl.optim.sparse_adam.ShardAdam``) over its block, and the updated
blocks are all-gathered into every replica. (The record instead pulls only the rows the
next cycle reads, which needs the loader's lookahead; the all-gather costs ~300 MB per
event at the record's size, i.e. every 4th step.)

``exchange="fixed"`` does this without a device -> host sync: a micro-batch of T tokens
keeps a fixed number of sentinel-padded ids (``row_exchange.unique_fixed``; min(T, V), or the
capacity ``SparseChannels.value_rows`` sizes from the batch plan), and its compact
gradient is added at once into one persistent fp32 cycle buffer ``[P, W·c, D]`` (the
record's selected-load backward into a persistent cycle buffer, RECORD §5), so nothing is
queued and nothing is merged. At the event each rank sends every owner its block of the
buffer (one ``all_to_all`` of equal blocks), the owner adds its own block and the peers' in
rank order (the reference's order) and runs Adam over its whole block (``ShardAdam.update_dense_``).
At the record's size a cycle touches most of the 50,304 ids on every rank, so the dense
blocks carry about what the compact rows would. ``reference`` (exact sizes) is the default.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from ..model.embeddings import CompactRows, compact_rows, gather_rows_, padded_leaf
from ..ops.triton import triton_usable
from ..optim.sparse_adam import ShardAdam
from .row_exchange import EXCHANGES, RowExchange, dist_world_rank, merge_compact, unique_fixed
from .side_files import STATE_FORMAT

# Rows past the owners' blocks in the fixed exchange's cycle buffer that take the padding
# entries' (zero) gradient rows in the PyTorch path, dealt in turn: 16,384 - U padding rows a
# stage-0 micro-batch, a few atomic adds on each instead of thousands on one.
SCRATCH_ROWS = 1024


class ValueEmbedShard:
    """Value-embedding planes: replicated tables, compact gradients, owner-sharded Adam.

    Row ``x·P + p`` stands for token ``x`` of plane ``p`` (P planes), so the owner of token
    block ``[r·c, (r+1)·c)`` (``c = ceil(V / W)``) owns one contiguous block of that row space.

    Args:
        tables: the P value-embedding tables ``[V, D]`` (the model's parameters; updated in place).
        process_group: ranks sharing them.
        grad_wire_dtype: dtype of gradient rows on the wire (default: the tables' dtype).
        exchange: ``"reference"`` (exact sizes, host-side counts) or ``"fixed"`` (fixed
            capacity from the batch, no host sync).
    """

    def __init__(self, tables: list[Tensor], process_group: Optional[dist.ProcessGroup] = None,
                 grad_wire_dtype: Optional[torch.dtype] = None, exchange: str = "reference") -> None:
        if exchange not in EXCHANGES:
            raise ValueError(f"value-embedding exchange={exchange!r}: choose one of {EXCHANGES}")
        self.fixed = exchange == "fixed"
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
            [r * self.tokens_per_rank * self.planes for r in range(self.world + 1)], process_group, self.device
        )
        self.grad_wire_dtype = grad_wire_dtype
        self.adam = ShardAdam(self.planes, self.hi - self.lo, self.dim)
        # padding id of the fixed exchange: after every token, and its rows (id·P + p) after every owner's
        self.sentinel = self.tokens_per_rank * self.world
        self._queue: list[tuple[Tensor, Tensor]] = []
        # the fixed exchange's cycle buffer (allocated at the first push): [P, W·c + scratch, D] fp32,
        # and which token ids it holds a gradient for (the checkpoint's pending ids)
        self._grad: Optional[Tensor] = None
        self._touched: Optional[Tensor] = None
        self._pending = False

    @property
    def device(self) -> torch.device:
        return self.params[0].device

    def prepare(self, input_ids: Tensor, requires_grad: bool = True, pad_to: Optional[int] = None,
                leaf_dtype: torch.dtype = torch.float32) -> CompactRows:
        """Gather every plane at the unique ids of ``input_ids`` as the model's :class:`CompactRows`.

        With the fixed exchange only training reads (``requires_grad``) take the fixed path,
        as in ``NgramShard.prepare``. Its leaf has ``pad_to`` rows (default min(T, V), the most
        distinct ids T tokens can hold); a smaller ``pad_to`` must hold every distinct id of
        ``input_ids``, which the caller knows from the host (``SparseChannels.value_rows``):
        reading it here would be a device -> host sync.
        """
        if self.fixed and requires_grad:
            bound = min(input_ids.numel(), self.vocab)
            if pad_to is not None and not 0 < pad_to <= bound:
                raise ValueError(f"pad_to={pad_to}: the fixed value-embedding leaf of a batch of {input_ids.numel()} "
                                 f"tokens takes 1 to {bound} rows")
            ids, index = unique_fixed(input_ids.long().reshape(-1), pad_to or bound, self.sentinel)
            # the leaf itself, written plane by plane (zeros at the padding), no stack or cast after
            values = torch.empty(self.planes, ids.numel(), self.dim, dtype=leaf_dtype, device=ids.device)
            for p, table in enumerate(self.params):
                gather_rows_(values[p], table.detach(), ids, self.vocab)
            return CompactRows(values=values.requires_grad_(requires_grad), index=index.view(input_ids.shape),
                               ids=ids)
        else:
            ids, index = compact_rows(input_ids.long(), pad_to)
            values = torch.stack([t.detach().index_select(0, ids) for t in self.params])
        return CompactRows(values=padded_leaf(values, pad_to, leaf_dtype).requires_grad_(requires_grad),
                           index=index, ids=ids)

    def push(self, ids: Tensor, grad: Tensor) -> None:
        """Take a micro-batch's compact gradient ``[P, U (+ padding), D]`` of the sorted unique ``ids``.

        The reference exchange queues it; the fixed one adds it into the cycle buffer.
        """
        n = ids.numel()
        if grad.shape[0] != self.planes or grad.shape[1] < n:
            raise ValueError(f"gradient of shape {tuple(grad.shape)} for {self.planes} planes x {n} ids")
        if self.fixed:
            self._accumulate(ids.to(self.device), grad[:, :n].detach())
        else:
            # a copy: under CUDA graphs the gradient is the graph's buffer, which the next replay overwrites
            self._queue.append((ids.to(self.device), grad[:, :n].detach().clone()))

    def _buffers(self) -> tuple[Tensor, Tensor]:
        if self._grad is None:
            rows = self.tokens_per_rank * self.world + SCRATCH_ROWS
            self._grad = torch.zeros(self.planes, rows, self.dim, dtype=torch.float32, device=self.device)
            self._touched = torch.zeros(rows, dtype=torch.bool, device=self.device)
        return self._grad, self._touched

    @torch.no_grad()
    def _accumulate(self, ids: Tensor, grad: Tensor) -> None:
        """Add a padded compact gradient into the cycle buffer (no host sync).

        The real ids of one micro-batch are unique, so each buffer row gets at most one term
        per call, in push order (the reference merge's order). On a GPU one Triton pass adds the
        real rows and skips the padding (``scatter_add_rows_triton_``, the same bits as
        ``index_add_``). Elsewhere ``index_add_`` takes the padding entries too (gradient zero: no
        token reads them), dealt round ``SCRATCH_ROWS`` rows past the owners' blocks.
        """
        buf, touched = self._buffers()
        blocks = self.tokens_per_rank * self.world
        spread = blocks + torch.arange(ids.numel(), device=ids.device) % SCRATCH_ROWS
        target = torch.where(ids < self.vocab, ids, spread)
        if triton_usable(buf.device) and grad.stride(-1) == 1:
            # one read-add-write a real row, the padding skipped (nanogpt_pl.ops.triton.gather_rows)
            from ..ops.triton.gather_rows import scatter_add_rows_triton_

            scatter_add_rows_triton_(buf, ids, grad, self.vocab)
        else:
            buf.index_add_(1, target, grad.to(buf.dtype))
        touched.index_fill_(0, target, True)
        self._pending = True

    def merged_gradient(self) -> tuple[Tensor, Tensor]:
        """This rank's cycle gradient so far: (sorted unique ids, fp32 ``[P, U, D]``).

        For checkpoints and inspection: with the fixed exchange it reads the touched ids on the
        host; the event itself never calls it there.
        """
        if self.fixed:
            if not self._pending:
                return (torch.zeros(0, dtype=torch.long, device=self.device),
                        torch.zeros(self.planes, 0, self.dim, dtype=torch.float32, device=self.device))
            buf, touched = self._buffers()
            ids = touched[: self.vocab].nonzero().flatten()
            return ids, buf.index_select(1, ids)
        ids, grads = merge_compact(self._queue, (self.planes, 0, self.dim), self.device, row_dim=1)
        self._queue = [(ids, grads)] if ids.numel() else []
        return ids, grads

    @property
    def step_count(self) -> int:
        """Events run so far (the Adam step count)."""
        return self.adam.step

    @torch.no_grad()
    def step(self, lr: float, betas: tuple[float, float], eps: float, weight_decay: float) -> None:
        """One event: owners merge the cycle's rows, run Adam over their block, share it. Collective."""
        blocks = [table.data[self.lo : self.hi] for table in self.params]
        if self.fixed:
            grad = self._owned_gradient()
            if self.world > 1:
                grad.div_(self.world)
            emptied = self.adam.update_dense_(blocks, grad, lr, betas, eps, weight_decay)
            if self._grad is not None:
                if emptied and self.world == 1:
                    # the Triton pass emptied the owned rows, at one rank every token's; what is
                    # left are the scratch rows, which hold at most the padding's zero terms
                    self._grad[:, self.hi - self.lo:].zero_()
                else:
                    self._grad.zero_()
                self._touched.zero_()
            self._pending = False
        else:
            ids, grads = self.merged_gradient()
            rows = (ids[:, None] * self.planes + torch.arange(self.planes, device=ids.device)).reshape(-1)
            values = grads.permute(1, 0, 2).reshape(-1, self.dim)
            local, merged = self.exchange.reduce_to_owners(rows, values, self.grad_wire_dtype)
            if self.world > 1:
                merged.div_(self.world)
            self.adam.update_(blocks, local % self.planes, local // self.planes, merged, lr, betas, eps, weight_decay)
            self._queue = []
        if self.world > 1:
            self._share_blocks()

    def _owned_gradient(self) -> Tensor:
        """The cycle gradient of this rank's token block summed over ranks: fp32 ``[P, hi - lo, D]``.

        Every rank sends each owner that owner's block of its cycle buffer (equal blocks, one
        ``all_to_all``; in ``grad_wire_dtype`` if set). The owner adds its own block (never cast)
        and then the peers' in rank order, as ``RowExchange.reduce_to_owners`` does.
        """
        buf, _ = self._buffers()
        c, own = self.tokens_per_rank, self.hi - self.lo
        mine = buf[:, self.rank * c : self.rank * c + own]
        if self.world == 1:
            return mine
        wire = self.grad_wire_dtype or buf.dtype
        send = buf[:, : self.world * c].unflatten(1, (self.world, c)).transpose(0, 1).to(wire).contiguous()
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.exchange.group)
        peer = send[0].numel() * send.element_size() * (self.world - 1)
        self.exchange.bytes_sent["push_values"] += peer
        self.exchange.bytes_received["push_values"] += peer
        total = mine.clone()
        for r in range(self.world):
            if r != self.rank:
                total.add_(recv[r, :, :own].float())
        return total

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
        return self.step_count == 0 and not self._queue and not self._pending

    @torch.no_grad()
    def reset_(self) -> None:
        """Drop the Adam state and queued gradients (the tables belong to the model)."""
        self.adam.reset_()
        self._queue = []
        if self._grad is not None:
            self._grad.zero_()
            self._touched.zero_()
        self._pending = False

    def state_dict(self) -> dict[str, Any]:
        ids, grads = self.merged_gradient()  # the real ids only (with the fixed exchange, a host read)
        return {"format": STATE_FORMAT, "world_size": self.world, "rank": self.rank, **self.adam.state_dict(),
                "pending_ids": ids, "pending_grad": grads}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["world_size"] != self.world:
            raise ValueError(
                f"checkpoint value-embedding Adam state is sharded over {state['world_size']} ranks, this run has "
                f"{self.world}; resume with the same number of devices"
            )
        self.adam.load_state_dict(state, self.device)
        ids, grads = state["pending_ids"].to(self.device), state["pending_grad"].to(self.device)
        self._queue = []
        if self._grad is not None:
            self._grad.zero_()
            self._touched.zero_()
        self._pending = False
        if ids.numel() and self.fixed:
            self._accumulate(ids, grads)
        elif ids.numel():
            self._queue = [(ids, grads)]
