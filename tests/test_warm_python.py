"""tests/warm_python.py: a run forked from the warm process is what a cold ``python ...`` of it is."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import warm_python
from background import command_env

ROOT = Path(__file__).resolve().parents[1]

# what a command sees of its process, then how it ends (its first argument)
SCRIPT = r'''
import json, os, sys
print(json.dumps({"name": __name__, "file": __file__, "argv": sys.argv, "path0": sys.path[0], "cwd": os.getcwd(),
                  "var": os.environ.get("WARM_CHECK"), "leaked": os.environ.get("WARM_LEAK"),
                  "module_leaked": hasattr(json, "leaked"), "parent_is_the_test": os.getppid() == int(sys.argv[2])}))
print("to stderr", file=sys.stderr)
mode = sys.argv[1]
if mode == "leak":  # changes a later run must not see
    os.environ["WARM_LEAK"] = "1"
    json.leaked = True
elif mode == "exit":
    sys.exit(3)
elif mode == "raise":
    def inner():
        raise ValueError("boom")
    inner()
elif mode == "kill":
    sys.stdout.flush()
    os.kill(os.getpid(), 9)
'''


def env_of(**extra: str) -> dict[str, str]:
    """The environment ``run_cli`` gives a run (so this run is forked from the same warm process), and ``extra``."""
    env = {k: v for k, v in command_env().items() if k not in ("WARM_CHECK", "WARM_LEAK")}
    return {**env, **extra}


@pytest.fixture(scope="module")
def commands(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("warm")
    (root / "script.py").write_text(SCRIPT)
    (root / "linked").mkdir()
    (root / "linked" / "script.py").symlink_to(root / "script.py")
    (root / "warm_check_module.py").write_text(SCRIPT)
    return root


def both(argv: list[str], cwd: Path, env: dict[str, str]) -> tuple[subprocess.CompletedProcess, ...]:
    warm = warm_python.run(argv, cwd=cwd, env=env, timeout=120)
    cold = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    return warm, cold


@pytest.mark.parametrize("mode", ["return", "exit", "raise", "kill"])
def test_a_warm_run_is_a_cold_run(commands, mode):
    argv = [sys.executable, str(commands / "script.py"), mode, str(os.getpid())]
    warm, cold = both(argv, commands, env_of(WARM_CHECK="seen"))
    assert warm.returncode == cold.returncode == {"return": 0, "exit": 3, "raise": 1, "kill": -9}[mode]
    seen_warm, seen_cold = json.loads(warm.stdout), json.loads(cold.stdout)
    # the warm run was forked from the warm process, the cold one started by this one
    assert not seen_warm.pop("parent_is_the_test") and seen_cold.pop("parent_is_the_test")
    assert seen_warm == seen_cold
    assert seen_warm["name"] == "__main__" and seen_warm["var"] == "seen" and seen_warm["path0"] == str(commands)
    assert warm.stderr == cold.stderr  # the traceback too, from the command's own frames
    if mode == "raise":
        assert warm.stderr.startswith("to stderr\nTraceback") and "ValueError: boom" in warm.stderr


def test_module_and_linked_script_forms(commands):
    for argv in ([sys.executable, "-m", "warm_check_module", "return", str(os.getpid())],
                 [sys.executable, "linked/script.py", "return", str(os.getpid())]):
        warm, cold = both(argv, commands, env_of())
        assert warm.returncode == cold.returncode == 0, (warm.stderr, cold.stderr)
        seen_warm, seen_cold = json.loads(warm.stdout), json.loads(cold.stdout)
        assert not seen_warm.pop("parent_is_the_test") and seen_cold.pop("parent_is_the_test")
        assert seen_warm == seen_cold, argv
    # python resolves a linked script's folder: its target's
    assert seen_warm["path0"] == str(commands) and seen_warm["argv"][0] == "linked/script.py"


def test_nothing_one_run_changes_reaches_the_next(commands):
    argv = [sys.executable, str(commands / "script.py"), "leak", str(os.getpid())]
    assert warm_python.run(argv, cwd=commands, env=env_of(), timeout=120).returncode == 0
    argv[2] = "return"
    seen = json.loads(warm_python.run(argv, cwd=commands, env=env_of(), timeout=120).stdout)
    assert seen["leaked"] is None and not seen["module_leaked"] and not seen["parent_is_the_test"]


def test_other_startup_variables_start_cold(commands):
    argv = [sys.executable, str(commands / "script.py"), "return", str(os.getpid())]
    for env in (env_of(OMP_NUM_THREADS="2"), env_of(PYTHONPATH=str(commands)), env_of(PYTHONHASHSEED="1")):
        done = warm_python.run(argv, cwd=commands, env=env, timeout=120)
        assert done.returncode == 0 and json.loads(done.stdout)["parent_is_the_test"]
