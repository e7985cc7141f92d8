"""Command line: LightningCLI for training, plus ``data`` sub-commands.

    python main.py fit --config configs/quickstart.yaml
    python main.py fit --config configs/speedrun.yaml --trainer.devices 8
    nanogpt-pl fit --config configs/speedrun_1gpu.yaml --trainer.max_steps 50
    nanogpt-pl data prepare|fineweb|tokenizer|corpus ...

The top-level ``schedule:`` section is the stage table; it is handed to both the
module (``model.schedule``) and the data module (``data.schedule``), so batch shapes
and per-step settings come from one object.
"""

from __future__ import annotations

import sys
import warnings
from typing import Optional

from lightning.pytorch.cli import LightningCLI

from .config_files import expand_config_bases
from .data.datamodule import SpeedrunDataModule
from .distributed.strategy import SpeedrunStrategy  # noqa: F401  (registers trainer.strategy: speedrun)
from .module import SpeedrunModule
from .schedule import Schedule


class SpeedrunCLI(LightningCLI):
    """LightningCLI with the shared top-level ``schedule`` section."""

    def add_arguments_to_parser(self, parser) -> None:
        parser.add_class_arguments(Schedule, "schedule", fail_untyped=False)
        parser.link_arguments("schedule", "model.schedule", apply_on="instantiate")
        parser.link_arguments("schedule", "data.schedule", apply_on="instantiate")


# Lightning warns that with manual optimization a step checkpoint holds the weights after the
# optimizer step. That is what resuming needs here: the data stream, schedule and optimizer
# state in the checkpoint all describe the state after the same step.
warnings.filterwarnings("ignore", message="Using ModelCheckpoint with manual optimization")
# cli_main always hands LightningCLI its arguments (``base:`` includes expanded, config_files.py),
# which LightningCLI warns about when they came from the command line.
warnings.filterwarnings("ignore", message="LightningCLI's args parameter is intended to run from within Python")


def cli_main(args: Optional[list[str]] = None, run: bool = True, save_config: bool = True) -> SpeedrunCLI:
    """Build (and by default run) the training CLI; ``args`` defaults to ``sys.argv[1:]``.

    ``save_config``: write the resolved config next to the logs (LightningCLI's default).
    """
    extra = {} if save_config else {"save_config_callback": None}
    return SpeedrunCLI(
        SpeedrunModule,
        SpeedrunDataModule,
        save_config_kwargs={"overwrite": True},
        args=expand_config_bases(list(sys.argv[1:] if args is None else args)),
        run=run,
        **extra,
    )


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point of ``nanogpt-pl`` and ``main.py``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "data":
        from .data.commands import main as data_main  # the data commands' dependencies load only for `data`

        return data_main(argv[1:])
    cli_main(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
