"""The sparse channels as the module sees them: per-micro-batch inputs, gradient hand-back, state.

Who builds what: the module creates the channels in ``setup`` (through
:func:`build_sparse_channels`) on the strategy's device and process group
(``SpeedrunStrategy.process_group``); the strategy writes their per-rank state to side
files (``side_files``).
"""

from __future__ import annotations

import warnings
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from ..model.embeddings import CompactRows, NgramInput
from .ngram_shard import NgramShard
from .value_embed_shard import ValueEmbedShard

# The value-embedding leaf's reserved rows are a multiple of this (aligned rows for the gathers).
VALUE_ROWS_MULTIPLE = 64


def reserved_value_rows(distinct: int, full: int) -> int:
    """The value-embedding leaf's rows for at most ``distinct`` distinct ids: rounded up to
    :data:`VALUE_ROWS_MULTIPLE`, at most ``full`` (min(T, V))."""
    return min(full, -(-int(distinct) // VALUE_ROWS_MULTIPLE) * VALUE_ROWS_MULTIPLE)


class SparseChannels:
    """The module's view of the sparse channels: per-micro-batch inputs and gradient hand-back.

    Args:
        ngram: this rank's n-gram shard (None = no n-gram channel).
        value_embeds: the value-embedding channel (None = value embeddings take the dense path).
        fixed_shapes: pad the compact leaves to an upper bound (2T n-gram rows; for the value
            embeddings the capacity :meth:`value_rows` gives) so a compiled model sees one shape
            per sequence length. ``build_sparse_channels`` then gives the channels the fixed
            exchange, which needs no host sync, unless ``model.optim.sparse_exchange`` asks for
            the reference one.

    The value-embedding leaf holds one row per distinct token id of the micro-batch. Its
    capacity is min(T, V) unless :meth:`reserve_value_rows` sized it from the run's batch plan
    (the speedrun timer does, before its warmup): a micro-batch holds far fewer distinct ids than
    tokens (on the embedded corpus at most 4,220 in 49,152), and every padding row is written in
    the forward and zero-filled in the gradient. The loader counts each micro-batch's distinct ids on the
    host (``distinct_tokens``), so the capacity is checked without asking the device.
    """

    def __init__(self, ngram: Optional[NgramShard] = None, value_embeds: Optional[ValueEmbedShard] = None,
                 fixed_shapes: bool = False) -> None:
        self.ngram = ngram
        self.value_embeds = value_embeds
        self.fixed_shapes = fixed_shapes
        self._value_rows: dict[int, int] = {}  # T -> the value-embedding leaf's rows, from the plan

    def reserve_value_rows(self, distinct: dict[int, int]) -> None:
        """Size the value-embedding leaf of each micro-batch length T for at most ``distinct[T]``
        distinct token ids (rounded up to :data:`VALUE_ROWS_MULTIPLE`, at most min(T, V)).

        From the run's whole plan (``TrainStream.plan_bounds``), so a T keeps one leaf shape; a
        later reservation only grows it. Nothing without the value-embedding channel or fixed shapes.
        """
        if self.value_embeds is None or not self.fixed_shapes:
            return
        for tokens, ids in distinct.items():
            tokens = int(tokens)
            rows = reserved_value_rows(ids, self._full_rows(tokens))
            self._value_rows[tokens] = max(self._value_rows.get(tokens, 0), rows)

    def _full_rows(self, tokens: int) -> int:
        return min(tokens, self.value_embeds.vocab)

    def value_rows(self, tokens: int, distinct: Optional[int]) -> Optional[int]:
        """Rows of the value-embedding leaf of a training micro-batch of ``tokens`` ids holding
        ``distinct`` different ones (None: not counted): the reserved capacity, or min(T, V);
        None without the value-embedding channel or fixed shapes.

        A micro-batch the reservation cannot hold (more distinct ids, or none counted) gets
        min(T, V), and so does every later one of that length (one warning): its shape changes
        once, and no id is ever dropped.
        """
        if self.value_embeds is None or not self.fixed_shapes:
            return None
        full = self._full_rows(tokens)
        rows = self._value_rows.get(tokens, full)
        if rows >= full:
            return full
        if distinct is None or distinct > rows:
            held = "no distinct-token count" if distinct is None else f"{distinct} distinct token ids"
            warnings.warn(f"value embeddings: a micro-batch of {tokens} tokens has {held}, beyond the {rows} "
                          f"rows reserved from the batch plan; micro-batches of {tokens} tokens take {full} rows "
                          "from now on")
            self._value_rows[tokens] = rows = full
        return rows

    def channels(self) -> dict[str, Any]:
        """name -> channel, for :class:`~nanogpt_pl.optim.sparse_adam.SparseAdam`."""
        out: dict[str, Any] = {}
        if self.ngram is not None:
            out["ngram"] = self.ngram
        if self.value_embeds is not None:
            out["value_embeds"] = self.value_embeds
        return out

    @property
    def capturable(self) -> bool:
        """Whether a training pull (:meth:`inputs` with ``train=True``) is device work of fixed
        shapes with no collective, so a CUDA graph can hold it (``nanogpt_pl.capture.PullGraphs``):
        the fixed exchange on every channel, and the n-gram table on one rank (at several ranks
        its pull is an all-to-all, which stays eager between the graphs)."""
        if not self.fixed_shapes or not self.channels():
            return False
        if self.ngram is not None and not (self.ngram.fixed and self.ngram.world == 1):
            return False
        return self.value_embeds is None or self.value_embeds.fixed

    def table_addresses(self) -> tuple:
        """The addresses of the tables a pull reads (a captured pull reads them at these addresses)."""
        out: list[int] = []
        if self.ngram is not None:
            out.append(self.ngram.weight.data_ptr())
        if self.value_embeds is not None:
            out += [t.data_ptr() for t in self.value_embeds.params]
        return tuple(out)

    def train_inputs(self, input_ids: Tensor, distinct_tokens: Optional[int] = None) -> dict[str, Any]:
        """:meth:`inputs` of a training micro-batch whose distinct ids the host counted
        (``distinct_tokens``, None: not counted), with the value-embedding rows :meth:`value_rows` gives."""
        rows = self.value_rows(input_ids.numel(), distinct_tokens)
        return self.inputs(input_ids, train=True, value_rows=rows)

    def inputs(self, input_ids: Tensor, train: bool, value_rows: Optional[int] = None) -> dict[str, Any]:
        """Keyword arguments of ``GPT.forward`` for one micro-batch (``ngram``, ``value_rows``). Collective.

        ``value_rows``: the training leaf's rows under fixed shapes, from :meth:`value_rows`
        (default min(T, V)).
        """
        n = input_ids.numel()
        out: dict[str, Any] = {}
        with torch.no_grad():
            if self.ngram is not None:
                pad = 2 * n if (train and self.fixed_shapes) else None
                out["ngram"] = self.ngram.prepare(input_ids, requires_grad=train, pad_to=pad)
            if self.value_embeds is not None:
                pad = (value_rows or self._full_rows(n)) if (train and self.fixed_shapes) else None
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
                          fixed_shapes: bool = False, ngram_hash: str = "auto",
                          exchange: str = "auto") -> Optional[SparseChannels]:
    """The channels a GPT needs (None when it has neither an n-gram table nor sparse value embeddings).

    ``ngram_hash`` is ``model.backends.ngram``, how the n-gram channel hashes its tokens;
    ``exchange`` is ``model.optim.sparse_exchange``: ``fixed``, ``reference`` or ``auto``, the
    fixed exchange with fixed leaf shapes (compiled, graph-captured steps must not wait on the
    host) and the reference exchange otherwise.
    """
    cfg = model.cfg
    if exchange == "auto":
        exchange = "fixed" if fixed_shapes else "reference"
    ngram = None
    if cfg.ngram_rows:
        ngram = NgramShard(cfg.ngram_rows, cfg.model_dim, process_group, device, exchange=exchange,
                           hash_backend=ngram_hash)
    ve = None
    if sparse_value_embeds and len(model.value_embeds):
        ve = ValueEmbedShard(list(model.value_embeds), process_group, exchange=exchange)
    if ngram is None and ve is None:
        return None
    return SparseChannels(ngram, ve, fixed_shapes)
