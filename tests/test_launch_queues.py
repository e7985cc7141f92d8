"""The launch queues' scale: set before CUDA starts, the user's own value kept, a bad one one clear line."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from nanogpt_pl import launch_queues
from nanogpt_pl.launch_queues import ENV, LaunchQueueError, scale_launch_queues

ROOT = Path(__file__).resolve().parents[1]


def test_unset_takes_the_default_and_the_users_scale_is_kept(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert scale_launch_queues() == "4x"
    assert os.environ[ENV] == "4x"
    monkeypatch.setenv(ENV, " 1x ")
    assert scale_launch_queues() == "1x"
    monkeypatch.setenv(ENV, "0.25x")
    assert scale_launch_queues("2x") == "0.25x"
    monkeypatch.delenv(ENV)
    assert scale_launch_queues(None) is None and ENV not in os.environ


@pytest.mark.parametrize("bad", ["4", "x", "four", "4 x", "-2x"])
def test_a_malformed_scale_is_one_clear_error(monkeypatch, bad):
    monkeypatch.setenv(ENV, bad)
    with pytest.raises(LaunchQueueError, match=r"CUDA_SCALE_LAUNCH_QUEUES=.*: give a scale such as 4x"):
        scale_launch_queues()
    monkeypatch.delenv(ENV)
    with pytest.raises(LaunchQueueError, match="give a scale such as 4x"):
        scale_launch_queues(bad)


def test_once_cuda_is_initialized_nothing_is_set_and_it_says_so(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.warns(UserWarning, match="CUDA is already initialized"):
        assert scale_launch_queues() is None
    assert ENV not in os.environ
    assert launch_queues.cuda_initialized()


def test_main_sets_the_scale_before_training(monkeypatch, capsys):
    from nanogpt_pl.cli import main

    monkeypatch.delenv(ENV, raising=False)
    with pytest.raises(SystemExit) as done:
        main(["fit", "--config", "configs/quickstart.yaml", "--print_config"])
    assert done.value.code in (0, None)
    assert os.environ[ENV] == "4x"


def test_main_names_a_bad_scale_in_one_line():
    from warm_python import run

    # PYTHONPATH and one thread as the other command-line tests have them, so the process is forked
    # from their warm one (tests/warm_python.py); main.py's folder is first on the path either way
    env = {**os.environ, ENV: "lots", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    out = run([sys.executable, "main.py", "fit", "--config", "configs/quickstart.yaml"], cwd=ROOT, env=env,
              timeout=300)
    assert out.returncode == 1
    assert out.stderr.strip().splitlines()[-1].startswith(
        "error: CUDA_SCALE_LAUNCH_QUEUES='lots': give a scale such as 4x (1x keeps the driver's default queues)")
