"""Research tools on top of training: ``nanogpt-pl generate | plot | ablate``.

- ``generate CHECKPOINT``: sample text from a checkpoint (tail-averaged weights when present).
- ``plot RUN_DIR...``: loss and throughput curves from the CSV logs, several runs overlaid.
- ``ablate``: a base config and each ablation overlay at one horizon, as a markdown table.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

COMMANDS = ("generate", "plot", "ablate")

# Errors a user can cause: reported as one line, without a traceback.
USER_ERRORS = (ValueError, FileNotFoundError, FileExistsError, RuntimeError, ImportError, OSError)


def build_parser(command: str) -> argparse.ArgumentParser:
    from . import ablate, generate, plot  # each command loads only when run (generate pulls in the model)

    mod = {"generate": generate, "plot": plot, "ablate": ablate}[command]
    parser = argparse.ArgumentParser(prog=f"nanogpt-pl {command}", description=mod.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    mod.add_arguments(parser)
    parser.set_defaults(run=mod.run)
    return parser


def main(argv: Sequence[str]) -> int:
    """Run ``nanogpt-pl COMMAND ...`` for one of :data:`COMMANDS`; returns the exit status."""
    argv = list(argv)
    try:
        args = build_parser(argv[0]).parse_args(argv[1:])
    except SystemExit as e:  # --help, or a usage error argparse already reported
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    try:
        return args.run(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except USER_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
