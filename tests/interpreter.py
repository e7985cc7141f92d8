"""Run a test module again in a child process under ``TRITON_INTERPRET=1``.

The variable must be set before triton is imported, so a module's interpreter tests run
in a fresh process: the parent test launches ``pytest`` on the same file with the
variable set, and the module's ``@interp`` tests run only there.
"""

import os
import re
import subprocess
import sys

import pytest

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
interp = pytest.mark.skipif(not INTERPRETED, reason="runs in the TRITON_INTERPRET=1 child process")


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


def run_module_under_interpreter(path: str) -> int:
    """Run ``pytest`` on ``path`` with TRITON_INTERPRET=1 and check what the child ran.

    The child runs the module's tests but its ``@pytest.mark.cuda`` ones (deselected: the
    interpreter is the CPU path). It must run every one it collects, skip only the tests
    marked ``skipif(INTERPRETED, ...)`` (the launcher among them, which run in the parent),
    pass all the others, and pass at least one test per ``@interp`` function of the module,
    so a child that runs nothing, or skips what it should run, fails the parent. Returns the
    child's pass count.
    """
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-m", "not cuda", os.path.abspath(path)],
        env=env, capture_output=True, text=True, timeout=900,
    )
    tail = proc.stdout[-6000:] + proc.stderr[-3000:]
    assert proc.returncode == 0, tail
    collected = re.search(r"collected (\d+) items?(?: / (\d+) deselected)?", proc.stdout)
    # (a test id may hold spaces: parametrize ids such as "[many short documents-64-64]")
    outcomes = re.findall(r"::(.+?) (PASSED|SKIPPED|FAILED|ERROR|XFAIL|XPASS)\b", proc.stdout)
    passed = [name for name, outcome in outcomes if outcome == "PASSED"]
    skipped = [name.split("[")[0] for name, outcome in outcomes if outcome == "SKIPPED"]
    assert collected is not None, tail
    selected = int(collected.group(1)) - int(collected.group(2) or 0)
    assert len(outcomes) == selected, tail
    with open(path) as f:
        source = f.read()
    parent_only = parent_only_tests(source)
    assert any(name.endswith("_under_interpreter") for name in skipped), (skipped, tail)
    assert set(skipped) <= parent_only, (skipped, parent_only, tail)
    assert len(passed) == selected - len(skipped), tail
    interp_functions = len(re.findall(r"^@interp\b", source, re.M))
    assert interp_functions > 0 and len(passed) >= interp_functions, (interp_functions, len(passed), tail)
    return len(passed)
