"""The workspace cuBLASLt may use for a matrix multiply: none by default here.

PyTorch hands cuBLASLt a workspace (``CUBLASLT_WORKSPACE_SIZE`` KiB; megabytes when unset) for
every ``torch._scaled_mm`` and Lt ``mm``. With it, each FP8 GEMM on a Hopper GPU comes with a
memset of the workspace: about 60 a micro-batch in the record's network, each a node of the
captured graph. Given no workspace, cuBLASLt picks the same tiles in their static-scheduler form
("ssched" in the kernel names) and launches no memset. On an H100 at stage 0 the GEMMs took the
same time either way (49.7 against 49.5 ms a step), while the GPU's idle time between the
kernels of a micro-batch's graph fell from 5.0 to 3.0 ms a step: BENCHMARKS.md, "cuBLASLt without
a workspace".

PyTorch reads the variable once, when it first sets up cuBLASLt in a process. ``main.py`` and
``benchmarks/step_time.py`` set it to :data:`DEFAULT_KIB` at their start unless the environment
already names a size: ``CUBLASLT_WORKSPACE_SIZE=32768 python main.py fit ...`` gives cuBLASLt
32 MiB again.
"""

from __future__ import annotations

from typing import Optional

from .cuda_env import default_before_cuda

ENV = "CUBLASLT_WORKSPACE_SIZE"
DEFAULT_KIB = "0"  # no workspace: the static-scheduler kernels, no memset before each FP8 GEMM


class GemmWorkspaceError(ValueError):
    """A malformed ``CUBLASLT_WORKSPACE_SIZE`` value in the environment."""


def _check(value: str, from_environment: bool) -> str:
    if not value.isdigit():
        where = ENV if from_environment else "cuBLASLt workspace"
        raise GemmWorkspaceError(f"{where}={value!r}: give a size in KiB such as 0 (no workspace) or 32768 (32 MiB)")
    return value


def set_cublaslt_workspace(default: Optional[str] = DEFAULT_KIB) -> Optional[str]:
    """Set ``CUBLASLT_WORKSPACE_SIZE`` to ``default`` (KiB) unless the environment names a size;
    return the size in effect (None: PyTorch's own default).

    Call it before anything runs a CUDA matrix multiply in this process (in practice, before CUDA
    is initialized): PyTorch reads the size once, so a later call changes nothing and warns.
    Processes started from this one (Lightning's launcher of the other ranks, a benchmark's loops)
    inherit it.
    """
    return default_before_cuda(ENV, default, _check, "cuBLASLt keeps PyTorch's default workspace")
