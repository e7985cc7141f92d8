"""Command line: LightningCLI for training, plus ``data`` sub-commands.

    python main.py fit --config configs/quickstart.yaml
    python main.py fit --config configs/speedrun.yaml --trainer.devices 8
    nanogpt-pl fit --config configs/speedrun_1gpu.yaml --trainer.max_steps 50
    nanogpt-pl validate --config configs/quickstart.yaml --ckpt_path last
    nanogpt-pl data prepare|fineweb|tokenizer|corpus ...
    nanogpt-pl generate|plot|compare|ablate ...   (nanogpt_pl/tools)
    nanogpt-pl describe --config configs/speedrun.yaml

The top-level ``schedule:`` section is the stage table; it is handed to both the
module (``model.schedule``) and the data module (``data.schedule``), so batch shapes
and per-step settings come from one object. One field of one stage is set from the
command line as ``--schedule.stages.2.candidates null``.

Checkpoints go to the run's log folder (``<save_dir>/<name>/version_N/checkpoints``) unless a
ModelCheckpoint names a ``dirpath``; ``--ckpt_path last`` resumes the newest run of the config
that saved one and fits the model, and continues in its ``version_N`` folder.

Errors a user can cause print as one line; ``NANOGPT_PL_DEBUG=1`` (or ``--debug``) shows the
traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import os
import re
import sys
import warnings
from pathlib import Path
from typing import Any, Optional

import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter

from .config_files import expand_config_bases, load_config
from .data.datamodule import SpeedrunDataModule
from .distributed.strategy import SpeedrunStrategy  # noqa: F401  (registers trainer.strategy: speedrun)
from .gemm_workspace import set_cublaslt_workspace
from .launch_queues import scale_launch_queues
from .model.gpt import GPT, GPTConfig
from .module import SpeedrunModule
from .optim.groups import adam_families
from .run_control import RunControl
from .schedule import Schedule
from .tools import COMMANDS as TOOL_COMMANDS
from .tools import main as tools_main
from .trackers import prepare_loggers

DEBUG_ENV = "NANOGPT_PL_DEBUG"
# Lightning's own trainer options for optimizers; this project builds its optimizers from model.optim
OPTIMIZER_FLAGS = ("--optimizer", "--lr_scheduler")
STAGE_OVERRIDE = re.compile(r"^--schedule\.stages\.(\d+)\.(\w+)(?:=(.*))?$", re.S)


class UserError(Exception):
    """An error in what the user asked for; printed as one line."""


def expand_stage_overrides(parser, args: list[str]) -> list[str]:
    """Turn ``--schedule.stages.I.KEY VALUE`` into one ``--schedule.stages=[...]`` argument.

    jsonargparse cannot address one element of a list from the command line, so the stage table
    is resolved from everything else on the command line first (configs and other overrides),
    the fields are set, and the whole table is handed back as one argument.
    """
    overrides: list[tuple[int, str, str]] = []
    rest: list[str] = []
    i = 0
    while i < len(args):
        m = STAGE_OVERRIDE.match(args[i])
        if m is None:
            rest.append(args[i])
            i += 1
            continue
        if m.group(3) is not None:
            value = m.group(3)
            i += 1
        else:
            if i + 1 >= len(args):
                raise UserError(f"{args[i]} needs a value, e.g. {args[i]} null")
            value = args[i + 1]
            i += 2
        overrides.append((int(m.group(1)), m.group(2), value))
    if not overrides:
        return args
    import yaml  # only when a config has a base: to expand

    probe = [a for a in rest if not a.startswith("--print_config")]
    with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
        try:
            config = parser.parse_args(probe)
        except SystemExit:
            return rest  # the remaining arguments have an error of their own; the real parse reports it
    section = config[config["subcommand"]] if config.get("subcommand") else config
    stages = section["schedule"]["stages"]
    if stages is None:
        raise UserError("--schedule.stages.N.*: the config gives no schedule.stages table to change")
    stages = [s.as_dict() if hasattr(s, "as_dict") else dict(s) for s in stages]
    for index, key, value in overrides:
        if index >= len(stages):
            raise UserError(f"--schedule.stages.{index}.{key}: the schedule has stages 0..{len(stages) - 1}")
        stages[index][key] = yaml.safe_load(value)
    return rest + ["--schedule.stages", json.dumps(stages)]


class _AppendingWriter(ExperimentWriter):
    """CSV writer that continues a resumed run's ``metrics.csv`` instead of deleting it."""

    def _check_log_dir_exists(self) -> None:
        if self._fs.isfile(self.metrics_file_path):
            with self._fs.open(self.metrics_file_path, "r", newline="") as f:
                header = f.readline().strip()
            self.metrics_keys = sorted(k for k in header.split(",") if k)


def checkpoint_mismatches(path: str | Path, module: torch.nn.Module) -> list[str]:
    """How the weights in checkpoint ``path`` differ from ``module``'s (empty when they fit)."""
    state = torch.load(path, map_location="cpu", mmap=True, weights_only=False).get("state_dict", {})
    own = {k: v for k, v in module.state_dict().items() if torch.is_tensor(v)}
    state = {k: v for k, v in state.items() if torch.is_tensor(v)}
    problems = []
    for k in own:
        if k not in state:
            problems.append(f"{k} missing")
        elif tuple(state[k].shape) != tuple(own[k].shape):
            problems.append(f"{k}: checkpoint {tuple(state[k].shape)} vs model {tuple(own[k].shape)}")
    return problems + [f"{k} not in this model" for k in state if k not in own]


def check_checkpoint_fits(path: str | Path, module: torch.nn.Module) -> None:
    """Raise a one-line error naming ``path`` and the first differing weights if it does not fit ``module``."""
    problems = checkpoint_mismatches(path, module)
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise UserError(f"checkpoint {path} does not fit this model: {'; '.join(problems[:3])}{more}; "
                        f"give the config it was trained with, or another --ckpt_path")


def resolve_last(trainer, module: torch.nn.Module) -> Optional[Path]:
    """``--ckpt_path last``: the newest ``checkpoints/last.ckpt`` among this config's runs that fits the model.

    Runs of the config with another architecture (say ``--model.gpt.num_layers 2``) are passed over;
    if no run's checkpoint fits, the newest one's mismatch is the error. Points every logger at
    the chosen run's ``version_N`` so the resumed run continues its logs. ``None`` when checkpoints
    go to an explicit ``dirpath`` (Lightning resolves ``last`` there) or no run saved one.
    """
    checkpoints = [cb for cb in trainer.callbacks if isinstance(cb, ModelCheckpoint)]
    if not trainer.loggers or not checkpoints or any(cb.dirpath is not None for cb in checkpoints):
        return None
    root = Path(trainer.loggers[0].root_dir)
    found = []
    for d in root.glob("version_*"):
        suffix = d.name[len("version_"):]
        if suffix.isdigit() and (d / "checkpoints" / "last.ckpt").is_file():
            found.append((int(suffix), d / "checkpoints" / "last.ckpt"))
    if not found:
        return None
    found.sort(reverse=True)
    fitting = [(v, p) for v, p in found if not checkpoint_mismatches(p, module)]
    if not fitting:
        check_checkpoint_fits(found[0][1], module)
    version, path = fitting[0]
    for logger in trainer.loggers:
        if hasattr(logger, "_version"):
            logger._version = version
        if isinstance(logger, CSVLogger) and logger._experiment is None:
            logger._experiment = _AppendingWriter(log_dir=logger.log_dir)
    return path


class SpeedrunCLI(LightningCLI):
    """LightningCLI with the shared top-level ``schedule`` section."""

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        # test and predict need test_step / predict_step, which the speedrun does not have
        return {
            "fit": {"model", "train_dataloaders", "val_dataloaders", "datamodule"},
            "validate": {"model", "dataloaders", "datamodule"},
        }

    def init_parser(self, **kwargs: Any):
        kwargs.setdefault("description", "nanogpt-pl: the NanoGPT speedrun in PyTorch Lightning. Commands: fit, "
                          "validate, describe, generate, plot, compare, ablate, and "
                          "'data {prepare,fineweb,tokenizer,corpus}' (nanogpt-pl COMMAND --help).")
        return super().init_parser(**kwargs)

    def add_arguments_to_parser(self, parser) -> None:
        parser.add_class_arguments(Schedule, "schedule", fail_untyped=False)
        parser.link_arguments("schedule", "model.schedule", apply_on="instantiate")
        parser.link_arguments("schedule", "data.schedule", apply_on="instantiate")
        parser.add_argument("--warmup_only", type=bool, default=False,
                            help="fit: run the SpeedrunTimer's untimed warmup, then stop before the first step "
                                 "(fills a fresh machine's compile caches, and CompileCache's file, for a timed run)")

    def parse_arguments(self, parser, args) -> None:
        # (LightningCLI's version warns whenever args are given while sys.argv has any: main() always gives them)
        args = list(sys.argv[1:] if args is None else args)
        self.config = parser.parse_args(expand_stage_overrides(parser, args))

    def _resolve_checkpoint(self) -> None:
        section = self.config_init[self.subcommand]
        ckpt = section.get("ckpt_path")
        if ckpt == "last":
            found = resolve_last(self.trainer, self.model)
            if found is not None:
                section["ckpt_path"] = ckpt = str(found)
        if ckpt and Path(ckpt).is_file():
            check_checkpoint_fits(ckpt, self.model)

    def before_fit(self) -> None:
        self._resolve_checkpoint()
        if self.config_init[self.subcommand].get("warmup_only"):
            from callbacks.speedrun_timer import SpeedrunTimer  # (the callbacks package imports nanogpt_pl)

            timers = [cb for cb in self.trainer.callbacks if isinstance(cb, SpeedrunTimer)]
            if not timers:
                raise UserError("--warmup_only needs the SpeedrunTimer in trainer.callbacks (its warmup is what "
                                "runs); add --trainer.callbacks+=callbacks.speedrun_timer.SpeedrunTimer")
            for timer in timers:
                timer.warmup_only = True
            for cb in self.trainer.checkpoint_callbacks:  # no step is trained: nothing to keep
                if isinstance(cb, ModelCheckpoint):
                    cb.save_last = False

    def before_validate(self) -> None:
        if self.config_init[self.subcommand].get("warmup_only"):
            raise UserError("--warmup_only is for fit (a warmup trains); drop it from validate")
        self._resolve_checkpoint()
        ckpt = self.config_init[self.subcommand].get("ckpt_path")
        if ckpt and Path(ckpt).is_file():
            # the rows carry the training step, as the fit's own validation rows do (the index
            # of the last step trained, global_step - 1), not 0
            step = torch.load(ckpt, map_location="cpu", mmap=True, weights_only=False).get("global_step", 0)
            self.trainer.fit_loop.epoch_loop._batches_that_stepped = max(step - 1, 0)

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


class _SingleProcessBanner(logging.Filter):
    """Drop Lightning's distributed banner when there is one process (the speedrun strategy always
    starts a process group, also for one device)."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        return not ("MEMBER: 1/1" in msg or "Starting with 1 processes" in msg)


for _name in ("lightning.fabric.utilities.distributed", "lightning.fabric.utilities.rank_zero",
              "lightning.pytorch.utilities.rank_zero", "lightning_utilities.core.rank_zero"):
    logging.getLogger(_name).addFilter(_SingleProcessBanner())


def cli_main(args: Optional[list[str]] = None, run: bool = True, save_config: bool = True) -> SpeedrunCLI:
    """Build (and by default run) the training CLI; ``args`` defaults to ``sys.argv[1:]``.

    ``save_config``: write the resolved config next to the logs (LightningCLI's default).
    """
    extra = {} if save_config else {"save_config_callback": None}
    return SpeedrunCLI(
        SpeedrunModule,
        SpeedrunDataModule,
        save_config_kwargs={"overwrite": True},
        trainer_defaults={"callbacks": [RunControl()]},
        parser_kwargs={"allow_abbrev": False},
        auto_configure_optimizers=False,
        args=expand_config_bases(list(sys.argv[1:] if args is None else args)),
        run=run,
        **extra,
    )


OOM_HINT = ("lower model.gpt.ngram_rows (the n-gram table), set model.cuda_graphs false (the graphs of every "
            "stage stay allocated from the timer's warmup on), or use configs/speedrun_24gb.yaml")


def _out_of_memory(exc: BaseException) -> str:
    """torch's out-of-memory message, cut to its figures, and what to change."""
    text = " ".join(str(exc).split())
    figures = []
    for pattern, form in ((r"Tried to allocate ([\d.]+ [KMG]iB)", "a request of {}"),
                          (r"total capacity of ([\d.]+ [KMG]iB)", "a card of {}"),
                          (r"this process has ([\d.]+ [KMG]iB) memory in use", "{} in use"),
                          (r"([\d.]+ [KMG]iB) allocated in private pools", "{} in CUDA graph pools")):
        found = re.search(pattern, text)
        if found:
            figures.append(form.format(found.group(1)))
    said = ", ".join(figures) if figures else text
    return f"out of GPU memory ({said}); {OOM_HINT}"


def _one_line(exc: BaseException) -> str:
    if isinstance(exc, torch.OutOfMemoryError):
        return _out_of_memory(exc)
    text = " ".join(str(exc).split()) or type(exc).__name__
    if isinstance(exc, (UserError, ValueError, RuntimeError, OSError)):
        return text
    return f"{type(exc).__name__}: {text}"


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
    debug = os.environ.get(DEBUG_ENV) == "1" or "--debug" in argv
    if "--debug" in argv:
        argv.remove("--debug")
        os.environ[DEBUG_ENV] = "1"  # launched ranks re-read the environment, not the removed flag
    if argv and argv[0] == "data":
        from .data.commands import main as data_main  # the data commands' dependencies load only for `data`

        return data_main(argv[1:])
    if argv and argv[0] == "describe":
        return describe_main(argv[1:])
    if argv and argv[0] in TOOL_COMMANDS:
        return tools_main(argv)
    try:
        scale_launch_queues()  # before anything initializes CUDA (nanogpt_pl/launch_queues.py)
        set_cublaslt_workspace()  # likewise: no cuBLASLt workspace, no memset a GEMM (nanogpt_pl/gemm_workspace.py)
        for flag in OPTIMIZER_FLAGS:
            if any(a == flag or a.startswith(flag + "=") or a.startswith(flag + ".") for a in argv):
                raise UserError(f"{flag}: this project builds its optimizers from model.optim "
                                "(e.g. --model.optim.matrix_optimizer adamw --model.optim.matrix_lr 0.002); "
                                "see --print_config")
        cli_main(argv)
    except Exception as exc:  # noqa: BLE001  (anything else keeps its traceback under --debug)
        if debug:
            raise
        print(f"error: {_one_line(exc)}  [traceback: {DEBUG_ENV}=1]", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
