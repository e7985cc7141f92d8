"""Environment variables CUDA or its libraries read once per process: set a default before CUDA starts.

``launch_queues.py`` (the driver's launch queues) and ``gemm_workspace.py`` (cuBLASLt's workspace)
each give :func:`default_before_cuda` their variable, default and check.
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import Callable, Optional


def cuda_initialized() -> bool:
    """Whether CUDA is initialized in this process (without importing torch to ask)."""
    torch = sys.modules.get("torch")  # never import torch just to ask
    return torch is not None and torch.cuda.is_initialized()


def default_before_cuda(name: str, default: Optional[str], check: Callable[[str, bool], str],
                        late: str) -> Optional[str]:
    """Set the environment variable ``name`` to ``default`` unless the environment names a value;
    return the value in effect (None: the library's own default).

    ``check(value, from_environment)`` returns a valid value or raises one clear error. Once CUDA is
    initialized the variable may already have been read, so nothing is set and a warning ends
    with ``late`` (what the library keeps instead). Processes started from this one inherit it.
    """
    value = os.environ.get(name)
    if value is not None:
        return check(value.strip(), True)
    if default is None:
        return None
    check(default, False)
    if cuda_initialized():
        warnings.warn(f"{name} not set: CUDA is already initialized in this process, so {late}")
        return None
    os.environ[name] = default
    return default
