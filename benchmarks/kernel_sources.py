"""What each inductor kernel of a profile computes: the kernel table of ``step_time.py --profile``
joined with the ``output_code`` log of the same run.

``step_time.py --profile DIR`` writes ``DIR/<loop>-kernels.tsv`` (every kernel's launches and time
per step); run under ``TORCH_LOGS=output_code TORCH_LOGS_OUT=FILE``, torch also writes the code it
compiled, where a comment above every kernel names the graph operations it fuses and the ATen
operators they came from. This script prints the kernels that take at least ``--min-ms`` a step,
largest first, each with its launches, time, element counts (``xnumel`` / ``r0_numel``) and the
operations it fuses, so a kernel such as ``triton_poi_fused_add_select_backward_84`` reads as
"select_backward + add over 151M elements":

    TORCH_LOGS=output_code TORCH_LOGS_OUT=oc.log python benchmarks/step_time.py --only plain --no-eager \\
        --stage 2 --warmup 6 --steps 4 --profile prof
    python benchmarks/kernel_sources.py prof/plain-kernels.tsv oc.log --min-ms 1

Kernels that are not inductor's (cuBLAS, attention, the project's Triton kernels) are listed by
name only. A kernel name defined in several compiled graphs (the same name in a forward and a
backward) lists every definition's operations.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

_LOG_PREFIX = re.compile(r"^[VIWE]\d{4} [^\]]*\] (?:\[[^\]]*\] )*")  # the logging header of a torch log line
_DEFINITION = re.compile(r"^(triton_\w+) = async_compile\.triton\('")
_SOURCES = "# Topologically Sorted Source Nodes: "
_NUMEL = re.compile(r"^\s+(xnumel|r0_numel|rnumel) = (\d+)")


@dataclass
class KernelSource:
    """One compiled definition of an inductor kernel."""

    nodes: str = ""  # the graph operations it fuses, as the comment lists them
    aten: str = ""  # the ATen operators they came from
    numel: dict[str, int] = field(default_factory=dict)


def parse_output_code(text: str) -> dict[str, list[KernelSource]]:
    """Every inductor kernel defined in an ``output_code`` log, by name, with what it fuses."""
    out: dict[str, list[KernelSource]] = {}
    pending = KernelSource()
    current = None
    for raw in text.splitlines():
        line = _LOG_PREFIX.sub("", raw)
        if line.startswith(_SOURCES):
            body = line[len(_SOURCES):]
            nodes, _, aten = body.partition("], Original ATen: [")
            pending = KernelSource(nodes=nodes.lstrip("[").strip(), aten=aten.rstrip("]").strip())
            continue
        m = _DEFINITION.match(line)
        if m:
            current = pending
            out.setdefault(m.group(1), []).append(current)
            pending = KernelSource()
            continue
        if current is not None:
            n = _NUMEL.match(line)
            if n:
                current.numel[n.group(1)] = int(n.group(2))
            elif line.startswith("''', device_str"):
                current = None
    return out


def read_kernel_table(path: Path) -> list[tuple[str, float, float, float, str]]:
    """The rows of a ``<loop>-kernels.tsv``: (kind, launches a step, ms a step, us a launch, name)."""
    lines = path.read_text().splitlines()
    if not lines or lines[0].split("\t")[:2] != ["kind", "launches_per_step"]:
        raise ValueError(f"{path}: not a kernel table of step_time.py --profile (its header is missing)")
    rows = []
    for line in lines[1:]:
        kind, n, ms, us, name = line.split("\t", 4)
        rows.append((kind, float(n), float(ms), float(us), name))
    return rows


def describe(rows: list[tuple[str, float, float, float, str]], sources: dict[str, list[KernelSource]],
             min_ms: float, width: int = 160) -> list[str]:
    """One line per kernel of at least ``min_ms`` a step, and an indented line per compiled definition."""
    lines = []
    total = sum(r[2] for r in rows) or 1.0
    for kind, n, ms, us, name in rows:
        if ms < min_ms:
            continue
        lines.append(f"{ms:8.2f} ms {100 * ms / total:5.1f}%  {n:6.1f} x {us:8.1f} us  {name[:width]}  [{kind}]")
        for src in sources.get(name, []):
            numel = " ".join(f"{k}={v:,}" for k, v in src.numel.items())
            lines.append(f"{'':>12}{numel}: {src.aten}"[:width + 40])
            lines.append(f"{'':>14}fuses {src.nodes}"[:width + 40])
    return lines


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kernels", type=Path, help="DIR/<loop>-kernels.tsv from step_time.py --profile DIR")
    ap.add_argument("output_code", type=Path, help="the TORCH_LOGS=output_code log of the same run (TORCH_LOGS_OUT)")
    ap.add_argument("--min-ms", type=float, default=1.0, help="list kernels of at least this many ms a step")
    a = ap.parse_args(argv)
    for path in (a.kernels, a.output_code):
        if not path.is_file():
            sys.exit(f"kernel_sources: {path} does not exist; see this script's --help for how both files are made")
    try:
        rows = read_kernel_table(a.kernels)
    except ValueError as err:
        sys.exit(f"kernel_sources: {err}")
    sources = parse_output_code(a.output_code.read_text(errors="replace"))
    if not sources:
        sys.exit(f"kernel_sources: {a.output_code} defines no inductor kernel; was the run made with "
                 "TORCH_LOGS=output_code and compile on?")
    print("\n".join(describe(rows, sources, a.min_ms)))


if __name__ == "__main__":
    main()
