"""Long command-line runs started in the background as soon as collection ends.

The README's quickstart trains for about three minutes on a 2-core machine, most of it in
one process of torch threads. Started right after collection (``conftest.py``) with one
intra-op thread, it runs beside the rest of the session, whose tests are mostly one thread
of Python, and its test, moved to the end of the session, waits for it and checks what it
wrote. A test whose run was not started in the background (the test selected alone) starts
it itself and waits.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
# Rendezvous variables an earlier in-process Lightning run leaves in os.environ: a child CLI
# that inherits LOCAL_RANK would take itself for a launched rank and wait for its peers.
LAUNCH_VARS = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "WORLD_SIZE", "RANK", "PL_GLOBAL_SEED",
               "PL_SEED_WORKERS")


def command_env(threads: Optional[int] = 1) -> dict[str, str]:
    """The environment the tests give a command-line run: this process's without :data:`LAUNCH_VARS`,
    ``PYTHONPATH`` the repository and ``threads`` OpenMP threads (None: as this process has it)."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env["PYTHONPATH"] = str(ROOT)
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


# test node id -> main.py arguments, for the runs the session starts early
RUNS: dict[str, list[str]] = {
    "test_quickstart.py::test_quickstart_config_end_to_end":
        ["fit", "--config", str(ROOT / "configs" / "quickstart.yaml")],
}


@dataclass
class Finished:
    """What a background run left: exit code, output, and the directory it ran in."""

    returncode: int
    stdout: str
    stderr: str
    cwd: Path


# The niceness of the processes started in the background. The session's own tests (and the processes
# they start) come first; these take what CPU they leave. On a 2-core machine the session is
# CPU-bound while they run, and at equal priority the tests beside them ran 2 to 4 times slower
# than alone (a training loop's threads waiting for a core); niced, they run at nearly their own
# speed, and the background runs finish in the time the later tests, mostly one thread, leave idle.
BACKGROUND_NICENESS = 10


class Process:
    """A child process started now, its output collected in temporary files (no pipe to fill), at
    :data:`BACKGROUND_NICENESS`."""

    def __init__(self, argv: list[str], env: dict[str, str], cwd: Optional[Path] = None) -> None:
        self._out, self._err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        self._proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=self._out, stderr=self._err, text=True)
        # before the child starts threads or processes, which inherit it
        os.setpriority(os.PRIO_PROCESS, self._proc.pid, BACKGROUND_NICENESS)
        self._done: Optional[tuple[int, str, str]] = None

    def wait(self, timeout: float) -> tuple[int, str, str]:
        """(exit code, stdout, stderr) once it ends; past ``timeout`` seconds it is killed and TimeoutExpired raised."""
        if self._done is None:
            try:
                code = self._proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.stop()
                raise
            self._out.seek(0)
            self._err.seek(0)
            self._done = (code, self._out.read(), self._err.read())
            self._out.close()
            self._err.close()
        return self._done

    def stop(self) -> None:
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()


class BackgroundRun:
    """``python main.py ARGS`` in a fresh directory, started now with one intra-op thread."""

    def __init__(self, args: list[str]) -> None:
        self.cwd = Path(tempfile.mkdtemp(prefix="nanogpt-pl-bg-"))
        self._process = Process([sys.executable, str(ROOT / "main.py"), *args], command_env(), self.cwd)

    def result(self, timeout: float) -> Finished:
        return Finished(*self._process.wait(timeout), self.cwd)

    def stop(self) -> None:
        self._process.stop()

    def remove(self) -> None:
        shutil.rmtree(self.cwd, ignore_errors=True)


_runs: dict[str, BackgroundRun] = {}


def is_background_test(nodeid: str) -> bool:
    return any(nodeid.endswith(name) for name in RUNS)


def start_runs(nodeids) -> None:
    """Start the background run of every collected test that has one (from ``conftest.py``)."""
    for nodeid in nodeids:
        for name, args in RUNS.items():
            if nodeid.endswith(name) and name not in _runs:
                _runs[name] = BackgroundRun(args)


def finished_run(name: str, timeout: float) -> Finished:
    """The run of test ``name`` (a key of :data:`RUNS`): the one the session started, else one started now."""
    if name not in _runs:
        _runs[name] = BackgroundRun(RUNS[name])
    return _runs[name].result(timeout)


def stop_runs() -> None:
    """Kill runs still going (the session ended before their tests, e.g. ``-x``) and remove their directories."""
    for run in _runs.values():
        run.stop()
        run.remove()
