"""callbacks.spectra: singular values and stable rank logged to a real logger, and kept off the speedrun clock."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from train_helpers import make_run, make_trainer, tiny_schedule

from callbacks.spectra import Spectra, spectrum
from callbacks.speedrun_timer import SpeedrunTimer


@pytest.fixture(scope="module")
def files():
    from nanogpt_pl.data.corpus import build_corpus

    corpus = build_corpus()
    return corpus.train_pattern, corpus.val_pattern


def test_spectrum_against_its_definition():
    torch.manual_seed(int(torch.randint(0, 10**6, ())))
    w = torch.randn(24, 10) @ torch.diag(torch.linspace(0.1, 3.0, 10))
    got = spectrum(w, 3)
    s = torch.linalg.svdvals(w.double())
    assert [got[f"sv{i}"] for i in range(3)] == pytest.approx(s[:3].tolist(), rel=1e-5)
    assert got["stable_rank"] == pytest.approx(float((w.double().norm() / s[0]) ** 2), rel=1e-5)
    assert spectrum(torch.eye(5), 1)["stable_rank"] == pytest.approx(5.0)


def read(path: Path) -> list[dict]:
    return list(csv.DictReader(open(next(path.rglob("metrics.csv")))))


def test_logged_every_n_steps_to_the_logger(files, tmp_path, one_thread):
    module, data = make_run(files, tiny_schedule(6))
    spectra = Spectra(every_n_steps=2, patterns=["blocks.1.mlp.*"], top_k=3)
    make_trainer(tmp_path, callbacks=[spectra], logger=CSVLogger(tmp_path, name="csv"),
                 limit_val_batches=0).fit(module, data)
    rows = [r for r in read(tmp_path) if r.get("spectra/blocks.1.mlp.fc_w/sv0")]
    assert [int(r["step"]) for r in rows] == [1, 2, 4, 6]
    assert not any(k.startswith("spectra/blocks.0") or "attn" in k for k in rows[0] if rows[0][k])
    final = spectrum(module.model.blocks[1].mlp.fc_w, 3)  # step 6 is the last step: the final weights
    for key, value in final.items():
        assert float(rows[-1][f"spectra/blocks.1.mlp.fc_w/{key}"]) == pytest.approx(value, rel=1e-5)
    assert float(rows[-1]["spectra/blocks.1.mlp.proj_w/stable_rank"]) >= 1.0


def test_stays_off_the_speedrun_clock(files, tmp_path, one_thread):
    module, data = make_run(files, tiny_schedule(4))
    with pytest.warns(UserWarning, match="not computed while the SpeedrunTimer's clock runs"):
        make_trainer(tmp_path, callbacks=[Spectra(every_n_steps=1), SpeedrunTimer(warmup_steps=[])],
                     logger=CSVLogger(tmp_path, name="csv"), limit_val_batches=0).fit(module, data)
    assert not any(k.startswith("spectra/") and r[k] for r in read(tmp_path) for k in r)


def test_a_pattern_matching_nothing_is_named(files, tmp_path):
    module, data = make_run(files, tiny_schedule(2))
    with pytest.raises(ValueError, match=r"match no weight matrix; names look like \['blocks.0"):
        make_trainer(tmp_path, callbacks=[Spectra(patterns=["decoder.*"])]).fit(module, data)
