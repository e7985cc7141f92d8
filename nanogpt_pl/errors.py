"""How the ``nanogpt-pl`` sub-commands report errors a user can cause: one line, no traceback."""

from __future__ import annotations

import argparse
import sys
from typing import Callable, Optional, Sequence

# Errors a user can cause (a missing file, a bad option value, a missing extra): one line each.
USER_ERRORS = (ValueError, FileNotFoundError, FileExistsError, RuntimeError, ImportError, OSError)


def run_command(parser: argparse.ArgumentParser, argv: Sequence[str],
                run: Callable[[argparse.Namespace], Optional[int]]) -> int:
    """Parse ``argv`` with ``parser`` and call ``run``; the exit status (0 when ``run`` returns None).

    ``--help`` and usage errors keep argparse's own output and status; a user error prints
    ``error: ...`` on one line and gives 1; Ctrl-C gives 130.
    """
    try:
        args = parser.parse_args(list(argv))
    except SystemExit as e:  # --help, or a usage error argparse already reported
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    try:
        status = run(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except USER_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0 if status is None else int(status)
