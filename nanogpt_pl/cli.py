"""Command line: LightningCLI for training, plus ``data`` sub-commands.

    python main.py fit --config configs/quickstart.yaml
    python main.py fit --config configs/speedrun.yaml --trainer.devices 8
    nanogpt-pl fit --config configs/speedrun_1gpu.yaml --trainer.max_steps 50
    nanogpt-pl data prepare|fineweb|tokenizer|corpus ...
    nanogpt-pl generate|plot|ablate ...   (nanogpt_pl/tools)
    nanogpt-pl describe --config configs/speedrun.yaml

The top-level ``schedule:`` section is the stage table; it is handed to both the
module (``model.schedule``) and the data module (``data.schedule``), so batch shapes
and per-step settings come from one object.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from typing import Optional

import torch
from lightning.pytorch.cli import LightningCLI

from .config_files import expand_config_bases, load_config
from .data.datamodule import SpeedrunDataModule
from .distributed.strategy import SpeedrunStrategy  # noqa: F401  (registers trainer.strategy: speedrun)
from .model.gpt import GPT, GPTConfig
from .module import SpeedrunModule
from .optim.groups import adam_families
from .schedule import Schedule
from .tools import COMMANDS as TOOL_COMMANDS
from .tools import main as tools_main
from .trackers import prepare_loggers


class SpeedrunCLI(LightningCLI):
    """LightningCLI with the shared top-level ``schedule`` section."""

    def add_arguments_to_parser(self, parser) -> None:
        parser.add_class_arguments(Schedule, "schedule", fail_untyped=False)
        parser.link_arguments("schedule", "model.schedule", apply_on="instantiate")
        parser.link_arguments("schedule", "data.schedule", apply_on="instantiate")

    def before_instantiate_classes(self) -> None:
        # a tracker's missing package or refused store, as one line instead of "Not a valid subclass of Logger"
        config = self.config.get(self.subcommand) if self.subcommand else self.config
        try:
            prepare_loggers(config.get("trainer"))
        except ValueError as e:
            sys.exit(f"error: {e}")


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


def describe_main(argv: list[str]) -> int:
    """``nanogpt-pl describe --config A.yaml [--config B.yaml ...]``: the network a config builds.

    Prints one row per layer slot (which sublayers exist, attention widths, window, paired
    heads, key offset, XSA, gate, value-embedding plane, x0 / n-gram injection) and the
    parameter counts per family. The model is built on the ``meta`` device, so nothing is
    allocated (the n-gram table lives outside the model and is only counted).
    """
    parser = argparse.ArgumentParser(prog="nanogpt-pl describe", description=describe_main.__doc__)
    parser.add_argument("--config", action="append", required=True,
                        help="YAML config; repeat to layer overlays as `fit` does")
    args = parser.parse_args(argv)
    gpt: dict = {}
    for path in args.config:
        try:
            layered = load_config(path)  # with its `base:` chain, as `fit` reads it
        except OSError as err:
            raise SystemExit(f"nanogpt-pl describe: cannot read --config {path}: {err.strerror or err}")
        gpt.update((layered.get("model") or {}).get("gpt") or {})
    unknown = sorted(set(gpt) - set(GPTConfig.__dataclass_fields__))
    if unknown:
        raise SystemExit(f"nanogpt-pl describe: unknown key(s) model.gpt.{', model.gpt.'.join(unknown)} in "
                         f"{', '.join(args.config)}; see `nanogpt-pl fit --help` for the model.gpt options")
    cfg = GPTConfig(**gpt)
    with torch.device("meta"):
        model = GPT(cfg)

    def mark(flag: bool) -> str:
        return "yes" if flag else "-"

    head = ("L", "attention (d_qk,d_v)", "window", "paired", "key-off", "XSA", "gate", "VE", "x0", "n-gram", "MLP",
            "other")
    rows = []
    for i, block in enumerate(model.blocks):
        attn = block.attn
        other = []
        if attn is not None and cfg.attn_input_cache is not None and i > cfg.attn_input_cache:
            other.append(f"input norm(cache[{cfg.attn_input_cache}])")
        if block.parallel_mlp is not None:
            other.append("parallel MLP")
        if cfg.mixed_layer(i):
            other.append("MUDD layer mix")
        if i == cfg.skip_to:
            other.append(f"skip add of cache[{cfg.skip_from}]")
        if attn is None and block.mlp is None:
            other.append("removed")
        plane = cfg.value_embed_layers.index(i) if i in cfg.value_embed_layers else None
        rows.append((
            str(i),
            f"{cfg.width_kind(i)} ({attn.spec.d_qk},{attn.spec.d_v})" if attn is not None else "none",
            attn.spec.chain if attn is not None else "-",
            mark(attn is not None and attn.spec.paired), mark(attn is not None and attn.spec.key_offset),
            mark(attn is not None and attn.spec.xsa), mark(attn is not None and attn.spec.gate),
            f"p{plane}" if plane is not None else "-",
            "μ" if cfg.mixed_layer(i) else mark(i in cfg.injected_x0_layers()),
            ("μ" if cfg.mixed_layer(i) else mark(i in cfg.ngram_layers)) if cfg.ngram_rows else "-",
            mark(block.mlp is not None), ", ".join(other),
        ))
    widths = [max(len(r[c]) for r in (head, *rows)) for c in range(len(head))]
    for r in (head, *rows):
        print("  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip())
    print(f"\nmudd: {cfg.mudd}; attention scales: short {model.rotaries['short'].attn_scale}, "
          f"long {model.rotaries['long'].attn_scale}")
    print("\nparameters per family")
    fams = model.param_families()
    counts = {name: sum(p.numel() for p in fams[name]) for name in ("qk", "vo", "mlp")}
    counts.update({f"adam:{name}": sum(p.numel() for p in ps) for name, ps in adam_families(model).items()})
    total = sum(p.numel() for p in model.parameters())
    for name, n in counts.items():
        print(f"  {name:<22}{n:>15,}")
    print(f"  {'total (model)':<22}{total:>15,}")
    if cfg.ngram_rows:
        print(f"  {'n-gram table (sharded)':<22}{cfg.ngram_rows * cfg.model_dim:>15,}  (not allocated)")
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point of ``nanogpt-pl`` and ``main.py``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "data":
        from .data.commands import main as data_main  # the data commands' dependencies load only for `data`

        return data_main(argv[1:])
    if argv and argv[0] == "describe":
        return describe_main(argv[1:])
    if argv and argv[0] in TOOL_COMMANDS:
        return tools_main(argv)
    cli_main(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
