"""The one timing loop of the GPU benchmarks: CUDA-event wall time of a callable, and its peak memory."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch


@dataclass
class Timing:
    median_ms: float
    p90_ms: float
    peak_bytes: int  # peak allocated during the timed calls, above the allocation before them
    first: Optional[torch.Tensor]  # a float copy of the first warmup call's output (None if it returned None)


def time_cuda(step: Callable[[], Any], warmup: int, iters: int, params: Sequence[torch.Tensor] = (),
              absolute_peak: bool = False) -> Timing:
    """Run ``step`` ``warmup`` times untimed, then ``iters`` times between CUDA events.

    ``params``' gradients are cleared before every call (each call is one forward+backward,
    not an accumulation). The peak is measured above what was allocated before the timed
    calls, or from zero with ``absolute_peak`` (parameters and optimizer state included).
    """
    def clear() -> None:
        for p in params:
            p.grad = None

    first = None
    for i in range(warmup):
        clear()
        out = step()
        if i == 0 and isinstance(out, torch.Tensor):
            first = out.detach().float().clone()
    torch.cuda.synchronize()
    clear()
    torch.cuda.empty_cache()
    base = 0 if absolute_peak else torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(iters):
        clear()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    peak = torch.cuda.max_memory_allocated() - base
    clear()
    times.sort()
    return Timing(statistics.median(times), times[min(len(times) - 1, int(0.9 * len(times)))], peak, first)


def warm_on_side_stream(step: Callable[[], Any], leaves: Sequence[torch.Tensor], calls: int) -> None:
    """``calls`` calls of ``step`` on a side stream, as a capture runs it (compiles, the allocator's
    and cuBLAS's per-stream warmup), the leaves' gradients cleared before each and after."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(calls):
            for leaf in leaves:
                leaf.grad = None
            step()
    torch.cuda.current_stream().wait_stream(side)
    for leaf in leaves:
        leaf.grad = None


def graphed(step: Callable[[], Any], leaves: Sequence[torch.Tensor] = ()) -> Callable[[], None]:
    """``step`` captured in a CUDA graph after three calls on a side stream; returns the graph's
    replay, to time the GPU's work as a captured training step runs it rather than the host's
    launches. The leaves' gradients are allocated in the capture and rewritten by every replay."""
    warm_on_side_stream(step, leaves, 3)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def time_replayed(step: Callable[[], Any], leaves: Sequence[torch.Tensor], warmup: int, iters: int,
                  no_graph: bool = False, what: str = "step") -> Timing:
    """``step``'s time replayed from a CUDA graph (the GPU's time, as the captured training step
    runs it), or launched from the host with ``no_graph`` or where the capture fails (said in one
    line naming ``what``: those figures then include the host's launches)."""
    if not no_graph:
        try:
            return time_cuda(graphed(step, leaves), warmup, iters)
        except Exception as e:  # noqa: BLE001 - a backend whose calls cannot be captured
            torch.cuda.synchronize()
            first = str(e).splitlines()[0][:80] if str(e) else ""
            print(f"{what}: CUDA graph capture failed ({type(e).__name__}: {first}); timed from the host instead")
    return time_cuda(step, warmup, iters, leaves)


def copy_bandwidth(like: torch.Tensor, iters: int) -> float:
    """Bytes a second, read + written, of a device copy of a tensor shaped and typed like ``like``
    (median of ``iters``): the bandwidth the memory-bound benchmarks state their floors in."""
    src, dst = torch.empty_like(like), torch.empty_like(like)
    copy_ms = time_cuda(lambda: dst.copy_(src), 5, iters).median_ms
    return 2 * src.numel() * src.element_size() / (copy_ms * 1e-3)


def print_floor_table(times: dict[str, float], floor_bytes: float, bandwidth: float, iters: int) -> None:
    """The memory-bound benchmarks' report: the device, the copy bandwidth and the floor (``floor_bytes``
    at ``bandwidth``), then each row's median ms, its multiple of the floor and ``reference`` / row
    (``times`` holds a ``reference`` row)."""
    floor_ms = floor_bytes / bandwidth * 1e3
    width = max(len(name) for name in times) + 2
    print(f"device: {torch.cuda.get_device_name()}; torch {torch.__version__}; median of {iters}")
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s; floor {floor_bytes / 1e9:.3f} GB moved = {floor_ms:.3f} ms")
    print(f"{'row':<{width}} {'ms':>8} {'x floor':>8} {'reference/row':>14}")
    for name, ms in times.items():
        print(f"{name:<{width}} {ms:8.3f} {ms / floor_ms:7.2f}x {times['reference'] / ms:13.2f}x")
