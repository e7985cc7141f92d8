"""The ReLU² MLP: y = relu(x·W_fcᵀ)²·W_proj.

Both weights are stored as [hidden, dim] (RECORD §8: the record's mlp bank holds c_fc
and c_proj in that shape), so the optimizer sees two tall matrices of one shape.
The output projection starts at zero (RECORD §2 "Initialization"), which makes every
block the identity at step 0.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# RECORD §2: c_fc ~ U(±√3·0.5·dim^-½)
FC_INIT_GAIN = 0.5


class MLP(nn.Module):
    """ReLU² MLP; ``fp8`` runs both matmuls through ``ops.fp8.fp8_mlp`` (RECORD §7)."""

    def __init__(self, dim: int, hidden: int, fp8: bool = False, fp8_backend: str = "auto") -> None:
        super().__init__()
        self.fc_w = nn.Parameter(torch.empty(hidden, dim))
        self.proj_w = nn.Parameter(torch.zeros(hidden, dim))
        bound = math.sqrt(3) * FC_INIT_GAIN * dim**-0.5
        nn.init.uniform_(self.fc_w, -bound, bound)
        self.fp8 = fp8
        if fp8:
            from ..ops.fp8 import Fp8MLPState  # FP8 (and Triton) load only when used

            self.fp8_state = Fp8MLPState(backend=fp8_backend)

    def refresh_fp8(self) -> None:
        """Refresh the FP8 weight caches if the weights changed (eager; before a compiled forward)."""
        if self.fp8 and self.training:
            self.fp8_state.refresh(self.fc_w, self.proj_w)

    def forward(self, x: Tensor) -> Tensor:
        if self.fp8 and self.training:
            from ..ops.fp8 import fp8_mlp  # FP8 (and Triton) load only when used

            return fp8_mlp(x, self.fc_w, self.proj_w, self.fp8_state)
        h = F.relu(x @ self.fc_w.type_as(x).t()).square()
        return h @ self.proj_w.type_as(x)
