"""The fixed validation set (RECORD.md §12)."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator, Optional

import numpy as np
import torch

from nanogpt_pl.data.planning import BOS_ID, Files, pack_cu_seqlens, to_tensor
from nanogpt_pl.data.shards import MAKE_DATA_HINT, ShardError, check_vocab, list_shards, open_shard
from nanogpt_pl.data.tokenizer import TOKENIZER_VOCAB

MicroBatch = dict
# a suggested shorter val_seq_len is rounded down to this, so kernels see familiar shapes
SEQ_LEN_MULTIPLE = 128


class ValidationSet:
    """The fixed validation batches of this rank (RECORD.md §12).

    The first ``val_tokens + 1`` tokens of the validation shards, contiguous and not
    BOS-aligned. Batch ``b`` covers tokens ``[b * W * S, (b + 1) * W * S)``; rank ``r``
    takes its contiguous ``S = val_seq_len`` slice; targets are the next tokens. Segment
    boundaries are the BOS positions in the slice (plus 0), padded like training.

    Args:
        files: validation shards: a glob or a list of paths.
        val_tokens: tokens per validation pass (a multiple of ``W * val_seq_len``).
        val_seq_len: tokens per rank per batch.
        world_size: ranks ``W``; rank: this rank.
        vocab_size: every token id must be below it.
        pin_memory: pin batches (default: when CUDA is available).
    """

    def __init__(
        self,
        files: Files,
        val_tokens: int,
        val_seq_len: int,
        world_size: int = 1,
        rank: int = 0,
        vocab_size: Optional[int] = TOKENIZER_VOCAB,
        pin_memory: Optional[bool] = None,
        option: str = "data.val_files",
    ):
        if val_seq_len <= 0 or val_tokens <= 0:
            raise ValueError(f"data.val_tokens ({val_tokens}) and data.val_seq_len ({val_seq_len}) must be positive")
        per_batch = world_size * val_seq_len
        if val_tokens % per_batch:
            lower = val_tokens // per_batch * per_batch
            raise ValueError(
                f"data.val_tokens={val_tokens} is not a multiple of world_size {world_size} x "
                f"data.val_seq_len {val_seq_len} = {per_batch}; use a multiple such as "
                f"{max(lower, per_batch)} or change data.val_seq_len"
            )
        paths = list_shards(files, option) if isinstance(files, (str, Path)) else [Path(p) for p in files]
        if not paths:
            raise ShardError(f"{option} lists no shards; {MAKE_DATA_HINT}")
        need = val_tokens + 1
        pieces, have = [], 0
        for p in paths:
            tokens = open_shard(p)
            take = min(tokens.size, need - have)
            if vocab_size is not None:
                check_vocab(p, tokens, vocab_size, limit=take)
            pieces.append(tokens[:take])
            have += take
            if have == need:
                break
        if have < need:
            where = f"{paths[0]}" + (f" and {len(paths) - 1} more" if len(paths) > 1 else "")
            raise ShardError(
                f"data.val_tokens={val_tokens} needs {need} tokens but {option} ({where}) holds only {have}; "
                f"{_smaller_validation(have - 1, world_size, val_seq_len)}"
            )
        self.tokens = pieces[0] if len(pieces) == 1 else np.concatenate(pieces)
        self.paths = paths
        self.val_tokens = val_tokens
        self.seq_len = val_seq_len
        self.world_size = world_size
        self.rank = rank
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory

    def __len__(self) -> int:
        return self.val_tokens // (self.world_size * self.seq_len)

    def batch(self, index: int) -> MicroBatch:
        """Validation batch ``index`` of this rank."""
        if not 0 <= index < len(self):
            raise IndexError(f"validation batch {index} out of range [0, {len(self)})")
        start = (index * self.world_size + self.rank) * self.seq_len
        buf = np.asarray(self.tokens[start : start + self.seq_len + 1])
        inputs = buf[:-1]
        bos = np.flatnonzero(inputs == BOS_ID)
        boundaries = np.unique(np.concatenate([[0], bos, [self.seq_len]]))
        return {
            "inputs": to_tensor(inputs.astype(np.int32), self.pin_memory),
            "targets": to_tensor(buf[1:].astype(np.int64), self.pin_memory),
            "cu_seqlens": to_tensor(pack_cu_seqlens(boundaries, self.seq_len), self.pin_memory),
            "max_seqlen": int(np.diff(boundaries).max()),
        }

    def __iter__(self) -> Iterator[MicroBatch]:
        return (self.batch(i) for i in range(len(self)))



def _smaller_validation(usable: int, world_size: int, val_seq_len: int) -> str:
    """A fix for validation shards that hold only ``usable`` input tokens (one more is the last target)."""
    per_batch = world_size * val_seq_len
    if usable >= per_batch:
        return (f"lower data.val_tokens to {usable // per_batch * per_batch} (a multiple of world_size {world_size} "
                f"x data.val_seq_len {val_seq_len}), or add validation data")
    seq_len = usable // world_size
    if seq_len >= SEQ_LEN_MULTIPLE:
        seq_len -= seq_len % SEQ_LEN_MULTIPLE
    if seq_len < 1:
        return f"add validation data (one batch needs at least {world_size + 1} tokens on {world_size} rank(s))"
    # not even one batch of val_seq_len per rank fits: shorten the sequences too
    return (f"one batch needs world_size {world_size} x data.val_seq_len {val_seq_len} + 1 tokens; lower "
            f"data.val_tokens to {world_size * seq_len} and data.val_seq_len to {seq_len}, or add validation data")
