"""The sparse channels as the module sees them: per-micro-batch inputs, gradient hand-back, state.

Who builds what: the module creates the channels in ``setup`` (through
:func:`build_sparse_channels`) on the strategy's device and process group
(``SpeedrunStrategy.process_group``); the strategy writes their per-rank state to side
files (``side_files``).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from ..model.embeddings import CompactRows, NgramInput
from .ngram_shard import NgramShard
from .value_embed_shard import ValueEmbedShard


class SparseChannels:
    """The module's view of the sparse channels: per-micro-batch inputs and gradient hand-back.

    Args:
        ngram: this rank's n-gram shard (None = no n-gram channel).
        value_embeds: the value-embedding channel (None = value embeddings take the dense path).
        fixed_shapes: pad the compact leaves to their upper bound (2T n-gram rows, min(T, V)
            ids) so a compiled model sees one shape per sequence length. ``build_sparse_channels``
            then gives the channels the fixed exchange, which needs no host sync, unless
            ``model.optim.sparse_exchange`` asks for the reference one.
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
