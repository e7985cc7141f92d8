"""The shared Triton-interpreter child's checks (tests/interpreter.py): each launcher fails only for its own
module's failures, and every launcher fails when the child itself broke."""

from __future__ import annotations

import pytest
from interpreter import check_module, parse_child

MODULE_A = '''
@pytest.mark.skipif(INTERPRETED, reason="")
def test_suite_under_interpreter():
    pass


@interp
def test_kernel(n):
    pass
'''
MODULE_B = '''
@pytest.mark.skipif(INTERPRETED, reason="")
def test_kernels_under_interpreter():
    pass


@interp
def test_other():
    pass


def test_plain():
    pass
'''


def _stdout(lines: list[str], collected: str) -> str:
    return "\n".join([f"collected {collected}", *lines, "=== summary ==="])


@pytest.fixture
def modules(tmp_path):
    a, b = tmp_path / "test_a.py", tmp_path / "test_b.py"
    a.write_text(MODULE_A)
    b.write_text(MODULE_B)
    return str(a), str(b)


A_OK = ["tests/test_a.py::test_suite_under_interpreter SKIPPED (runs in the parent)  [ 14%]",
        "tests/test_a.py::test_kernel[many short documents-64-64] PASSED  [ 28%]",
        "tests/test_a.py::test_kernel[1] PASSED  [ 42%]"]
B_OK = ["tests/test_b.py::test_kernels_under_interpreter SKIPPED (runs in the parent)  [ 57%]",
        "tests/test_b.py::test_other PASSED  [ 71%]", "tests/test_b.py::test_plain PASSED  [ 85%]"]


def test_each_module_is_judged_on_its_own_outcomes(modules):
    a, b = modules
    run = parse_child(0, _stdout(A_OK + B_OK, "7 items / 1 deselected"), "")
    assert check_module(run, a) == 2 and check_module(run, b) == 2
    failing = [line.replace("test_other PASSED", "test_other FAILED") for line in B_OK]
    run = parse_child(1, _stdout(A_OK + failing, "7 items / 1 deselected"), "")
    assert check_module(run, a) == 2
    with pytest.raises(AssertionError, match="test_other"):
        check_module(run, b)


@pytest.mark.parametrize("case", ["died part-way", "interrupted", "interp test skipped", "launcher ran",
                                  "module missing"])
def test_a_child_that_did_not_run_what_it_should_fails_the_launchers(modules, case):
    a, b = modules
    lines, code, collected = A_OK + B_OK, 0, "7 items / 1 deselected"
    if case == "died part-way":
        lines = A_OK + B_OK[:1]
    elif case == "interrupted":
        code = 2
    elif case == "interp test skipped":
        lines = A_OK + [B_OK[0], B_OK[1].replace("PASSED", "SKIPPED"), B_OK[2]]
    elif case == "launcher ran":
        lines = A_OK + [B_OK[0].replace("SKIPPED", "PASSED"), *B_OK[1:]]
    elif case == "module missing":
        lines, collected = A_OK, "3 items"
    run = parse_child(code, _stdout(lines, collected), "")
    if case in ("died part-way", "interrupted"):
        for path in (a, b):
            with pytest.raises(AssertionError):
                check_module(run, path)
    else:
        assert check_module(run, a) == 2
        with pytest.raises(AssertionError):
            check_module(run, b)
