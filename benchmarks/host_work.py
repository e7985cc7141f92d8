"""Host work of the training step's eager parts, on the CPU: what a GPU's host must issue.

On a GPU every ATen operation outside a CUDA graph is a host launch, and the H200's stage-0 step
waits on the host (BENCHMARKS.md, "MUDD's final mix, where the step's time goes at stage 0").
This script builds the record network (``configs/speedrun_1gpu.yaml``, a small n-gram table so it
fits a CPU) and measures, in one run, each part against its baseline:

- **optimizer step**: ATen operations dispatched by one ``step()`` of the combined optimizer, with
  the dense Adam groups updated as ``torch._foreach_*`` calls (``DistAdam._foreach_update``, the
  default, eager here as on a GPU with ``model.optim.adam_cuda_graph: false``) against the same
  optimizer with every parameter updated alone (``DistAdam._update`` in turn, the baseline), from
  the same state and gradients;
- **FP8 staleness checks**: host time of ``Fp8State.refresh_cache`` over every FP8 layer when no
  weight changed (skipped) against the full check it skips (the baseline), median of repeats;
- **sparse pull**: ATen operations of one micro-batch's ``SparseChannels.inputs`` with the fixed
  exchange, which one rank now replays from a CUDA graph (``PullGraphs``).

The counts do not depend on the machine; the times are this CPU's and only their ratio carries over.

    python benchmarks/host_work.py
"""

from __future__ import annotations

import collections
import copy
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from step_time import _args_for  # noqa: E402

from nanogpt_pl.cli import cli_main  # noqa: E402
from nanogpt_pl.optim.adam import DistAdam  # noqa: E402

NGRAM_ROWS = 65_536  # the record's 21M-row table would not fit a CPU; the step's operations do not depend on it


class CountOps(TorchDispatchMode):
    """Counts the ATen operations dispatched inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.ops.values())


def build():
    args, _ = _args_for("configs/speedrun_1gpu.yaml", 0, 4, True, [f"model.gpt.ngram_rows={NGRAM_ROWS}"])
    cli = cli_main(args + ["--trainer.accelerator", "cpu"], run=False, save_config=False)
    module = cli.model
    module.prepare_for_training(torch.device("cpu"))
    return module


def optimizer_ops(module, per_parameter: bool) -> tuple[int, dict[str, int]]:
    """ATen operations of the combined optimizer's second ``step()``, in all and by part."""
    opt = module.configure_optimizers()
    module.use_plain_optimizer(opt)
    module.apply_schedule(0)  # the stage's learning rates on this optimizer
    if per_parameter:
        assert hasattr(DistAdam, "_update_replicated"), "DistAdam's replicated update was renamed: patch the new name"
        for part in opt.parts.values():
            if isinstance(part, DistAdam):
                part._update_replicated = lambda replicated, part=part: [
                    part._update(p, p.grad, group) for group, params in replicated for p in params]
    gen = torch.Generator().manual_seed(0)
    parts: dict[str, int] = {}
    for _ in range(2):  # the second step counts: the state exists
        for p in module.model.parameters():
            p.grad = (torch.randn(p.shape, generator=gen) * 1e-3).to(p.dtype)
        for name, part in opt.parts.items():  # what CombinedOptimizer.step does, part by part
            with CountOps() as c:
                part.step()
            parts[name] = c.total
    return sum(parts.values()), parts


def fp8_check_ms(module, repeats: int = 30) -> tuple[float, float]:
    from nanogpt_pl.ops.fp8.cache import Fp8State

    ids = torch.randint(0, 50_257, (256,))
    cu = torch.tensor([0, 256], dtype=torch.int32)
    with torch.no_grad():  # one forward: every FP8 layer's last call
        module.model(ids, cu, 256, module.settings.windows, **module.sparse_channels.inputs(ids, train=True))
    states = [m for m in module.model.modules() if isinstance(m, Fp8State) and m._last_call is not None]
    for st in states:
        st.refresh_cache()

    def timed(full: bool) -> float:
        out = []
        for _ in range(repeats):
            if full:
                for st in states:
                    st._checked = None  # the check runs as it did before the skip
            t = time.perf_counter()
            for st in states:
                st.refresh_cache()
            out.append(1e3 * (time.perf_counter() - t))
        return statistics.median(out)

    return timed(full=False), timed(full=True)


def main() -> None:
    torch.manual_seed(0)
    module = build()
    start = copy.deepcopy(module.model.state_dict())
    grouped, by_part = optimizer_ops(module, per_parameter=False)
    module.model.load_state_dict(start)
    single, _ = optimizer_ops(module, per_parameter=True)
    skipped, full = fp8_check_ms(module)
    ids = torch.randint(0, 50_257, (16_384,))
    with CountOps() as pull:
        module.sparse_channels.inputs(ids, train=True)
    print(f"record network (configs/speedrun_1gpu.yaml, stage 0, {NGRAM_ROWS:,} n-gram rows), CPU, "
          f"torch {torch.__version__}")
    print(f"optimizer step, ATen operations: {grouped:,} with grouped Adam, {single:,} with one update a "
          f"parameter (baseline): {single / grouped:.2f}x fewer; by part (eager forms, as on this CPU): "
          + ", ".join(f"{k} {v:,}" for k, v in by_part.items()))
    print(f"FP8 staleness checks, all layers, host ms: {skipped:.3f} skipped, {full:.3f} full (baseline): "
          f"{full / skipped:.1f}x less")
    print(f"sparse pull of one 16,384-token micro-batch, ATen operations: {pull.total:,} "
          "(replayed from one CUDA graph at one rank)")


if __name__ == "__main__":
    main()
