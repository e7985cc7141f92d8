"""Run test modules again in a child process under ``TRITON_INTERPRET=1``.

The variable must be set before triton is imported, so a module's interpreter tests run
in a fresh process: the module's launcher test (``test_*_under_interpreter``) calls
:func:`run_module_under_interpreter`, and the module's ``@interp`` tests run only there.

One child serves the whole session: ``pytest`` on every module whose launcher this session
collected (``conftest.py`` registers them with :func:`register_session_modules`), and each
launcher checks its own module's part of that run. A child's start-up (interpreter, torch,
triton, the test modules' imports) costs about 7 s on a 2-core machine, once instead of once
per module. The child starts in the background as soon as collection ends
(:func:`start_session_child`) and runs beside the parent's tests, and ``conftest.py`` moves
the launchers to the end of the session: both processes are mostly one thread of Python, so on
a 2-core machine the child's ~80 s then cost the session little. A launcher waits for the
child; a launcher whose module it does not cover starts its own run.
"""

import importlib.util
import os
import re
import sys
from dataclasses import dataclass
from typing import Optional

import pytest
from background import Process

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
interp = pytest.mark.skipif(not INTERPRETED, reason="runs in the TRITON_INTERPRET=1 child process")
LAUNCHER_CALL = "run_module_under_interpreter(__file__)"

_session_modules: set[str] = set()  # absolute paths of the modules whose launchers were collected


@dataclass
class ChildRun:
    """One child ``pytest`` run over several modules: its exit code, output, and per-module outcomes."""

    returncode: int
    output: str
    outcomes: dict[str, list[tuple[str, str]]]  # module file name -> (test id, outcome)
    selected: int  # tests the child collected and did not deselect


def register_session_modules(paths) -> None:
    """Modules (paths) whose launcher test this session collected: the shared child runs them all."""
    _session_modules.update(os.path.abspath(str(p)) for p in paths)


def is_launcher_module(path) -> bool:
    with open(path) as f:
        return LAUNCHER_CALL in f.read()


def parent_only_tests(source: str) -> set[str]:
    """The module's tests marked ``skipif(INTERPRETED, ...)``: they run in the parent, so the child skips them."""
    names, pending = set(), False
    for line in source.splitlines():
        if line.startswith("@pytest.mark.skipif(INTERPRETED"):
            pending = True
        elif line.startswith("def "):
            if pending:
                names.add(line[4:].split("(")[0])
            pending = False
        elif not line.startswith("@"):
            pending = False
    return names


def parse_child(returncode: int, stdout: str, stderr: str) -> ChildRun:
    """The per-module outcomes of a ``pytest -v`` run (a test id may hold spaces:
    parametrize ids such as "[many short documents-64-64]")."""
    outcomes: dict[str, list[tuple[str, str]]] = {}
    for module, name, outcome in re.findall(
            r"^(\S+?\.py)::(.+?) (PASSED|SKIPPED|FAILED|ERROR|XFAIL|XPASS)\b", stdout, re.M):
        outcomes.setdefault(os.path.basename(module), []).append((name, outcome))
    collected = re.search(r"collected (\d+) items?(?: / (\d+) deselected)?", stdout)
    selected = -1 if collected is None else int(collected.group(1)) - int(collected.group(2) or 0)
    return ChildRun(returncode, stdout[-6000:] + stderr[-3000:], outcomes, selected)


class _Child:
    """A child ``pytest`` run under the interpreter, started now; :meth:`result` waits for it."""

    def __init__(self, modules: tuple[str, ...]) -> None:
        # one intra-op thread: the interpreter's tests are small, and the parent runs beside it
        env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
        self._process = Process([sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-m", "not cuda",
                                 "--continue-on-collection-errors", *modules], env)
        self._run: Optional[ChildRun] = None

    def result(self) -> ChildRun:
        if self._run is None:
            self._run = parse_child(*self._process.wait(CHILD_TIMEOUT_S))
        return self._run

    def stop(self) -> None:
        self._process.stop()


CHILD_TIMEOUT_S = 900
_children: dict[tuple[str, ...], _Child] = {}


def start_session_child() -> None:
    """Start the session's child in the background (from ``conftest.py``, after collection):
    nothing in a child itself, without registered launchers, or without triton."""
    if INTERPRETED or not _session_modules or importlib.util.find_spec("triton") is None:
        return
    modules = tuple(sorted(_session_modules))
    if modules not in _children:
        _children[modules] = _Child(modules)


def stop_children() -> None:
    """Kill children still running (the session ended before their launchers ran, e.g. ``-x``)."""
    for child in _children.values():
        child.stop()


def _child_run(path: str) -> ChildRun:
    path = os.path.abspath(path)
    for modules, child in _children.items():
        if path in modules:
            return child.result()
    modules = tuple(sorted(_session_modules | {path}))
    if modules not in _children:
        _children[modules] = _Child(modules)
    return _children[modules].result()


def check_module(run: ChildRun, path: str) -> int:
    """Check ``path``'s part of a child run; returns the module's pass count.

    The child runs the module's tests but its ``@pytest.mark.cuda`` ones (deselected: the
    interpreter is the CPU path). It must report an outcome for every test it selected (all
    modules together: a child that died part-way fails every launcher), skip only the tests
    marked ``skipif(INTERPRETED, ...)`` (the launcher among them, which run in the parent),
    pass all the module's others, and pass at least one test per ``@interp`` function of the
    module, so a child that runs nothing, or skips what it should run, fails the launcher.
    """
    tail = run.output
    assert run.returncode in (0, 1), tail  # 1: some test failed (whose, below); else the run itself broke
    assert run.selected >= 0 and sum(map(len, run.outcomes.values())) == run.selected, tail
    mine = run.outcomes.get(os.path.basename(path), [])
    with open(path) as f:
        source = f.read()
    failed = [name for name, outcome in mine if outcome not in ("PASSED", "SKIPPED")]
    assert not failed, (failed, tail)
    passed = [name for name, outcome in mine if outcome == "PASSED"]
    skipped = [name.split("[")[0] for name, outcome in mine if outcome == "SKIPPED"]
    parent_only = parent_only_tests(source)
    assert any(name.endswith("_under_interpreter") for name in skipped), (skipped, tail)
    assert set(skipped) <= parent_only, (skipped, parent_only, tail)
    interp_functions = len(re.findall(r"^@interp\b", source, re.M))
    assert interp_functions > 0 and len(passed) >= interp_functions, (interp_functions, len(passed), tail)
    return len(passed)


def run_module_under_interpreter(path: str) -> int:
    """Run ``path``'s tests with TRITON_INTERPRET=1 (in the session's shared child) and check
    them (:func:`check_module`); returns the module's pass count."""
    pytest.importorskip("triton")
    return check_module(_child_run(path), path)
