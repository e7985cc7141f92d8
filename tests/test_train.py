"""End-to-end training on CPU: the module, strategy, data stream and callbacks together."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from train_helpers import LossRecorder, make_run, make_trainer, tiny_optim, tiny_schedule

from nanogpt_pl.model.gpt import GPT
from nanogpt_pl.module import micro_batches


def test_training_reduces_loss_and_validates(toy_files, tmp_path):
    sched = tiny_schedule(30)
    module, data = make_run(toy_files, sched)
    rec = LossRecorder()
    make_trainer(tmp_path, callbacks=[rec]).fit(module, data)
    assert sorted(rec.losses) == list(range(30))
    # sampled softmax over 2,048 candidates starts near ln(2048) = 7.6; validation is full-vocabulary
    # (ln(50304) = 10.8 at init)
    assert abs(rec.losses[0] - 7.62) < 0.1
    assert rec.losses[29] < rec.losses[0] - 0.5
    assert rec.val is not None and rec.val < 10.3


def test_resume_gives_the_same_losses_as_a_straight_run(toy_files, tmp_path):
    sched = tiny_schedule(20)

    module, data = make_run(toy_files, sched)
    straight = LossRecorder()
    make_trainer(tmp_path / "straight", callbacks=[straight]).fit(module, data)

    module, data = make_run(toy_files, sched)
    first = LossRecorder()
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=10, save_top_k=-1)
    trainer = make_trainer(tmp_path / "first", max_steps=10, callbacks=[first, ckpt], enable_checkpointing=True)
    trainer.fit(module, data)
    saved = sorted((tmp_path / "ckpt").glob("*step=10*.ckpt"))
    assert saved, list((tmp_path / "ckpt").iterdir())

    module, data = make_run(toy_files, sched)
    second = LossRecorder()
    make_trainer(tmp_path / "second", callbacks=[second]).fit(module, data, ckpt_path=str(saved[0]))

    assert sorted(first.losses) == list(range(10)) and sorted(second.losses) == list(range(10, 20))
    resumed = {**first.losses, **second.losses}
    for step in range(20):
        assert abs(resumed[step] - straight.losses[step]) <= 1e-5, (step, resumed[step], straight.losses[step])
    assert abs(second.val - straight.val) <= 1e-5


def test_checkpoint_holds_each_weight_once(toy_files, tmp_path):
    module, _ = make_run(toy_files, tiny_schedule(4))
    keys = list(module.state_dict())
    assert keys and all(k.startswith("model.") for k in keys), [k for k in keys if not k.startswith("model.")]


def test_timer_warmup_stays_within_max_steps(toy_files, tmp_path):
    """A run shortened with trainer.max_steps asks for no data past it (the untimed warmup included)."""
    from dataclasses import replace

    from callbacks.speedrun_timer import SpeedrunTimer, default_warmup_steps
    from nanogpt_pl.schedule import Schedule

    one = tiny_schedule(6)
    sched = Schedule(stages=[one.stages[0], replace(one.stages[0])], warmup_steps=2, cooldown_frac=0.5,
                     final_lr_mul=0.1, adam_every=1, untie_step=None, val_window_short=64, val_window_long=256,
                     attention_cap=None, sparse_cadence_start=10**9)
    assert max(default_warmup_steps(sched)) >= 6  # the plan visits the stage boundary at step 6
    module, data = make_run(toy_files, sched)
    asked = []
    batch_at = data.batch_at
    data.batch_at = lambda step: asked.append(step) or batch_at(step)
    rec = LossRecorder()
    make_trainer(tmp_path, max_steps=6, callbacks=[SpeedrunTimer(target=0.0), rec]).fit(module, data)
    assert asked and max(asked) < 6, asked
    assert sorted(rec.losses) == list(range(6))


def test_compile_in_place_keeps_the_state_dict_keys(toy_files):
    plain, _ = make_run(toy_files, tiny_schedule(4))
    compiled, _ = make_run(toy_files, tiny_schedule(4), compile=True)
    for module in (plain, compiled):
        module.prepare_for_training(torch.device("cpu"))
    # the model itself is compiled (nn.Module.compile), not wrapped: no "_orig_mod." in any key
    assert type(compiled.model) is GPT and compiled.model._compiled_call_impl is not None
    assert plain.model._compiled_call_impl is None
    assert list(compiled.state_dict()) == list(plain.state_dict())
    compiled.load_state_dict(plain.state_dict())  # checkpoints move between the two


def test_compile_options_reach_inductor_and_an_unknown_one_is_one_line(toy_files):
    module, _ = make_run(toy_files, tiny_schedule(4), compile=True, compile_options={"combo_kernels": True})
    module.prepare_for_training(torch.device("cpu"))
    config = module.model._compiled_call_impl.get_compiler_config()  # what inductor compiles with
    assert config["combo_kernels"] is True
    plain, _ = make_run(toy_files, tiny_schedule(4), compile=True)
    plain.prepare_for_training(torch.device("cpu"))
    assert plain.model._compiled_call_impl.get_compiler_config()["combo_kernels"] is False
    with pytest.raises(ValueError, match=r"^model.compile_options: 'combo_kernel' is not an inductor option"):
        make_run(toy_files, tiny_schedule(4), compile=True, compile_options={"combo_kernel": True})


def test_micro_batches_normalises_a_step_batch():
    a, b = {"inputs": torch.zeros(3)}, {"inputs": torch.zeros(5)}
    assert micro_batches([a, b]) == [a, b]
    assert micro_batches(a) == [a] and micro_batches(a)[0] is a


def test_anvil_matrices_stay_views_of_their_banks_through_a_run_and_a_resume(toy_files, tmp_path):
    """model.optim.anvil_bank_views: the hidden matrices become views of their ANVIL bank when the
    optimizer is built, and nothing in a Lightning run (the timer's reset to its saved state, a
    checkpoint save and a resume) re-points them; the losses are those of the copying optimizer."""
    from callbacks.speedrun_timer import SpeedrunTimer

    def banks(module):
        return module._combined().parts["matrices"]._banks

    sched = tiny_schedule(6)
    losses = {}
    for views in (True, False):
        module, data = make_run(toy_files, sched, optim=tiny_optim(matrix_optimizer="anvil", matrix_lr=0.02,
                                                                  anvil_bank_views=views))
        rec = LossRecorder()
        ckpt = ModelCheckpoint(dirpath=tmp_path / f"ckpt{views}", every_n_train_steps=3, save_top_k=-1)
        make_trainer(tmp_path / f"run{views}", callbacks=[SpeedrunTimer(target=0.0), rec, ckpt],
                     enable_checkpointing=True).fit(module, data)
        assert banks(module) and all(b.views_intact() is views for b in banks(module))
        losses[views] = rec.losses
    assert losses[True] == losses[False] and sorted(losses[True]) == list(range(6))

    module, data = make_run(toy_files, sched, optim=tiny_optim(matrix_optimizer="anvil", matrix_lr=0.02))
    resumed = LossRecorder()
    make_trainer(tmp_path / "resumed", callbacks=[resumed]).fit(
        module, data, ckpt_path=str(next((tmp_path / "ckptTrue").glob("*step=3*.ckpt"))))
    assert all(b.views_intact() for b in banks(module))
    assert {s: resumed.losses[s] for s in range(3, 6)} == {s: losses[True][s] for s in range(3, 6)}
