"""Command-line runs of the tests forked from one warm Python process instead of started cold.

A cold ``python main.py ...`` spends about 5 s of a 2-core machine importing torch, Lightning and
the project before its first line of work, and the tests start a few dozen of them. The warm
process (this module run as a script) imports the project's command line once; each run is then a
fork of it that runs the command's script or module (``runpy``) as the interpreter does
(``__name__ == "__main__"``, ``__file__``, ``sys.argv``, ``sys.path[0]``, the working directory and
environment asked for, stdin from /dev/null, stdout and stderr to files, an uncaught exception's
traceback from the command's own frames), and leaves through the interpreter's usual shutdown: its
exit status (a negative signal number when a signal ended it) is what ``subprocess.run`` would
report. Each run is still a process of its own, so nothing one run changes reaches another, and
what a run starts (Lightning's other ranks, ablate's runs) starts cold as before.
``tests/test_warm_python.py`` compares warm runs with cold ones.

The warm process forks only while it has one thread (checked when it starts), and it is started
with the first run's environment: :func:`run` starts a command cold (``subprocess.run``) when its
interpreter or its form (``python SCRIPT ...`` or ``python -m MODULE ...``) differs, when it asks for
other values of the variables a process reads as it starts (``PYTHONPATH``, ``OMP_NUM_THREADS``, ...:
:data:`STARTUP_PREFIXES`), or when the warm process could not start.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
_SELF = __file__  # (a script's run replaces the __main__ module, not this module's globals)
READY_TIMEOUT_S = 120
# variables read when a process starts (Python's own, the thread pools', torch's and the loader's): a
# run asking for other values of any of these than the warm process has starts cold
STARTUP_PREFIXES = ("PYTHON", "OMP_", "GOMP_", "KMP_", "MKL_", "TORCH", "LD_", "MALLOC_")


def _startup_vars(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(STARTUP_PREFIXES)}


# -- the warm process ------------------------------------------------------------------------------
def _serve() -> dict:
    """Fork a child per request; returns the request in each child (the parent loops until stdin ends)."""
    import threading

    sys.path[0] = str(ROOT)  # not this folder: no test module may stand in for one the imports look for
    import nanogpt_pl.cli  # noqa: F401  (torch, Lightning and the project: what every run imports first)

    requests = os.fdopen(os.dup(0), "rb")
    replies = os.dup(1)
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(2, 1)
    threads = len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else threading.active_count()
    if threads != 1:  # a fork copies only the forking thread: refuse rather than fork a broken copy
        os.write(replies, json.dumps({"error": f"{threads} threads after the imports"}).encode() + b"\n")
        sys.exit(1)
    os.write(replies, b'{"ready": true}\n')
    for line in requests:
        request = json.loads(line)
        sys.stdout.flush()  # nothing buffered here may be written again by the child
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            requests.close()
            os.close(replies)
            return request
        os.write(replies, json.dumps({"pid": pid}).encode() + b"\n")
        _, status = os.waitpid(pid, 0)
        os.write(replies, json.dumps({"returncode": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
    sys.exit(0)


def _become(request: dict) -> None:
    """In the forked child: the process ``python ARGV`` would be, then run it (the interpreter's exit follows)."""
    import runpy

    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(out, fd)
        os.close(out)
    argv = request["argv"]
    try:
        if argv[0] == "-m":
            sys.argv = ["-m", *argv[2:]]  # run_module puts the module's file first, as python -m does
            sys.path[0] = os.getcwd()
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            _run_script(argv)
    except SystemExit:
        raise
    except BaseException as exc:  # noqa: BLE001  (what the interpreter does with it: traceback, exit status 1)
        tb = exc.__traceback__
        ours = (_SELF, runpy.__file__, runpy.run_path.__code__.co_filename)  # runpy may be frozen
        while tb is not None and tb.tb_frame.f_code.co_filename in ours:
            tb = tb.tb_next  # the traceback from the command's own frames, as a cold run prints it
        sys.excepthook(type(exc), exc.with_traceback(tb), tb)
        sys.exit(1)


def _run_script(argv: list[str]) -> None:
    """``python SCRIPT ARGS`` from here on: the script's code as the ``__main__`` module, its absolute path
    as ``__file__`` and in tracebacks, ``sys.argv[0]`` as given and its (link-resolved) folder first on the
    path. (``runpy.run_path`` would put the path it was given in ``sys.argv[0]`` as well.)"""
    import builtins
    import importlib.machinery
    import types

    path = os.path.abspath(argv[0])
    with open(path, "rb") as f:
        code = compile(f.read(), path, "exec")
    module = types.ModuleType("__main__")
    module.__dict__.update(__file__=path, __cached__=None, __package__=None, __spec__=None, __builtins__=builtins,
                           __loader__=importlib.machinery.SourceFileLoader("__main__", path))
    sys.modules["__main__"] = module
    sys.argv = list(argv)
    sys.path[0] = os.path.dirname(os.path.realpath(path))
    exec(code, module.__dict__)


# -- the test side ---------------------------------------------------------------------------------
class _Server:
    """The warm process, started on first use."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env
        self._log = tempfile.TemporaryFile("w+")
        self._proc = subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=self._log, env=env, cwd=ROOT)
        self._child: Optional[int] = None
        self._pending = b""
        try:
            self.ready = self._reply(READY_TIMEOUT_S).get("ready", False)
        except TimeoutError:
            self.ready = False
        if not self.ready:
            self.stop()

    def _reply(self, timeout: float) -> dict:
        """The next reply line; {} if the process ended; ``TimeoutError`` past ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        fd = self._proc.stdout.fileno()
        while b"\n" not in self._pending:
            ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                raise TimeoutError
            data = os.read(fd, 65536)
            if not data:
                return {}
            self._pending += data
        line, self._pending = self._pending.split(b"\n", 1)
        return json.loads(line)

    def run(self, argv: list[str], cwd: Path, env: dict[str, str],
            timeout: float) -> Optional[subprocess.CompletedProcess]:
        """The finished run; None if the warm process could not start it (it is not used again)."""
        with tempfile.TemporaryDirectory() as tmp:
            out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
            request = {"argv": argv[1:], "cwd": str(cwd), "env": env, "stdout": out, "stderr": err}
            start = time.monotonic()
            try:
                self._proc.stdin.write(json.dumps(request).encode() + b"\n")
                self._proc.stdin.flush()
                self._child = self._reply(READY_TIMEOUT_S).get("pid")
            except (OSError, TimeoutError):
                self._child = None
            if self._child is None:
                self.ready = False
                self.stop()
                return None
            try:
                done = self._reply(max(0.0, timeout - (time.monotonic() - start)))
            except TimeoutError:
                self.stop()
                raise subprocess.TimeoutExpired(argv, timeout) from None
            self._child = None
            if "returncode" not in done:  # the warm process died with the run under way: say so, run nothing again
                self.stop()
                self._log.seek(0)
                raise RuntimeError(f"the warm process ended during {argv}: {self._log.read()[-3000:]}")
            with open(out) as o, open(err) as e:
                return subprocess.CompletedProcess(argv, done["returncode"], o.read(), e.read())

    def stop(self) -> None:
        """End the run in progress, if any, and the warm process."""
        if self._child is not None:
            try:
                os.kill(self._child, 9)
            except ProcessLookupError:
                pass
            self._child = None
        if self._proc.poll() is None:
            self._proc.stdin.close()
            try:
                self._proc.wait(30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self.ready = False


_server: Optional[_Server] = None


def _warm_form(argv: list[str]) -> bool:
    return len(argv) >= 2 and argv[0] == sys.executable and (argv[1] == "-m" or not argv[1].startswith("-"))


def run(argv: list[str], cwd: Path, env: dict[str, str], timeout: float = 600) -> subprocess.CompletedProcess:
    """``subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)``, forked from
    the warm process where it can be (the module docstring says when)."""
    global _server
    if _warm_form(argv):
        if _server is None:
            _server = _Server(dict(env))
        if _server.ready and _startup_vars(env) == _startup_vars(_server.env):
            done = _server.run(argv, cwd, env, timeout)
            if done is not None:
                return done
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def stop() -> None:
    """End the warm process (from ``conftest.py`` at the end of the session)."""
    if _server is not None:
        _server.stop()


if __name__ == "__main__":
    _become(_serve())
