"""Per-step optimizer scalars shipped to the device without a host sync.

A CUDA graph reads its step's learning rate, bias corrections and decay from a device buffer
whose address it baked in; :class:`ScalarStager` refills that buffer every step with one
asynchronous copy from pinned host memory, so schedules need no recapture and the host never
waits for the GPU.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor


class ScalarStager:
    """A ``[rows, columns]`` fp32 device buffer refilled from the host once a step.

    On CUDA the values go through a small ring of pinned host buffers; a slot is refilled only
    after the copy that last read it has run (its event), which with the step's run-ahead of at
    most two steps never waits. Elsewhere the values are copied directly. The device buffer
    keeps its address for the stager's life.
    """

    SLOTS = 4

    def __init__(self, rows: int, columns: int, device: torch.device) -> None:
        self.device = torch.device(device)
        self.shape = (rows, columns)
        self.dev = torch.zeros(rows, columns, dtype=torch.float32, device=self.device)
        self.cells = [list(row.unbind()) for row in self.dev]  # 0-d views, made once: no per-step ops
        self.cuda = self.device.type == "cuda"
        if self.cuda:
            self.host = [torch.zeros(rows, columns, dtype=torch.float32, pin_memory=True) for _ in range(self.SLOTS)]
            self.events: list[Optional[torch.cuda.Event]] = [None] * self.SLOTS
            self.slot = 0

    def push(self, values: Sequence[Sequence[float]]) -> Tensor:
        """Stage ``values`` (``rows`` lists of ``columns`` floats); returns the device buffer."""
        src = torch.tensor(values, dtype=torch.float32)
        if tuple(src.shape) != self.shape:
            raise ValueError(f"ScalarStager: got values of shape {tuple(src.shape)}, holds {self.shape}")
        if not self.cuda:
            self.dev.copy_(src)
            return self.dev
        i = self.slot
        self.slot = (i + 1) % self.SLOTS
        if self.events[i] is not None:
            self.events[i].synchronize()
        self.host[i].copy_(src)
        self.dev.copy_(self.host[i], non_blocking=True)
        ev = torch.cuda.Event()
        ev.record()
        self.events[i] = ev
        return self.dev
