"""Whole-micro-batch CUDA graphs: one per configuration key, static buffers, a replay-vs-eager self-check.

RECORD §11: the record captures the forward (loss) and the backward of a micro-batch once
per *configuration key*, everything that decides which kernels run with which shapes and
Python-side constants (tokens, ``cu_seqlens`` length, MTP terms, candidate count, prefix
weight, windows, longest document), and replays it for every later micro-batch of that key.
Here one graph holds forward + loss + backward of one micro-batch:

- **Static inputs.** The micro-batch's tensors (token ids, targets, ``cu_seqlens``,
  candidates, prefix targets, the MTP weights as a device tensor) and the sparse leaves the
  n-gram / value-embedding exchange pulled are copied into the graph's own buffers before
  each replay, except the leaves of a captured pull, which the graph reads in place. The
  exchange itself stays between the graphs (pull before, gradient hand-back after): eager
  where it has a collective in it, and where it has none (the fixed exchange at one rank) a
  graph of its own per token-id layout, :class:`PullGraphs`.
- **Persistent gradients.** The backward accumulates in place into ``.grad`` buffers this
  module owns (allocated once, zeroed when a step first uses them), so the optimizers'
  ``zero_grad(set_to_none=True)`` never frees what a graph writes to. A parameter gets a
  buffer only if the key's eager run gave it a gradient (a parameter an eager step leaves
  at ``None`` stays ``None``, so optimizers skip it as before).
- **Python-side state.** What the forward reads as Python numbers is in the key; what it
  reads as tensors (FP8 delayed scales, amaxes, rotary frequencies) is read at replay time.
  The FP8 weight caches are brought up to date eagerly before every micro-batch
  (``Fp8State.refresh_cache``) and refresh in place (``Fp8State.hold_cache_addresses``),
  because a replay runs none of their host-side staleness checks.
- **Visits.** The first visit of a key runs eagerly (compilation, Triton autotuning, cuBLAS
  workspaces). The second captures, on a side stream warmed by an eager run of the same
  micro-batch, replays, and compares: loss within :data:`SELF_CHECK_RTOL` and the gradients
  within :data:`GRAD_CHECK_RTOL` (norm-wise), else one warning and the key stays eager. The
  eager run's result is the one kept, so the self-check changes nothing the step computes.
  Any exception while capturing is a warning and eager for that key, never an error.

Also the host side of a fast step: :class:`RunAhead` (the CPU at most two steps ahead of
the GPU) and :class:`FrozenGC` (the collector off while the speedrun clock runs).
"""

from __future__ import annotations

import collections
import dataclasses
import gc
import math
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
from torch import Tensor
from torch.profiler import record_function

# RECORD §11: replay vs eager loss within 5e-4 relative (fp16/fp32 atomics jitter ~1e-4).
SELF_CHECK_RTOL = 5e-4
# Whole-model gradient norm of (replay - eager) over the eager gradient's norm. Atomics in the
# attention backward move a bf16 gradient by an ulp here and there (~1e-3 norm-wise at most);
# a graph that read a stale value is off by far more.
GRAD_CHECK_RTOL = 1e-2
# RECORD §11: host run-ahead is throttled to 2 steps.
RUN_AHEAD_STEPS = 2


# -- configuration keys ------------------------------------------------------------------------
@dataclass(frozen=True)
class CaptureKey:
    """Everything that decides what one micro-batch's graph computes, besides tensor values.

    The record's key (RECORD §11) is (T, max docs, MTP weights, P, prefix weight, short window,
    long window, max doc length); the rest are constants of a run that the forward also reads
    as Python numbers (YaRN-adjusted softmax scales, the 1/micro-batches factor of the loss)
    and the layout of every input tensor.

    Attributes:
        tokens: T, tokens of the micro-batch.
        max_docs: length of ``cu_seqlens`` (the padded document count + 1).
        max_seqlen: the longest segment the attention kernel is told to expect.
        windows: (short, long) attention windows.
        attn_scales: softmax scale of each rotary chain.
        candidates: sampled-softmax candidate count P (None = full vocabulary).
        mtp_terms: number of multi-token-prediction weights (their values are a tensor input).
        prefix_weight: weight of the prefix loss (0 = off).
        micro_batches: micro-batches of the step (the loss is scaled by T / micro-batches).
        layout: (name, shape, dtype, requires_grad) of every input tensor and (name, value) of
            every other input.
    """

    tokens: int
    max_docs: int
    max_seqlen: int
    windows: tuple[int, int]
    attn_scales: tuple[float, ...]
    candidates: Optional[int]
    mtp_terms: int
    prefix_weight: float
    micro_batches: int
    layout: tuple = ()


def _flatten(value: Any, name: str = "") -> list[tuple[str, Any]]:
    """(dotted name, leaf) pairs of a nest of dicts, lists and dataclasses."""
    if isinstance(value, dict):
        return [item for k in sorted(value) for item in _flatten(value[k], f"{name}.{k}" if name else str(k))]
    if isinstance(value, (list, tuple)) and not isinstance(value, Tensor):
        return [item for i, v in enumerate(value) for item in _flatten(v, f"{name}[{i}]")]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [item for f in dataclasses.fields(value) for item in _flatten(getattr(value, f.name),
                                                                             f"{name}.{f.name}")]
    return [(name, value)]


def input_layout(inputs: Any) -> tuple:
    """The part of a key that the inputs' structure decides (see :attr:`CaptureKey.layout`)."""
    out = []
    for name, v in _flatten(inputs):
        if isinstance(v, Tensor):
            out.append((name, tuple(v.shape), v.dtype, v.requires_grad))
        else:
            out.append((name, v))
    return tuple(out)


def capture_key(mb: dict[str, Any], sparse: Optional[dict[str, Any]], *, windows: Sequence[int],
                attn_scales: Sequence[float], mtp_terms: int, prefix_weight: float, micro_batches: int) -> CaptureKey:
    """The key of one micro-batch (``mb`` as :meth:`SpeedrunModule._micro_loss` reads it)."""
    cand = mb.get("candidates")
    prefix_on = mb.get("prefix_targets") is not None and float(prefix_weight) != 0.0
    return CaptureKey(
        tokens=int(mb["inputs"].numel()),
        max_docs=int(mb["cu_seqlens"].numel()),
        max_seqlen=int(mb["max_seqlen"]),
        windows=(int(windows[0]), int(windows[1])),
        attn_scales=tuple(float(s) for s in attn_scales),
        candidates=None if cand is None else int(cand.numel()),
        mtp_terms=int(mtp_terms),
        prefix_weight=float(prefix_weight) if prefix_on else 0.0,
        micro_batches=int(micro_batches),
        layout=input_layout({"mb": mb, "sparse": sparse or {}}),
    )


def schedule_key(schedule: Any, step: int) -> tuple:
    """The schedule's share of a step's capture keys: steps with equal values share their graphs.

    The speedrun timer's warmup visits the first two steps of each (RECORD §11: every key gets
    two untimed visits, capture and self-check).
    """
    return (schedule.batch_tokens(step), schedule.seq_len(step), schedule.max_doc_len(step),
            schedule.attention_split(step), schedule.windows(step), schedule.candidates(step),
            len(schedule.mtp_weights(step)), schedule.prefix_weight(step))


def max_seqlen_bound(schedule: Any, mb: dict[str, Any]) -> int:
    """The longest segment a micro-batch of its step can hold: the stage's document cap (or the
    attention split below it), at most T. A captured attention kernel is sized for this bound,
    so every batch of a key fits it (``max_seqlen`` only sizes the kernel's grid)."""
    n = int(mb["inputs"].numel())
    step = mb.get("step")
    if schedule is None or step is None:
        return n
    bound = schedule.max_doc_len(step)
    split = schedule.attention_split(step)
    if split is not None:
        bound = min(bound, split)
    return min(n, int(bound))


def graph_docs_length(n: int) -> int:
    """The ``cu_seqlens`` length the graphs use for one of ``n`` entries: the next power of two."""
    return 1 << (max(int(n), 1) - 1).bit_length()


def pad_cu_seqlens(cu_seqlens: Tensor, at_least: int = 0) -> Tensor:
    """``cu_seqlens`` padded with its last entry (T: zero-length segments) to the next power of
    two of its length, and at least ``at_least`` entries.

    The loader pads to the record's fixed length (RECORD §1) or, when a micro-batch has more
    documents, to the next multiple of 128: on a corpus of short documents that gave a new
    length, hence a new key and a new capture, every few micro-batches. The graphs pad further,
    to few lengths, and never shrink back within a sequence length (``at_least``), so a stage
    settles on one key.
    """
    n = cu_seqlens.numel()
    want = max(int(at_least), graph_docs_length(n))
    if want <= n:
        return cu_seqlens
    return torch.cat([cu_seqlens, cu_seqlens[-1:].expand(want - n)])


# -- the graphs ----------------------------------------------------------------------------------
def _static_copy(value: Any, keep: Optional[Callable[[Tensor], bool]] = None) -> Any:
    """A same-layout copy of a nest of tensors; a leaf that requires grad stays one. A tensor
    ``keep`` accepts (a buffer that is already fixed) is kept itself, not copied."""
    if isinstance(value, Tensor):
        if keep is not None and keep(value):
            return value
        t = value.detach().clone()
        return t.requires_grad_(True) if value.requires_grad else t
    if isinstance(value, dict):
        return {k: _static_copy(v, keep) for k, v in value.items()}
    if isinstance(value, list):
        return [_static_copy(v, keep) for v in value]
    if isinstance(value, tuple):
        return tuple(_static_copy(v, keep) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.replace(value, **{f.name: _static_copy(getattr(value, f.name), keep)
                                             for f in dataclasses.fields(value) if f.init})
    return value


def _tensor_pairs(static: Any, live: Any) -> list[tuple[Tensor, Tensor]]:
    a, b = _flatten(static), _flatten(live)
    return [(s, v) for (_, s), (_, v) in zip(a, b) if isinstance(s, Tensor)]


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


def backward_into_grads(backward: Callable[[], None], params: Sequence[Tensor]) -> None:
    """Run ``backward`` and add what it gives each parameter into the ``.grad`` it already had.

    The result is what autograd's own accumulation gives, bit for bit (the same elementwise
    add), and every ``.grad`` keeps its tensor (a graph's persistent buffer stays the one it
    baked in). The difference is the kernels: autograd adds each parameter's gradient alone,
    about 95 small adds a micro-batch in the record network (BENCHMARKS.md, "Capture on and
    off", the stage-2 profile: 761 add kernels, 4.4 ms a step); here the backward writes fresh
    gradients and one multi-tensor add per dtype folds them in. A parameter whose ``.grad`` was None
    gets the fresh gradient; one the backward does not reach keeps its ``.grad``. If the
    backward raises, every ``.grad`` is put back as it was and nothing is added.
    """
    held = [p.grad for p in params]
    for p in params:
        p.grad = None
    try:
        backward()
    except BaseException:
        for p, old in zip(params, held):
            p.grad = old
        raise
    # the multi-tensor kernels take one device and dtype a call, and tensors of equal strides
    groups: dict[tuple, tuple[list[Tensor], list[Tensor]]] = {}
    for p, old in zip(params, held):
        new = p.grad
        if old is None:
            continue
        p.grad = old
        if new is None:
            continue
        if (new.layout == old.layout == torch.strided and new.dtype == old.dtype and new.shape == old.shape
                and new.device == old.device and new.stride() == old.stride()):
            dst, src = groups.setdefault((old.device, old.dtype), ([], []))
            dst.append(old)
            src.append(new)
        else:  # a sparse or mismatched gradient: autograd's own form of the add
            old.add_(new)
    for dst, src in groups.values():
        torch._foreach_add_(dst, src)


def close_failed_capture() -> None:
    """Take the current device's CUDA generator out of capture mode after a capture failed.

    When CUDA invalidates a capture (a host sync inside it, work on a stream it did not fork),
    torch 2.11's ``CUDAGraph.capture_end`` raises before it ends the default generator's capture;
    the generator stays in capture mode and the next random op outside a capture fails with
    "Offset increment outside graph capture encountered unexpectedly". A one-kernel capture on a
    stream of its own begins and ends that capture properly on the same generator state, so the
    graphs captured before keep drawing from the state eager ops use. The failed capture's work
    never ran, so the random stream goes on where it was.
    """
    try:
        scratch = torch.zeros(1, device="cuda")
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=torch.cuda.Stream(), capture_error_mode="thread_local"):
            scratch.add_(1.0)
        del graph
    except Exception as err:  # pragma: no cover - a CUDA error that outlived the failed capture
        warnings.warn(f"CUDA graphs: after a failed capture, ending the random generator's capture failed too "
                      f"({type(err).__name__}: {err}); random ops on this device may fail")


def _capture_stream(owner: Any) -> torch.cuda.Stream:
    """The side stream ``owner`` captures on (``owner._stream``), with its graph memory pool
    (``owner._pool``), both made at its first capture."""
    if owner._stream is None:
        owner._stream = torch.cuda.Stream()
        owner._pool = torch.cuda.graph_pool_handle()
    return owner._stream


@dataclass
class _Entry:
    visits: int = 0
    graph: Any = None
    static_inputs: Any = None
    static_loss: Optional[Tensor] = None
    static_grads: tuple = ()  # the gradients the graph writes for the sparse leaves, in input order
    used: tuple = ()  # parameters the key's backward gives a gradient
    eager_only: bool = False


@dataclass
class SelfCheck:
    """What a capture's self-check measured (kept per key in :attr:`StepGraphs.checks`)."""

    loss_eager: float
    loss_replay: float
    loss_rel: float
    grad_rel: float
    passed: bool


class StepGraphs:
    """One CUDA graph per configuration key over forward + loss + backward of a micro-batch.

    Generic over the model: :meth:`run` takes the key, the micro-batch's inputs (a nest of
    dicts/dataclasses of tensors; tensors that require grad are the sparse leaves) and two
    callables, ``forward(inputs) -> (loss, scaled)`` and ``backward(scaled)`` (the eager
    backward, e.g. Lightning's ``manual_backward``; captures call ``torch.autograd.backward``
    through :func:`backward_into_grads`).

    Args:
        params: the parameters whose gradients the backward accumulates.
        before_micro_batch: called before every micro-batch, eager or replayed (refreshes the
            FP8 weight caches, which a replay cannot check).
        fingerprint: returns the addresses the graphs bake in beyond their own buffers
            (parameters, buffers, FP8 caches); checked once per step, a change drops every graph.
        keep_input: true for an input tensor that is already a fixed buffer (the captured sparse
            pull's outputs, :meth:`PullGraphs.owns`): a graph captured with it reads it in place,
            and a replay copies nothing into it.
        self_check_rtol / grad_check_rtol: the self-check's tolerances.
    """

    def __init__(self, params: Sequence[Tensor], before_micro_batch: Optional[Callable[[], None]] = None,
                 fingerprint: Optional[Callable[[], tuple]] = None, self_check_rtol: float = SELF_CHECK_RTOL,
                 grad_check_rtol: float = GRAD_CHECK_RTOL,
                 keep_input: Optional[Callable[[Tensor], bool]] = None) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.keep_input = keep_input
        self.before_micro_batch = before_micro_batch
        self.fingerprint = fingerprint
        self.self_check_rtol = self_check_rtol
        self.grad_check_rtol = grad_check_rtol
        self.entries: dict[Any, _Entry] = {}
        self.checks: dict[Any, SelfCheck] = {}
        self.grads: dict[int, Tensor] = {}  # id(param) -> persistent gradient buffer
        # static input buffers by input layout: keys of one layout (same T) share them, since
        # every replay copies its inputs in first
        self._statics: dict[tuple, Any] = {}
        self._stream: Optional[torch.cuda.Stream] = None
        self._pool = None
        self._fingerprint: Optional[tuple] = None
        self.enabled = True
        self.replays = 0  # micro-batches run from a graph (self-check replays not counted)
        self.eager_runs = 0

    # -- bookkeeping ---------------------------------------------------------------------------
    def captured_keys(self) -> list:
        return [k for k, e in self.entries.items() if e.graph is not None]

    def key_differences(self) -> dict[str, int]:
        """What the keys seen so far differ in: field (or input-layout entry) -> distinct values.

        A stage whose micro-batches should share one graph but make several points at the
        input whose shape or value varies.
        """
        keys = [k for k in self.entries if isinstance(k, CaptureKey)]
        out: dict[str, int] = {}
        for f in dataclasses.fields(CaptureKey):
            if f.name == "layout":
                continue
            n = len({getattr(k, f.name) for k in keys})
            if n > 1:
                out[f.name] = n
        entries: dict[str, set] = collections.defaultdict(set)
        for k in keys:
            for item in k.layout:
                entries[item[0]].add(item[1:])
        for name, values in entries.items():
            if len(values) > 1:
                out[f"layout:{name}"] = len(values)
        return out

    def reset(self) -> None:
        """Drop every graph and visit count (the next two visits of each key capture again)."""
        self.entries.clear()
        self.checks.clear()
        self._statics.clear()

    def begin_step(self) -> None:
        """Verify the baked addresses (once per step); if any moved, drop the graphs."""
        if self.fingerprint is None or self._fingerprint is None or not self.captured_keys():
            return
        if self.fingerprint() != self._fingerprint:
            warnings.warn("CUDA graphs: parameters, buffers or FP8 caches moved in memory; capturing again")
            self.reset()
            self._fingerprint = None

    def _attach(self, used: Sequence[Tensor]) -> None:
        """Point each used parameter's ``.grad`` at its buffer, keeping what the step accumulated."""
        # one zeroing launch per (device, dtype): CUDA's foreach kernels take a list of one dtype
        # only, and a mixed list falls back to a fill per tensor (the bf16 matrices and the fp32
        # scalars of a step's first micro-batch: about 45 launches)
        fresh: dict[tuple, list[Tensor]] = {}
        for p in used:
            buf = self.grads[id(p)]
            g = p.grad
            if g is buf:
                continue
            if g is None:
                fresh.setdefault((buf.device, buf.dtype), []).append(buf)
            else:
                buf.copy_(g)
            p.grad = buf
        for bufs in fresh.values():
            torch._foreach_zero_(bufs)

    # -- one micro-batch -----------------------------------------------------------------------
    def run(self, key: Any, inputs: Any, forward: Callable[[Any], tuple[Tensor, Tensor]],
            backward: Callable[[Tensor], None]) -> Tensor:
        """Forward, loss and backward of one micro-batch; returns the (detached) loss."""
        if self.before_micro_batch is not None:
            with record_function("graphs/before_micro_batch"):
                self.before_micro_batch()
        entry = self.entries.get(key)
        if entry is None:
            entry = self.entries[key] = _Entry()
        entry.visits += 1
        if not self.enabled or entry.eager_only or (entry.graph is None and entry.visits < 2):
            self.eager_runs += 1
            return self._eager(inputs, forward, backward)
        if entry.graph is None:
            return self._capture(key, entry, inputs, forward, backward)
        return self._replay(entry, inputs)

    @staticmethod
    def _eager(inputs: Any, forward, backward) -> Tensor:
        loss, scaled = forward(inputs)
        backward(scaled)
        return loss.detach()

    def _replay(self, entry: _Entry, inputs: Any) -> Tensor:
        with record_function("graphs/copy_in"):
            self._attach(entry.used)
            pairs = _tensor_pairs(entry.static_inputs, inputs)
            with torch.no_grad():
                for s, v in pairs:
                    if s is not v:  # an input the graph reads in place needs no copy
                        s.copy_(v, non_blocking=True)
        with record_function("graphs/replay"):
            entry.graph.replay()
        self.replays += 1
        leaves = [v for _, v in pairs if v.requires_grad]
        for v, g in zip(leaves, entry.static_grads):
            if g is not None:
                # the static buffer itself (the next replay of this key overwrites it): the sparse
                # channels take it right after the micro-batch, and those that keep it copy it
                v.grad = g
        return entry.static_loss.clone()

    def _capture(self, key: Any, entry: _Entry, inputs: Any, forward, backward) -> Tensor:
        """Second visit: eager run on the capture stream, capture, replay, compare; keep the eager result."""
        self.eager_runs += 1
        current = torch.cuda.current_stream()
        side = _capture_stream(self)
        # what the step accumulated so far; a persistent buffer is copied (the capture reuses it)
        stash = [g.clone() if g is not None and g is self.grads.get(id(p)) else g
                 for p, g in ((p, p.grad) for p in self.params)]
        for p in self.params:
            p.grad = None
        leaves = [v for _, v in _flatten(inputs) if isinstance(v, Tensor) and v.requires_grad]
        # 1. the eager run (it is the one whose result the step keeps), on the capture stream so
        #    its cuBLAS workspaces exist before the capture
        side.wait_stream(current)
        with torch.cuda.stream(side):
            loss_e, scaled = forward(inputs)
            backward(scaled)
            loss_e = loss_e.detach()
        current.wait_stream(side)
        eager_grads = [p.grad for p in self.params]
        used = tuple(p for p in self.params if p.grad is not None)
        leaf_grads = [v.grad for v in leaves]
        try:
            graph, static_inputs, static_loss, static_grads = self._record(used, inputs, forward)
        except Exception as err:  # pragma: no cover - depends on the model and the GPU toolchain
            warnings.warn(f"CUDA graphs: capturing key {_short(key)} failed ({type(err).__name__}: {err}); "
                          "this key runs eagerly")
            close_failed_capture()
            entry.eager_only = True
            graph = None
        check = None
        if graph is not None:
            for p in self.params:
                p.grad = None
            self._attach(used)
            graph.replay()
            by_id = {id(p): g for p, g in zip(self.params, eager_grads)}
            pairs = [(by_id[id(p)], self.grads[id(p)]) for p in used]
            pairs += [(e, g) for e, g in zip(leaf_grads, static_grads) if e is not None and g is not None]
            check = self._compare(loss_e, static_loss, pairs)
            self.checks[key] = check
            if check.passed:
                entry.graph, entry.static_inputs, entry.static_loss = graph, static_inputs, static_loss
                entry.static_grads, entry.used = static_grads, used
                if self.fingerprint is not None:
                    self._fingerprint = self.fingerprint()
            else:
                warnings.warn(f"CUDA graphs: the replay of key {_short(key)} differs from eager (loss "
                              f"{check.loss_replay:.6g} vs {check.loss_eager:.6g}, gradients {check.grad_rel:.2e} "
                              "relative); this key runs eagerly")
                entry.eager_only = True
        # 3. leave the gradients as one eager run would: accumulate the eager run's on the stash
        for p, old, new in zip(self.params, stash, eager_grads):
            if new is None:
                p.grad = old
            elif old is None:
                p.grad = new
            else:
                p.grad = old.add_(new)
        for v, g in zip(leaves, leaf_grads):
            v.grad = g
        return loss_e

    def _record(self, used: Sequence[Tensor], inputs: Any, forward) -> tuple[Any, Any, Tensor, tuple]:
        for p in used:
            if id(p) not in self.grads:
                self.grads[id(p)] = torch.zeros_like(p, memory_format=torch.preserve_format)
        layout = input_layout(inputs)
        static_inputs = self._statics.get(layout)
        if static_inputs is None:
            static_inputs = self._statics[layout] = _static_copy(inputs, self.keep_input)
        else:
            with torch.no_grad():
                for s, v in _tensor_pairs(static_inputs, inputs):
                    if s is not v:
                        s.copy_(v)
        static_leaves = [v for _, v in _flatten(static_inputs) if isinstance(v, Tensor) and v.requires_grad]
        for v in static_leaves:
            v.grad = None  # this graph's backward writes a gradient of its own (another key's stays its)
        for p in self.params:
            p.grad = None
        self._attach(used)
        graph = torch.cuda.CUDAGraph()
        side = self._stream
        side.wait_stream(torch.cuda.current_stream())
        # thread_local: the data loader's prefetch thread may pin memory meanwhile
        with torch.cuda.graph(graph, pool=self._pool, stream=side, capture_error_mode="thread_local"):
            loss, scaled = forward(static_inputs)
            backward_into_grads(lambda: torch.autograd.backward(scaled), used)
            static_loss = loss.detach()
        return graph, static_inputs, static_loss, tuple(v.grad for v in static_leaves)

    def _compare(self, loss_e: Tensor, loss_g: Tensor, grads: Sequence[tuple[Tensor, Tensor]]) -> SelfCheck:
        """Loss and whole-model gradient of the replay against the eager run's (``grads``: (eager, replay))."""
        num = torch.zeros((), dtype=torch.float64, device=loss_e.device)
        den = torch.zeros((), dtype=torch.float64, device=loss_e.device)
        for e, g in grads:
            e, g = e.double(), g.double()
            num += (g - e).square().sum()
            den += e.square().sum()
        le, lg = float(loss_e), float(loss_g)
        grad_rel = math.sqrt(float(num) / max(float(den), 1e-300)) if grads else 0.0
        loss_rel = _rel(lg, le)
        finite = math.isfinite(lg) == math.isfinite(le) and math.isfinite(grad_rel)
        passed = finite and (loss_rel <= self.self_check_rtol or lg == le) and grad_rel <= self.grad_check_rtol
        return SelfCheck(loss_eager=le, loss_replay=lg, loss_rel=loss_rel, grad_rel=grad_rel, passed=passed)


@dataclass
class _PullEntry:
    visits: int = 0
    graph: Any = None
    static_ids: Optional[Tensor] = None
    outputs: Any = None
    eager_only: bool = False


class PullGraphs:
    """CUDA graphs of the sparse channels' pull of a micro-batch, where it has no collective in it.

    With the fixed exchange at one rank, the pull (``SparseChannels.inputs``) is device work
    only: the n-gram hashes, a sort-based unique of fixed size and the row gathers from the
    n-gram and value-embedding tables, about 190 operations a micro-batch, each a host launch
    between the micro-batch graphs. Where the channels say it is capturable
    (``SparseChannels.capturable``) it gets one graph per layout of the token ids:

    - The first visit of a layout runs eagerly. The second runs eagerly on a side stream,
      captures, replays and compares every output with the eager run's bit for bit; a
      difference or an exception is one warning and eager pulls for that layout from then on
      (the eager result is the step's), else the step takes the graph's outputs.
    - The outputs are fixed buffers (:meth:`owns`): the micro-batch graphs captured with them
      read them in place instead of copying them into buffers of their own.
    - Later visits copy the ids into the graph's buffer and replay. The outputs are the
      graph's own tensors, which the next replay overwrites: ``run_step`` pushes a
      micro-batch's gradients before it pulls the next micro-batch. The leaves come back with
      their ``.grad`` cleared.
    - What the graph reads besides the ids (the tables) is read at replay time. Their
      addresses (``fingerprint``) are checked once a step; if any moved, every pull graph is
      dropped and captured again.
    """

    def __init__(self, fingerprint: Optional[Callable[[], tuple]] = None) -> None:
        self.fingerprint = fingerprint
        self.entries: dict[tuple, _PullEntry] = {}
        self._fingerprint: Optional[tuple] = None
        self._stream: Optional[torch.cuda.Stream] = None
        self._pool = None
        self.replays = 0
        self.eager_runs = 0
        self._owned: set[int] = set()  # ids of the captured graphs' output tensors (held by the entries)

    def owns(self, t: Tensor) -> bool:
        """Whether ``t`` is an output of one of these graphs (a buffer each replay rewrites in place)."""
        return id(t) in self._owned

    def captured(self) -> int:
        return sum(e.graph is not None for e in self.entries.values())

    def begin_step(self) -> None:
        """Verify the tables' addresses (once a step); if any moved, drop the graphs."""
        if self.fingerprint is None or self._fingerprint is None or not self.captured():
            return
        if self.fingerprint() != self._fingerprint:
            warnings.warn("CUDA graphs: the sparse channels' tables moved in memory; capturing the pull again")
            self.entries.clear()
            self._owned.clear()
            self._fingerprint = None

    def run(self, ids: Tensor, pull: Callable[[Tensor], Any], extra_key: tuple = ()) -> Any:
        """``pull(ids)``, from the layout's graph once it has one (``extra_key``: what else
        fixes the pull's shapes, e.g. the value-embedding capacity)."""
        key = (tuple(ids.shape), ids.dtype, ids.device, *extra_key)
        entry = self.entries.get(key)
        if entry is None:
            entry = self.entries[key] = _PullEntry()
        entry.visits += 1
        if entry.eager_only or (entry.graph is None and entry.visits < 2):
            self.eager_runs += 1
            return pull(ids)
        if entry.graph is None:
            return self._capture(entry, ids, pull)
        with record_function("graphs/pull_copy_in"):
            entry.static_ids.copy_(ids, non_blocking=True)
        with record_function("graphs/pull_replay"):
            entry.graph.replay()
        self.replays += 1
        for _, v in _flatten(entry.outputs):
            if isinstance(v, Tensor) and v.requires_grad:
                v.grad = None
        return entry.outputs

    def _capture(self, entry: _PullEntry, ids: Tensor, pull: Callable[[Tensor], Any]) -> Any:
        self.eager_runs += 1
        side, current = _capture_stream(self), torch.cuda.current_stream()
        side.wait_stream(current)
        with torch.cuda.stream(side):  # also warms the kernels on the capture stream
            eager = pull(ids)
        current.wait_stream(side)
        try:
            static_ids = ids.clone()
            graph = torch.cuda.CUDAGraph()
            side.wait_stream(current)
            # thread_local: the data loader's prefetch thread may pin memory meanwhile
            with torch.cuda.graph(graph, pool=self._pool, stream=side, capture_error_mode="thread_local"):
                outputs = pull(static_ids)
            graph.replay()
            a, b = _flatten(outputs), _flatten(eager)
            same = input_layout(outputs) == input_layout(eager) and all(
                _bytes_equal(x, y) for (_, x), (_, y) in zip(a, b) if isinstance(x, Tensor))
        except Exception as err:  # pragma: no cover - depends on the channels and the GPU toolchain
            warnings.warn(f"CUDA graphs: capturing the sparse pull of {tuple(ids.shape)} token ids failed "
                          f"({type(err).__name__}: {err}); it runs eagerly")
            close_failed_capture()
            entry.eager_only = True
            return eager
        if not same:
            warnings.warn(f"CUDA graphs: the replayed sparse pull of {tuple(ids.shape)} token ids differs from "
                          "the eager one; it runs eagerly")
            entry.eager_only = True
            return eager
        entry.graph, entry.static_ids, entry.outputs = graph, static_ids, outputs
        self._owned.update(id(v) for _, v in _flatten(outputs) if isinstance(v, Tensor))
        if self.fingerprint is not None:
            self._fingerprint = self.fingerprint()
        return outputs


def gpu_memory_gib(device: torch.device) -> dict[str, float]:
    """The caching allocator's peak allocated and current reserved memory on ``device``, and
    the part of the reserved memory held by CUDA graph pools (every pool but the default), in GiB."""
    segments = torch.cuda.memory_snapshot()
    index = torch.device(device).index
    index = torch.cuda.current_device() if index is None else index
    pools = sum(seg["total_size"] for seg in segments
                if seg.get("device", index) == index and tuple(seg.get("segment_pool_id", (0, 0))) != (0, 0))
    gib = float(1 << 30)
    return {"peak_allocated": torch.cuda.max_memory_allocated(device) / gib,
            "reserved": torch.cuda.memory_reserved(device) / gib, "graph_pools": pools / gib}


@dataclass
class TailEntry:
    """One key of an optimizer-tail graph set (:class:`RefreshGraphs`, ``DistAdam``'s ``UpdateGraphs``)."""

    visits: int = 0
    graph: Any = None
    addresses: tuple = ()  # what the graph reads and writes, by address, where the key does not hold them
    eager_only: bool = False


def _bytes_equal(a: Tensor, b: Tensor) -> bool:
    """Bit-for-bit equality (NaNs included) of two tensors of one dtype and shape."""
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        a.detach().reshape(-1).view(torch.uint8), b.detach().reshape(-1).view(torch.uint8))


def capture_checked(owner: Any, written: Sequence[Tensor], run: Callable[[], None], what: str,
                    host: Optional[tuple[Callable[[], Any], Callable[[Any], None]]] = None,
                    allow: Optional[Callable[[bool], None]] = None) -> Any:
    """An optimizer tail's second visit: ``run`` eagerly (the step keeps that result), then the
    same ``run`` captured from the eager run's starting values and replayed; the graph only if
    its replay wrote the eager bytes into every tensor of ``written``, else None.

    ``run`` updates ``written`` in place. ``host`` (save, load) is host-side state ``run`` also
    changes: loaded back to its start before the capture, and to the eager result when no graph
    is kept. ``allow(True)`` / ``allow(False)`` bracket the capture. A failed capture or a replay
    that differs is one warning (``what`` names the work), and the eager result stands.
    Captures on ``owner``'s side stream and pool (:func:`_capture_stream`).
    """
    start = [t.clone() for t in written]
    start_host = host[0]() if host is not None else None
    run()  # the result the step keeps
    done = [t.clone() for t in written]
    done_host = host[0]() if host is not None else None
    side, current = _capture_stream(owner), torch.cuda.current_stream()
    graph = None
    same = False
    try:
        with torch.no_grad():
            for t, v in zip(written, start):
                t.copy_(v)
        del start
        if host is not None:
            host[1](start_host)
        if allow is not None:
            allow(True)
        graph = torch.cuda.CUDAGraph()
        side.wait_stream(current)
        # thread_local: the data loader's prefetch thread may pin memory meanwhile
        with torch.cuda.graph(graph, pool=owner._pool, stream=side, capture_error_mode="thread_local"):
            run()
        graph.replay()
        same = all(_bytes_equal(t, v) for t, v in zip(written, done))
    except Exception as err:  # pragma: no cover - depends on the work and the GPU toolchain
        warnings.warn(f"CUDA graphs: capturing the {what} failed ({type(err).__name__}: {err}); it runs eagerly")
        close_failed_capture()
        graph = None
    finally:
        if allow is not None:
            allow(False)
    if graph is not None and same:
        return graph
    if graph is not None:
        warnings.warn(f"CUDA graphs: the replayed {what} differs from the eager one; it runs eagerly")
    with torch.no_grad():  # leave the eager result
        for t, v in zip(written, done):
            t.copy_(v)
    if host is not None:
        host[1](done_host)
    return None


class RefreshGraphs:
    """The FP8 weight refresh after an optimizer step as CUDA graph replays (RECORD §11's
    optimizer-tail graphs, (b)).

    ``run`` stands for every state's ``refresh_cache``: the states whose weights changed
    (``Fp8State.stale``) refresh, through one graph per key, the key being which states are stale
    and each one's ``refresh_variant`` (the MLP's exact-scale bootstrap or lagged scales). The set
    changes with the optimizer: the matrices every step, the lm_head only on the steps its Adam
    group updates (the record's two MLP graphs, with and without the head).

    - A key's first visit refreshes eagerly. The second refreshes eagerly (the step keeps that
      result), then restores every tensor the refresh writes and its host record, captures the
      refresh from there, replays it and compares all it wrote with the eager result bit for bit.
      A difference or an exception is one warning and eager refreshes for that key from then on.
    - Later visits check the addresses the graph baked (the weights', the buffers', the held
      caches'), replay and then do each state's host bookkeeping (``commit_refresh``). A moved
      address drops every refresh graph (one warning) and the key starts again.
    - The states must hold their cache addresses (``hold_cache_addresses``).
    """

    def __init__(self, states: Sequence[Any]) -> None:
        self.states = list(states)
        self.entries: dict[tuple, TailEntry] = {}
        self._stream: Optional[torch.cuda.Stream] = None
        self._pool = None
        self.replays = 0
        self.eager_runs = 0

    def captured(self) -> int:
        return sum(e.graph is not None for e in self.entries.values())

    def run(self) -> None:
        """Refresh every stale state: eagerly, by capture, or by replay (see the class)."""
        marked = [(i, st) for i, st in enumerate(self.states) if st.stale()]
        if not marked:
            return
        stale = [st for _, st in marked]
        key = tuple((i, st.refresh_variant()) for i, st in marked)
        entry = self.entries.get(key)
        if entry is None:
            entry = self.entries[key] = TailEntry()
        entry.visits += 1
        if entry.graph is not None:
            if self._addresses(stale) == entry.addresses:
                with record_function("graphs/fp8_refresh_replay"):
                    entry.graph.replay()
                for st in stale:
                    st.commit_refresh()
                self.replays += 1
                return
            warnings.warn("CUDA graphs: FP8 weights, scales or caches moved in memory; capturing the refresh again")
            self.entries.clear()
            entry = self.entries[key] = TailEntry(visits=1)
        if entry.eager_only or entry.visits < 2 or not all(t.is_cuda for st in stale for t in st.refresh_writes()):
            self._eager(stale)
            return
        self._capture(entry, stale)

    def _eager(self, stale: Sequence[Any]) -> None:
        self.eager_runs += 1
        for st in stale:
            st.refresh_now()

    @staticmethod
    def _addresses(stale: Sequence[Any]) -> tuple:
        out = []
        for st in stale:
            out += [t.data_ptr() for t in st.refresh_writes()]
            out += [r.build().data_ptr() for r in st._last_call[0]]
        return tuple(out)

    def _capture(self, entry: TailEntry, stale: Sequence[Any]) -> None:
        def refresh() -> None:
            for st in stale:
                st.refresh_now()

        def load(hosts: list) -> None:
            for st, h in zip(stale, hosts):
                st.set_host_state(h)

        def allow(on: bool) -> None:
            for st in stale:
                st.allow_refresh_in_capture(on)

        self.eager_runs += 1
        graph = capture_checked(self, [t for st in stale for t in st.refresh_writes()], refresh,
                                f"FP8 refresh of {len(stale)} layers",
                                host=(lambda: [st.host_state() for st in stale], load), allow=allow)
        if graph is None:
            entry.eager_only = True
        else:
            entry.graph, entry.addresses = graph, self._addresses(stale)


def _short(key: Any) -> str:
    if isinstance(key, CaptureKey):
        return (f"(T={key.tokens}, docs={key.max_docs}, max_seqlen={key.max_seqlen}, windows={key.windows}, "
                f"P={key.candidates}, mtp={key.mtp_terms}, prefix={key.prefix_weight})")
    return repr(key)[:200]


# -- the module's side -----------------------------------------------------------------------------
_MB_TENSORS = ("inputs", "targets", "cu_seqlens", "candidates", "prefix_targets")


class ModuleGraphs:
    """:class:`StepGraphs` wired to a :class:`~nanogpt_pl.module.SpeedrunModule` (``model.cuda_graphs``).

    The module's ``run_step`` calls :meth:`micro_step` per micro-batch instead of its eager
    forward/backward, and :meth:`pull` for the sparse channels' inputs (a :class:`PullGraphs`
    graph where the pull has no collective; the exchange eager otherwise). The gradient
    hand-back after the micro-batch stays the module's.
    """

    def __init__(self, module: Any) -> None:
        from .ops.fp8.cache import Fp8State  # the fp8 package loads only with capture on

        self.module = module
        self.fp8_states = [m for m in module.model.modules() if isinstance(m, Fp8State)]
        for st in self.fp8_states:
            st.hold_cache_addresses(True)
        # the refresh after each optimizer step (model.cuda_graphs_fp8_refresh), else eager
        self.refresh: Optional[RefreshGraphs] = (
            RefreshGraphs(self.fp8_states) if module.cuda_graphs_fp8_refresh else None)
        channels = module.sparse_channels
        self.pulls: Optional[PullGraphs] = (
            PullGraphs(fingerprint=channels.table_addresses) if channels is not None and channels.capturable else None)
        self.graphs = StepGraphs(list(module.model.parameters()), before_micro_batch=self._refresh_fp8,
                                 fingerprint=self._fingerprint,
                                 keep_input=self.pulls.owns if self.pulls is not None else None)
        self._mtp: Optional[tuple[tuple, Tensor]] = None
        self._warned_bound = False
        self._docs_bound: dict[int, int] = {}  # T -> the cu_seqlens length its keys use (only grows)

    def _refresh_fp8(self) -> None:
        if self.refresh is not None:
            self.refresh.run()
            return
        for st in self.fp8_states:
            st.refresh_cache()

    def _fingerprint(self) -> tuple:
        model = self.module.model
        ptrs = [t.data_ptr() for t in model.parameters()]
        ptrs += [t.data_ptr() for t in model.buffers()]
        for st in self.fp8_states:
            ptrs += [t.data_ptr() for t in st.cache_tensors()]
        return tuple(ptrs)

    def _mtp_weights(self, weights: tuple, device: torch.device) -> Tensor:
        """The MTP weights as a device tensor (a graph input: they change every step, RECORD §2)."""
        if self._mtp is None or self._mtp[0] != weights:
            host = torch.tensor([float(w) for w in weights], dtype=torch.float32)
            if device.type == "cuda":
                host = host.pin_memory()
            self._mtp = (weights, host.to(device, non_blocking=True))
        return self._mtp[1]

    def reserve_cu_seqlens(self, lengths: dict[int, int]) -> None:
        """Pad the micro-batches of each sequence length T to at least ``lengths[T]`` entries of
        ``cu_seqlens`` (rounded up as :func:`pad_cu_seqlens` rounds).

        The padding only grows, so without this the length a key is captured with depends on
        which batches came before it: a warmup that visits the schedule out of order captures
        keys at lengths the run has outgrown by then, and the run captures again on the clock.
        Reserved from the run's own plan (``TrainStream.plan_bounds``), every key of a
        T has one length from the first visit on.
        """
        for tokens, n in lengths.items():
            self._docs_bound[int(tokens)] = max(self._docs_bound.get(int(tokens), 0), graph_docs_length(n))

    def padded_cu_seqlens(self, cu_seqlens: Tensor, tokens: int) -> Tensor:
        """``cu_seqlens`` of a micro-batch of ``tokens`` tokens as its graph takes it: padded to the
        length reserved for ``tokens`` or, past it, to the next power of two, which is then the
        length for every later micro-batch of ``tokens`` (it never shrinks)."""
        out = pad_cu_seqlens(cu_seqlens, self._docs_bound.get(tokens, 0))
        self._docs_bound[tokens] = int(out.numel())
        return out

    def key_names(self, start: int = 0) -> list[str]:
        """The keys seen so far, from the ``start``-th on, as short text (in order of first visit)."""
        return [_short(k) for k in list(self.graphs.entries)[start:]]

    def begin_step(self) -> None:
        self.graphs.begin_step()
        if self.pulls is not None:
            self.pulls.begin_step()

    def pull(self, ids: Tensor, distinct_tokens: Optional[int] = None) -> Optional[dict[str, Any]]:
        """The sparse channels' inputs of a micro-batch (``SparseChannels.inputs``), from a
        :class:`PullGraphs` graph where the pull is capturable, else eagerly. ``distinct_tokens``
        is the micro-batch's host-side count (the value-embedding capacity's check)."""
        channels = self.module.sparse_channels
        if channels is None:
            return None
        if self.pulls is None:
            return channels.train_inputs(ids, distinct_tokens)
        rows = channels.value_rows(ids.numel(), distinct_tokens)  # part of the layout: a graph per capacity
        return self.pulls.run(ids, lambda t: channels.inputs(t, train=True, value_rows=rows), extra_key=(rows,))

    def micro_step(self, mb: dict[str, Any], sparse: Optional[dict[str, Any]], micro_batches: int) -> Tensor:
        """Forward, loss and backward of one micro-batch through its key's graph; the detached loss."""
        module = self.module
        s = module.settings
        device = mb["inputs"].device
        bound = max_seqlen_bound(module.schedule, mb)
        run_mb = {k: mb[k] for k in _MB_TENSORS if mb.get(k) is not None}
        if int(mb["max_seqlen"]) > bound:
            if not self._warned_bound:
                self._warned_bound = True
                warnings.warn(f"CUDA graphs: a micro-batch has a segment of {int(mb['max_seqlen'])} tokens, above the "
                              f"stage's bound {bound}; such micro-batches run eagerly")
            run_mb["max_seqlen"] = int(mb["max_seqlen"])
            return module.eager_micro_step(run_mb, sparse, micro_batches)
        run_mb["max_seqlen"] = bound
        run_mb["cu_seqlens"] = self.padded_cu_seqlens(mb["cu_seqlens"], int(mb["inputs"].numel()))
        run_mb["mtp_weights"] = self._mtp_weights(tuple(s.mtp_weights), device)
        scales = tuple(rot.attn_scale for rot in module.model.rotaries.values())
        key = capture_key(run_mb, sparse, windows=s.windows, attn_scales=scales, mtp_terms=len(s.mtp_weights),
                          prefix_weight=s.prefix_weight, micro_batches=micro_batches)
        scale = run_mb["targets"].numel() / micro_batches

        def forward(inp):
            loss = module._micro_loss(inp["mb"], inp["sparse"] or None)
            return loss, loss * scale

        return self.graphs.run(key, {"mb": run_mb, "sparse": sparse or {}}, forward, module.backward_of)


def cuda_graphs_active(requested: bool, device: torch.device) -> bool:
    """Whether ``model.cuda_graphs`` takes effect on ``device`` (CUDA only; elsewhere one warning)."""
    if not requested:
        return False
    if device.type != "cuda":
        warnings.warn(f"model.cuda_graphs: true has no effect on {device.type} (CUDA graphs need a CUDA GPU); "
                      "the step runs eagerly")
        return False
    return True


# -- host side ---------------------------------------------------------------------------------------
class RunAhead:
    """Keep the host at most ``depth`` steps ahead of the GPU (RECORD §11: 2).

    :meth:`step_done` records an event after each step's work and waits for the event of the
    step ``depth`` before it; a no-op off CUDA.
    """

    def __init__(self, depth: int = RUN_AHEAD_STEPS) -> None:
        if depth < 1:
            raise ValueError(f"run-ahead depth must be at least 1, got {depth}")
        self.depth = depth
        self._events: collections.deque = collections.deque()

    def step_done(self, device: torch.device) -> None:
        if device.type != "cuda":
            return
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        self._events.append(event)
        while len(self._events) > self.depth:
            self._events.popleft().synchronize()

    def pending(self) -> int:
        """Steps recorded and not yet waited for."""
        return len(self._events)

    def clear(self) -> None:
        self._events.clear()


class FrozenGC:
    """The Python garbage collector frozen and disabled while the speedrun clock runs (RECORD §11).

    :meth:`pause` collects once, moves every live object to the permanent generation
    (``gc.freeze``) and disables collection; :meth:`resume` undoes exactly what ``pause``
    changed. Both are idempotent.
    """

    def __init__(self) -> None:
        self._was_enabled: Optional[bool] = None

    @property
    def paused(self) -> bool:
        return self._was_enabled is not None

    def pause(self) -> None:
        if self.paused:
            return
        self._was_enabled = gc.isenabled()
        gc.collect()
        gc.freeze()
        gc.disable()

    def resume(self) -> None:
        if not self.paused:
            return
        gc.unfreeze()
        if self._was_enabled:
            gc.enable()
        self._was_enabled = None
