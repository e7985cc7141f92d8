"""SpeedrunModule: the GPT, its loss and its optimizers under manual optimization.

Length: over 450 lines because it is the one place where Lightning's hooks meet the step
(schedule hooks, micro-batch loop, optimizer wiring, checkpoint and warmup state).

One training step (``shared/DESIGN.md`` "Data flow"): ``on_train_batch_start`` has set
this step's lr, momentum, windows, loss options and which optimizer parts update from the
schedule (``apply_schedule``);
``training_step`` runs forward and backward over the step's micro-batches (gradient
accumulation when the batch does not fit one pass per rank), then steps the
:class:`~nanogpt_pl.optim.combined.CombinedOptimizer`, whose parts communicate their
own gradients (there is no DDP wrapper). Validation is always the full-vocabulary
softcapped cross-entropy.

Callbacks change behaviour over time only through the small public hooks in the
"schedule hooks" section below (the speedrun timer's warmup replays schedule steps with them).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Optional

import lightning as L
import numpy as np
import torch
from torch import Tensor
from torch.profiler import record_function

from .backends import Backends, check_opt_in
from .capture import ModuleGraphs, RunAhead, cuda_graphs_active, max_seqlen_bound
from .data.stream import PlanBounds
from .data.tokenizer import build_prefix_table
from .distributed.row_exchange import EXCHANGES
from .distributed.side_files import RANK_LOCAL_KEY
from .distributed.sparse_channels import SparseChannels, build_sparse_channels
from .distributed.strategy import SpeedrunStrategy
from .metrics import BitsPerByte, MeanTokenLoss
from .model.attention import resolve_backend
from .model.gpt import GPT, GPTConfig
from .ops.cross_entropy import TRITON_BACKENDS, check_backend, full_cross_entropy, lm_head_loss
from .ops.sampling import CandidateSampler
from .ops.triton import interpret_mode
from .optim.adam import DistAdam
from .optim.anvil import Anvil
from .optim.combined import CombinedOptimizer
from .optim.groups import adam_families, anvil_group
from .optim.sparse_adam import SparseAdam
from .schedule import Schedule


def micro_batches(batch: Any) -> list[dict[str, Any]]:
    """A training step's batch as its list of micro-batches (the data module yields a list; a single
    micro-batch may also come as a bare dict)."""
    return batch if isinstance(batch, list) else [batch]


@dataclass
class AdamGroup:
    """Adam settings of one parameter family (RECORD §8's table).

    Args:
        lr_mul: multiplier on ``optim.adam_lr``.
        betas: Adam's (beta1, beta2).
        wd_mul: multiplier on ``optim.adam_weight_decay``.
    """

    lr_mul: float = 1.0
    betas: tuple[float, float] = (0.9, 0.99)
    wd_mul: float = 0.0


@dataclass
class OptimConfig:
    """Optimizers of the run; YAML keys under ``model.optim``.

    Args:
        matrix_optimizer: ``anvil`` (ANVIL II, RECORD §8) or ``adamw`` for the hidden matrices.
        matrix_lr: base lr of the hidden matrices (ANVIL: 0.023; AdamW wants about 1e-3..4e-3).
        matrix_betas: AdamW betas when ``matrix_optimizer`` is ``adamw``.
        matrix_weight_decay: decay of the hidden matrices (ANVIL: 2.25, RECORD §8).
        anvil_cuda_graph: on a GPU, ANVIL replays each bank's update from a CUDA graph (one
            launch instead of ~70 per bank; same arithmetic, bit for bit); False runs it eagerly.
        anvil_bank_views: the matrices become views of their ANVIL bank's one tensor, so the update
            writes them in place (one rank) or gathers into them (several) instead of copying every
            matrix into the bank and back each step; same bits. False copies.
        adam_cuda_graph: on a GPU, the dense Adam update of the replicated parameters replays from
            a CUDA graph per layout (RECORD §11's optimizer tail; each graph checked bit for bit
            against the eager update when captured); False runs it eagerly. It applies to the
            PyTorch update (``model.backends.adam: reference``); the Triton update, ``auto`` on a
            GPU, is one launch a parameter and runs without a graph.
        adam_lr: base lr of the Adam families (RECORD §8: 0.008).
        adam_eps: Adam's epsilon (RECORD §8: 1e-10).
        adam_weight_decay: decay per unit lr of the Adam families, times each family's wd_mul.
        cautious_wd: decay only where the update and the weight agree in sign.
        adam_decay_lr_power: Adam decay per step is (lr·lr_mul)^power·adam_weight_decay·wd_mul;
            2 is the record's (RECORD §8), 1 is ordinary AdamW.
        shard_embeddings: embed and lm_head Adam state and updates split by rows over the ranks
            (reduce-scatter, update, all-gather; RECORD §8).
        embed: settings of the token embedding.
        lm_head: settings of the lm_head.
        value_embeds: settings of the value-embedding tables.
        scalars: settings of the scalar gates and lambdas not in a family below.
        ngram: settings of the n-gram table's lazy row Adam (RECORD §4; beta1 must be 0).
        sparse_value_embeds: value embeddings get compact gradients and update with the n-gram
            table in the ``sparse`` optimizer part, on the sparse cadence (RECORD §5); False keeps
            them in the dense Adam part.
        sparse_exchange: how the sparse channels move rows between ranks
            (``nanogpt_pl.distributed.row_exchange``): ``fixed`` (capacities from the batch plan,
            no host sync; at 8 ranks about 2.3x the bytes of exact sizes, BENCHMARKS.md),
            ``reference`` (exact sizes; the counts are read on the host at every pull and event)
            or ``auto`` (``fixed`` when the leaves have fixed shapes, i.e. with compile or CUDA
            graphs, else ``reference``). Either works with fixed leaf shapes and gives the same
            bits; on one rank nothing moves and ``fixed`` only avoids the host reads.
        value_rows_from_plan: with fixed leaf shapes, the value-embedding leaf of a micro-batch
            length T holds the most distinct tokens any micro-batch of T in the run's batch plan
            has (counted on the host before the run; the speedrun timer reserves it) instead of
            min(T, V) rows, every one of which is written in the forward and zero-filled in the
            gradient. False: min(T, V). The same bits either way.
        smear_gate: the smear gate's weight (RECORD §8: lr ×0.01).
        ve_gate: the value-embedding gates (lr ×1, decay ×1).
        post_lambdas: the post-lambdas π (betas 0.9, 0.95).
        resid_lambdas: the residual lambdas ρ (lr ×5, betas 0.9, 0.95).
        mudd: MUDD's layer and final mix weights (lr ×0.25, decay ×1).
        mudd_bias: their biases (no decay).
        mudd_gate: MUDD's pre and post gate weights (lr ×0.1, decay ×1).
        mudd_gate_bias: the gate biases and the gate scale κ (no decay).
    """

    matrix_optimizer: str = "anvil"
    matrix_lr: float = 0.023
    matrix_betas: tuple[float, float] = (0.9, 0.95)
    matrix_weight_decay: float = 2.25
    anvil_cuda_graph: bool = True
    anvil_bank_views: bool = True
    adam_cuda_graph: bool = True
    adam_lr: float = 0.008
    adam_eps: float = 1e-10
    adam_weight_decay: float = 0.005
    cautious_wd: bool = True
    adam_decay_lr_power: int = 2
    shard_embeddings: bool = True
    embed: AdamGroup = field(default_factory=lambda: AdamGroup(lr_mul=1.0, betas=(0.5, 0.95), wd_mul=150.0))
    lm_head: AdamGroup = field(default_factory=lambda: AdamGroup(lr_mul=1.0, betas=(0.5, 0.95), wd_mul=150.0))
    value_embeds: AdamGroup = field(default_factory=lambda: AdamGroup(lr_mul=70.0, betas=(0.75, 0.95), wd_mul=5.0))
    scalars: AdamGroup = field(default_factory=lambda: AdamGroup(lr_mul=5.0, betas=(0.9, 0.99), wd_mul=0.0))
    ngram: AdamGroup = field(default_factory=lambda: AdamGroup(lr_mul=70.0, betas=(0.0, 0.95), wd_mul=5.0))
    sparse_value_embeds: bool = True
    sparse_exchange: str = "auto"
    value_rows_from_plan: bool = True
    # RECORD §8 "Adam parameter groups": the small parameters by family (names matched in
    # nanogpt_pl.optim.groups.ADAM_RULES)
    smear_gate: AdamGroup = field(default_factory=lambda: AdamGroup(0.01, (0.9, 0.99), 0.0))
    ve_gate: AdamGroup = field(default_factory=lambda: AdamGroup(1.0, (0.9, 0.99), 1.0))
    post_lambdas: AdamGroup = field(default_factory=lambda: AdamGroup(1.0, (0.9, 0.95), 0.0))
    resid_lambdas: AdamGroup = field(default_factory=lambda: AdamGroup(5.0, (0.9, 0.95), 0.0))
    mudd: AdamGroup = field(default_factory=lambda: AdamGroup(0.25, (0.9, 0.99), 1.0))
    mudd_bias: AdamGroup = field(default_factory=lambda: AdamGroup(0.25, (0.9, 0.99), 0.0))
    mudd_gate: AdamGroup = field(default_factory=lambda: AdamGroup(0.1, (0.9, 0.99), 1.0))
    mudd_gate_bias: AdamGroup = field(default_factory=lambda: AdamGroup(0.1, (0.9, 0.99), 0.0))

    def __post_init__(self) -> None:
        if self.matrix_optimizer not in ("anvil", "adamw"):
            raise ValueError(f"model.optim.matrix_optimizer={self.matrix_optimizer!r}: choose 'anvil' or 'adamw'")
        if self.sparse_exchange not in ("auto", *EXCHANGES):
            raise ValueError(f"model.optim.sparse_exchange={self.sparse_exchange!r}: choose one of auto, "
                             f"{', '.join(EXCHANGES)}")


class SliceSamplers:
    """One candidate sampler per global micro-batch slice.

    A step's batch is cut into ``G = world_size x micro-batches`` slices (slice ``g`` is
    micro-batch ``g // world_size`` of rank ``g % world_size``). Giving each slice its own
    sweep position (as if it were rank ``g`` of ``G``) makes the candidate sets, and so the
    training run, independent of how the slices are spread over ranks; at 8 ranks with one
    micro-batch each this is exactly the record's per-rank sampler (RECORD §6).
    """

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.samplers: dict[tuple[int, int], CandidateSampler] = {}

    def get(self, slice_index: int, num_slices: int) -> CandidateSampler:
        key = (slice_index, num_slices)
        if key not in self.samplers:
            self.samplers[key] = CandidateSampler(vocab_size=self.vocab_size, rank=slice_index, world_size=num_slices)
        return self.samplers[key]

    def state_dict(self) -> dict[str, dict]:
        return {f"{g}/{n}": s.state_dict() for (g, n), s in self.samplers.items()}

    def load_state_dict(self, state: dict[str, dict]) -> None:
        self.samplers = {}
        for key, value in state.items():
            g, n = (int(x) for x in key.split("/"))
            self.get(g, n).load_state_dict(value)


@dataclass
class StepSettings:
    """What the schedule decided for the current step (set through the module's hooks)."""

    windows: tuple[int, int] = (128, 384)
    candidates: Optional[int] = None
    mtp_weights: tuple[float, ...] = (1.0,)
    prefix_weight: float = 0.0
    active_parts: Optional[tuple[str, ...]] = None
    sparse_cadence_engaged: bool = False
    tied: bool = False


# Checkpoints store the hyperparameters as these dataclasses; allow them under torch.load's
# weights_only unpickler (Lightning loads checkpoints with it by default).
torch.serialization.add_safe_globals([GPTConfig, OptimConfig, AdamGroup, Backends])


# torch._dynamo's recompiles per frame with model.compile (its default of 8 is below the record
# network's layer kinds times one stage's keys; see prepare_for_training)
COMPILE_RECOMPILE_LIMIT = 64


def check_compile_options(options: Optional[dict[str, Any]]) -> dict[str, Any]:
    """``model.compile_options`` as a dict, each name checked against ``torch._inductor.config``
    (one line naming the unknown option; inductor itself would only say so at the first compile)."""
    options = dict(options or {})
    import torch._inductor.config as inductor_config

    known = inductor_config.get_config_copy()
    unknown = sorted(k for k in options if k not in known)
    if unknown:
        raise ValueError(f"model.compile_options: {', '.join(map(repr, unknown))} "
                         f"{'is not an inductor option' if len(unknown) == 1 else 'are not inductor options'} "
                         "(torch._inductor.config names them, e.g. combo_kernels); remove or correct it")
    return options


def _host_copy(obj: Any) -> Any:
    """A deep copy of a (nested) state dict with every tensor copied to host memory.

    Dicts keep their type and a module state dict its ``_metadata`` (``load_state_dict`` reads it).
    """
    if isinstance(obj, Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        out = copy.copy(obj)  # the same type (and attributes such as _metadata), refilled below
        out.clear()
        out.update((k, _host_copy(v)) for k, v in obj.items())
        if hasattr(obj, "_metadata"):
            out._metadata = copy.deepcopy(obj._metadata)
        return out
    if isinstance(obj, list):
        return [_host_copy(v) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(_host_copy(v) for v in obj)
    return copy.deepcopy(obj)


class SpeedrunModule(L.LightningModule):
    """The speedrun GPT trained with manual optimization.

    Args:
        gpt: the model's shape and techniques.
        optim: the optimizers.
        schedule: the stage table (linked from the top-level ``schedule`` section by the CLI).
        backends: the implementation of each numerical part (attention, FP8, loss, ANVIL's polar
            cascade and elementwise update, dense Adam, the n-gram hashes), all in one section
            (``nanogpt_pl.backends.Backends``).
        compile: compile the model's forward with ``torch.compile``: one graph, the FP8 layers inside it
            as custom operators (their weight caches refreshed eagerly before each forward).
        fp8_graph_breaks: with ``compile``, end the compiled graph at every FP8 layer instead (the layers
            run eagerly between compiled pieces, as before the custom operators), for comparison.
        compile_options: with ``compile``, inductor options for the model's compile (``torch.compile``'s
            ``options``), e.g. ``{combo_kernels: true}``; names are checked against ``torch._inductor.config``.
        param_dtype: ``auto`` (bf16 matrices and embeddings on CUDA, fp32 on CPU), ``bfloat16``
            or ``float32``. Scalars always stay fp32.
        cuda_graphs: on a GPU, capture forward, loss and backward of each micro-batch as a CUDA
            graph per configuration key and replay it (``nanogpt_pl/capture.py``, RECORD §11); each
            capture is checked against eager first. No effect on CPU (one warning if set).
        cuda_graphs_fp8_refresh: with ``cuda_graphs``, also replay the FP8 weight refresh after each
            optimizer step from CUDA graphs (``capture.RefreshGraphs``; each checked bit for bit
            against an eager refresh first); false refreshes eagerly.
    """

    def __init__(
        self,
        gpt: GPTConfig = GPTConfig(),
        optim: OptimConfig = OptimConfig(),
        schedule: Optional[Schedule] = None,
        backends: Backends = Backends(),
        compile: bool = False,
        param_dtype: str = "auto",
        cuda_graphs: bool = False,
        fp8_graph_breaks: bool = False,
        cuda_graphs_fp8_refresh: bool = True,
        compile_options: Optional[dict[str, Any]] = None,
    ) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.save_hyperparameters(ignore=["schedule"])
        self.gpt_config = gpt
        self.optim_config = optim
        self.schedule = schedule if schedule is not None else Schedule()
        self.backends = backends
        self.compile = compile
        self.fp8_graph_breaks = fp8_graph_breaks
        self.compile_options = check_compile_options(compile_options)
        check_backend(backends.loss)
        check_opt_in("ngram", backends.ngram)
        if param_dtype not in ("auto", "bfloat16", "float32"):
            raise ValueError(f"model.param_dtype={param_dtype!r}: choose 'auto', 'bfloat16' or 'float32'")
        self.param_dtype = param_dtype
        self.cuda_graphs = cuda_graphs
        self.cuda_graphs_fp8_refresh = cuda_graphs_fp8_refresh
        self.model = GPT(gpt, backends)
        self.settings = StepSettings(windows=self.schedule.windows(0))
        self.sampler: Optional[SliceSamplers] = None
        # the n-gram table shard and value-embedding channel (built in setup, on the strategy's group)
        self.sparse_channels: Optional[SparseChannels] = None
        self._world = (1, 0)  # (world size, rank), set by prepare_for_training
        self._plain_optimizer: Optional[CombinedOptimizer] = None
        # the schedule step whose window path the rotary state reflects (apply_schedule); -1: none yet
        self._rotary_step = -1
        self._prefix: Optional[np.ndarray] = None  # the prefix-token table (RECORD §2), built on first use
        # restored from a checkpoint before setup builds what they belong to
        self._pending_sparse_state: Optional[dict[str, Any]] = None
        self._pending_sampler_state: Optional[dict[str, dict]] = None
        # dense-model FLOPs of this rank's last step (callbacks.throughput reads it for MFU)
        self.flops_per_batch: Optional[int] = None
        # token-weighted over batches and ranks by torchmetrics (nanogpt_pl/metrics.py)
        self.val_loss = MeanTokenLoss()
        self.val_bpb = BitsPerByte()
        self._graphs: Optional[ModuleGraphs] = None  # built at the first step on a GPU
        self._run_ahead = RunAhead()

    # -- setup ---------------------------------------------------------------------
    def setup(self, stage: str) -> None:
        self._check_gpu_options(self.trainer.strategy.root_device)
        self.prepare_for_training(self.trainer.strategy.root_device, self.trainer.world_size, self.global_rank)
        if (self.sparse_channels is not None and self.trainer.world_size > 1
                and not isinstance(self.trainer.strategy, SpeedrunStrategy)):
            raise RuntimeError(
                "the n-gram table (model.gpt.ngram_rows) and sparse value embeddings "
                "(model.optim.sparse_value_embeds) keep per-rank state and gradients outside autograd; "
                f"with several devices use trainer.strategy: speedrun (got {type(self.trainer.strategy).__name__})"
            )

    def prepare_for_training(self, device: torch.device, world_size: int = 1, rank: int = 0) -> None:
        """Parameter dtypes, sparse channels, samplers and compilation for ``device``.

        ``setup`` calls it with the trainer's device and ranks; a plain training loop (see
        ``benchmarks/step_time.py``) calls it directly.
        """
        self._world = (world_size, rank)
        self._check_device_options(device)
        dtype = torch.bfloat16 if (self.param_dtype == "bfloat16" or
                                   (self.param_dtype == "auto" and device.type == "cuda")) else torch.float32
        roles = self.model.param_roles()
        for name in ("matrices", "embed", "lm_head", "value_embeds"):
            for p in roles[name]:
                p.data = p.data.to(dtype)
        # the activations take the embedding's dtype; no training segment is longer than a micro-batch
        self.model.build_rotary_tables(max(st.seq_len for st in self.schedule.stages), dtype)
        self.sampler = SliceSamplers(self.gpt_config.vocab_size)
        graphs = cuda_graphs_active(self.cuda_graphs, device)
        if self.sparse_channels is None:
            self.sparse_channels = build_sparse_channels(self.model, self.process_group, device,
                                                         self.optim_config.sparse_value_embeds,
                                                         fixed_shapes=self.compile or graphs,
                                                         ngram_hash=self.backends.ngram,
                                                         exchange=self.optim_config.sparse_exchange)
            if self._pending_sparse_state is not None and self.sparse_channels is not None:
                self.sparse_channels.load_state_dict(self._pending_sparse_state)
                self._pending_sparse_state = None
        if self.compile:
            # Each layer kind (widths, paired heads, gates, value embedding) and each capture key's
            # shapes is a recompile of the frames they share; at dynamo's default limit of 8 one
            # stage of the record network already sent some attention frames back to eager.
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, COMPILE_RECOMPILE_LIMIT)
            for m in self.model.modules():
                if hasattr(m, "graph_break"):  # the FP8 layer states (nanogpt_pl.ops.fp8)
                    m.graph_break = self.fp8_graph_breaks
            # compiled in place: the module keeps its parameters, so state_dict keys stay the same
            self.model.compile(dynamic=False, options=self.compile_options or None)

    def _check_gpu_options(self, device: torch.device) -> None:
        """A trainer run off CUDA rejects the options that are for a GPU (a plain loop calling
        ``prepare_for_training`` may still compile on CPU)."""
        if device.type == "cuda":
            return
        cfg = self.gpt_config
        # (model.optim.anvil_cuda_graph and adam_cuda_graph only apply on CUDA: elsewhere the update runs
        # eagerly, as documented)
        gpu_only = ["--model.compile false"] if self.compile else []
        if self.backends.fp8 == "auto":
            gpu_only += [f"--model.gpt.{k} false" for k in ("fp8_mlp", "fp8_head", "fp8_qkv") if getattr(cfg, k)]
        if gpu_only:
            raise RuntimeError(
                f"{', '.join(o.split()[0][2:] for o in gpu_only)} are GPU options and this run is on "
                f"{device.type}: add {' '.join(gpu_only)} (or --model.backends.fp8 reference to emulate FP8), "
                "or train configs/quickstart.yaml"
            )

    def _check_device_options(self, device: torch.device) -> None:
        """Reject options this device cannot run, naming the option and the fix."""
        resolve_backend(self.backends.attention, device)
        cfg = self.gpt_config
        if device.type != "cuda":
            if self.backends.fp8 == "scaled_mm" and (cfg.fp8_mlp or cfg.fp8_head or cfg.fp8_qkv):
                raise RuntimeError(
                    "model.backends.fp8='scaled_mm' needs a CUDA GPU with FP8 (sm_89+); "
                    "use model.backends.fp8: reference on CPU"
                )
            if self.backends.loss in TRITON_BACKENDS:
                if not interpret_mode():
                    raise RuntimeError(
                        f"model.backends.loss={self.backends.loss!r} needs a CUDA GPU (or TRITON_INTERPRET=1 for "
                        "debugging); use model.backends.loss: auto or reference on CPU"
                    )

    @property
    def process_group(self):
        return getattr(self.trainer.strategy, "process_group", None) if self._trainer is not None else None

    def configure_optimizers(self) -> torch.optim.Optimizer:
        o = self.optim_config
        pg = self.process_group
        parts: dict[str, torch.optim.Optimizer] = {}
        # which parameter goes where, and with which block shape and lr multiplier: by name (optim/groups.py)
        matrices = anvil_group(self.model, self.gpt_config.head_dim)
        if o.matrix_optimizer == "anvil":
            parts["matrices"] = Anvil([matrices], lr=o.matrix_lr, weight_decay=o.matrix_weight_decay,
                                      engage_step=self.schedule.anvil_engage_step,
                                      cuda_graph=None if o.anvil_cuda_graph else False, process_group=pg,
                                      backend=self.backends.polar, update_backend=self.backends.anvil,
                                      bank_views=o.anvil_bank_views)
        else:
            parts["matrices"] = DistAdam(matrices["params"], lr=o.matrix_lr, betas=o.matrix_betas, eps=o.adam_eps,
                                         weight_decay=o.matrix_weight_decay, cautious_wd=o.cautious_wd,
                                         process_group=pg, update_backend=self.backends.adam,
                                         cuda_graph=None if o.adam_cuda_graph else False)
        sparse = self.sparse_channels.channels() if self.sparse_channels is not None else {}
        groups = []
        for name, params in adam_families(self.model).items():
            g = getattr(o, name)
            if name not in sparse:
                groups.append(dict(params=params, name=name, lr_mul=g.lr_mul, betas=tuple(g.betas),
                                   wd_mul=g.wd_mul, sharded=o.shard_embeddings and name in ("embed", "lm_head")))
        parts["adam"] = DistAdam(groups, lr=o.adam_lr, eps=o.adam_eps, weight_decay=o.adam_weight_decay,
                                 cautious_wd=o.cautious_wd, process_group=pg, decay_lr_power=o.adam_decay_lr_power,
                                 update_backend=self.backends.adam, cuda_graph=None if o.adam_cuda_graph else False)
        if sparse:
            settings = {name: dict(lr_mul=g.lr_mul, betas=tuple(g.betas), wd_mul=g.wd_mul)
                        for name, g in (("ngram", o.ngram), ("value_embeds", o.value_embeds))}
            parts["sparse"] = SparseAdam(sparse, lr=o.adam_lr, eps=o.adam_eps, weight_decay=o.adam_weight_decay,
                                         groups=settings)
        return CombinedOptimizer(parts)

    # -- schedule hooks ------------------------------------------------------------------
    def apply_schedule(self, step: int, previous_step: Optional[int] = None) -> None:
        """Set ``step``'s schedule values through the hooks below.

        Every value is a pure function of the step (``schedule.py``), so a resumed run applies
        exactly what the straight run would have. YaRN fires when the windows of ``step`` differ
        from those of the step before. A YaRN change multiplies onto the rotary state, so that
        state depends on the path of window changes: unless the rotary state is that of ``step - 1``
        (``previous_step``, by default the step this method last applied), the rotaries are reset
        and the schedule's window changes up to ``step`` replayed in order. Every visit, in any
        order (the speedrun timer's warmup visits steps out of order, a benchmark starts at a later
        stage, a resumed run at its checkpoint's step), then sees the straight run's frequencies
        and softmax scales bit for bit: a warmup at another path's scales would compile and capture
        for values the run never uses.
        """
        sched = self.schedule
        self.set_lr_scale(sched.lr_mul(step))
        self.set_momentum(sched.momentum(step))
        short, long = sched.windows(step)
        if previous_step is None:
            previous_step = self._rotary_step
        if previous_step == step - 1 and step > 0:
            prev = sched.windows(previous_step)
            self.set_windows(short, long, yarn_from=prev if prev != (short, long) else None)
        else:
            self.replay_windows(step)
        self._rotary_step = step
        self.set_loss_options(sched.candidates(step), sched.mtp_weights(step), sched.prefix_weight(step))
        self.set_active_parts(self.active_parts_for(step))
        self.set_tied(sched.tied(step), untie_now=step > 0 and sched.tied(step - 1) and not sched.tied(step))

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.apply_schedule(self.global_step)

    def set_lr_scale(self, scale: float) -> None:
        """Set every param group's lr to its initial lr times ``scale``."""
        for group in self._combined().param_groups:
            group["lr"] = group["initial_lr"] * scale

    def learning_rates(self) -> dict[str, float]:
        """This step's learning rate of each optimizer part, as logged: ``lr/matrix`` (ANVIL's base lr,
        before its per-shape sqrt(max(1, rows/cols)) factor; AdamW's lr), ``lr/adam_<group>`` and
        ``lr/sparse_<channel>`` (lr times the group's lr_mul)."""
        out: dict[str, float] = {}
        for part_name, part in self._combined().parts.items():
            for group in part.param_groups:
                lr = float(group["lr"]) * float(group.get("lr_mul", 1.0))
                key = "lr/matrix" if part_name == "matrices" else f"lr/{part_name}_{group.get('name', len(out))}"
                out.setdefault(key, lr)
        return out

    def set_momentum(self, momentum: float) -> None:
        """Set the momentum of the optimizer groups that have one (ANVIL)."""
        for group in self._combined().param_groups:
            if "momentum" in group:
                group["momentum"] = momentum

    def set_windows(self, short: int, long: int, yarn_from: Optional[tuple[int, int]] = None) -> None:
        """Use attention windows (short, long); with ``yarn_from`` also stretch the rotary frequencies."""
        if yarn_from is not None:
            self.model.rotaries["short"].apply_yarn(yarn_from[0], short)
            self.model.rotaries["long"].apply_yarn(yarn_from[1], long)
        self.settings.windows = (short, long)

    def replay_windows(self, step: int) -> None:
        """Set the rotary state of ``step`` as the straight run reaches it: reset, then every window
        change of the schedule from step 1 to ``step`` in order."""
        for rotary in self.model.rotaries.values():
            rotary.reset_yarn()
        sched = self.schedule
        windows = sched.windows(0)
        for s in range(1, step + 1):
            new = sched.windows(s)
            if new != windows:
                self.set_windows(*new, yarn_from=windows)
                windows = new
        self.settings.windows = tuple(windows)

    def set_loss_options(self, candidates: Optional[int], mtp_weights: list[float], prefix_weight: float) -> None:
        """Sampled-softmax candidate count (None = full), multi-token weights, prefix-loss weight."""
        if candidates is not None and candidates >= self.gpt_config.vocab_size:
            candidates = None
        self.settings.candidates = candidates
        self.settings.mtp_weights = tuple(mtp_weights)
        self.settings.prefix_weight = prefix_weight

    def set_active_parts(self, names: Optional[list[str]]) -> None:
        """Optimizer parts that update at the end of this step (None = all)."""
        self.settings.active_parts = None if names is None else tuple(names)

    def set_tied(self, tied: bool, untie_now: bool = False) -> None:
        """Tie the embedding to the lm_head for this step; ``untie_now`` hands it its own update.

        While tied (RECORD §2), the embedding's gradient is added to the lm_head's, only the
        lm_head is updated, and the embedding copies it after each update. At the untie step
        the embedding inherits the lm_head's Adam moments and step count.
        """
        if untie_now:
            adam = self._combined().parts["adam"]
            head, emb = self.model.lm_head, self.model.embed
            if head in adam.state:
                adam.state[emb] = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in adam.state[head].items()}
        self.settings.tied = tied

    def active_parts_for(self, step: int) -> list[str]:
        """Optimizer parts that update at ``step``: matrices every step, Adam on its cadence, the
        sparse channels on theirs (RECORD §5). Also notes whether ``step`` runs the sparse cadence
        engaged (squared betas, doubled decay), which the sparse part applies when it steps."""
        parts = ["matrices"]
        if self.schedule.adam_step(step):
            parts.append("adam")
        if self.sparse_channels is not None and self.schedule.sparse_step(step):
            parts.append("sparse")
            self.settings.sparse_cadence_engaged = self.schedule.sparse_cadence_engaged(step)
        return parts

    def use_plain_optimizer(self, optimizer: CombinedOptimizer) -> None:
        """Drive the module without a Trainer: ``run_step`` steps ``optimizer`` and calls
        ``backward`` directly (the plain-loop baseline of ``benchmarks/step_time.py``)."""
        self._plain_optimizer = optimizer

    def _combined(self) -> CombinedOptimizer:
        if self._plain_optimizer is not None:
            return self._plain_optimizer
        opt = self.optimizers()
        return opt.optimizer if hasattr(opt, "optimizer") else opt

    # -- steps ---------------------------------------------------------------------
    def prepare_batch(self, batch: Any, step: int) -> Any:
        """Host-side per-step additions, before the batch moves to the device.

        Adds each micro-batch's sampled-softmax candidate set (built on the CPU copy of the
        targets, RECORD §6) and its prefix-token targets when the schedule uses them.
        """
        micro = micro_batches(batch)
        num = self.schedule.candidates(step)
        prefix = self.schedule.prefix_weight(step) > 0
        world, rank = self._world
        for a, mb in enumerate(micro):
            # pinned like the loader's tensors, so the copy to the device does not block the host
            pin = mb["targets"].is_pinned()
            if num is not None and num < self.gpt_config.vocab_size:
                sampler = self.sampler.get(a * world + rank, len(micro) * world)
                mb["candidates"] = sampler.build(mb["targets"], num)
                if pin:
                    mb["candidates"] = mb["candidates"].pin_memory()
            if prefix:
                # a numpy gather on the host copy: torch's CPU index op here averaged 1.4-7.5 ms a
                # micro-batch in an H100 machine's stage-0 profile (BENCHMARKS.md, the host's data step)
                mb["prefix_targets"] = torch.from_numpy(self._prefix_table()[mb["targets"].numpy()])
                if pin:
                    mb["prefix_targets"] = mb["prefix_targets"].pin_memory()
        return batch

    def _prefix_table(self) -> np.ndarray:
        if self._prefix is None:  # built on first use: it needs the tokenizer's files
            self._prefix = build_prefix_table(vocab_size=self.gpt_config.vocab_size).numpy()
        return self._prefix

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        if self.trainer.training and self.sampler is not None:
            batch = self.prepare_batch(batch, self.global_step)
        return batch

    def _forward(self, inputs: Tensor, cu_seqlens: Tensor, max_seqlen: int, windows: tuple[int, int],
                 sparse: dict[str, Any]) -> Tensor:
        if self.compile:
            # cu_seqlens is padded to a power of two that grows with the documents a micro-batch
            # holds (nanogpt_pl.capture.pad_cu_seqlens): a dynamic length, or every new length
            # recompiles the model (with the FP8 layers inside the graph, all of it)
            torch._dynamo.mark_dynamic(cu_seqlens, 0)
        return self.model(inputs, cu_seqlens, max_seqlen, windows, **sparse)

    def _micro_loss(self, mb: dict[str, Any], sparse: Optional[dict[str, Any]] = None) -> Tensor:
        if self.compile and not self.fp8_graph_breaks:
            # the compiled forward reads the FP8 weight caches without checking them (with the
            # graph breaks the FP8 layers run eagerly and check their own)
            self.model.refresh_fp8()
        max_seqlen = int(mb["max_seqlen"])
        if self.compile:
            # the stage's bound, as the CUDA graphs take it: the compiled model specializes on this
            # int, and each micro-batch's own longest segment was a recompile of the whole model
            max_seqlen = max(max_seqlen, max_seqlen_bound(self.schedule, mb))
        hidden = self._forward(mb["inputs"], mb["cu_seqlens"], max_seqlen, self.settings.windows,
                               sparse or {})
        s = self.settings
        head = self.model.fp8_head
        if head is not None:
            head.loss_rows = hidden.shape[0]  # the loss is a mean over these rows
        return lm_head_loss(
            hidden, self.model.lm_head, mb["targets"], candidates=mb.get("candidates"),
            mtp_weights=mb.get("mtp_weights", s.mtp_weights),
            prefix_targets=mb.get("prefix_targets"), prefix_weight=s.prefix_weight, backend=self.backends.loss,
            head=head,
        )

    def backward_of(self, scaled: Tensor) -> None:
        """The backward of a scaled micro-batch loss: autograd's under the plain loop
        (``use_plain_optimizer``), Lightning's ``manual_backward`` under the Trainer."""
        if self._plain_optimizer is not None:
            scaled.backward()
        else:
            self.manual_backward(scaled)

    def eager_micro_step(self, mb: dict[str, Any], sparse: Optional[dict[str, Any]], micro_batches: int) -> Tensor:
        """Forward, loss and backward of one micro-batch, eagerly; the detached loss."""
        loss = self._micro_loss(mb, sparse)
        # RECORD §1: the backward sees the SUM of the rank's per-token losses (times
        # 1/micro-batches); the FP8 static gradient scales and Adam's eps assume that scale.
        self.backward_of(loss * (mb["targets"].numel() / micro_batches))
        return loss.detach()

    def run_step(self, batch: list[dict[str, Any]]) -> Tensor:
        """Forward, backward and optimizer step over one step's micro-batches; the mean loss.

        ``training_step`` adds logging on top; the speedrun timer calls this directly for
        its untimed warmup steps.
        """
        opt = self._plain_optimizer if self._plain_optimizer is not None else self.optimizers()
        micro = micro_batches(batch)
        total = torch.zeros((), device=self.device)
        graphs = self._step_graphs()
        if graphs is not None:
            graphs.begin_step()
        for mb in micro:
            # n-gram rows pulled from their owner ranks, value-embedding rows as compact leaves
            with record_function("step/sparse_pull"):
                if graphs is not None:
                    sparse = graphs.pull(mb["inputs"], mb.get("distinct_tokens"))
                elif self.sparse_channels is not None:
                    sparse = self.sparse_channels.train_inputs(mb["inputs"], mb.get("distinct_tokens"))
                else:
                    sparse = None
            with record_function("step/micro_batch"):
                if graphs is not None:  # forward and backward from the micro-batch's CUDA graph
                    loss = graphs.micro_step(mb, sparse, len(micro))
                else:
                    loss = self.eager_micro_step(mb, sparse, len(micro))
            if sparse:
                with record_function("step/sparse_push"):
                    self.sparse_channels.push_grads(sparse)
            total += loss
        combined = self._combined()
        if "sparse" in combined.parts:
            combined.parts["sparse"].set_cadence_engaged(self.settings.sparse_cadence_engaged)
        combined.set_active(self.settings.active_parts)
        tied = self.settings.tied
        if tied:
            emb, head = self.model.embed, self.model.lm_head
            if emb.grad is not None:
                head.grad = emb.grad if head.grad is None else head.grad.add_(emb.grad)
                emb.grad = None
        with record_function("step/optimizer"):
            opt.step()
            if tied and "adam" in combined.active_names():
                with torch.no_grad():
                    emb.copy_(head)
            opt.zero_grad(set_to_none=True)
        with record_function("step/run_ahead_wait"):
            self._run_ahead.step_done(self.device)
        return total / len(micro)

    def graph_counts(self) -> dict[str, int]:
        """What the CUDA graphs have done so far: micro-batches replayed and run eagerly, keys
        seen and captured, and the same for the sparse pulls, the FP8 refreshes and the Adam
        updates (all zero while the step runs eagerly)."""
        adam = [part.graphs for part in self._combined().parts.values() if getattr(part, "graphs", None) is not None]
        counts = {"adam_replays": sum(a.replays for a in adam), "adam_eager": sum(a.eager_runs for a in adam)}
        g = self._graphs
        if g is None:
            return {"replays": 0, "eager": 0, "keys_seen": 0, "keys": 0, "pull_replays": 0, "pull_eager": 0,
                    "refresh_replays": 0, "refresh_eager": 0, **counts}
        pulls, refresh = g.pulls, g.refresh
        return {"replays": g.graphs.replays, "eager": g.graphs.eager_runs, "keys_seen": len(g.graphs.entries),
                "keys": len(g.graphs.captured_keys()),
                "pull_replays": pulls.replays if pulls is not None else 0,
                "pull_eager": pulls.eager_runs if pulls is not None else 0,
                "refresh_replays": refresh.replays if refresh is not None else 0,
                "refresh_eager": refresh.eager_runs if refresh is not None else 0, **counts}

    def graph_key_names(self, start: int = 0) -> list[str]:
        """The micro-batch graph keys seen so far from the ``start``-th on (none while eager)."""
        return [] if self._graphs is None else self._graphs.key_names(start)

    def reserve_shapes(self, bounds: PlanBounds) -> None:
        """Size the step's inputs per sequence length for the run ahead, from its batch plan
        (``SpeedrunDataModule.plan_bounds``): the CUDA graphs' ``cu_seqlens``
        (:meth:`ModuleGraphs.reserve_cu_seqlens`, nothing while the step runs eagerly) and the
        value-embedding leaf's rows (:meth:`SparseChannels.reserve_value_rows`, unless
        ``model.optim.value_rows_from_plan`` is off)."""
        graphs = self._step_graphs()
        if graphs is not None:
            graphs.reserve_cu_seqlens(bounds.cu_seqlens)
        if self.sparse_channels is not None and self.optim_config.value_rows_from_plan:
            self.sparse_channels.reserve_value_rows(bounds.distinct_tokens)

    def _step_graphs(self) -> Optional[ModuleGraphs]:
        """The CUDA graphs of the training step (``model.cuda_graphs``), None when the step runs eagerly."""
        if self._graphs is None and self.cuda_graphs and self.device.type == "cuda":
            self._graphs = ModuleGraphs(self)
        return self._graphs

    def training_step(self, batch: list[dict[str, Any]], batch_idx: int) -> Tensor:
        step = self.global_step  # optimizer steps completed before this one
        mean_loss = self.run_step(batch)
        micro = micro_batches(batch)
        tokens = sum(mb["inputs"].numel() for mb in micro)
        self.flops_per_batch = tokens * self.gpt_config.flops_per_token(micro[0]["inputs"].numel(),
                                                                       *self.settings.windows)
        if self._logs_at(step):
            # read on the host only when the loggers write (every log_every_n_steps): the
            # progress bar reads its value every step, which for a device tensor is a sync
            loss = self.trainer.strategy.reduce(mean_loss.detach(), reduce_op="mean").cpu()
            self.log("train/loss", loss, prog_bar=True, batch_size=1)
        self.log("train/tokens", float(self.schedule.tokens_through(step)), batch_size=1)
        self.log("schedule/lr_mul", self.schedule.lr_mul(step), batch_size=1)
        for name, lr in self.learning_rates().items():
            self.log(name, lr, batch_size=1)
        # tokens this rank's documents lost to the step's max_doc_len (data.long_documents)
        self.log("train/doc_tokens_cut", float(sum(mb.get("doc_tokens_cut", 0) for mb in micro)), batch_size=1)
        return mean_loss

    def _logs_at(self, step: int) -> bool:
        """Whether the loggers write at the end of ``step`` (Lightning's ``log_every_n_steps``)."""
        every = self.trainer.log_every_n_steps
        return every > 0 and ((step + 1) % every == 0 or step + 1 >= self.schedule.run_steps(self.trainer.max_steps))

    def log(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        """``LightningModule.log``, with Python numbers logged as CPU tensors.

        Lightning turns a number into a tensor on the module's device: on a GPU that is a
        blocking host-to-device copy, a sync every step (with ``sync_dist`` the value must be
        on the device, so it goes there as before).
        """
        if isinstance(value, (int, float)) and not isinstance(value, bool) and not kwargs.get("sync_dist"):
            value = torch.tensor(float(value))
        super().log(name, value, *args, **kwargs)

    # -- state capture (the speedrun timer resets to the start after its warmup) -------
    def capture_state(self) -> dict[str, Any]:
        """A deep copy of everything training changes: weights, buffers, optimizer, sampler.

        The weights' and optimizer's tensors are copied to host memory: the speedrun timer holds
        this copy through its warmup, whose captures need the GPU's memory (several GiB at the
        record's size; :meth:`restore_state` copies them back into place).
        """
        return {
            "model": _host_copy(self.model.state_dict()),
            "optimizer": _host_copy(self._combined().state_dict()),
            "sampler": None if self.sampler is None else copy.deepcopy(self.sampler.state_dict()),
            "settings": copy.deepcopy(self.settings),
            "rotary_step": self._rotary_step,
            # a record-size n-gram shard is not copied: before any sparse event it is all zeros
            "sparse": None if self.sparse_channels is None or self.sparse_channels.pristine()
            else copy.deepcopy(self.sparse_channels.state_dict()),
        }

    def restore_state(self, state: dict[str, Any]) -> None:
        """Return to a state from :meth:`capture_state`; gradients are cleared."""
        self.model.load_state_dict(state["model"])
        combined = self._combined()
        for part in combined.parts.values():
            part.zero_grad(set_to_none=True)
            if not isinstance(part, DistAdam):  # DistAdam loads into the moments it holds (its graphs read them)
                part.state.clear()
        combined.load_state_dict(_host_copy(state["optimizer"]))  # the parts may keep what they are given
        if self.sampler is not None and state["sampler"] is not None:
            self.sampler.load_state_dict(state["sampler"])
        self.settings = copy.deepcopy(state["settings"])
        self._rotary_step = state.get("rotary_step", -1)
        self._prefix = None  # RECORD §11: the prefix-table build is on the clock, so the timed run rebuilds it
        if self.sparse_channels is not None:
            if state.get("sparse") is None:
                self.sparse_channels.reset_()
            else:
                self.sparse_channels.load_state_dict(copy.deepcopy(state["sparse"]))

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> Tensor:
        sparse = self.sparse_channels.inputs(batch["inputs"], train=False) if self.sparse_channels else {}
        max_seqlen = int(batch["max_seqlen"])
        if self.compile:
            # validation documents are not capped, so the bound is T: one compiled shape for every
            # batch, where each batch's own longest document was a recompile (a larger max_seqlen
            # only sizes the attention grid and reads the rotary rows computed instead of tabled)
            max_seqlen = max(max_seqlen, batch["inputs"].numel())
        hidden = self._forward(batch["inputs"], batch["cu_seqlens"], max_seqlen,
                               (self.schedule.val_window_short, self.schedule.val_window_long), sparse)
        loss = full_cross_entropy(hidden, self.model.lm_head, batch["targets"])
        self.val_loss.update(loss, batch["targets"].numel())
        self.val_bpb.update_from_loss(hidden, self.model.lm_head, batch["targets"], loss)
        self.log("val/loss", self.val_loss, prog_bar=True)
        self.log("val/bpb", self.val_bpb)
        return loss

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        # Stop after the schedule's last step so the final validation runs (Lightning validates
        # when training is asked to stop).
        if self.global_step >= self.schedule.run_steps(self.trainer.max_steps):
            self.trainer.should_stop = True

    # -- checkpoint ----------------------------------------------------------------
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        samplers = {} if self.sampler is None else self.sampler.state_dict()
        if self.trainer.world_size > 1:
            # every rank runs this hook; the slices' samplers live on different ranks
            gathered: list = [None] * self.trainer.world_size
            torch.distributed.all_gather_object(gathered, samplers)
            samplers = {k: v for part in gathered for k, v in part.items()}
        checkpoint["speedrun"] = {"samplers": samplers, "windows": self.settings.windows}
        # what `nanogpt-pl generate` needs to run the validation network from this file alone
        checkpoint["speedrun"]["val_windows"] = (self.schedule.val_window_short, self.schedule.val_window_long)
        if self.sparse_channels is not None:
            # rank-local: SpeedrunStrategy moves it to <ckpt>.ngram-rank<r>.pt (distributed/side_files.py)
            checkpoint[RANK_LOCAL_KEY] = self.sparse_channels.state_dict()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        state = checkpoint.get("speedrun", {})
        self._pending_sampler_state = state.get("samplers")
        if "windows" in state:
            self.settings.windows = tuple(state["windows"])
        sparse = checkpoint.get(RANK_LOCAL_KEY)
        if isinstance(sparse, dict) and sparse.get("side_files"):
            raise RuntimeError(
                "this checkpoint keeps the n-gram table in per-rank side files (.ngram-rank<r>.pt), which only "
                "trainer.strategy: speedrun reads; resume with that strategy and the same number of devices"
            )
        if sparse is not None:
            if self.sparse_channels is None:
                self._pending_sparse_state = sparse  # applied when setup builds the channels
            else:
                self.sparse_channels.load_state_dict(sparse)

    def on_train_start(self) -> None:
        if self._pending_sampler_state is not None and self.sampler is not None:
            self.sampler.load_state_dict(self._pending_sampler_state)
            self._pending_sampler_state = None


