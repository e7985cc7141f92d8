"""Triton kernels, and the one place that decides whether they can run.

Importing this package does not import triton: the callers ask :func:`triton_usable` first
and fall back to their PyTorch reference when it says no.
"""

from __future__ import annotations

import os
from typing import Union

import torch

__all__ = ["ATTENTION_HEAD_DIMS", "QK_ROTARY_HEAD_DIMS", "interpret_mode", "lastdim_contiguous", "triton_usable"]

# head widths (d_qk and d_v) the attention kernels take (``attention.py``): powers of two a tile holds whole
ATTENTION_HEAD_DIMS = (16, 32, 64, 128)
# head widths the QK norm + rotary kernels take (``qk_rotary.py``): powers of two, a row is one tile
QK_ROTARY_HEAD_DIMS = (8, 16, 32, 64, 128)


def interpret_mode() -> bool:
    """Whether Triton kernels run in its CPU interpreter (``TRITON_INTERPRET=1``, for debugging).

    Triton reads the variable when it compiles a kernel, so it must be set before the kernel
    modules are imported; ``tests/interpreter.py`` re-runs a test module in a fresh process
    with it set.
    """
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_usable(device: Union[torch.device, str]) -> bool:
    """Whether Triton kernels can run on ``device``: a CUDA device (or the interpreter), and
    triton importable."""
    if torch.device(device).type != "cuda" and not interpret_mode():
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def lastdim_contiguous(x: torch.Tensor) -> torch.Tensor:
    """``x`` itself if its last dimension is contiguous (what the kernels' row pointers assume), else a copy."""
    return x if x.stride(-1) == 1 else x.contiguous()
