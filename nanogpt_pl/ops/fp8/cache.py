"""The FP8 weight cache: when a weight's FP8 copies are stale, and the state base class.

Weight caches are rebuilt once per optimizer step, not per micro-batch: a weight's
``_version`` counter (bumped by every in-place update made through autograd-visible ops,
which is how optimizers update parameters) and its storage address decide staleness. An
update made through ``param.data`` does not bump the counter: call ``state.invalidate()``
after one.
"""

from __future__ import annotations

import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor, nn

from .backends import _FAST, _REFERENCE, check_backend, fp8_available
from .formats import AMAX_CEILING


def weight_key(w: Tensor) -> tuple:
    """What identifies the values of ``w`` between optimizer steps.

    The root tensor (a view's base) is compared by identity, so a weight recomputed every
    forward (``torch.cat`` of parameters) never matches a freed one that happened to get
    the same address; ``_version`` is shared by a parameter and all its views.
    """
    root = w._base if w._base is not None else w
    return weakref.ref(root), (w.data_ptr(), w._version, tuple(w.shape), w.stride(), w.dtype, w.device)


@dataclass(frozen=True)
class WeightRecipe:
    """How to remake a weight a state refreshes from, without holding its autograd history.

    A row block such as ``qk_w[0]`` is a view made with grad on, so it holds its parameter's
    AccumulateGrad node: kept past the step, that node pins the stream it was made on, and a
    later CUDA-graph capture on another stream is invalidated when autograd syncs with it. The
    recipe keeps the view's base and geometry and remakes the view, with grad off, when asked
    (same base, address, version, shape and strides: the same :func:`weight_key`).
    """

    tensor: Tensor  # the weight itself, or the base of a view
    view: Optional[tuple] = None  # (shape, stride, storage offset) of a view of ``tensor``

    @classmethod
    def of(cls, w: Tensor) -> "WeightRecipe":
        # ``grad_fn`` of a view is not read: for a view made with grad off (the ones ``build``
        # makes) whose base changed since, autograd refuses to read it
        base = w._base
        if base is None:
            return cls(w if w.grad_fn is None else w.detach())
        if base.grad_fn is not None:  # a view of a recomputed tensor: rebuilt every call anyway
            return cls(w.detach())
        return cls(base, (tuple(w.shape), tuple(w.stride()), w.storage_offset()))

    def build(self) -> Tensor:
        if self.view is None:
            return self.tensor
        with torch.no_grad():
            return self.tensor.as_strided(*self.view)


def keys_match(old: Optional[tuple], new: tuple) -> bool:
    if old is None or len(old) != len(new):
        return False
    for (ref_a, meta_a), (ref_b, meta_b) in zip(old, new):
        root = ref_a()
        if root is None or root is not ref_b() or meta_a != meta_b:
            return False
    return True


@dataclass
class WeightCache:
    row: Tensor  # [out, in] e4m3, contiguous
    col: Tensor  # [in, out] e4m3, contiguous (a view of row on the reference path)


def keep_addresses(old: Optional[WeightCache], new: WeightCache) -> WeightCache:
    """``new``'s values written into ``old``'s tensors when their layouts match (else ``new``).

    Used while a state holds its cache addresses (:meth:`Fp8State.hold_cache_addresses`).
    """
    if old is None or not (_same_layout(old.row, new.row) and _same_layout(old.col, new.col)):
        return new
    old.row.copy_(new.row)
    if old.col.untyped_storage().data_ptr() != old.row.untyped_storage().data_ptr():
        old.col.copy_(new.col)  # the fast path's column-major copy (the reference's is a view of row)
    return old


def _same_layout(a: Tensor, b: Tensor) -> bool:
    return a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype and a.device == b.device


def fold_delayed(amax: Tensor, scale: Tensor, gain: float, floor: float) -> None:
    """scale <- max(amax·gain, floor) where something was seen (amax > 0); amax <- 0.

    inf/NaN amaxes count as nothing seen, so one bad step cannot poison the scale.
    """
    a = torch.nan_to_num(amax, nan=0.0, posinf=0.0, neginf=0.0).clamp(max=AMAX_CEILING)
    scale.copy_(torch.where(a > 0, (a * gain).clamp(min=floor), scale))
    amax.zero_()


def scalar_buffer(value: float) -> Tensor:
    return torch.tensor(float(value), dtype=torch.float32)


class Fp8State(nn.Module):
    """Backend choice, device handling and cache invalidation shared by the FP8 states.

    The scale buffers are read through reciprocals computed at each cache refresh: an edit
    to a buffer takes effect at the next refresh (``invalidate()`` forces one).
    """

    def __init__(self, backend: str, config_key: str) -> None:
        super().__init__()
        check_backend(backend)
        self.backend = backend
        self.config_key = config_key
        self.register_buffer("refresh_count", torch.zeros((), dtype=torch.int64))
        self._refreshes = 0  # host mirror of refresh_count, so no step syncs on it
        self._cache_key: Optional[tuple] = None
        self._cache_kern: Optional[str] = None
        self._kernels_override: Any = None  # tests run the fast path on CPU under TRITON_INTERPRET=1
        self._warned_recomputed = False
        self._hold = False  # see hold_cache_addresses
        self._capture_ok = False  # see allow_refresh_in_capture
        self._last_call: Optional[tuple] = None  # (WeightRecipes, kernels) of the last refresh, for refresh_cache
        self._checked: Optional[tuple] = None  # what refresh_cache's last full check read (_watch())
        self.checks_skipped = 0  # refresh_cache calls that found nothing it reads changed
        # under torch.compile: run the layer outside the graph (a graph break) instead of as a custom op
        self.graph_break = False

    def invalidate(self) -> None:
        """Force the weight cache (and the delayed scales) to refresh at the next call."""
        self._cache_key = None

    # -- CUDA graphs (nanogpt_pl/capture.py) --------------------------------------------------
    def hold_cache_addresses(self, on: bool = True) -> None:
        """Refresh the FP8 weight copies in place, so their tensors keep their addresses.

        A captured CUDA graph reads the copies by address and runs none of the host-side
        staleness check: with this on, call :meth:`refresh_cache` before every replay. A
        refresh inside a capture raises (the capture then falls back to eager).
        """
        self._hold = on

    def refresh_cache(self) -> bool:
        """Run the staleness check (and the refresh, with the delayed scales) now, eagerly, on the
        weights of the last call; True if it refreshed. Nothing happens before the first call, nor
        while nothing the check reads changed since its last run (the last call and the cache key,
        by identity; each weight root's address and version): between two optimizer steps only the
        first micro-batch pays for the check (``benchmarks/host_work.py``: the record network's
        layers together 8.1x less host time skipped than checked, on a CPU)."""
        if not self.stale():
            return False
        return self.refresh_now()

    def stale(self) -> bool:
        """Whether :meth:`refresh_cache` would refresh now: its check without the refresh. False
        before the first call; a check that finds nothing changed is remembered (and counted in
        ``checks_skipped`` when even the cheap watch is unchanged)."""
        if self._last_call is None:
            return False
        seen, watch = self._checked, self._watch()
        if seen is not None and watch[0] is seen[0] and watch[1] is seen[1] and watch[2] == seen[2]:
            self.checks_skipped += 1
            return False
        kern = self._last_call[1]
        if self.cache_tensors() and self._cache_kern == kern.name and keys_match(self._cache_key, self._weights_key()):
            self._checked = watch
            return False
        return True

    def refresh_now(self) -> bool:
        """Refresh from the weights of the last call, unless their cache is current; True if it refreshed."""
        before = self._refreshes
        recipes, kern = self._last_call
        self._refresh_with(tuple(r.build() for r in recipes), kern)
        self._checked = self._watch()
        return self._refreshes != before

    # -- the refresh as a CUDA graph (nanogpt_pl/capture.py, RefreshGraphs) --------------------
    def refresh_variant(self) -> tuple:
        """What the Python of a refresh branches on besides the weights: part of a refresh graph's key."""
        return ()

    def refresh_writes(self) -> list[Tensor]:
        """Every tensor a refresh writes (held in place): the scale, amax and count buffers and the caches."""
        return [b for b in self.buffers(recurse=False)] + self.cache_tensors()

    def host_state(self) -> tuple:
        """The host-side record of the last refresh (restored by :meth:`set_host_state`)."""
        return self._cache_key, self._cache_kern, self._refreshes, self._checked

    def set_host_state(self, state: tuple) -> None:
        self._cache_key, self._cache_kern, self._refreshes, self._checked = state

    def commit_refresh(self) -> None:
        """The host's side of a refresh whose device work ran as a graph replay: the cache key of
        the weights now, the refresh count and the check's record, as :meth:`refresh_now` leaves them."""
        self._cache_key = self._weights_key()
        self._cache_kern = self._last_call[1].name
        self._refreshes += 1
        self._checked = self._watch()

    def _weights_key(self) -> tuple:
        """The cache key of the last call's weights as they are now (``weight_key`` of each)."""
        return tuple(weight_key(r.build()) for r in self._last_call[0])

    def allow_refresh_in_capture(self, on: bool) -> None:
        """Let a refresh run inside a CUDA graph capture (the refresh graph's own capture)."""
        self._capture_ok = on

    def _watch(self) -> tuple:
        """What :meth:`refresh_cache`'s check reads, cheaply: the last call, the cache key and each
        weight root's (address, version)."""
        call = self._last_call
        versions = () if call is None else tuple((r.tensor.data_ptr(), r.tensor._version) for r in call[0])
        return call, self._cache_key, versions

    def cache_tensors(self) -> list[Tensor]:
        """The FP8 weight copies a forward reads (their addresses are what a graph bakes in)."""
        return []

    def _refresh_with(self, weights: tuple, kern: Any) -> None:
        raise NotImplementedError

    def _before_refresh(self, weights: tuple, kern: Any) -> None:
        """Bookkeeping of every refresh: remember the weights; refuse to run inside a capture."""
        w = weights[0]
        if self._hold and not self._capture_ok and w.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"{self.config_key}: the FP8 weight cache went stale inside a CUDA graph capture; "
                               "call refresh_cache() before capturing")
        self._last_call = (tuple(WeightRecipe.of(w) for w in weights), kern)

    def _kernels(self, device: torch.device) -> Any:
        if self._kernels_override is not None:
            return self._kernels_override
        if self.backend == "reference":
            return _REFERENCE
        fast = fp8_available(device)
        if self.backend == "scaled_mm" and not fast:
            raise RuntimeError(
                f"{self.config_key}: fp8 backend 'scaled_mm' needs a CUDA GPU with compute capability >= 8.9 "
                f"and Triton, but the input is on {device}. Set {self.config_key}: false to run this layer "
                "without FP8, or use fp8 backend 'auto' (the reference off such GPUs) or 'reference'.")
        return _FAST if fast else _REFERENCE

    def _follow_device(self, device: torch.device) -> None:
        if self.refresh_count.device != device:
            self.to(device)

    def _check_recomputed(self, w: Tensor) -> None:
        if w._base is None and not w.is_leaf and not self._warned_recomputed:
            self._warned_recomputed = True
            warnings.warn(
                f"{self.config_key}: the FP8 weight passed here is recomputed every forward (it has a grad_fn "
                "and is not a view of a parameter), so its FP8 cache is rebuilt on every call. Pass the "
                "parameters themselves (fp8_linear accepts a tuple of row blocks).", stacklevel=4)

    def _apply(self, fn, recurse=True):
        # model.bfloat16() / .half() must not round the scales: torch._scaled_mm and the
        # kernels read them as fp32. Device moves still apply.
        saved = {k: b for k, b in self._buffers.items() if b is not None and b.dtype == torch.float32}
        super()._apply(fn, recurse)
        for k, old in saved.items():
            new = self._buffers[k]
            if new is not None and new.dtype != torch.float32:
                self._buffers[k] = old.to(new.device)
        return self

    def _count_refresh(self) -> None:
        self.refresh_count.add_(1)
        self._refreshes += 1

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs) -> None:
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)
        self._refreshes = int(self.refresh_count)
        self.invalidate()

