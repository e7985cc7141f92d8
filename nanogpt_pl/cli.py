"""Command line: LightningCLI for training, plus ``data`` sub-commands.

    python main.py fit --config configs/quickstart.yaml
    python main.py fit --config configs/speedrun.yaml --trainer.devices 8
    nanogpt-pl fit --config configs/speedrun_1gpu.yaml --trainer.max_steps 50
    nanogpt-pl data prepare|fineweb|tokenizer|corpus ...
    nanogpt-pl generate|plot|ablate ...   (nanogpt_pl/tools)

The top-level ``schedule:`` section is the stage table; it is handed to both the
module (``model.schedule``) and the data module (``data.schedule``), so batch shapes
and per-step settings come from one object.
"""

from __future__ import annotations

import sys
import warnings
from typing import Optional

from lightning.pytorch.cli import LightningCLI

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

    def before_instantiate_classes(self) -> None:
        # a tracker's missing package or refused store, as one line instead of "Not a valid subclass of Logger"
        from .trackers import prepare_loggers

        config = self.config.get(self.subcommand) if self.subcommand else self.config
        try:
            prepare_loggers(config.get("trainer"))
        except ValueError as e:
            sys.exit(f"error: {e}")


# Lightning warns that with manual optimization a step checkpoint holds the weights after the
# optimizer step. That is what resuming needs here: the data stream, schedule and optimizer
# state in the checkpoint all describe the state after the same step.
warnings.filterwarnings("ignore", message="Using ModelCheckpoint with manual optimization")


def cli_main(args: Optional[list[str]] = None, run: bool = True, save_config: bool = True) -> SpeedrunCLI:
    """Build (and by default run) the training CLI; ``args`` defaults to ``sys.argv[1:]``.

    ``save_config``: write the resolved config next to the logs (LightningCLI's default).
    """
    extra = {} if save_config else {"save_config_callback": None}
    return SpeedrunCLI(
        SpeedrunModule,
        SpeedrunDataModule,
        save_config_kwargs={"overwrite": True},
        args=args,
        run=run,
        **extra,
    )


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point of ``nanogpt-pl`` and ``main.py``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "data":
        from .data.commands import main as data_main

        return data_main(argv[1:])
    from .tools import COMMANDS as TOOL_COMMANDS

    if argv and argv[0] in TOOL_COMMANDS:
        from .tools import main as tools_main

        return tools_main(argv)
    cli_main(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
