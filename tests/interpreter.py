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


def run_module_under_interpreter(path: str) -> None:
    """Run ``pytest`` on ``path`` with TRITON_INTERPRET=1; only the launcher itself may be skipped there."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", os.path.abspath(path)],
        env=env, capture_output=True, text=True, timeout=900,
    )
    tail = proc.stdout[-6000:] + proc.stderr[-3000:]
    assert proc.returncode == 0, tail
    summary = proc.stdout.strip().splitlines()[-1]
    assert re.search(r"\d+ passed", summary) and re.search(r"\b1 skipped", summary), tail
