"""The attention kernels build for the GPU (sm_90) on the CPU, through Triton's NVIDIA backend.

The interpreter tests run the kernels' arithmetic on the CPU but never compile them: an error that
only the GPU compiler raises (a global that is not a ``tl.constexpr``, a layout it cannot lower)
would first show on the GPU machine. ``benchmarks/kernel_build.py`` builds each kernel at its
``TILES`` for every layer kind of the record (RECORD §2) and reads the machine code back; here
every build must succeed, use Hopper's warpgroup matrix instruction (``HGMMA``) and pipeline its
loads with asynchronous copies (``num_stages``). Registers and spills are reported by the script,
not asserted: they depend on the Triton version.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

triton = pytest.importorskip("triton")
from benchmarks.kernel_build import LAYER_KINDS, build, production_builds  # noqa: E402


def _backend_tools_present() -> bool:
    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    return (bin_dir / "ptxas").exists() and (bin_dir / "cuobjdump").exists()


pytestmark = pytest.mark.skipif(not _backend_tools_present(), reason="triton's NVIDIA backend tools are not installed")


def test_every_attention_kernel_builds_for_sm90_on_wgmma_with_pipelined_loads():
    builds = production_builds()
    assert len(builds) == 3 * len(LAYER_KINDS)
    for b in builds:
        what = f"{b.kernel} {b.kind} {b.tile}"
        assert b.counts["HGMMA"] > 0, f"{what}: no warpgroup matrix instruction (HGMMA): {b.counts}"
        assert b.counts["LDGSTS"] > 0, f"{what}: no asynchronous copies, the loads are not pipelined: {b.counts}"
        assert 0 < b.regs <= 255 and b.smem <= 227 * 1024, f"{what}: {b.regs} registers, {b.smem} B shared"


def test_a_tile_too_large_for_shared_memory_is_refused_in_one_line():
    """Triton compiles it; the launch on the GPU would fail, so the build says so first."""
    with pytest.raises(ValueError, match=r"fwd at tile \(256, 256, 8, 4\).*shared memory.*smaller tile"):
        build("fwd", 128, 128, (256, 256, 8, 4))


def test_an_error_only_the_gpu_compiler_raises_shows_here():
    """A plain Python global read inside a kernel runs under the interpreter but fails to compile
    (the forward-kernel experiment of 2026-12-07 lost a GPU call to it); the sm_90 build catches it."""
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    @triton.jit
    def scaled(X, Y):
        offs = tl.arange(0, 16)
        tl.store(Y + offs, tl.load(X + offs) * _PLAIN_GLOBAL)

    src = ASTSource(fn=scaled, signature={"X": "*fp32", "Y": "*fp32"}, constexprs={})
    with pytest.raises(Exception, match="_PLAIN_GLOBAL"):
        triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 1})


_PLAIN_GLOBAL = -1.0e6
