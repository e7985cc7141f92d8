"""callbacks.finite_guard: a non-finite loss or gradient stops the run with a checkpoint of the last good state."""

from __future__ import annotations

import copy

import lightning as L
import pytest
import torch
from train_helpers import make_run, make_trainer, tiny_schedule

from callbacks.finite_guard import FiniteGuard, NonFiniteError

BAD_STEP = 3


@pytest.fixture(scope="module")
def files():
    from nanogpt_pl.data.corpus import build_corpus

    corpus = build_corpus()
    return corpus.train_pattern, corpus.val_pattern


class Poison(L.Callback):
    """At BAD_STEP, breaks the loss (a NaN weight) or only one gradient (an autograd hook); keeps the good state."""

    def __init__(self, where: str) -> None:
        self.where = where
        self.good = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step != BAD_STEP:
            return
        self.good = copy.deepcopy(pl_module.model.state_dict())
        p = pl_module.model.blocks[1].mlp.fc_w
        if self.where == "loss":
            with torch.no_grad():
                p[0, 0] = float("nan")
        else:
            p.register_hook(lambda g: g * float("inf"))


@pytest.mark.parametrize("where,expect", [
    ("loss", "non-finite loss (nan) at step 3"),
    ("gradient", "non-finite gradient in parameter group 'matrices' (blocks.1.mlp.fc_w) at step 3"),
])
def test_stops_with_the_last_good_state(files, tmp_path, one_thread, where, expect):
    module, data = make_run(files, tiny_schedule(8))
    poison = Poison(where)
    guard = FiniteGuard()
    with pytest.raises(NonFiniteError) as err:
        make_trainer(tmp_path, callbacks=[poison, guard], limit_val_batches=0).fit(module, data)
    message = str(err.value)
    assert expect in message and "\n" not in message and "--ckpt_path" in message
    saved = torch.load(guard.checkpoint_path, map_location="cpu", weights_only=False)
    assert saved["global_step"] == BAD_STEP and guard.checkpoint_path in message
    state = {k.removeprefix("model."): v for k, v in saved["state_dict"].items()}
    for name, good in poison.good.items():
        if torch.is_tensor(good):
            if where == "loss" and name == "blocks.1.mlp.fc_w":
                good = good.clone()
                good[0, 0] = float("nan")  # the poison itself (written after the copy); the rest is the good state
            torch.testing.assert_close(state[name], good, rtol=0, atol=0, equal_nan=True, msg=name)
    if where == "gradient":  # the optimizer step never ran: every saved weight is finite
        assert all(torch.isfinite(v).all() for v in state.values() if torch.is_tensor(v))


def test_a_finite_run_is_untouched(files, tmp_path, one_thread):
    module, data = make_run(files, tiny_schedule(3))
    guard = FiniteGuard()
    make_trainer(tmp_path, callbacks=[guard], limit_val_batches=0).fit(module, data)
    assert guard.checkpoint_path is None and module.global_step == 3
