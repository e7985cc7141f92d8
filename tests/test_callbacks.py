"""Tail averaging, the speedrun timer and user callbacks, on CPU."""

from __future__ import annotations

import copy
import logging
import re
import time
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from train_helpers import LossRecorder, make_run, make_trainer, tiny_gpt, tiny_optim, tiny_schedule

from callbacks.ema import TailAveraging, TailTrack, record_tracks
from callbacks.speedrun_timer import SpeedrunTimer, default_warmup_steps
from callbacks.throughput import SpeedrunThroughput
from nanogpt_pl.data.stream import PlanBounds
from nanogpt_pl.module import SpeedrunModule
from nanogpt_pl.schedule import Schedule, Stage

# -- tail averaging against a plain reference ------------------------------------------------

class _Model(torch.nn.Module):
    def __init__(self, gen):
        super().__init__()
        self.a = torch.nn.Parameter(torch.randn(4, 3, generator=gen))
        self.b = torch.nn.Parameter(torch.randn(5, generator=gen))

    def param_families(self):
        return {"fa": [self.a], "fb": [self.b]}


def _fake(total_steps: int, gen):
    schedule = Schedule(stages=[Stage(steps=total_steps, batch_tokens=1024, seq_len=512, max_doc_len=256)])
    module = SimpleNamespace(model=_Model(gen), schedule=schedule, device=torch.device("cpu"))
    trainer = SimpleNamespace(global_step=0, max_steps=-1)
    return module, trainer


def _reference(values, total, track):
    """E after the run for one track, from the list of parameter values per step."""
    last = total - 1
    start = total - track.window
    e = None
    for step, v in enumerate(values):
        if step < start:
            continue
        cadence = step % track.every == track.phase or step > last - track.extra_last
        if e is None:
            if cadence or (track.seed_at_start and step == start):
                e = v.clone()
            continue
        if cadence:
            rate = track.last_rate if (track.last_rate is not None and step == last) else track.rate
            e = e + rate * (v - e)
    return e


@pytest.mark.parametrize("seed", [3, 8])
def test_tail_tracks_and_ship_match_reference(seed):
    gen = torch.Generator().manual_seed(seed)
    total = 40
    tracks = [
        TailTrack(name="ema", params=["fa"], window=20, every=2, phase=1, rate=0.2, last_rate=0.1, seed_at_start=True,
                  blend=0.65),
        TailTrack(name="avg", params=["fb"], window=12, every=4, phase=1, rate=0.3, extra_last=2, blend=1.0),
    ]
    cb = TailAveraging(tracks=tracks, decontract=["fa"])
    module, trainer = _fake(total, gen)
    history_a, history_b = [], []
    for step in range(total):
        with torch.no_grad():
            module.model.a.add_(0.1 * torch.randn(4, 3, generator=gen))
            module.model.b.add_(0.1 * torch.randn(5, generator=gen))
        history_a.append(module.model.a.detach().clone())
        history_b.append(module.model.b.detach().clone())
        trainer.global_step = step + 1
        if step < total - 1:
            cb.on_train_batch_end(trainer, module, None, None, step)
    pre_norm_a = history_a[-1].norm()
    cb.on_train_batch_end(trainer, module, None, None, total - 1)  # last step: ticks, then ships
    e_a = _reference(history_a, total, tracks[0])
    e_b = _reference(history_b, total, tracks[1])
    shipped_a = history_a[-1] + 0.65 * (e_a - history_a[-1])
    shipped_a = shipped_a * (pre_norm_a / shipped_a.norm())  # decontraction
    assert torch.allclose(module.model.a, shipped_a, atol=1e-6)
    assert torch.allclose(module.model.b, e_b, atol=1e-6)
    # blend applied once: another end-of-step call at the last step does not ship again
    before_a, before_b = module.model.a.detach().clone(), module.model.b.detach().clone()
    cb.on_train_batch_end(trainer, module, None, None, total - 1)
    assert cb.shipped
    assert torch.equal(module.model.a, before_a) and torch.equal(module.model.b, before_b)


def test_tail_state_survives_a_checkpoint():
    gen = torch.Generator().manual_seed(1)
    total = 30
    tracks = [TailTrack(name="avg", params=["fa", "fb"], window=16, every=2, phase=0, rate=0.25, blend=1.0)]
    straight = TailAveraging(tracks=copy.deepcopy(tracks), decontract=[])
    resumed = TailAveraging(tracks=copy.deepcopy(tracks), decontract=[])
    m1, t1 = _fake(total, gen)
    m2 = copy.deepcopy(m1)
    t2 = SimpleNamespace(global_step=0, max_steps=-1)
    for step in range(total):
        delta_a, delta_b = torch.randn(4, 3, generator=gen), torch.randn(5, generator=gen)
        for m in (m1, m2):
            with torch.no_grad():
                m.model.a.add_(delta_a)
                m.model.b.add_(delta_b)
        t1.global_step = t2.global_step = step + 1
        straight.on_train_batch_end(t1, m1, None, None, step)
        resumed.on_train_batch_end(t2, m2, None, None, step)
        if step == 20:  # checkpoint and restore into a fresh callback
            state = copy.deepcopy(resumed.state_dict())
            resumed = TailAveraging(tracks=copy.deepcopy(tracks), decontract=[])
            resumed.load_state_dict(state)
            resumed.on_train_start(None, m2)
    assert torch.allclose(m1.model.a, m2.model.a) and torch.allclose(m1.model.b, m2.model.b)


def test_record_tracks_match_the_table():
    tracks = {t.name: t for t in record_tracks()}
    assert tracks["tail_ema"].window == 298 and tracks["tail_ema"].blend == 0.65
    assert abs(tracks["tail_ema"].rate - 0.013333) < 1e-5 and abs(tracks["tail_ema"].last_rate - 2 / 299) < 1e-12
    assert tracks["tail_avg"].rate == 4 / 53 and tracks["tail_avg"].window == 250
    assert abs(tracks["bank_blend_vo_mlp"].blend - 0.3493) < 1e-12 and tracks["bank_blend_qk"].blend == 0.55
    cb = TailAveraging()
    # ticks of the record's 1,194-step run (last step 1193)
    ticks = [s for s in range(1194) if cb.ticks(tracks["tail_avg"], s, 1193)[0]]
    assert ticks[0] == 945 and ticks[-1] == 1193 and all(b - a == 4 for a, b in zip(ticks, ticks[1:]))


# -- the speedrun timer ----------------------------------------------------------------------

def test_default_warmup_steps_are_the_records():
    steps = default_warmup_steps(Schedule(), limit=100)
    # RECORD §11: 29 sampled steps (around 320, 681, 965, 1107, 1174; 1176–1178 after the untie;
    # each configuration key's first step and the next), then the prefix 0..7 last: 37 steps
    sampled = [318, 319, 320, 321, 411, 412, 501, 502, 591, 592, 679, 680, 681, 682, 963, 964, 965, 966,
               1105, 1106, 1107, 1108, 1172, 1173, 1174, 1175, 1176, 1177, 1178]
    assert sorted(steps[:-8]) == sampled and steps[-8:] == list(range(8)) and len(steps) == 37
    # the runs of consecutive steps by the micro-batch of their first step, longest first (RECORD §9:
    # stage 2's 49,152 tokens, stage 3's 40,960 with the extension's 16,384 after it, stage 1's 32,768,
    # and the run into stage 1 from stage 0's 16,384), each in step order
    assert steps[:-8] == [963, 964, 965, 966, 1105, 1106, 1107, 1108, 1172, 1173, 1174, 1175, 1176, 1177, 1178,
                          411, 412, 501, 502, 591, 592, 679, 680, 681, 682, 318, 319, 320, 321]
    assert default_warmup_steps(Schedule(), limit=40) == steps
    # over the limit, sampled steps go from the end of the schedule first
    assert default_warmup_steps(Schedule(), limit=10) == sampled[:2] + list(range(8))
    # the record's own order: the sampled steps ascending, then the prefix
    assert default_warmup_steps(Schedule(), limit=40, order="schedule") == sampled + list(range(8))


def test_warmup_order_is_checked_with_one_line():
    with pytest.raises(ValueError, match="warmup_order='biggest'.*largest_first, schedule"):
        SpeedrunTimer(warmup_order="biggest")
    with pytest.raises(ValueError, match="warmup_order='x'"):
        default_warmup_steps(Schedule(), order="x")


class _Snapshot(L.Callback):
    def __init__(self):
        self.params = None

    def on_train_start(self, trainer, pl_module):
        self.params = {k: v.detach().clone() for k, v in pl_module.state_dict().items() if torch.is_tensor(v)}


class _SlowValidation(L.Callback):
    def on_validation_batch_end(self, *args, **kwargs):
        time.sleep(0.5)


def test_timer_warmup_resets_everything_and_excludes_validation(toy_files, tmp_path):
    sched = tiny_schedule(12)
    module, data = make_run(toy_files, sched)
    plain = LossRecorder()
    make_trainer(tmp_path / "plain", callbacks=[plain]).fit(module, data)

    module, data = make_run(toy_files, sched)
    before, after = _Snapshot(), _Snapshot()
    timer = SpeedrunTimer(warmup_steps=[0, 1, 5, 6, 11], target=0.0)
    timed = LossRecorder()
    start = time.perf_counter()
    make_trainer(tmp_path / "timed", callbacks=[before, timer, after, timed, _SlowValidation()]).fit(module, data)
    wall = time.perf_counter() - start

    for k, v in before.params.items():
        assert torch.equal(v, after.params[k]), k
    # the warmup ran real steps, then the run reproduced the straight run exactly
    assert timer.warmup_seconds > 0
    for step, loss in plain.losses.items():
        assert timed.losses[step] == loss, step
    val_batches = 4096 // 1024
    assert 0 < timer.elapsed < wall - 0.5 * val_batches  # the slow validation is off the clock
    assert not timer.reached


def test_sigterm_in_the_warmup_stops_it_between_steps_and_puts_the_model_back(toy_files, tmp_path, caplog):
    """A real SIGTERM during the warmup (Lightning's handler sets the flag): the warmup stops before
    its next step, the weights are the ones it started from, no step is trained, and the run ends as
    Lightning ends it at a step (SIGTERMException)."""
    import os
    import signal

    from lightning.pytorch.utilities.exceptions import SIGTERMException

    module, data = make_run(toy_files, tiny_schedule(12))
    before = _Snapshot()
    timer = SpeedrunTimer(warmup_steps=[0, 1, 5, 6, 11], target=0.0)
    ran = []
    run_step = module.run_step

    def run_and_signal(batch):
        out = run_step(batch)
        ran.append(module.global_step)
        if len(ran) == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return out

    module.run_step = run_and_signal
    trained = LossRecorder()
    lightning_log = logging.getLogger("lightning.pytorch")
    lightning_log.addHandler(caplog.handler)
    previous = signal.getsignal(signal.SIGTERM)
    try:
        with pytest.raises(SIGTERMException):
            make_trainer(tmp_path, callbacks=[before, timer, trained]).fit(module, data)
    finally:
        signal.signal(signal.SIGTERM, previous)
        lightning_log.removeHandler(caplog.handler)
    assert len(ran) == 2 and trained.losses == {}
    for k, v in module.state_dict().items():
        if torch.is_tensor(v) and k in before.params:
            assert torch.equal(v, before.params[k]), k
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("speedrun warmup")]
    assert all(re.match(r"speedrun warmup: [12]/5, step [01], [0-9.]+ s \([0-9.]+ s so far\)$", line)
               for line in lines[:2]), lines
    assert len(lines) == 3 and lines[2].startswith("speedrun warmup: stopped by a signal after 2 of 5 steps"), lines


def test_timer_ends_with_the_slowest_timed_steps(toy_files, tmp_path, caplog):
    """The end-of-training line names the median and the slowest timed steps; on CPU no step runs a
    CUDA graph, so none is reported as run eagerly on the clock."""
    module, data = make_run(toy_files, tiny_schedule(6))
    timer = SpeedrunTimer(warmup_steps=[0, 1], target=0.0)
    lightning_log = logging.getLogger("lightning.pytorch")  # it does not propagate to the root logger
    lightning_log.addHandler(caplog.handler)
    try:
        make_trainer(tmp_path, callbacks=[_SlowStep(3, 1.0), timer]).fit(module, data)
    finally:
        lightning_log.removeHandler(caplog.handler)
    assert [step for step, _ in timer._step_seconds] == list(range(6))
    lines = [r.getMessage() for r in caplog.records if "timed steps" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("speedrun timer: 6 timed steps, median ")
    # the slowest steps, slowest first: the slept step is among them at its full second (on a loaded
    # machine another step can take longer still)
    listed = re.search(r"slowest \(step: s\) (.*)", lines[0])[1]
    pairs = [(int(a), float(b)) for a, b in re.findall(r"(\d+): ([0-9.]+)", listed)]
    assert [t for _, t in pairs] == sorted((t for _, t in pairs), reverse=True)
    assert dict(pairs)[3] >= 1.0 and timer.clock_eager_steps == []
    assert "eagerly" not in lines[0]


def test_a_resumed_run_sizes_the_graphs_for_the_plan_without_a_warmup():
    """No warmup after a resume (callbacks hold restored state), but the CUDA graphs' inputs are still
    sized from the whole batch plan before the clock starts, up to trainer.max_steps."""
    plan = PlanBounds(cu_seqlens={512: 9, 1024: 17}, distinct_tokens={512: 300, 1024: 500})
    asked, reserved = [], []

    def lengths_of(stop):
        asked.append(stop)
        return plan

    timer = SpeedrunTimer(target=0.0)
    timer.run_warmup = lambda *a: pytest.fail("a resumed run ran the warmup")
    module = SimpleNamespace(device=torch.device("cpu"), reserve_shapes=reserved.append)
    for max_steps, stop in ((-1, None), (40, 40)):
        trainer = SimpleNamespace(global_step=7, max_steps=max_steps,
                                  datamodule=SimpleNamespace(plan_bounds=lengths_of))
        timer.on_train_start(trainer, module)
        timer._pause(module)
    assert asked == [None, 40] and reserved == [plan, plan]


class _SlowStep(L.Callback):
    def __init__(self, step: int, seconds: float):
        self.step, self.seconds = step, seconds

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step - 1 == self.step:
            time.sleep(self.seconds)


# -- throughput ------------------------------------------------------------------------------

def test_throughput_logs_what_lightnings_meter_computes(toy_files, tmp_path):
    steps, window = 6, 3
    module, data = make_run(toy_files, tiny_schedule(steps))
    meter = SpeedrunThroughput(window_size=window, available_flops=1e12)
    trainer = make_trainer(tmp_path, callbacks=[meter])
    trainer.fit(module, data)
    # every step's micro-batches and tokens were counted (1,024 tokens as 2 micro-batches of 512)
    assert (meter.steps, meter.micro_batches, meter.tokens) == (steps, 2 * steps, 1024 * steps)
    rates = meter.meter.compute()
    logged = trainer.callback_metrics
    assert float(logged["train/tokens_per_s"]) == pytest.approx(rates["device/items_per_sec"])
    assert float(logged["train/device/items_per_sec"]) == pytest.approx(rates["device/items_per_sec"])
    assert float(logged["train/device/mfu"]) == pytest.approx(rates["device/flops_per_sec"] / 1e12)
    # the window's FLOPs are the module's per-step figure: tokens x dense FLOPs per token
    assert module.flops_per_batch == 1024 * module.gpt_config.flops_per_token(512, 64, 256)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_throughput_on_a_gpu_reads_events_and_counts_every_step(toy_files, tmp_path):
    steps, window = 8, 4
    module, data = make_run(toy_files, tiny_schedule(steps))
    meter = SpeedrunThroughput(window_size=window, available_flops=1e12)
    trainer = make_trainer(tmp_path, callbacks=[meter], accelerator="cuda")
    trainer.fit(module, data)
    assert not meter._pending and meter._start is not None  # every step's event was read by the end
    assert (meter.steps, meter.micro_batches, meter.tokens) == (steps, 2 * steps, 1024 * steps)
    assert list(meter.meter._batches) == list(range(steps - window + 1, steps + 1))
    assert meter.meter.compute()["device/items_per_sec"] > 0


def _rotary_state(module) -> dict:
    return {name: (rot.attn_scale, rot.omega.clone()) for name, rot in module.model.rotaries.items()}


def test_the_warmups_out_of_order_visits_see_the_straight_runs_rotary_state():
    """The timer's warmup visits the record's schedule out of order (stage 2 first, step 0 last). YaRN
    multiplies onto the rotary state, so each visit must find the frequencies and softmax scales the
    straight run has at that step, bit for bit: a key compiled and captured at another path's scale
    is compiled and captured again on the clock (on an H100, 3 recompiles of ~33 s at the stage starts)."""
    schedule = Schedule()  # the record's: windows change at steps 320, 681 and later (RECORD §9)
    module = SpeedrunModule(gpt=tiny_gpt(), optim=tiny_optim(), schedule=schedule)
    module.use_plain_optimizer(module.configure_optimizers())
    start = _rotary_state(module)
    visits = default_warmup_steps(schedule)
    assert visits[0] > 681 and visits[-1] == 7  # out of order: a stage-2 run first, the prefix last
    straight, wanted = {}, set(visits)
    for step in range(max(visits) + 1):
        module.apply_schedule(step)
        if step in wanted:
            straight[step] = _rotary_state(module)
    assert straight[max(visits)]["short"][0] > start["short"][0]  # YaRN changed the scale on the way
    previous = 0
    for step in [0] + visits:
        module.apply_schedule(step, previous_step=previous)
        got = _rotary_state(module) if step else start
        for name, (scale, omega) in (straight[step] if step in straight else start).items():
            assert got[name][0] == scale and torch.equal(got[name][1], omega), (step, name)
        previous = step
    # the timer's restore: back to step 0 from the last visit, as a fresh module has it
    module.apply_schedule(0, previous_step=previous)
    for name, (scale, omega) in start.items():
        assert module.model.rotaries[name].attn_scale == scale and torch.equal(module.model.rotaries[name].omega, omega)
    # without previous_step the module knows which step its rotary state reflects: a benchmark that
    # starts at stage 2's first step, and steps on from there, sees the straight run's state too
    for step in (681, 682):
        module.apply_schedule(step)
    fresh = SpeedrunModule(gpt=tiny_gpt(), optim=tiny_optim(), schedule=schedule)
    fresh.use_plain_optimizer(fresh.configure_optimizers())
    for step in range(683):
        fresh.apply_schedule(step)
    for name, (scale, omega) in _rotary_state(fresh).items():
        got = module.model.rotaries[name]
        assert got.attn_scale == scale and torch.equal(got.omega, omega), name
