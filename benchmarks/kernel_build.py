"""The attention kernels built for an H100/H200 (sm_90) on any machine, GPU or not.

Triton's NVIDIA backend compiles for a named target without a device: this script builds the
forward, dQ and dK/dV kernels of ``nanogpt_pl.ops.triton.attention`` at their ``TILES`` for each
layer kind of the record (RECORD §2: (d_qk, d_v) = (128, 128), (64, 128), (64, 64)) and reads
the machine code back with the ``cuobjdump`` that Triton's package carries:

- ``regs``: registers a thread; ``stack``: bytes of local memory a thread (spilled registers:
  anything above 0 is slow);
- ``smem``: shared memory a program (two programs share a multiprocessor only below ~113 KB);
- instruction counts: ``HGMMA`` (Hopper's warpgroup matrix instruction; a matrix kernel without it
  runs on a slower path), ``LDGSTS`` (asynchronous global-to-shared copies: the software pipeline
  of ``num_stages``; plain ``LDG`` loads instead mean the loads are not pipelined), ``MUFU`` (the
  exponentials), ``LDL``/``STL`` (spill traffic).

The launcher specializes pointers and integer arguments divisible by 16 (alignment the copies
need); the build here assumes what the record's shapes give: every pointer 16-byte aligned and
every integer argument a multiple of 16. Without that assumption Triton emits no asynchronous
copies at all.

    python benchmarks/kernel_build.py                  # the TILES in use
    python benchmarks/kernel_build.py --tiles fwd:128x64x8x3,dkdv:64x128x8x3

It builds with the installed Triton, whose version is printed; the GPU machine's may differ.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

LAYER_KINDS = {"wide": (128, 128), "narrow": (64, 128), "dv64": (64, 64)}  # RECORD §2
SM90_SMEM_PER_PROGRAM = 232448  # 227 KB: the most shared memory one program may take on sm_90
COUNTED = ("HGMMA", "HMMA", "LDGSTS", "LDG", "LDL", "STL", "MUFU")

# argument types of the three kernels, by name (everything else is an int32 stride or a constexpr)
_POINTERS = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "DO": "*bf16", "OUT": "*bf16", "DQ": "*bf16", "DK": "*bf16",
             "DV": "*bf16", "LSE": "*fp32", "DELTA": "*fp32", "ROW_LO": "*i32", "COL_HI": "*i32"}
_FLOATS = {"qk_scale", "sm_scale"}
_CONSTEXPRS = {"D_QK", "D_V", "BLOCK_M", "BLOCK_N"}


@dataclass
class Build:
    kernel: str
    kind: str
    tile: tuple[int, int, int, int]
    regs: int
    stack: int
    smem: int
    counts: dict[str, int]


def _signature(fn) -> tuple[dict[str, str], dict[tuple[int, ...], list]]:
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in _CONSTEXPRS:
            sig[name] = "constexpr"
        elif name in _POINTERS:
            sig[name] = _POINTERS[name]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in _FLOATS:
            sig[name] = "fp32"
        else:  # N and the strides
            sig[name] = "i32"
            attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, attrs


def build(kernel: str, d_qk: int, d_v: int, tile: tuple[int, int, int, int], kind: str = "") -> Build:
    """Compile one attention kernel (``fwd``, ``dq`` or ``dkdv``) for sm_90 and read its resources."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from nanogpt_pl.ops.triton import attention as A

    fn = {"fwd": A._fwd_kernel, "dq": A._dq_kernel, "dkdv": A._dkdv_kernel}[kernel]
    bm, bn, warps, stages = tile
    sig, attrs = _signature(fn)
    src = ASTSource(fn=fn, signature=sig, attrs=attrs,
                    constexprs={"D_QK": d_qk, "D_V": d_v, "BLOCK_M": bm, "BLOCK_N": bn})
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": warps, "num_stages": stages})
    if compiled.metadata.shared > SM90_SMEM_PER_PROGRAM:
        raise ValueError(f"attention {kernel} at tile {tile}, (d_qk, d_v) = ({d_qk}, {d_v}): needs "
                         f"{compiled.metadata.shared:,} B of shared memory, more than the "
                         f"{SM90_SMEM_PER_PROGRAM:,} B a program may have on an H100/H200 (the launch would "
                         "fail); use a smaller tile or fewer stages")
    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "k.cubin")
        Path(cubin).write_bytes(compiled.asm["cubin"])
        usage = subprocess.run([str(tools / "cuobjdump"), "--dump-resource-usage", cubin], check=True,
                               capture_output=True, text=True).stdout
        sass = subprocess.run([str(tools / "cuobjdump"), "-sass", cubin], check=True, capture_output=True,
                              text=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+)", usage)
    if found is None:
        raise RuntimeError(f"cuobjdump gave no resource line for {kernel}: {usage[:200]}")
    ops = collections.Counter(m.split(".")[0] for m in re.findall(r"\b([A-Z][A-Z0-9]+(?:\.\S+)?)\s", sass))
    return Build(kernel, kind, tile, int(found.group(1)), int(found.group(2)), compiled.metadata.shared,
                 {name: ops.get(name, 0) for name in COUNTED})


def production_builds() -> list[Build]:
    """Every kernel at the tile ``TILES`` gives it, for each layer kind."""
    from nanogpt_pl.ops.triton import attention as A

    return [build(kernel, d_qk, d_v, A.TILES[(kernel, max(d_qk, d_v) > 64)], kind)
            for kind, (d_qk, d_v) in LAYER_KINDS.items() for kernel in ("fwd", "dq", "dkdv")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiles", default="", help="kernel:BMxBNxWARPSxSTAGES,... overriding TILES (all kinds)")
    args = ap.parse_args()
    import triton

    from nanogpt_pl.ops.triton import attention as A

    for item in filter(None, args.tiles.split(",")):
        try:
            kernel, spec = item.split(":")
            tile = tuple(int(x) for x in spec.split("x"))
            if kernel not in ("fwd", "dq", "dkdv") or len(tile) != 4:
                raise ValueError
        except ValueError:
            raise SystemExit(f"--tiles: {item!r} is not kernel:BMxBNxWARPSxSTAGES with kernel fwd, dq or dkdv "
                             "(e.g. fwd:128x64x8x3)") from None
        for wide in (True, False):
            A.TILES[(kernel, wide)] = tile
    print(f"attention kernels built for sm_90 with triton {triton.__version__} (no GPU needed)")
    print(f"{'kind':<7} {'kernel':<5} {'tile (m, n, warps, stages)':<27} {'regs':>4} {'stack':>5} {'smem KB':>7}  "
          + " ".join(f"{c:>6}" for c in COUNTED))
    for b in production_builds():
        print(f"{b.kind:<7} {b.kernel:<5} {str(b.tile):<27} {b.regs:>4} {b.stack:>5} {b.smem / 1024:>7.0f}  "
              + " ".join(f"{b.counts[c]:>6}" for c in COUNTED))


if __name__ == "__main__":
    main()
