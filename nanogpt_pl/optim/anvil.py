"""ANVIL II: the record's optimizer for the hidden matrices, sharded over ranks.

Length: over 450 lines because one optimizer's state (banks, rails, lanes, sidecar), its
sharded communication and its captured update belong together (RECORD §8).

Per matrix and per step (RECORD.md §8), with ``g`` the rank-averaged gradient:

1. **Twin rails** (fp32): a fast rail ``v_f ← v_f + (1 − β_f)(g − v_f)`` and a zero-initialised
   slow rail ``v_s ← v_s + (1 − β_s)(g − v_s)``, β_s = 0.98, both running from step 0. Before the
   engage step (514) β_f is the scheduled momentum μ and the blend is the fast rail alone;
   from it on β_f = 0.85 and ``m = w·v_f + (1 − w)·v_s`` with w = 0.4385.
2. **Nesterov lookahead**: ``u = (1 − μ)·g + μ·m``.
3. **Polar cascade** (``nanogpt_pl.optim.polar``): Frobenius-normalize ``u`` and apply six
   quintic maps through the Gram matrix in bf16, so every singular value lands near 1.
4. **Isotropic lanes**: a lane is a row when rows ≥ cols, else a column. Each lane keeps an
   EMA ``E`` (β₂ = 0.9, zero init) of its mean squared update ``P``; the update is rescaled
   by ``1/√max(E, 1e-10)`` per lane and then back to its Frobenius norm before the rescale.
5. **Cautious decoupled decay and the step**:
   ``θ ← θ − 𝟙[v_s·θ ≥ 0]·θ·(wd·lr)·lr_eff − lr_eff·v`` with ``lr`` the group's lr (already
   times the schedule's multiplier), ``wd`` = 2.25 and ``lr_eff = lr·√max(1, rows/cols)·anvil_lr_mul``.
   The decay is gated on the slow rail, the de-noised direction of the gradient.

**Precision.** bf16 parameters keep an fp32 master: the bf16 weight holds the high 16 bits
of the fp32 value and a uint16 "mantissa sidecar" in the optimizer state holds the low 16
(RECORD §8 step 5), so ``θ_fp32 = (bf16 bits << 16) | sidecar`` exactly and the visible bf16
weight is the master truncated toward zero. The master costs 2 bytes per parameter element
instead of the 4 of an fp32 copy, and only on the rank that owns the matrix (2/world bytes
per element per rank). fp32 parameters are their own master (no sidecar). The rest of the
state is fp32: two rails (8 bytes per element, again only on the owner) and one lane value
per row or column.

**Banks and sharding.** Matrices of equal shape (within a param group and dtype) form a bank,
ordered as the parameters are given. A parameter is viewed as ``(-1, rows, cols)``: its last
two dims, or the block shape its param group lists for it (``group["blocks"]``, built by
``nanogpt_pl.optim.groups`` from parameter names; e.g. ``qk_w [2, 768, 768]`` in blocks of
(256, 768) is six 256×768 matrices, two heads of Q or K each). With ``W``
ranks each bank is padded to a multiple of ``W`` matrices; rank ``k`` owns the ``k``-th
contiguous slice. A step stacks each bank's gradients, launches every bank's
reduce-scatter (average) at once, then works bank by bank: wait for its gradient shard,
update the owned matrices, launch its all-gather; finally it waits for the gathers and
writes the gathered matrices back into the parameters. With ``bank_views`` (the default) a
bank's matrices live in one tensor and the parameters are views of it: one rank updates
them in place and several ranks gather straight into it, so no matrix is copied into or out
of the bank. There is no DDP wrapper: this
optimizer owns the communication of its parameters. A parameter's gradient that is
``None`` counts as zero, unless every gradient of the bank is ``None`` (then the bank is
skipped on every rank; the ranks must agree on that, as they do in data-parallel training).

**Driving it.** Before each ``step()`` the caller sets ``group["lr"]`` (the base lr times the
schedule's multiplier; ``group["initial_lr"]`` keeps the base) and ``group["momentum"]`` (μ of
the schedule). The optimizer counts its own steps (``state_dict`` carries the count), which
decides the engage step; a caller may instead set ``group["step"]`` (an int, the 0-based
index of the step being taken) to drive that group explicitly.

**Checkpoints.** With one rank ``state_dict()`` is the full state. With several ranks it is
this rank's shard (``"anvil-local"``), which loads back only on the same rank of the same
world size; :meth:`Anvil.consolidate_state_dict` (a collective, Lightning's protocol for
sharded optimizers) makes the next ``state_dict()`` on rank ``to`` return the full,
world-size-independent state (``"anvil-full"``), which loads on any world size.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor
from torch.autograd.graph import increment_version

from ..backends import resolve_fast_on_gpu
from ..capture import close_failed_capture
from .adam import row_range
from .polar import ANVIL_MAPS, polar_cascade, resolve_backend
from .staging import ScalarStager

# RECORD.md §8 "Hyperparameters" [L360@186k] and "Per-matrix update" steps 1, 4, 5.
ANVIL_LR = 0.023
ANVIL_WEIGHT_DECAY = 2.25
LANE_BETA2 = 0.9
LANE_EPS = 1e-10
# RECORD.md §8 step 1: DUAL_MOMENTUM "0.85, 0.98, 0.4385, 514".
FAST_BETA_ENGAGED = 0.85
SLOW_BETA = 0.98
BLEND = 0.4385
ENGAGE_STEP = 514
# RECORD.md §8 step 2: μ(0) = 0.85 (the schedule raises it to 0.93).
MOMENTUM_START = 0.85

_FULL = "anvil-full"
_LOCAL = "anvil-local"
_STATE_VERSION = 1

# Layout of the per-group step scalars shipped to the device once per step.
_S_ONE_MINUS_FAST, _S_ONE_MINUS_SLOW, _S_BLEND, _S_MU, _S_ONE_MINUS_LANE, _S_EPS, _S_WD_LR, _S_LR = range(8)
_N_SCALARS = 8

# torch wraps Optimizer.add_param_group in _disable_dynamo, whose first call imports torch._dynamo
# (seconds of CPU); the wrapped function does the same work without that import.
_base_add_param_group = getattr(torch.optim.Optimizer.add_param_group, "__wrapped__",
                                torch.optim.Optimizer.add_param_group)

_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


# -- the update math (plain functions so torch.compile can fuse them on the GPU) ----------
def rails_lookahead(g: Tensor, rails: Tensor, s: Tensor) -> Tensor:
    """Advance both rails with ``g`` and return the Nesterov lookahead ``(1 − μ)·g + μ·m`` (fp32).

    ``rails`` is ``[2, n, rows, cols]`` fp32 (fast, slow); ``s`` the group's step scalars.
    """
    g = g.float()
    rails[0].lerp_(g, s[_S_ONE_MINUS_FAST])
    rails[1].lerp_(g, s[_S_ONE_MINUS_SLOW])
    w = s[_S_BLEND]
    m = w * rails[0] + (1 - w) * rails[1]
    return g.lerp(m, s[_S_MU])


def lanes_equalize(x: Tensor, lane_energy: Tensor, s: Tensor, lane_dim: int) -> Tensor:
    """Rescale each lane of ``x`` by ``1/√max(E, eps)`` at fixed Frobenius norm; updates ``E`` (fp32)."""
    v = x.float()
    length = v.shape[lane_dim]
    power = v.square().mean(dim=lane_dim, keepdim=True)
    pre = (power.sum(dim=(-2, -1), keepdim=True) * length).sqrt()
    lane_energy.lerp_(power, s[_S_ONE_MINUS_LANE])
    gain = torch.clamp(lane_energy, min=s[_S_EPS]).rsqrt()
    post = (power * length * gain.square()).sum(dim=(-2, -1), keepdim=True).sqrt()
    return v * (gain * (pre / torch.clamp(post, min=s[_S_EPS])))


def master_from_bf16(param_bits: Tensor, sidecar: Tensor) -> Tensor:
    """The fp32 master ``(bf16 bits << 16) | sidecar`` from int16 views of both halves."""
    hi = param_bits.to(torch.int32) << 16
    lo = sidecar.to(torch.int32) & 0xFFFF
    return (hi | lo).view(torch.float32)


def split_master(theta: Tensor) -> tuple[Tensor, Tensor]:
    """(high 16 bits, low 16 bits) of fp32 ``theta`` as int16: the bf16 weight (truncated) and the sidecar."""
    bits = theta.view(torch.int32)
    return (bits >> 16).to(torch.int16), bits.to(torch.int16)


def decay_and_step(theta: Tensor, v: Tensor, slow: Tensor, lr_eff: Tensor, s: Tensor) -> Tensor:
    """``θ − 𝟙[v_s·θ ≥ 0]·θ·(wd·lr)·lr_eff − lr_eff·v`` (RECORD §8 step 5)."""
    aligned = (slow * theta) >= 0
    return theta - theta * aligned * (s[_S_WD_LR] * lr_eff) - v * lr_eff


def finish_update(
    x: Tensor, lane_energy: Tensor, slow: Tensor, params: Tensor, sidecar: Optional[Tensor],
    lr_mul: Tensor, s: Tensor, lane_dim: int,
) -> None:
    """Lanes, cautious decay and the step, written into ``params`` (and the sidecar) in place."""
    v = lanes_equalize(x, lane_energy, s, lane_dim)
    lr_eff = lr_mul * s[_S_LR]
    if sidecar is None:
        params.copy_(decay_and_step(params.float(), v, slow, lr_eff, s))
        return
    bits = params.view(torch.int16)
    theta = decay_and_step(master_from_bf16(bits, sidecar), v, slow, lr_eff, s)
    hi, lo = split_master(theta)
    bits.copy_(hi)
    sidecar.copy_(lo)


def resolve_update_backend(backend: str, device: torch.device) -> str:
    """``reference`` or ``triton`` for the elementwise update (``model.backends.anvil``); raises for an
    impossible choice. ``auto`` is the Triton kernels on a GPU (timed faster in the step, BENCHMARKS.md)."""
    return resolve_fast_on_gpu("anvil", backend, device, "the parameters are")


class _Fused:
    """``fn`` compiled with torch.compile on first use, falling back to eager if compilation fails.

    The fallback only covers a failure of the first call, before any kernel of the compiled
    graph ran (compilation happens before execution), so no state is half-updated.
    """

    def __init__(self, fn: Callable, enabled: bool) -> None:
        self.fn = fn
        self.compiled: Optional[Callable] = torch.compile(fn, fullgraph=True, dynamic=False) if enabled else None
        self.proven: set = set()

    def __call__(self, *args: Any, key: Any = None) -> Any:
        if self.compiled is None:
            return self.fn(*args)
        if key in self.proven:
            return self.compiled(*args)
        try:
            out = self.compiled(*args)
        except Exception as err:  # pragma: no cover - depends on the GPU toolchain
            # error path only; torch._dynamo is slow to import
            from torch._dynamo.exc import BackendCompilerFailed, TorchRuntimeError, Unsupported

            if not isinstance(err, (BackendCompilerFailed, Unsupported, TorchRuntimeError)):
                raise
            warnings.warn(f"Anvil: torch.compile of {self.fn.__name__} failed ({err!r}); running it eagerly. "
                          f"Pass compile=False to skip the attempt.")
            self.compiled = None
            return self.fn(*args)
        self.proven.add(key)
        return out


@dataclass
class _Bank:
    """Matrices of one shape, dtype and param group; this rank owns ``[lo, hi)`` of them."""

    group: int
    rows: int
    cols: int
    dtype: torch.dtype
    pieces: list[tuple[Tensor, int, int]]  # (param, first matrix index, matrix count)
    count: int
    per_rank: int
    lo: int
    hi: int
    lr_mul: Tensor  # [owned, 1, 1] fp32: √max(1, rows/cols) · anvil_lr_mul
    rails: Tensor  # [2, owned, rows, cols] fp32
    lane_energy: Tensor  # [owned, rows, 1] or [owned, 1, cols] fp32
    sidecar: Optional[Tensor]  # [owned, rows, cols] int16, bf16 params only
    # bank_views: [per_rank * world, rows, cols], every piece's parameter a view of its slice
    storage: Optional[Tensor] = None
    view_ptrs: tuple = ()  # the address each piece's parameter has while it is that view
    buffers: dict[str, Tensor] = field(default_factory=dict)
    # CUDA graph of this bank's local work (see Anvil's cuda_graph); keyed by what it captured
    graph: Optional[Any] = None
    graph_key: Optional[tuple] = None
    warmed: bool = False

    @property
    def owned(self) -> int:
        return self.hi - self.lo

    @property
    def lane_dim(self) -> int:
        # a lane is a row when rows >= cols: its energy is the mean over the columns
        return -1 if self.rows >= self.cols else -2

    def buffer(self, name: str, count: int, dtype: torch.dtype, device: torch.device) -> Tensor:
        buf = self.buffers.get(name)
        if buf is None:
            buf = self.buffers[name] = torch.zeros(count, self.rows, self.cols, dtype=dtype, device=device)
        return buf

    def matrices(self, p: Tensor) -> Tensor:
        return p.view(-1, self.rows, self.cols)

    def views_intact(self) -> bool:
        """Every parameter of the bank is still the view of ``storage`` it was made (nothing re-pointed it)."""
        return self.storage is not None and tuple(p.data_ptr() for p, _, _ in self.pieces) == self.view_ptrs

    def owned_pieces(self) -> list[tuple[Tensor, int, int, int]]:
        """(param, first matrix in the param, first slot in the owned shard, count) for owned matrices."""
        out = []
        for p, start, n in self.pieces:
            a, b = max(start, self.lo), min(start + n, self.hi)
            if a < b:
                out.append((p, a - start, a - self.lo, b - a))
        return out

    def meta(self) -> dict:
        return {"group": self.group, "rows": self.rows, "cols": self.cols,
                "dtype": str(self.dtype).replace("torch.", ""),
                "count": self.count}


class Anvil(torch.optim.Optimizer):
    """ANVIL II for hidden matrices (RECORD.md §8), sharded over the ranks of ``process_group``.

    Args:
        params: matrices (or param groups). Each parameter is viewed as ``(-1, rows, cols)``
            with ``(rows, cols)`` its entry in the group's ``blocks`` list (aligned with
            ``params``; ``nanogpt_pl.optim.groups`` builds it from parameter names), else its
            ``anvil_block`` attribute, else its last two dims. The group's ``lr_muls`` list (or
            an ``anvil_lr_mul`` attribute; a float, or one float per matrix) scales its lr
            (RECORD §8: 2.0 for the MLP output projection, 0.0 freezes a matrix).
        lr: base lr (RECORD §8: 0.023). The schedule multiplies it into ``group["lr"]`` each step.
        momentum: μ of the Nesterov lookahead, and β of the fast rail before the engage step;
            the schedule sets ``group["momentum"]`` each step (RECORD §8: 0.85 → 0.93 → 0.85).
        weight_decay: cautious decay per unit lr² (RECORD §8: 2.25).
        lane_beta2: EMA decay of the lane energies (0.9).
        lane_eps: floor of the lane energies and of the rescaled norm (1e-10).
        slow_beta: β of the slow rail (0.98).
        blend: weight of the fast rail in the blend once engaged (0.4385).
        fast_beta_engaged: β of the fast rail once engaged (0.85).
        engage_step: first step (0-based) of the blend (514).
        maps: the cascade's (a, b, c) coefficients (default: the record's ``ANVIL_MAPS``).
        backend: ``auto``, ``reference`` or ``triton`` for the cascade's Gram/polynomial kernels.
        update_backend: the elementwise update around the cascade (rails and lookahead before it;
            lanes, cautious decay and step after it): ``reference`` (the PyTorch functions of this
            module), ``triton`` (``nanogpt_pl.ops.triton.anvil_update``: four kernels a bank
            instead of about forty passes) or ``auto`` (see :func:`resolve_update_backend`).
        compile: fuse the elementwise parts with torch.compile (None = off: on the H200 the
            compiled update of one rank's share took 10.1 ms against 4.2 ms eager, BENCHMARKS.md).
            Applies to the ``reference`` update only.
        cuda_graph: capture each bank's local work (copy of the owned matrices, rails, cascade,
            lanes, decay and step, and with one rank the copy back into the parameters) in a CUDA
            graph and replay it, so one launch replaces ~70 kernel launches per bank. None = on
            for CUDA parameters. The first step runs eagerly (warm-up), the second captures and
            replays; every step's update runs exactly once, with the same arithmetic as eager.
            The graph reads the step's scalars from a device buffer, so schedules need no
            recapture; it is recaptured when a parameter's storage moves. CPU: ignored.
        process_group: ranks that share the matrices. None = the default group when
            torch.distributed is initialized (as ``DistAdam``), else no communication; a group
            of size 1 also means no communication.
        bank_views: hold each bank's matrices in one tensor and make its parameters views of it
            (``param.data`` is re-pointed once, here; values unchanged). One rank then updates
            the parameters in place and several ranks all-gather into them, where False copies
            every matrix into the bank's buffer and back each step (two copies a parameter).
            A parameter re-pointed later (``param.data = ...``) makes its bank copy again.
    """

    def __init__(
        self,
        params: Iterable,
        lr: float = ANVIL_LR,
        momentum: float = MOMENTUM_START,
        weight_decay: float = ANVIL_WEIGHT_DECAY,
        lane_beta2: float = LANE_BETA2,
        lane_eps: float = LANE_EPS,
        slow_beta: float = SLOW_BETA,
        blend: float = BLEND,
        fast_beta_engaged: float = FAST_BETA_ENGAGED,
        engage_step: int = ENGAGE_STEP,
        maps: Sequence[tuple[float, float, float]] = ANVIL_MAPS,
        backend: str = "auto",
        update_backend: str = "auto",
        compile: Optional[bool] = None,
        cuda_graph: Optional[bool] = None,
        process_group: Optional[dist.ProcessGroup] = None,
        bank_views: bool = True,
    ) -> None:
        if lr < 0:
            raise ValueError(f"Anvil: lr must be >= 0, got {lr}")
        for name, beta in (("momentum", momentum), ("lane_beta2", lane_beta2), ("slow_beta", slow_beta),
                           ("blend", blend), ("fast_beta_engaged", fast_beta_engaged)):
            if not 0.0 <= beta <= 1.0:
                raise ValueError(f"Anvil: {name} must lie in [0, 1], got {beta}")
        defaults = dict(lr=lr, momentum=momentum, weight_decay=weight_decay, lane_beta2=lane_beta2,
                        lane_eps=lane_eps, slow_beta=slow_beta, blend=blend,
                        fast_beta_engaged=fast_beta_engaged, engage_step=engage_step)
        self._banks: list[_Bank] = []
        self.bank_views = bool(bank_views)
        self._ready = False
        super().__init__(params, defaults)
        self.maps = tuple(tuple(float(v) for v in m) for m in maps)
        self.backend = backend
        self.process_group = process_group
        if dist.is_available() and dist.is_initialized():
            self.world_size = dist.get_world_size(process_group)
            self.rank = dist.get_rank(process_group)
        else:
            self.world_size, self.rank = 1, 0
        self._step = 0
        self._consolidated: Optional[dict] = None
        self._ready = True
        self.device = self._check_params()
        resolve_backend(backend, self.device)  # fail early on an impossible backend
        self.update_backend = resolve_update_backend(update_backend, self.device)
        use_compile = False if compile is None else bool(compile)
        self._rails_fn = _Fused(rails_lookahead, use_compile)
        self._finish_fn = _Fused(finish_update, use_compile)
        self._scalars = ScalarStager(len(self.param_groups), _N_SCALARS, self.device)
        on_cuda = self.device.type == "cuda"
        if cuda_graph and not on_cuda:
            warnings.warn("Anvil: cuda_graph=True has no effect on CPU parameters")
        self.cuda_graph = on_cuda and (cuda_graph is None or bool(cuda_graph))
        self._graph_pool: Any = None
        self._graph_stream: Optional[torch.cuda.Stream] = None
        for i in range(len(self.param_groups)):
            self._build_banks(i)

    # -- construction ----------------------------------------------------------------
    def add_param_group(self, param_group: dict) -> None:
        _base_add_param_group(self, param_group)
        param_group.setdefault("initial_lr", param_group["lr"])
        seen: set[int] = set()
        for group in self.param_groups:
            for p in group["params"]:
                if id(p) in seen:
                    raise ValueError(f"Anvil got the parameter of shape {tuple(p.shape)} twice; pass each matrix once")
                seen.add(id(p))
        if self._ready:  # set before Optimizer.__init__ adds the first groups
            self._check_params()
            self._scalars = ScalarStager(len(self.param_groups), _N_SCALARS, self.device)
            for bank in self._banks:  # their graphs read the old scalar buffer
                bank.graph, bank.graph_key = None, None
            self._build_banks(len(self.param_groups) - 1)

    def _check_params(self) -> torch.device:
        devices = set()
        for group in self.param_groups:
            for name in ("blocks", "lr_muls"):
                if name in group and len(group[name]) != len(group["params"]):
                    raise ValueError(f"Anvil: a param group's {name!r} has {len(group[name])} entries for "
                                     f"{len(group['params'])} parameters")
            for j, p in enumerate(group["params"]):
                devices.add(p.device)
                if p.dtype not in (torch.float32, torch.bfloat16):
                    raise ValueError(f"Anvil supports float32 and bfloat16 parameters, got {p.dtype} "
                                     f"(shape {tuple(p.shape)}); cast the parameter or use Adam for it")
                if not p.is_contiguous():
                    raise ValueError(f"Anvil needs contiguous parameters (shape {tuple(p.shape)}); "
                                     f"make it contiguous before building the optimizer")
                rows, cols = self._block_of(p, group, j)
                # a block is whole rows of the parameter's last two dims, so the (-1, rows, cols) view
                # cuts real submatrices
                if p.dim() < 2 or p.shape[-1] != cols or p.shape[-2] % rows:
                    raise ValueError(f"parameter of shape {tuple(p.shape)}: anvil_block {(rows, cols)} does not "
                                     f"tile its last two dims (cols must equal the last dim and rows divide the "
                                     f"one before)")
        if len(devices) > 1:
            raise ValueError(f"Anvil needs all parameters on one device, got {sorted(map(str, devices))}")
        return devices.pop() if devices else torch.device("cpu")

    @staticmethod
    def _block_of(p: Tensor, group: Optional[dict] = None, j: int = 0) -> tuple[int, int]:
        block = group["blocks"][j] if group is not None and "blocks" in group else getattr(p, "anvil_block", None)
        if block is None:
            if p.dim() < 2:
                raise ValueError(f"Anvil orthogonalizes matrices; got a parameter of shape {tuple(p.shape)}. "
                                 f"Give 1-D parameters (gains, biases, scalars) to Adam")
            return int(p.shape[-2]), int(p.shape[-1])
        if len(block) != 2 or min(block) < 1:
            raise ValueError(f"anvil_block must be (rows, cols) of positive ints, got {block!r}")
        return int(block[0]), int(block[1])

    @staticmethod
    def _lr_muls(p: Tensor, count: int, group: Optional[dict] = None, j: int = 0) -> list[float]:
        mul = group["lr_muls"][j] if group is not None and "lr_muls" in group else getattr(p, "anvil_lr_mul", 1.0)
        if isinstance(mul, (int, float)):
            return [float(mul)] * count
        muls = [float(m) for m in mul]
        if len(muls) != count:
            raise ValueError(f"anvil_lr_mul of a parameter with {count} matrices has {len(muls)} entries")
        return muls

    def _build_banks(self, gi: int) -> None:
        group = self.param_groups[gi]
        entries: dict[tuple[int, int, torch.dtype], list[tuple[Tensor, int]]] = {}
        for j, p in enumerate(group["params"]):
            rows, cols = self._block_of(p, group, j)
            entries.setdefault((rows, cols, p.dtype), []).append((p, j))
        w, k = self.world_size, self.rank
        for (rows, cols, dtype), ps in entries.items():
            pieces, muls, start = [], [], 0
            for p, j in ps:
                n = p.numel() // (rows * cols)
                pieces.append((p, start, n))
                muls += self._lr_muls(p, n, group, j)
                start += n
            count = start
            lo, hi, per_rank = row_range(count, w, k)
            shape_mul = math.sqrt(max(1.0, rows / cols))
            dev = self.device
            owned = hi - lo
            lane_shape = (owned, rows, 1) if rows >= cols else (owned, 1, cols)
            storage, view_ptrs = None, ()
            if self.bank_views:
                storage = torch.zeros(per_rank * w, rows, cols, dtype=dtype, device=dev)
                for p, start, n in pieces:
                    storage[start:start + n].copy_(p.detach().reshape(n, rows, cols))
                    p.data = storage[start:start + n].view(p.shape)
                view_ptrs = tuple(p.data_ptr() for p, _, _ in pieces)
            self._banks.append(_Bank(
                storage=storage, view_ptrs=view_ptrs,
                group=gi, rows=rows, cols=cols, dtype=dtype, pieces=pieces, count=count, per_rank=per_rank,
                lo=lo, hi=hi,
                lr_mul=torch.tensor([shape_mul * m for m in muls[lo:hi]], dtype=torch.float32,
                                    device=dev).view(-1, 1, 1),
                rails=torch.zeros(2, owned, rows, cols, dtype=torch.float32, device=dev),
                lane_energy=torch.zeros(lane_shape, dtype=torch.float32, device=dev),
                sidecar=(torch.zeros(owned, rows, cols, dtype=torch.int16, device=dev)
                         if dtype == torch.bfloat16 else None),
            ))

    # -- the step ----------------------------------------------------------------------
    def _group_scalars(self, group: dict) -> list[float]:
        t = group.get("step")
        t = self._step if t is None else int(t)
        engaged = t >= group["engage_step"]
        fast_beta = group["fast_beta_engaged"] if engaged else group["momentum"]
        w = group["blend"] if engaged else 1.0
        s = [0.0] * _N_SCALARS
        s[_S_ONE_MINUS_FAST] = 1.0 - fast_beta
        s[_S_ONE_MINUS_SLOW] = 1.0 - group["slow_beta"]
        s[_S_BLEND] = w
        s[_S_MU] = group["momentum"]
        s[_S_ONE_MINUS_LANE] = 1.0 - group["lane_beta2"]
        s[_S_EPS] = group["lane_eps"]
        s[_S_WD_LR] = group["weight_decay"] * group["lr"]
        s[_S_LR] = group["lr"]
        return s

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """One ANVIL update of every bank (see the module docstring for the order of work)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        scalars = self._scalars.push([self._group_scalars(g) for g in self.param_groups])
        world, dev = self.world_size, self.device
        # The device does the averaging with NCCL; gloo sums and we divide.
        avg_op = dev.type == "cuda"
        pending = []
        for bank in self._banks:
            if all(p.grad is None for p, _, _ in bank.pieces):
                continue
            stacked = bank.buffer("grad", bank.per_rank * world, bank.dtype, dev)
            dst, src = [], []  # the bank's gradients staged with one multi-tensor copy, not one a piece
            for p, start, n in bank.pieces:
                if p.grad is None:
                    stacked[start:start + n].zero_()
                else:
                    dst.append(stacked[start:start + n])
                    src.append(p.grad.reshape(n, bank.rows, bank.cols))
            if dst:
                torch._foreach_copy_(dst, src)
            if world == 1:
                pending.append((bank, stacked, None))
                continue
            shard = bank.buffer("grad_shard", bank.per_rank, bank.dtype, dev)
            op = dist.ReduceOp.AVG if avg_op else dist.ReduceOp.SUM
            work = _reduce_scatter(shard, stacked, op=op, group=self.process_group, async_op=True)
            pending.append((bank, shard, work))

        gathers = []
        for bank, shard, work in pending:
            if work is not None:
                work.wait()
                if not avg_op:
                    shard.mul_(1.0 / world)
            views = bank.views_intact()
            # one rank with views updates the parameters where they are; otherwise the owned matrices
            # are updated in a buffer (and with several ranks gathered from it)
            own = bank.storage if views and world == 1 else bank.buffer("own", bank.per_rank, bank.dtype, dev)
            if bank.owned:
                self._run_local(bank, shard, own, scalars, copy_back=world == 1, views=views)
                self._mark_written(bank, world == 1)
            if world == 1:
                continue
            full = bank.storage if views else bank.buffer("gathered", bank.per_rank * world, bank.dtype, dev)
            gathers.append((bank, full, views, _all_gather(full, own, group=self.process_group, async_op=True)))

        for bank, full, views, work in gathers:
            work.wait()
            if views:  # gathered into the parameters themselves; their version counters are their own
                increment_version([p for p, _, _ in bank.pieces])
                continue
            for p, start, n in bank.pieces:
                bank.matrices(p).copy_(full[start:start + n])
        self._step += 1
        return loss

    def _local_work(self, bank: _Bank, grad: Tensor, own: Tensor, scalars: Tensor, copy_back: bool,
                    views: bool) -> None:
        """Copy the owned matrices into ``own``, update them, and (one rank) copy them back.

        With ``views`` the matrices are read from the bank's storage: with one rank ``own`` is
        that storage (nothing to copy), with several one copy fills ``own`` from the owned slice.
        """
        n = bank.owned
        if views:
            if own is not bank.storage:
                own[:n].copy_(bank.storage[bank.lo:bank.hi])
            self._update_bank(bank, grad[:n], own[:n], scalars[bank.group])
            return
        pieces = bank.owned_pieces()
        for p, a, slot, m in pieces:
            own[slot:slot + m].copy_(bank.matrices(p)[a:a + m])
        self._update_bank(bank, grad[:n], own[:n], scalars[bank.group])
        if copy_back:
            for p, a, slot, m in pieces:
                bank.matrices(p)[a:a + m].copy_(own[slot:slot + m])

    def _run_local(self, bank: _Bank, grad: Tensor, own: Tensor, scalars: Tensor, copy_back: bool,
                   views: bool) -> None:
        """:meth:`_local_work`, eagerly or through the bank's CUDA graph (see ``cuda_graph``); the
        caller bumps the parameters' version counters after it (:meth:`_mark_written`)."""
        if not self.cuda_graph:
            self._local_work(bank, grad, own, scalars, copy_back, views)
            return
        # the graph bakes in every address it touches: recapture if any of them moved
        key = (grad.data_ptr(), own.data_ptr(), scalars.data_ptr(), copy_back, views, self.maps,
               tuple(p.data_ptr() for p, _, _ in bank.pieces))
        if bank.graph is not None and bank.graph_key == key:
            bank.graph.replay()
            return
        if self._graph_stream is None:
            self._graph_stream = torch.cuda.Stream(device=self.device)
            self._graph_pool = torch.cuda.graph_pool_handle()
        side, current = self._graph_stream, torch.cuda.current_stream(self.device)
        if not bank.warmed:
            # warm-up on the capture stream (cuBLAS handles and workspaces are per stream)
            side.wait_stream(current)
            with torch.cuda.stream(side):
                self._local_work(bank, grad, own, scalars, copy_back, views)
            current.wait_stream(side)
            bank.warmed = True
            return
        graph = torch.cuda.CUDAGraph()
        try:
            # thread_local: the data loader's prefetch thread may allocate (pinned) memory meanwhile
            with torch.cuda.graph(graph, pool=self._graph_pool, stream=side, capture_error_mode="thread_local"):
                self._local_work(bank, grad, own, scalars, copy_back, views)
        except Exception as err:  # pragma: no cover - depends on the GPU toolchain
            # capture records kernels without running them, so nothing was updated yet
            warnings.warn(f"Anvil: CUDA graph capture failed ({err!r}); running the update eagerly from now on. "
                          f"Pass cuda_graph=False to skip the attempt.")
            close_failed_capture()
            self.cuda_graph = False
            self._local_work(bank, grad, own, scalars, copy_back, views)
            return
        bank.graph, bank.graph_key = graph, key
        graph.replay()

    @staticmethod
    def _mark_written(bank: _Bank, wrote: bool) -> None:
        """Bump the version counters of the parameters after an update that wrote them (one rank),
        whichever way it ran; where a ``copy_`` back already bumped them, one more bump is harmless.

        A replay runs no ATen operation, and an update of the bank's storage moves the storage's
        counter, not the parameters' (a parameter re-pointed at a view keeps its own). Without
        this bump the FP8 weight caches (``nanogpt_pl.ops.fp8.cache``), which see a changed weight
        by its counter, would go on quantizing the weights of an earlier step.
        """
        if wrote:
            increment_version([p for p, _, _ in bank.pieces])

    def _update_bank(self, bank: _Bank, grad: Tensor, params: Tensor, s: Tensor) -> None:
        if self.update_backend == "triton":
            from ..ops.triton.anvil_update import finish_update_, rails_lookahead_

            u = rails_lookahead_(grad, bank.rails, s[_S_ONE_MINUS_FAST], s[_S_ONE_MINUS_SLOW], s[_S_BLEND], s[_S_MU])
            x = polar_cascade(u, self.maps, backend=self.backend)
            finish_update_(x, bank.lane_energy, bank.rails[1], params, bank.sidecar, bank.lr_mul,
                           s[_S_ONE_MINUS_LANE], s[_S_EPS], s[_S_WD_LR], s[_S_LR], bank.lane_dim)
            return
        key = (bank.group, bank.rows, bank.cols, bank.owned, bank.dtype)
        u = self._rails_fn(grad, bank.rails, s, key=key)
        x = polar_cascade(u, self.maps, backend=self.backend)
        self._finish_fn(x, bank.lane_energy, bank.rails[1], params, bank.sidecar, bank.lr_mul, s, bank.lane_dim,
                        key=key)

    # -- state -----------------------------------------------------------------------
    @property
    def step_count(self) -> int:
        """Steps taken so far (the 0-based index of the next step)."""
        return self._step

    def _groups_meta(self) -> list[dict]:
        return [{k: v for k, v in g.items() if k != "params"} | {"num_params": len(g["params"])}
                for g in self.param_groups]

    def _bank_state(self, bank: _Bank) -> dict:
        return {"rails": bank.rails, "lane_energy": bank.lane_energy, "sidecar": bank.sidecar}

    def state_dict(self) -> dict:
        """The optimizer state: full with one rank (or after :meth:`consolidate_state_dict`), else this rank's shard."""
        if self._consolidated is not None:
            sd, self._consolidated = self._consolidated, None
            return sd
        kind = _FULL if self.world_size == 1 else _LOCAL
        sd: dict[str, Any] = {"format": kind, "version": _STATE_VERSION, "step": self._step,
                              "param_groups": self._groups_meta(),
                              "banks": [bank.meta() | self._bank_state(bank) for bank in self._banks]}
        if kind == _LOCAL:
            sd["world_size"], sd["rank"] = self.world_size, self.rank
        return sd

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Collect the full state on rank ``to`` (a collective: every rank must call it).

        The next ``state_dict()`` on rank ``to`` then returns the world-size-independent
        ``anvil-full`` state. Lightning's strategies call this for sharded optimizers.
        """
        if self.world_size == 1:
            return
        banks = []
        for bank in self._banks:
            out = bank.meta()
            for name, t in self._bank_state(bank).items():
                if t is None:
                    out[name] = None
                    continue
                per = [t[i] for i in range(2)] if name == "rails" else [t]
                gathered = [self._gather_owned(bank, part) for part in per]
                out[name] = torch.stack(gathered) if name == "rails" else gathered[0]
            banks.append(out)
        if self.rank == to:
            self._consolidated = {"format": _FULL, "version": _STATE_VERSION, "step": self._step,
                                  "param_groups": self._groups_meta(), "banks": banks}

    def _gather_owned(self, bank: _Bank, part: Tensor) -> Tensor:
        """All-gather a per-owned-matrix tensor into ``[count, ...]`` in matrix order."""
        pad = torch.zeros((bank.per_rank, *part.shape[1:]), dtype=part.dtype, device=part.device)
        pad[: part.shape[0]].copy_(part)
        # gloo cannot gather int16; the bytes travel unchanged as bf16
        send = pad.view(torch.bfloat16) if pad.dtype == torch.int16 else pad
        full = torch.empty((bank.per_rank * self.world_size, *part.shape[1:]), dtype=send.dtype, device=part.device)
        _all_gather(full, send, group=self.process_group)
        if pad.dtype == torch.int16:
            full = full.view(torch.int16)
        return full[: bank.count]

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a full state (any world size) or this rank's own shard (same world size and rank)."""
        kind = state_dict.get("format")
        if kind not in (_FULL, _LOCAL):
            raise ValueError(f"not an Anvil state dict (format={kind!r}); was it saved by another optimizer?")
        if kind == _LOCAL and (state_dict["world_size"], state_dict["rank"]) != (self.world_size, self.rank):
            raise ValueError(
                f"this Anvil state is rank {state_dict['rank']}'s shard of a {state_dict['world_size']}-rank run; "
                f"this is rank {self.rank} of {self.world_size}. Save with consolidate_state_dict() (the full state) "
                f"to resume on another rank or world size"
            )
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups) or any(
            s["num_params"] != len(g["params"]) for s, g in zip(saved_groups, self.param_groups)
        ):
            raise ValueError("Anvil state has different param groups than this optimizer; the model's matrices "
                             "and their grouping must match the checkpoint's")
        saved_banks = state_dict["banks"]
        if [self._meta_key(b) for b in saved_banks] != [self._meta_key(b.meta()) for b in self._banks]:
            raise ValueError(
                f"Anvil state banks {[self._meta_key(b) for b in saved_banks]} differ from this optimizer's "
                f"{[self._meta_key(b.meta()) for b in self._banks]}; the model's matrices must match the checkpoint's"
            )
        for bank, saved in zip(self._banks, saved_banks):
            for name, t in self._bank_state(bank).items():
                src = saved[name]
                if (t is None) != (src is None):
                    raise ValueError(f"Anvil state bank {self._meta_key(saved)}: {name} present in one side only")
                if t is None:
                    continue
                if kind == _FULL:
                    src = src[:, bank.lo:bank.hi] if name == "rails" else src[bank.lo:bank.hi]
                if tuple(src.shape) != tuple(t.shape):
                    raise ValueError(f"Anvil state bank {self._meta_key(saved)}: {name} has shape "
                                     f"{tuple(src.shape)}, expected {tuple(t.shape)}")
                t.copy_(src)
        for group, saved in zip(self.param_groups, saved_groups):
            for k, v in saved.items():
                if k != "num_params":
                    group[k] = v
        self._step = int(state_dict["step"])

    @staticmethod
    def _meta_key(meta: dict) -> tuple:
        return (meta["group"], meta["rows"], meta["cols"], meta["dtype"], meta["count"])
