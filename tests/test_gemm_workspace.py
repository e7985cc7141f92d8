"""cuBLASLt's workspace: none unless the environment names a size, set before CUDA starts, a bad size one clear line."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from nanogpt_pl import launch_queues
from nanogpt_pl.gemm_workspace import ENV, GemmWorkspaceError, set_cublaslt_workspace

ROOT = Path(__file__).resolve().parents[1]


def test_unset_takes_no_workspace_and_the_users_size_is_kept(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert set_cublaslt_workspace() == "0"
    assert os.environ[ENV] == "0"
    monkeypatch.setenv(ENV, " 32768 ")
    assert set_cublaslt_workspace() == "32768"
    monkeypatch.setenv(ENV, "1024")
    assert set_cublaslt_workspace("0") == "1024"
    monkeypatch.delenv(ENV)
    assert set_cublaslt_workspace(None) is None and ENV not in os.environ


@pytest.mark.parametrize("bad", ["", "-1", "32M", "1.5", "lots"])
def test_a_malformed_size_is_one_clear_error(monkeypatch, bad):
    monkeypatch.setenv(ENV, bad)
    with pytest.raises(GemmWorkspaceError, match=r"CUBLASLT_WORKSPACE_SIZE=.*: give a size in KiB such as 0"):
        set_cublaslt_workspace()
    monkeypatch.delenv(ENV)
    with pytest.raises(GemmWorkspaceError, match="give a size in KiB"):
        set_cublaslt_workspace(bad)


def test_once_cuda_is_initialized_nothing_is_set_and_it_says_so(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.warns(UserWarning, match="CUDA is already initialized"):
        assert set_cublaslt_workspace() is None
    assert ENV not in os.environ
    assert launch_queues.cuda_initialized()


def test_main_sets_the_size_before_training(monkeypatch):
    from nanogpt_pl.cli import main

    monkeypatch.delenv(ENV, raising=False)
    with pytest.raises(SystemExit) as done:
        main(["fit", "--config", "configs/quickstart.yaml", "--print_config"])
    assert done.value.code in (0, None)
    assert os.environ[ENV] == "0"


def test_main_names_a_bad_size_in_one_line():
    from warm_python import run

    # PYTHONPATH and one thread as the other command-line tests have them, so the process is forked
    # from their warm one (tests/warm_python.py)
    env = {**os.environ, ENV: "32M", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    out = run([sys.executable, "main.py", "fit", "--config", "configs/quickstart.yaml"], cwd=ROOT, env=env,
              timeout=300)
    assert out.returncode == 1
    assert out.stderr.strip().splitlines()[-1].startswith(
        "error: CUBLASLT_WORKSPACE_SIZE='32M': give a size in KiB such as 0 (no workspace) or 32768 (32 MiB)")
