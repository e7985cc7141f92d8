"""The stage table: record values at the boundary steps, YAML == defaults, errors."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from nanogpt_pl.config_files import load_config
from nanogpt_pl.schedule import Schedule, Stage

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def record() -> Schedule:
    return Schedule()


def test_stage_ends_and_total(record):
    # RECORD §9: stage ends [0, 320, 681, 1107, 1174, 1194]; 1174 scheduled steps + 20 extension
    assert [record.stage_start(i) for i in range(5)] == [0, 320, 681, 1107, 1174]
    assert record.total_steps == 1194 and record.scheduled_steps == 1174
    assert record.cooldown_start == 234


@pytest.mark.parametrize("step,batch,seq,doc,windows", [
    (0, 131072, 16384, 896, (128, 384)),
    (319, 131072, 16384, 896, (128, 384)),
    (320, 262144, 32768, 2048, (384, 896)),
    (680, 262144, 32768, 2048, (384, 896)),
    (681, 393216, 49152, 3072, (640, 1408)),
    (1106, 393216, 49152, 3072, (640, 1408)),
    (1107, 327680, 40960, 3072, (640, 1408)),
    (1173, 327680, 40960, 3072, (640, 1408)),
    (1174, 131072, 16384, 3072, (768, 1664)),
    (1193, 131072, 16384, 3072, (768, 1664)),
])
def test_batch_shape_and_windows_at_boundaries(record, step, batch, seq, doc, windows):
    assert record.batch_tokens(step) == batch
    assert record.seq_len(step) == seq
    assert record.max_doc_len(step) == doc
    assert record.windows(step) == windows
    assert record.grad_accum(step, 8) == 1 and record.grad_accum(step, 1) == 8


@pytest.mark.parametrize("step,expected", [
    # RECORD §9 sample values (rounded to 3 decimals there)
    (0, 1.0), (233, 1.0), (319, 0.937), (320, 1.408), (680, 0.941), (681, 1.050), (1106, 0.403), (1107, 0.391),
    (1173, 0.301), (1174, 0.30), (1193, 0.30),
])
def test_lr_multiplier(record, step, expected):
    assert abs(record.lr_mul(step) - expected) < 1.5e-3


def test_lr_cooldown_formula(record):
    for step in (234, 500, 900, 1150):
        tau = min(1.0, (step - 234) / (1174 - 234))
        assert math.isclose(record.lr_mul(step), record.stage(step).lr_mul * (1 - tau) + 0.30 * tau)


@pytest.mark.parametrize("step,expected", [(0, 10240), (680, 10240), (681, 14336), (964, 14336), (965, 24576),
                                           (1106, 24576), (1107, None), (1193, None)])
def test_candidates(record, step, expected):
    # RECORD §6 (the code's values: 14,336 at 681-964, 24,576 at 965-1106, full from 1107)
    assert record.candidates(step) == expected


@pytest.mark.parametrize("step,expected", [(0, 0.25), (319, 0.25), (320, 0.20), (410, 0.20), (411, 0.15),
                                           (500, 0.15), (501, 0.10), (591, 0.05), (680, 0.05), (681, 0.0)])
def test_prefix_weight(record, step, expected):
    # RECORD §2 / §11: quarters of stage 1 start at 411, 501, 591
    assert record.prefix_weight(step) == expected


def test_mtp_weights(record):
    assert record.mtp_weights(0) == [1.0, 0.5, 0.25]
    assert record.mtp_weights(319) == [1.0, 0.5]  # the third weight reached 0 and is dropped
    mid = record.mtp_weights(160)
    assert mid[:2] == [1.0, 0.5] and abs(mid[2] - 0.25 * (1 - 160 / 319)) < 1e-12
    assert record.mtp_weights(320) == [1.0, 0.5] and record.mtp_weights(680) == [1.0]
    assert record.mtp_weights(681) == [1.0] and record.mtp_weights(1193) == [1.0]


def test_momentum(record):
    # RECORD §8: 0.85 → 0.93 over 0-240, flat, back to 0.85 over the last 50 steps
    assert record.momentum(0) == 0.85
    assert math.isclose(record.momentum(120), 0.89)
    assert record.momentum(240) == 0.93 and record.momentum(1143) == 0.93
    assert math.isclose(record.momentum(1193), 0.93 - 0.08 * 49 / 50)


def test_cadences(record):
    # RECORD §5 / §8: Adam on odd steps; sparse channels every 4th step (mod 4 = 3) from 336
    assert [s for s in range(8) if record.adam_step(s)] == [1, 3, 5, 7]
    assert record.sparse_step(333) and record.sparse_step(335)
    assert not record.sparse_step(337) and record.sparse_step(339) and record.sparse_step(343)
    assert not record.sparse_cadence_engaged(335) and record.sparse_cadence_engaged(336)
    assert not record.anvil_engaged(513) and record.anvil_engaged(514)
    assert record.tied(1174) and not record.tied(1175)


def test_tokens_consumed(record):
    # RECORD §1: 328,663,040 tokens over the whole run
    assert record.tokens_through(1193) == 328_663_040
    assert record.tokens_through(0) == 131072 and record.tokens_through(-1) == 0


@pytest.mark.parametrize("config", ["speedrun.yaml", "speedrun_1gpu.yaml"])
def test_speedrun_yaml_holds_the_record_table(record, config):
    cfg = load_config(ROOT / "configs" / config)["schedule"]  # speedrun_1gpu.yaml takes it from its base
    cfg["stages"] = [Stage(**s) for s in cfg["stages"]]
    from_yaml = Schedule(**cfg)
    for step in range(record.total_steps):
        for fn in ("batch_tokens", "seq_len", "max_doc_len", "windows", "candidates", "prefix_weight",
                   "mtp_weights", "adam_step", "sparse_step", "tied", "momentum", "attention_split"):
            assert getattr(from_yaml, fn)(step) == getattr(record, fn)(step), (fn, step)
        assert abs(from_yaml.lr_mul(step) - record.lr_mul(step)) < 1e-6


def test_bad_schedules_are_named():
    with pytest.raises(ValueError, match="not a multiple of seq_len"):
        Schedule(stages=[Stage(steps=5, batch_tokens=1000, seq_len=300, max_doc_len=100)])
    with pytest.raises(ValueError, match="steps must be positive"):
        Schedule(stages=[Stage(steps=0, batch_tokens=1024, seq_len=512, max_doc_len=100)])
    sched = Schedule(stages=[Stage(steps=5, batch_tokens=1536, seq_len=512, max_doc_len=100)])
    with pytest.raises(ValueError, match="not divisible by world_size 2 x seq_len 512"):
        sched.check_world_size(2)


def test_run_steps_is_the_schedule_end_or_a_smaller_max_steps(record):
    # Lightning's max_steps: -1 (and 0 / None) means no limit
    for no_limit in (None, -1, 0):
        assert record.run_steps(no_limit) == 1194  # RECORD §9: 1,174 scheduled + 20 extension steps
    assert record.run_steps(50) == 50 and record.run_steps(1194) == 1194 and record.run_steps(5000) == 1194
