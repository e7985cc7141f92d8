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


def run_module_under_interpreter(path: str) -> int:
    """Run ``pytest`` on ``path`` with TRITON_INTERPRET=1 and check what the child ran.

    The child must collect the module's tests, pass every one of them except the launcher
    (skipped there), and pass at least one test per ``@interp`` function of the module, so
    a child that runs nothing, or skips what it should run, fails the parent. Returns the
    child's pass count.
    """
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", os.path.abspath(path)],
        env=env, capture_output=True, text=True, timeout=900,
    )
    tail = proc.stdout[-6000:] + proc.stderr[-3000:]
    assert proc.returncode == 0, tail
    collected = re.search(r"collected (\d+) items?", proc.stdout)
    outcomes = re.findall(r"::(\S+) (PASSED|SKIPPED|FAILED|ERROR|XFAIL|XPASS)", proc.stdout)
    passed = [name for name, outcome in outcomes if outcome == "PASSED"]
    skipped = [name for name, outcome in outcomes if outcome == "SKIPPED"]
    assert collected is not None and len(outcomes) == int(collected.group(1)), tail
    assert len(skipped) == 1 and skipped[0].endswith("_under_interpreter"), (skipped, tail)
    assert len(passed) == int(collected.group(1)) - 1, tail
    with open(path) as f:
        interp_functions = len(re.findall(r"^@interp\b", f.read(), re.M))
    assert interp_functions > 0 and len(passed) >= interp_functions, (interp_functions, len(passed), tail)
    return len(passed)
