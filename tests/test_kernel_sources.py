"""benchmarks/kernel_sources.py: the profile's kernel table joined with inductor's output code."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HEAD = "V1206 08:15:37.076000 713 torch/_inductor/graph.py:2552] [0/0] [__output_code] "

# two compiled graphs (a forward and a backward) that both define the same kernel name, one of them
# with a reduction, as TORCH_LOGS=output_code writes them through TORCH_LOGS_OUT
LOG = "\n".join(HEAD + line for line in [
    "# kernel path: /tmp/torchinductor_root/44/c44k.py",
    "# Topologically Sorted Source Nodes: [full_default_190, add_360], Original ATen: [aten.select_backward, aten.add]",
    "# Source node to ATen node mapping:",
    "#   add_360 => add_360",
    "triton_poi_fused_add_select_backward_84 = async_compile.triton('triton_poi_fused_add_select_backward_84', '''",
    "@triton.jit",
    "def triton_poi_fused_add_select_backward_84(in_ptr0, out_ptr0, xnumel, XBLOCK : tl.constexpr):",
    "    xnumel = 150994944",
    "''', device_str='cuda')",
    "# Topologically Sorted Source Nodes: [rms_norm_4, fp8_mlp_default], Original ATen: [aten._fused_rms_norm]",
    "triton_red_fused_norm_1 = async_compile.triton('triton_red_fused_norm_1', '''",
    "def triton_red_fused_norm_1(in_ptr0, out_ptr0, xnumel, r0_numel, XBLOCK : tl.constexpr):",
    "    xnumel = 49152",
    "    r0_numel = 768",
    "''', device_str='cuda')",
    "# Topologically Sorted Source Nodes: [mul_417, sum_71], Original ATen: [aten.mul, aten.sum]",
    "triton_red_fused_norm_1 = async_compile.triton('triton_red_fused_norm_1', '''",
    "    xnumel = 512",
    "    r0_numel = 147456",
    "''', device_str='cuda')",
])

TABLE = "\n".join([
    "kind\tlaunches_per_step\tms_per_step\tus_per_launch\tname",
    "GEMM (cuBLAS)\t192.00\t36.0578\t187.80\tnvjet_sm90_qrtst_128x160",
    "inductor (torch.compile) kernels\t8.00\t7.6930\t961.62\ttriton_poi_fused_add_select_backward_84",
    "inductor (torch.compile) kernels\t24.00\t2.4568\t102.37\ttriton_red_fused_norm_1",
    "inductor (torch.compile) kernels\t1.00\t0.0100\t10.00\ttriton_poi_tiny_2",
]) + "\n"


def _module():
    spec = importlib.util.spec_from_file_location("kernel_sources", ROOT / "benchmarks" / "kernel_sources.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def test_each_kernel_definition_carries_its_fused_operations_and_sizes():
    sources = _module().parse_output_code(LOG)
    assert set(sources) == {"triton_poi_fused_add_select_backward_84", "triton_red_fused_norm_1"}
    (sel,) = sources["triton_poi_fused_add_select_backward_84"]
    assert sel.nodes == "full_default_190, add_360" and sel.aten == "aten.select_backward, aten.add"
    assert sel.numel == {"xnumel": 150994944}
    fwd, bwd = sources["triton_red_fused_norm_1"]  # the same name in two graphs: both definitions
    assert fwd.numel == {"xnumel": 49152, "r0_numel": 768} and "rms_norm_4" in fwd.nodes
    assert bwd.numel == {"xnumel": 512, "r0_numel": 147456} and bwd.aten == "aten.mul, aten.sum"


def test_the_listing_keeps_the_tables_order_and_names_what_each_kernel_fuses(tmp_path, capsys):
    mod = _module()
    (tmp_path / "k.tsv").write_text(TABLE)
    (tmp_path / "oc.log").write_text(LOG)
    mod.main([str(tmp_path / "k.tsv"), str(tmp_path / "oc.log"), "--min-ms", "1"])
    out = capsys.readouterr().out.splitlines()
    kernels = [line for line in out if " ms " in line]
    names = [line.split(" us  ")[1].split("  [")[0] for line in kernels]  # the tiny kernel is under 1 ms
    assert names == ["nvjet_sm90_qrtst_128x160", "triton_poi_fused_add_select_backward_84", "triton_red_fused_norm_1"]
    assert kernels[1].split()[0] == "7.69" and "961.6 us" in kernels[1]
    text = "\n".join(out)
    assert "xnumel=150,994,944: aten.select_backward, aten.add" in text
    assert "fuses full_default_190, add_360" in text
    assert text.count("fuses") == 3  # one definition, then two of the same name


def test_missing_or_wrong_files_are_one_clear_line(tmp_path):
    mod = _module()
    (tmp_path / "oc.log").write_text(LOG)
    with pytest.raises(SystemExit, match="does not exist; see this script's --help"):
        mod.main([str(tmp_path / "nope.tsv"), str(tmp_path / "oc.log")])
    (tmp_path / "bad.tsv").write_text("name\tms\n")
    with pytest.raises(SystemExit, match="not a kernel table of step_time.py --profile"):
        mod.main([str(tmp_path / "bad.tsv"), str(tmp_path / "oc.log")])
    (tmp_path / "k.tsv").write_text(TABLE)
    (tmp_path / "empty.log").write_text("nothing compiled here\n")
    with pytest.raises(SystemExit, match="defines no inductor kernel"):
        mod.main([str(tmp_path / "k.tsv"), str(tmp_path / "empty.log")])
