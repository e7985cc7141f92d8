"""Seeds for tests that draw fresh random inputs on every run (a failure names its seed)."""

import os


def fresh_seed() -> int:
    """A new 24-bit seed from the operating system."""
    return int.from_bytes(os.urandom(3), "little")
