"""Seeds for tests that draw fresh random inputs on every run (a failure names its seed), and the draw
the kernel tests compare sums with."""

import os

import torch


def fresh_seed() -> int:
    """A new 24-bit seed from the operating system."""
    return int.from_bytes(os.urandom(3), "little")


def draw_values(gen: torch.Generator, shape, dtype: torch.dtype, integers: bool) -> torch.Tensor:
    """Random values of ``shape`` in ``dtype``: small integers in [-8, 8] (every partial sum exact in
    fp32, whatever the order, so sums compare bit for bit) or standard normal draws."""
    if integers:
        return torch.randint(-8, 9, shape, generator=gen).to(dtype)
    return torch.randn(shape, generator=gen).to(dtype)
