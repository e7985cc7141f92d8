"""The variables CUDA or its libraries read once per process (``nanogpt_pl/cuda_env.py``): the launch
queues' scale and cuBLASLt's workspace, each set before CUDA starts, the user's own value kept, a bad
one one clear line."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Callable, NamedTuple

import pytest
import torch

from nanogpt_pl import cuda_env, gemm_workspace, launch_queues
from nanogpt_pl.gemm_workspace import GemmWorkspaceError, set_cublaslt_workspace
from nanogpt_pl.launch_queues import LaunchQueueError, scale_launch_queues

ROOT = Path(__file__).resolve().parents[1]


class Setting(NamedTuple):
    env: str
    set_default: Callable
    error: type
    default: str  # what main.py sets when the environment names nothing
    kept: tuple[str, str, str]  # a user's value (spaces stripped), a user's value and another default
    bad: tuple[str, ...]
    bad_env: str  # the message's pattern for a bad value in the environment
    bad_default: str  # ... and for a bad default
    bad_main: tuple[str, str]  # a value main.py refuses, and its one error line


QUEUES = Setting(launch_queues.ENV, scale_launch_queues, LaunchQueueError, "4x", ("1x", "0.25x", "2x"),
                 ("4", "x", "four", "4 x", "-2x"), r"CUDA_SCALE_LAUNCH_QUEUES=.*: give a scale such as 4x",
                 "give a scale such as 4x",
                 ("lots", "error: CUDA_SCALE_LAUNCH_QUEUES='lots': give a scale such as 4x (1x keeps the driver's "
                          "default queues)"))
WORKSPACE = Setting(gemm_workspace.ENV, set_cublaslt_workspace, GemmWorkspaceError, "0", ("32768", "1024", "0"),
                    ("", "-1", "32M", "1.5", "lots"), r"CUBLASLT_WORKSPACE_SIZE=.*: give a size in KiB such as 0",
                    "give a size in KiB",
                    ("32M", "error: CUBLASLT_WORKSPACE_SIZE='32M': give a size in KiB such as 0 (no workspace) or "
                            "32768 (32 MiB)"))
SETTINGS = pytest.mark.parametrize("s", [QUEUES, WORKSPACE], ids=["launch_queues", "gemm_workspace"])


@SETTINGS
def test_unset_takes_the_default_and_the_users_value_is_kept(monkeypatch, s):
    monkeypatch.delenv(s.env, raising=False)
    assert s.set_default() == s.default
    assert os.environ[s.env] == s.default
    first, second, other_default = s.kept
    monkeypatch.setenv(s.env, f" {first} ")
    assert s.set_default() == first
    monkeypatch.setenv(s.env, second)
    assert s.set_default(other_default) == second
    monkeypatch.delenv(s.env)
    assert s.set_default(None) is None and s.env not in os.environ


@SETTINGS
def test_a_malformed_value_is_one_clear_error(monkeypatch, s):
    for bad in s.bad:
        monkeypatch.setenv(s.env, bad)
        with pytest.raises(s.error, match=s.bad_env):
            s.set_default()
        monkeypatch.delenv(s.env)
        with pytest.raises(s.error, match=s.bad_default):
            s.set_default(bad)


@SETTINGS
def test_once_cuda_is_initialized_nothing_is_set_and_it_says_so(monkeypatch, s):
    monkeypatch.delenv(s.env, raising=False)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.warns(UserWarning, match="CUDA is already initialized"):
        assert s.set_default() is None
    assert s.env not in os.environ
    assert cuda_env.cuda_initialized()


def test_main_sets_both_before_training(monkeypatch):
    from nanogpt_pl.cli import main

    for s in (QUEUES, WORKSPACE):
        monkeypatch.delenv(s.env, raising=False)
    with pytest.raises(SystemExit) as done:
        main(["fit", "--config", "configs/quickstart.yaml", "--print_config"])
    assert done.value.code in (0, None)
    assert os.environ[QUEUES.env] == "4x" and os.environ[WORKSPACE.env] == "0"


@SETTINGS
def test_main_names_a_bad_value_in_one_line(s):
    from warm_python import run

    # PYTHONPATH and one thread as the other command-line tests have them, so the process is forked
    # from their warm one (tests/warm_python.py); main.py's folder is first on the path either way
    value, line = s.bad_main
    env = {**os.environ, s.env: value, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    out = run([sys.executable, "main.py", "fit", "--config", "configs/quickstart.yaml"], cwd=ROOT, env=env,
              timeout=300)
    assert out.returncode == 1
    assert out.stderr.strip().splitlines()[-1].startswith(line)
