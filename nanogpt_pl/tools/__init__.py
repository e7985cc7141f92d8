"""Research tools on top of training: ``nanogpt-pl generate | plot | compare | ablate``.

- ``generate CHECKPOINT``: sample text from a checkpoint (tail-averaged weights when present).
- ``plot RUN_DIR...``: loss and throughput curves from the CSV logs, several runs overlaid.
- ``compare RUN_A RUN_B``: whether two runs' loss curves agree within a seed's noise, and their speed.
- ``ablate``: a base config and each ablation overlay at one horizon, as a markdown table.
"""

from __future__ import annotations

import argparse
from typing import Sequence

from ..errors import run_command

COMMANDS = ("generate", "plot", "compare", "ablate")

def build_parser(command: str) -> argparse.ArgumentParser:
    from . import ablate, compare, generate, plot  # each command loads only when run (generate pulls in the model)

    mod = {"generate": generate, "plot": plot, "compare": compare, "ablate": ablate}[command]
    parser = argparse.ArgumentParser(prog=f"nanogpt-pl {command}", description=mod.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    mod.add_arguments(parser)
    parser.set_defaults(run=mod.run)
    return parser


def main(argv: Sequence[str]) -> int:
    """Run ``nanogpt-pl COMMAND ...`` for one of :data:`COMMANDS`; returns the exit status."""
    argv = list(argv)
    return run_command(build_parser(argv[0]), argv[1:], lambda args: args.run(args))
