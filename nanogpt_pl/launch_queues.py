"""How much work the host may queue ahead of the GPU: the CUDA driver's launch queues.

A replayed CUDA graph of a micro-batch holds about 1,080 kernels. With the driver's default
queues the host blocks in the graph launch until most of the graph has been taken off the
queue ("Command Buffer Full" in a profile), so when the launch returns, little GPU work is left
queued; the host's work before the next replay (the FP8 staleness check, the copy-in, the sparse
pull and push, the next batch) then outlasts it and the GPU waits. Larger queues let the host
stay a graph or more ahead (BENCHMARKS.md, "Stage 0's idle" and "The launch queues").

The driver reads ``CUDA_SCALE_LAUNCH_QUEUES`` (a scale such as ``4x``) once, when the process
first initializes CUDA. ``main.py`` and ``benchmarks/step_time.py`` set it to
:data:`DEFAULT_SCALE` at their start unless the environment already names one:
``CUDA_SCALE_LAUNCH_QUEUES=1x python main.py fit ...`` runs with the driver's default queues (the
way back should a driver or GPU misbehave with larger ones: llama.cpp reverted its own 4x default
after hangs on a Jetson, ggml-org/llama.cpp#19227).
"""

from __future__ import annotations

import re
from typing import Optional

from .cuda_env import default_before_cuda

ENV = "CUDA_SCALE_LAUNCH_QUEUES"
# four times the driver's default queue: the largest scale the CUDA programming guide lists
DEFAULT_SCALE = "4x"
_SCALE = re.compile(r"^(\d+(\.\d*)?|\.\d+)x$")


class LaunchQueueError(ValueError):
    """A malformed ``CUDA_SCALE_LAUNCH_QUEUES`` value in the environment."""


def _check(value: str, from_environment: bool) -> str:
    if not _SCALE.match(value):
        if from_environment:
            raise LaunchQueueError(f"{ENV}={value!r}: give a scale such as 4x (1x keeps the driver's default queues)")
        raise LaunchQueueError(f"launch queue scale {value!r}: give a scale such as 4x")
    return value


def scale_launch_queues(default: Optional[str] = DEFAULT_SCALE) -> Optional[str]:
    """Set ``CUDA_SCALE_LAUNCH_QUEUES`` to ``default`` unless the environment names a scale; return the
    scale in effect (None: the driver's default queues).

    Call it before anything initializes CUDA in this process: once CUDA is initialized the
    driver has read its queues, so the call then changes nothing and warns. Processes started
    from this one (Lightning's launcher of the other ranks, a benchmark's loops) inherit it.
    """
    return default_before_cuda(ENV, default, _check, "the launch queues keep the driver's default size")
