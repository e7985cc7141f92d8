"""Small end-to-end training runs on CPU for the tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import lightning as L
import numpy as np
import torch

from nanogpt_pl.data.datamodule import SpeedrunDataModule
from nanogpt_pl.data.shards import write_shard
from nanogpt_pl.data.tokenizer import PADDED_VOCAB
from nanogpt_pl.distributed.strategy import SpeedrunStrategy
from nanogpt_pl.model.gpt import GPTConfig
from nanogpt_pl.module import AdamGroup, OptimConfig, SpeedrunModule
from nanogpt_pl.schedule import Schedule, Stage

BOS = 50256


def write_markov_shards(root: Path, seed: int = 0, n_train: int = 400_000, n_val: int = 40_000,
                        vocab: int = 512) -> tuple[str, str]:
    """Train/val shards of documents drawn from a fixed random first-order Markov chain.

    Learnable (a model can beat the unigram entropy) and cheap to make.
    """
    rng = np.random.default_rng(seed)
    probs = rng.dirichlet(np.full(vocab, 0.05), size=vocab)
    cum = probs.cumsum(1)

    def docs(n_tokens: int) -> np.ndarray:
        out = np.empty(n_tokens, dtype=np.int64)
        i = 0
        while i < n_tokens:
            length = int(rng.integers(20, 400))
            out[i] = BOS
            tok = int(rng.integers(vocab))
            u = rng.random(length)
            for j in range(1, min(length, n_tokens - i)):
                out[i + j] = tok
                tok = int(np.searchsorted(cum[tok], u[j]))
                tok = min(tok, vocab - 1)
            i += length
        return out

    write_shard(root / "toy_val_000000.bin", docs(n_val))
    write_shard(root / "toy_train_000001.bin", docs(n_train))
    return str(root / "toy_train_*.bin"), str(root / "toy_val_*.bin")


def tiny_schedule(steps: int = 20, batch_tokens: int = 1024, seq_len: int = 512, candidates: Optional[int] = 2048,
                  **kw: Any) -> Schedule:
    stage = Stage(steps=steps, batch_tokens=batch_tokens, seq_len=seq_len, max_doc_len=256, window_short=64,
                  window_long=256, lr_mul=1.0, candidates=candidates)
    base: dict[str, Any] = dict(stages=[stage], warmup_steps=2, cooldown_frac=0.5, final_lr_mul=0.1, adam_every=1,
                                untie_step=None, val_window_short=64, val_window_long=256, attention_cap=None,
                                sparse_cadence_start=10**9)
    base.update(kw)
    return Schedule(**base)


def tiny_gpt(**kw: Any) -> GPTConfig:
    base = dict(vocab_size=PADDED_VOCAB, num_layers=3, model_dim=32, num_heads=2, head_dim=16, mlp_hidden=64,
                long_window_layers=[2], value_embed_layers=[1], skip_from=0, skip_to=2)
    base.update(kw)
    return GPTConfig(**base)


def tiny_optim(**kw: Any) -> OptimConfig:
    flat = AdamGroup(lr_mul=1.0, betas=(0.9, 0.95), wd_mul=0.0)
    base = dict(matrix_optimizer="adamw", matrix_lr=3e-3, matrix_weight_decay=0.0, adam_lr=3e-3,
                adam_weight_decay=0.0, embed=flat, lm_head=flat, value_embeds=flat, scalars=flat)
    base.update(kw)
    return OptimConfig(**base)


class LossRecorder(L.Callback):
    """Keeps every training step's loss (rank 0) and the final validation loss."""

    def __init__(self) -> None:
        self.losses: dict[int, float] = {}
        self.val: Optional[float] = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses[trainer.global_step - 1] = float(outputs["loss"] if isinstance(outputs, dict) else outputs)

    def on_validation_end(self, trainer, pl_module):
        if "val/loss" in trainer.callback_metrics:
            self.val = float(trainer.callback_metrics["val/loss"])


def make_trainer(tmp: Path, max_steps: int = -1, callbacks: Optional[list] = None, **kw: Any) -> L.Trainer:
    options: dict[str, Any] = dict(
        accelerator="cpu", devices=1, strategy=SpeedrunStrategy(), max_steps=max_steps, max_epochs=-1, logger=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        default_root_dir=str(tmp), callbacks=callbacks or [], enable_checkpointing=False,
    )
    options.update(kw)
    return L.Trainer(**options)


def make_run(files: tuple[str, str], schedule: Schedule, gpt: Optional[GPTConfig] = None,
             optim: Optional[OptimConfig] = None, val_tokens: int = 4096, val_seq_len: int = 1024,
             **module_kw: Any) -> tuple[SpeedrunModule, SpeedrunDataModule]:
    L.seed_everything(1234, workers=False, verbose=False)
    torch.manual_seed(1234)
    module = SpeedrunModule(gpt=gpt or tiny_gpt(), optim=optim or tiny_optim(), schedule=schedule, **module_kw)
    data = SpeedrunDataModule(train_files=files[0], val_files=files[1], val_tokens=val_tokens,
                              val_seq_len=val_seq_len, schedule=schedule, prefetch=2)
    return module, data
