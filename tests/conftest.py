"""Shared pytest set-up: ``@pytest.mark.cuda`` tests skip on machines without a CUDA GPU; shared fixtures.

Fixtures: ``one_thread``; ``toy_files`` (small Markov-chain train/val shards); ``toy_config``
(a tiny CPU config file from configs/quickstart.yaml); ``run_cli`` (main.py in a process of its own,
forked from a warm one: tests/warm_python.py).
"""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from background import command_env, is_background_test, start_runs, stop_runs
from interpreter import is_launcher_module, register_session_modules, start_session_child, stop_children
from seeds import fresh_seed
from train_helpers import write_markov_shards
from warm_python import run as warm_run
from warm_python import stop as stop_warm_python

ROOT = Path(__file__).resolve().parents[1]
# One intra-op thread in the session's own process: its tests train and check tiny models, whose ops
# gain little from a second thread, and on a 2-core machine the background runs, the multi-rank
# tests' processes and the command-line runs want the other core (full suite on 2 cores: 793 s with
# torch's default of two threads, 715 s with one). ``one_thread`` still pins it for the tests that ask.
torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    # the Triton-interpreter launchers collected this session share one child process (tests/interpreter.py)
    launchers = {str(item.fspath) for item in items if item.name.endswith("_under_interpreter")}
    register_session_modules(p for p in launchers if is_launcher_module(p))
    start_session_child()  # in the background, beside the parent's tests
    start_runs(item.nodeid for item in items)  # the long CLI runs too (tests/background.py)
    # the launchers and the background runs' tests wait for them: last, so the parent's other tests
    # run meanwhile
    items.sort(key=lambda item: (is_background_test(item.nodeid), item.name.endswith("_under_interpreter")))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


def pytest_sessionfinish(session, exitstatus):
    stop_children()
    stop_runs()
    stop_warm_python()


@pytest.fixture
def one_thread():
    """One intra-op thread for the test: tiny matmuls on a shared 2-core machine run faster without them."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def toy_files(tmp_path_factory) -> tuple[str, str]:
    """(train glob, val glob) of small Markov-chain token shards, written once per session."""
    return write_markov_shards(tmp_path_factory.mktemp("toy"))


def _toy_config(tmp: Path, files: tuple[str, str], **overrides) -> Path:
    cfg = yaml.safe_load((ROOT / "configs" / "quickstart.yaml").read_text())
    cfg["trainer"].update(accelerator="cpu", enable_progress_bar=False, enable_model_summary=False)
    cfg["trainer"]["logger"] = [{"class_path": "lightning.pytorch.loggers.CSVLogger",
                                 "init_args": {"save_dir": str(tmp / "logs"), "name": "toy"}}]
    cfg["trainer"]["callbacks"] = [{"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                                    "init_args": {"dirpath": str(tmp / "ckpt"), "save_last": True}}]
    cfg["model"]["gpt"].update(num_layers=2, model_dim=32, num_heads=2, head_dim=16, mlp_hidden=64,
                               long_window_layers=[1], value_embed_layers=[1], skip_from=None, skip_to=None)
    cfg["schedule"]["stages"] = [dict(steps=6, batch_tokens=1024, seq_len=512, max_doc_len=256, window_short=64,
                                      window_long=256, candidates=2048)]
    cfg["schedule"]["warmup_steps"] = 2
    cfg["data"] = dict(train_files=files[0], val_files=files[1], val_tokens=4096, val_seq_len=1024, prefetch=2)
    for key, value in overrides.items():
        node = cfg
        *path, last = key.split(".")
        for p in path:
            node = node.setdefault(p, {})
        node[last] = value
    out = tmp / "config.yaml"
    out.write_text(yaml.safe_dump(cfg))
    return out




def cli_in_process(args: list[str], cwd: Path | None = None) -> tuple[int, str, str]:
    """``python main.py *args`` run inside this process: (exit code, stdout, stderr).

    For ``--print_config`` checks, which stop after the parse: one takes ~0.4 s here against
    ~6 s in a fresh interpreter (importing torch and Lightning). Anything that trains runs in
    a subprocess (``run_cli``). ``cwd``: the directory relative paths are read from.
    """
    from nanogpt_pl.cli import main

    out, err, here = io.StringIO(), io.StringIO(), Path.cwd()
    if cwd is not None:
        os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(list(args))
            except SystemExit as stop:  # --print_config and parse errors leave through SystemExit
                code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    finally:
        os.chdir(here)
    return code, out.getvalue(), err.getvalue()


def cli_in_process_as_command(args: list[str], cwd: Path | None = None) -> tuple[int, str, str]:
    """:func:`cli_in_process` under the environment a command-line run gets (``command_env``: the launch variables
    removed, ``PYTHONPATH`` the repository, one OpenMP thread), restored afterwards: for the commands
    that train nothing themselves (``ablate`` starts each run as a process of its own, which inherits it)."""
    from unittest import mock

    with mock.patch.dict(os.environ):
        env = command_env()
        os.environ.clear()
        os.environ.update(env)
        return cli_in_process(args, cwd)


def _run_cli(args: list[str], cwd: Path, timeout: int = 600, threads: int | None = 1) -> subprocess.CompletedProcess:
    env = command_env(threads)
    # a process of its own, forked from a warm one that imported the project already (tests/warm_python.py)
    return warm_run([sys.executable, str(ROOT / "main.py"), *args], cwd=cwd, env=env, timeout=timeout)


@pytest.fixture
def random_seed() -> int:
    """A new seed for this test (``seeds.fresh_seed``), printed so a failing test's report names it.

    A fixture rather than a parametrization: a parameter drawn at collection differs between the
    processes of a parallel run (pytest-xdist), which must all collect the same tests."""
    seed = fresh_seed()
    print(f"random_seed: {seed}")
    return seed


@pytest.fixture
def toy_config():
    """``toy_config(tmp, files, **{"dotted.key": value})``: a tiny CPU config file; returns its path."""
    return _toy_config


@pytest.fixture
def run_cli():
    """``run_cli(args, cwd, timeout=600, threads=1)``: ``python main.py *args`` in a process of its own
    (forked from the warm process of tests/warm_python.py where it can be)."""
    return _run_cli


@pytest.fixture(autouse=True)
def _release_gpu_memory(request):
    """After a GPU test, free what its reference cycles still hold and return the cached blocks:
    the record-size GPU tests each need most of an 80 GB card, one after another."""
    yield
    if request.node.get_closest_marker("cuda") is not None and torch.cuda.is_available():
        import gc

        gc.collect()
        torch.cuda.empty_cache()
