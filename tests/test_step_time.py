"""benchmarks/step_time.py: one configuration key per timed stage, and the profile's kernel breakdown."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch
from seeds import fresh_seed

from nanogpt_pl.capture import schedule_key
from nanogpt_pl.schedule import Schedule, Stage

ROOT = Path(__file__).resolve().parents[1]


def _step_time():
    spec = importlib.util.spec_from_file_location("step_time_bench", ROOT / "benchmarks" / "step_time.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_every_step_of_a_timed_stage_has_one_key(stage):
    args, st = _step_time()._args_for(str(ROOT / "configs" / "speedrun_1gpu.yaml"), stage, 10, True, [])
    stages = json.loads(args[args.index("--schedule.stages") + 1])
    assert stages == [st]
    schedule = Schedule(stages=[Stage(**st)], warmup_steps=0, cooldown_frac=0.0, untie_step=None)
    keys = {schedule_key(schedule, s) for s in range(10)}
    assert len(keys) == 1, keys


def test_the_held_weights_are_the_stages_first_ones():
    mod = _step_time()
    config = str(ROOT / "configs" / "speedrun_1gpu.yaml")
    _, st0 = mod._args_for(config, 0, 10, True, [])
    _, st1 = mod._args_for(config, 1, 10, True, [])
    _, st2 = mod._args_for(config, 2, 10, True, [])
    # RECORD §9 / §6: stage 0 starts with MTP weights [1, 0.5, 0.25] and prefix weight 0.25;
    # stage 1 with [1, 0.5] and the first of its prefix weights, 0.20; stage 2 with 14,336 candidates
    s0, s1, s2 = (Schedule(stages=[Stage(**st)], cooldown_frac=0.0, untie_step=None) for st in (st0, st1, st2))
    assert s0.mtp_weights(9) == [1.0, 0.5, 0.25] and s0.prefix_weight(9) == 0.25
    assert s1.mtp_weights(9) == [1.0, 0.5] and s1.prefix_weight(9) == 0.20
    assert s2.candidates(9) == 14336


def test_variants_run_the_plain_loop_with_their_overrides_last():
    mod = _step_time()
    argv = ["--only", "plain", "--set", "model.backends.anvil=reference",
            "--variant", "tri", "model.backends.anvil=triton"]
    variants = mod.parse_variants([["tri", "model.backends.anvil=triton"], ["two", "a.b=1", "c.d=2"]])
    assert variants == [("tri", ["model.backends.anvil=triton"]), ("two", ["a.b=1", "c.d=2"])]
    cmd = mod.child_command(argv, "variant tri", variants)
    assert cmd[-6:] == ["--child", "plain", "--tag", "variant-tri", "--set", "model.backends.anvil=triton"]
    # the variant's override comes after the shared one, so it is the value the child's config gets
    args, _ = mod._args_for(str(ROOT / "configs" / "speedrun_1gpu.yaml"), 0, 4, True,
                            ["model.backends.anvil=reference", "model.backends.anvil=triton"])
    assert args[-2:] == ["--model.backends.anvil", "triton"]
    assert mod.child_command(argv, "plain-eager", variants)[-4:] == ["--child", "plain-eager", "--set",
                                                                     "model.cuda_graphs=false"]
    for bad in (["tri"], ["tri", "model.backends.anvil"], ["k=v", "a=b"]):
        with pytest.raises(SystemExit, match="give a name, then KEY=VALUE overrides"):
            mod.parse_variants([bad])
    with pytest.raises(SystemExit, match="the name is taken"):
        mod.parse_variants([["plain", "a=b"]])


def test_a_variants_env_overrides_set_its_process_environment_not_its_config(monkeypatch):
    mod = _step_time()
    monkeypatch.setenv("KEEP_ME", "1")
    variants = mod.parse_variants([["q1", "env:CUDA_SCALE_LAUNCH_QUEUES=1x", "model.compile=false"],
                                   ["cfg", "model.compile=false"]])
    argv = ["--only", "plain", "--variant", "q1", "env:CUDA_SCALE_LAUNCH_QUEUES=1x", "model.compile=false"]
    cmd = mod.child_command(argv, "variant q1", variants)
    assert cmd[-6:] == ["--child", "plain", "--tag", "variant-q1", "--set", "model.compile=false"]
    env = mod.child_env("variant q1", variants)
    assert env["CUDA_SCALE_LAUNCH_QUEUES"] == "1x" and env["KEEP_ME"] == "1"
    assert mod.child_env("variant cfg", variants) is None and mod.child_env("plain", variants) is None
    assert mod.split_env(["env:A=x=y", "b.c=1"]) == (["b.c=1"], {"A": "x=y"})
    with pytest.raises(SystemExit, match="env:NAME=VALUE variables"):
        mod.parse_variants([["bad", "env:=1x"]])


# Kernel names as the CUDA profiler reported them on the H200 (a stage-1 trace of step_time.py)
FILL = ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, std::array<char*, 1ul> >"
        "(int, at::native::FillFunctor<float>, std::array<char*, 1ul>)")
ADD = ("void at::native::vectorized_elementwise_kernel<8, at::native::CUDAFunctor_add<c10::BFloat16>, "
       "std::array<char*, 3ul> >(int, at::native::CUDAFunctor_add<c10::BFloat16>, std::array<char*, 3ul>)")
COPY = ("void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)"
        "::{lambda()#3}::operator()() const::{lambda()#4}::operator()() const::{lambda(long)#1}, "
        "std::array<char*, 2ul>")
FLASH = ("void pytorch_flash::flash_bwd_dot_do_o_kernel<true, Flash_bwd_kernel_traits<64, 128, 128, 8, 4, 4, 4, false, "
         "false, cutlass::bfloat16_t, Flash_kernel_traits<64, 128, 128, 8, cutlass::bfloat16_t> > >"
         "(pytorch_flash::Flash_bwd_params)")
WMMA = ("void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_32x32_32x1_tn_align2>"
        "(cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_32x32_32x1_tn_align2::Params)")


@pytest.mark.parametrize("name,kind", [
    ("nvjet_sm90_qrtst_128x160_128x5_2x1_v_bz_coopA_algo2_TNT", "GEMM (cuBLAS)"),
    (WMMA, "GEMM (cuBLAS)"),
    (FLASH, "attention"),
    ("_dkdv_kernel", "attention"),
    ("triton_per_fused__fused_rms_norm__to_copy_add_cat_mul_sigmoid_slice_2", "inductor (torch.compile) kernels"),
    ("_quantize_dual_kernel", "project Triton (FP8, loss, optimizer)"),
    ("_softcap_ce_rows_kernel", "project Triton (FP8, loss, optimizer)"),
    (FILL, "ATen elementwise (unfused)"),
    ("Memcpy DtoD (Device -> Device)", "copies and memsets"),
    ("Memset (Device)", "copies and memsets"),
    ("void at::native::(anonymous namespace)::compute_grad_weight<float, long>(long const*, float const*)", "other"),
])
def test_kernel_kinds_of_real_kernel_names(name, kind):
    assert _step_time().kernel_kind(name) == kind


def test_breakdown_sums_by_kind_and_names_the_elementwise_operations():
    mod = _step_time()
    kinds, ops = mod.gpu_time_by_kind([(FILL, 2.0), (ADD, 5.0), (ADD, 1.0), (COPY, 0.5), ("_dq_kernel", 9.0),
                                       ("triton_poi_fused_add_mul_0", 3.0)])
    assert list(kinds) == ["attention", "ATen elementwise (unfused)", "inductor (torch.compile) kernels"]
    assert kinds["ATen elementwise (unfused)"] == 8.5 and kinds["attention"] == 9.0
    assert list(ops) == ["add", "fill", "copy"]
    assert ops["add"] == (2, 6.0) and ops["fill"] == (1, 2.0) and ops["copy"] == (1, 0.5)


def test_the_kernel_table_gives_every_kernel_per_step_largest_first(tmp_path):
    mod = _step_time()
    # two steps: the add twice (6 us in all), the attention kernel once (9 us), the fill four times (2 us)
    events = [(ADD, 0.0, 5.0), ("_dq_kernel", 10.0, 19.0), (ADD, 20.0, 21.0)]
    events += [(FILL, t, t + 0.5) for t in (30, 31, 32, 33)]
    rows = mod.kernel_table(events, steps=2)
    assert [r[4] for r in rows] == ["_dq_kernel", ADD, FILL]
    kind, per_step, ms, us, _ = rows[1]
    assert kind == "ATen elementwise (unfused)" and per_step == 1.0 and ms == pytest.approx(3e-3) and us == 3.0
    assert rows[0][:4] == ("attention", 0.5, pytest.approx(4.5e-3), 9.0)
    path = tmp_path / "plain-kernels.tsv"
    mod.write_kernel_table(events, 2, path)
    lines = path.read_text().splitlines()
    assert lines[0].split("\t") == ["kind", "launches_per_step", "ms_per_step", "us_per_launch", "name"]
    assert len(lines) == 4 and lines[1].split("\t") == ["attention", "0.50", "0.0045", "9.00", "_dq_kernel"]
    assert lines[3].split("\t")[4] == FILL  # the full name, however long


def _launch_trace() -> dict:
    """A Chrome trace as ``export_chrome_trace`` writes it: two host threads, nested ops, phases."""
    def span(cat, name, tid, ts, dur):
        return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur}

    def launch(tid, ts, corr, name="cudaLaunchKernel"):
        return {**span("cuda_runtime", name, tid, ts, 1), "args": {"correlation": corr}}

    def gpu(cat, name, ts, dur, corr):
        return {**span(cat, name, 7, ts, dur), "args": {"correlation": corr}}

    events = [
        span("user_annotation", "step/micro_batch", 1, 0, 100),
        span("user_annotation", "unrelated range", 1, 0, 300),  # not a step phase: never named
        span("cpu_op", "aten::zeros", 1, 10, 10), span("cpu_op", "aten::zero_", 1, 12, 6),
        launch(1, 14, 1, "cudaMemsetAsync"),
        span("cpu_op", "aten::mul", 1, 30, 10), launch(1, 35, 2), launch(1, 36, 3),
        launch(1, 45, 6),  # inside the phase, outside every op
        span("user_annotation", "step/optimizer", 1, 100, 100),
        span("cpu_op", "aten::add_", 1, 110, 10), launch(1, 115, 4),
        span("cpu_op", "aten::copy_", 2, 0, 50), launch(2, 5, 5, "cudaMemcpyAsync"),  # another thread, same times
        gpu("gpu_memset", "Memset (Device)", 20, 1, 1), gpu("kernel", "k_small", 40, 3, 2),
        gpu("kernel", "k_big", 50, 20, 3), gpu("kernel", "k_add", 120, 2, 4),
        gpu("gpu_memcpy", "Memcpy DtoD (Device -> Device)", 10, 4, 5), gpu("kernel", "k_orphan", 200, 5, 99),
        gpu("kernel", "k_small", 60, 3, 6),
    ]
    return {"traceEvents": events}


def test_each_gpu_event_is_traced_to_the_op_and_phase_that_launched_it():
    mod = _step_time()
    got = {(name, op, around, phase) for name, _, op, around, phase in mod.trace_launches(_launch_trace())}
    assert got == {
        ("Memset (Device)", "aten::zero_", "aten::zeros", "step/micro_batch"),
        ("k_small", "aten::mul", "", "step/micro_batch"),
        ("k_big", "aten::mul", "", "step/micro_batch"),
        ("k_small", "?", "", "step/micro_batch"),
        ("k_add", "aten::add_", "", "step/optimizer"),
        ("Memcpy DtoD (Device -> Device)", "aten::copy_", "", "?"),
        ("k_orphan", "?", "", "?"),
    }


def test_the_launch_table_groups_per_step_and_names_memsets_copies_and_small_kernels(tmp_path, capsys):
    mod = _step_time()
    trace = _launch_trace()
    trace["traceEvents"] += [{**e, "args": {"correlation": 1}} for e in trace["traceEvents"]
                             if e["name"] == "Memset (Device)"]  # the memset twice
    rows = mod.launch_table(mod.trace_launches(trace), steps=2)
    assert rows[0] == ("memset", 1.0, 1.0, "aten::zero_", "aten::zeros", "step/micro_batch", "Memset (Device)")
    what = {(r[3], r[6]): r[0] for r in rows}
    assert what[("aten::mul", "k_small")] == "small kernel" and what[("aten::mul", "k_big")] == "kernel"
    assert what[("aten::copy_", "Memcpy DtoD (Device -> Device)")] == "copy"
    assert {(r[3], r[6]): r[2] for r in rows}[("aten::mul", "k_big")] == 10.0  # us per step
    mod.write_launch_table(json.loads(json.dumps(trace)), 2, tmp_path / "plain-launchers.tsv", "plain")
    lines = (tmp_path / "plain-launchers.tsv").read_text().splitlines()
    assert lines[0].split("\t")[:4] == ["what", "launches_per_step", "us_per_step", "launching_op"]
    assert len(lines) == 1 + len(rows)
    err = capsys.readouterr().err
    assert "plain: memsets per step: 1 launches" in err and "aten::zero_ <- aten::zeros [step/micro_batch]" in err
    assert "plain: small kernels per step: 2 launches" in err


def test_idle_gaps_name_the_work_the_gpu_waited_for(tmp_path, capsys):
    """Gaps inside one graph launch, before a graph's first kernel and before eager launches, per step;
    overlapping events leave no gap, and a gap is measured from the latest end so far."""
    def span(cat, name, tid, ts, dur):
        return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur}

    def launch(ts, corr, name):
        return {**span("cuda_runtime", name, 1, ts, 1), "args": {"correlation": corr}}

    def gpu(name, ts, dur, corr, cat="kernel"):
        return {**span(cat, name, 7, ts, dur), "args": {"correlation": corr}}

    trace = {"traceEvents": [
        span("user_annotation", "graphs/replay", 1, 0, 5), launch(1, 1, "cudaGraphLaunch"),
        span("user_annotation", "step/optimizer", 1, 50, 40),
        span("cpu_op", "aten::add_", 1, 60, 5), launch(61, 2, "cudaLaunchKernel"),
        span("cpu_op", "aten::zero_", 1, 70, 5), launch(71, 3, "cudaMemsetAsync"),
        span("user_annotation", "graphs/replay", 1, 80, 5), launch(81, 4, "cudaGraphLaunch"),
        # graph 1: three kernels with gaps of 1 and 2 us, the third overlapping a long second one
        gpu("g1_a", 10, 4, 1), gpu("g1_b", 15, 10, 1), gpu("g1_c", 20, 3, 1), gpu("g1_d", 27, 2, 1),
        gpu("k_add", 70, 2, 2),                       # 41 us after the graph's end: the eager add waited
        gpu("Memset (Device)", 75, 1, 3, "gpu_memset"),  # 3 us
        gpu("g2_a", 100, 5, 4), gpu("g2_b", 106, 5, 4),  # 24 us before the second graph, then 1 us inside
    ]}
    mod = _step_time()
    rows = mod.idle_gaps(trace, steps=2)
    got = {where: (n, us, big) for where, n, us, big in rows}
    assert got == {
        "aten::add_ [step/optimizer] k_add": (0.5, 20.5, 41.0),
        "graph start [graphs/replay]": (0.5, 12.0, 24.0),
        "inside a graph [graphs/replay]": (1.5, 2.0, 2.0),  # 1 (a->b) + 2 (b ends at 25, d at 27) + 1 (g2)
        "aten::zero_ [step/optimizer] Memset (Device)": (0.5, 1.5, 3.0),
    }
    assert [r[0] for r in rows][:2] == ["aten::add_ [step/optimizer] k_add", "graph start [graphs/replay]"]
    mod.write_idle_gaps(trace, 2, tmp_path / "plain-idle.tsv", "plain")
    lines = (tmp_path / "plain-idle.tsv").read_text().splitlines()
    assert lines[0].split("\t") == ["where", "gaps_per_step", "idle_us_per_step", "largest_gap_us"]
    assert lines[1].split("\t") == ["aten::add_ [step/optimizer] k_add", "0.50", "20.5", "41.0"]
    assert "plain: GPU idle per step by the work it waited for" in capsys.readouterr().err


def test_gpu_busy_time_is_the_union_of_the_intervals():
    # overlapping kernels count once, a gap counts nothing, an empty interval is skipped (microseconds in, seconds out)
    events = [("a", 0.0, 10.0), ("b", 5.0, 20.0), ("c", 30.0, 40.0), ("d", 45.0, 45.0), ("e", 31.0, 33.0)]
    assert _step_time().gpu_busy_seconds(events) == pytest.approx(30e-6)


def test_gpu_idle_spans_are_the_gaps_between_the_kernels_inside_the_window():
    events = [("a", 10.0, 20.0), ("b", 15.0, 30.0), ("c", 50.0, 60.0), ("d", 55.0, 58.0), ("e", 90.0, 120.0)]
    assert _step_time().gpu_idle_spans(events, 0.0, 100.0) == [(0.0, 10.0), (30.0, 50.0), (60.0, 90.0)]


def test_host_phases_count_the_gpu_idle_time_inside_each_phase():
    mod = _step_time()
    gpu = [("k1", 0.0, 40.0), ("k2", 60.0, 100.0)]  # idle 40-60 and 100-130 in a window 0-130
    host = [("step/micro_batch", 10.0, 50.0),  # holds 10 us of idle (40-50)
            ("graphs/replay", 45.0, 48.0),  # nested: 3 us of idle
            ("step/optimizer", 50.0, 70.0),  # 10 us (50-60)
            ("cudaEventSynchronize", 105.0, 115.0),  # a blocking call outside every step/ phase: 10 us
            ("step/micro_batch", 115.0, 120.0)]  # 5 us
    rows = mod.host_phases(gpu, host, 0.0, 130.0)
    assert rows["step/micro_batch"] == (2, 45.0, 15.0)
    assert rows["graphs/replay"] == (1, 3.0, 3.0)
    assert rows["step/optimizer"] == (1, 20.0, 10.0)
    assert rows["cudaEventSynchronize"] == (1, 10.0, 10.0)
    # 50 us idle in all, 25 us of it inside step/ phases (graphs/ ranges nest inside them)
    assert rows["(no phase)"] == (0, 0.0, 25.0)


def test_profile_events_read_the_steps_phase_ranges_from_a_real_profile():
    mod = _step_time()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with torch.profiler.record_function("step/micro_batch"):
            torch.randn(64, 64) @ torch.randn(64, 64)
        with torch.profiler.record_function("unrelated"):
            torch.randn(8).sum()
    gpu, host = mod.profile_events(prof)
    assert gpu == []  # CPU only
    assert [name for name, _, _ in host] == ["step/micro_batch"]
    _, a, b = host[0]
    assert b > a


def test_the_lightning_clock_times_from_the_end_of_step_start_to_the_end_of_step_stop():
    import time
    from types import SimpleNamespace

    mod = _step_time()
    clock = mod._Clock(start=2, stop=4)
    trainer = SimpleNamespace(global_step=0)
    for step in range(1, 6):  # global_step counts the steps completed
        trainer.global_step = step
        clock.on_train_batch_end(trainer, None, None, None, step - 1)
        if step in (2, 3):
            time.sleep(0.05)  # the time of steps 3 and 4
    assert 0.1 <= clock.seconds < 1.0


def test_rounds_report_each_loops_median_round_and_the_ratio_within_every_round():
    mod = _step_time()
    runs = {
        "plain": [{"seconds": 1.80, "peak": 1, "graphs": "a"}, {"seconds": 2.07, "peak": 2, "graphs": "b"},
                  {"seconds": 1.90, "peak": 3, "graphs": "c"}],
        "variant x": [{"seconds": 2.03, "peak": 4}, {"seconds": 1.97, "peak": 5}, {"seconds": 1.85, "peak": 6}],
    }
    combined = mod.combine_rounds(runs)
    # the median round whole (its peak and graph report with it), and every round's time in run order
    assert combined["plain"] == {"seconds": 1.90, "peak": 3, "graphs": "c", "rounds": [1.80, 2.07, 1.90]}
    assert combined["variant x"]["seconds"] == 1.97 and combined["variant x"]["peak"] == 5
    assert mod.round_ratios(runs, "plain", "variant x") == pytest.approx([1.80 / 2.03, 2.07 / 1.97, 1.90 / 1.85])
    # the printed ratio: the median rounds', then each round's
    assert mod.ratio_text(combined, runs, "plain", "variant x") == (
        f"{1.90 / 1.97:.3f}x (medians; per round {1.80 / 2.03:.3f}x, {2.07 / 1.97:.3f}x, {1.90 / 1.85:.3f}x)")
    one = {"plain": [{"seconds": 2.0}], "baseline": [{"seconds": 2.2}]}
    assert mod.ratio_text(mod.combine_rounds(one), one, "baseline", "plain") == "1.100x"
    # an even count takes the lower middle round; one round is itself
    two = mod.combine_rounds({"plain": [{"seconds": 3.0}, {"seconds": 2.0}]})
    assert two["plain"]["seconds"] == 2.0 and two["plain"]["rounds"] == [3.0, 2.0]
    assert mod.combine_rounds({"plain": [{"seconds": 2.5}]})["plain"] == {"seconds": 2.5, "rounds": [2.5]}


def _run_main(argv: list[str], capsys) -> tuple[object, str]:
    """``python benchmarks/step_time.py ARGV`` in this process, from the repository root: (the exit
    status main() ends with, None for a normal return; its stdout). An interpreter start-up (torch
    and the project, about 5 s on 2 cores) saved per call; the loops it starts are processes of
    their own, as from the command line. Its environment changes (the launch queues' and the
    cuBLASLt workspace's variables) are undone after it."""
    from unittest import mock

    mod = _step_time()
    here = os.getcwd()
    with mock.patch.dict(os.environ), mock.patch("sys.argv", [mod.__file__, *argv]):
        os.environ.pop("CUDA_SCALE_LAUNCH_QUEUES", None)
        os.environ.pop("CUBLASLT_WORKSPACE_SIZE", None)
        os.chdir(ROOT)
        try:
            mod.main()
            status = None
        except SystemExit as stop:
            status = stop.code
        finally:
            os.chdir(here)
    return status, capsys.readouterr().out


def test_rounds_below_one_are_one_clear_error(capsys):
    # sys.exit(message): the interpreter prints the message as stderr's last line and exits with 1
    status, _ = _run_main(["--rounds", "0"], capsys)
    assert status == "step_time: --rounds 0: give 1 or more"


def test_the_baseline_loop_runs_the_other_trees_script_without_the_option():
    mod = _step_time()
    argv = ["--only", "plain", "--baseline", "../before", "--rounds", "2", "--baseline=x", "--steps", "4"]
    assert mod.without_option(argv, "--baseline") == ["--only", "plain", "--rounds", "2", "--steps", "4"]
    cmd = mod.child_command(argv, "baseline", [], "../before")
    assert cmd[1] == str((Path("../before").resolve() / "benchmarks" / "step_time.py"))
    assert cmd[2:] == ["--only", "plain", "--rounds", "2", "--steps", "4", "--child", "plain", "--tag", "baseline"]
    # this tree's own loops keep the option (their parser knows it); only the baseline's drops it
    assert mod.child_command(argv, "plain", [])[2:] == [*argv, "--child", "plain"]


def test_a_missing_baseline_tree_is_one_clear_error(tmp_path):
    mod = _step_time()
    assert mod.baseline_error(str(tmp_path)) == (
        f"step_time: --baseline {tmp_path}: no benchmarks/step_time.py there (give the root of a source tree of "
        "this project, e.g. made with `git worktree add TREE REV`)")
    assert mod.baseline_error(str(ROOT)) is None


def test_a_baseline_tree_runs_its_own_code_in_the_same_run(tmp_path, capsys):
    """A real two-tree run on the CPU: the baseline loop imports the other tree's package (a marker
    its copy leaves) and the report has its row and its ratio to plain. The script's top runs in
    this process; its three loops (plain, baseline, the variant) each in their own, as always."""
    import shutil

    tree = tmp_path / "before"
    skip = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("benchmarks", "nanogpt_pl", "callbacks", "configs"):
        shutil.copytree(ROOT / name, tree / name, ignore=skip)
    init = tree / "nanogpt_pl" / "__init__.py"
    init.write_text(init.read_text() + "\nimport pathlib as _p\n(_p.Path(__file__).parents[1] / 'imported').touch()\n")
    # a narrow model: the loops' steps take less, and nothing below depends on the width
    status, stdout = _run_main(["--config", "configs/quickstart.yaml", "--only", "plain", "--no-eager", "--steps", "1",
                                "--warmup", "1", "--set", "model.gpt.num_layers=2",
                                "--set", "model.gpt.long_window_layers=[1]",
                                "--set", "model.gpt.value_embed_layers=[1]",
                                "--set", "model.gpt.skip_from=null", "--set", "model.gpt.skip_to=null",
                                "--set", "model.gpt.model_dim=32", "--set", "model.gpt.head_dim=16",
                                "--set", "model.gpt.mlp_hidden=64", "--baseline", str(tree),
                                "--variant", "q1", "env:CUDA_SCALE_LAUNCH_QUEUES=1x",
                                "env:CUBLASLT_WORKSPACE_SIZE=32768"], capsys)
    assert status is None, stdout[-5000:]
    assert (tree / "imported").is_file() and not (ROOT / "imported").exists()
    rows = [ln.split() for ln in stdout.splitlines()]
    table = [r for r in rows if len(r) == 7 and r[3].endswith("%")]  # loop, ms/step, tokens/s, MFU, ...
    assert [r[0] for r in table] == ["plain", "baseline"] and float(table[1][1]) > 0
    assert any(ln.startswith(f"baseline ({tree}) / plain step time: ") for ln in stdout.splitlines())
    # every loop starts with main.py's launch queues; the variant's own environment gives it 1x (the
    # baseline tree's copy of the script sets the default too, inherited or its own)
    assert "launch queues (CUDA_SCALE_LAUNCH_QUEUES): plain 4x, baseline 4x, variant q1 1x" in stdout
    # likewise cuBLASLt's workspace: none unless the variant's environment names a size
    assert ("cuBLASLt workspace (CUBLASLT_WORKSPACE_SIZE): plain 0 KiB, baseline 0 KiB, variant q1 32768 KiB"
            in stdout)


def test_blocking_calls_are_named_by_their_project_callers():
    """The innermost project frames around each synchronize, on its own thread; torch frames only
    where no project frame holds the call; per step."""
    def frame(name, tid, ts, dur):
        return {"ph": "X", "cat": "python_function", "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur}

    def call(name, tid, ts, dur):
        return {"ph": "X", "cat": "cuda_runtime", "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur,
                "args": {"correlation": ts}}

    trace = {"traceEvents": [
        frame("benchmarks/step_time.py(700): run_plain", 1, 0, 1000),
        frame("nanogpt_pl/module.py(690): run_step", 1, 10, 500),
        frame("nanogpt_pl/optim/staging.py(50): push", 1, 20, 100),
        frame("torch/cuda/streams.py(227): synchronize", 1, 25, 90),
        call("cudaEventSynchronize", 1, 30, 80),
        frame("nanogpt_pl/capture.py(1029): step_done", 1, 600, 50),
        call("cudaEventSynchronize", 1, 610, 20), call("cudaEventSynchronize", 1, 640, 4),
        frame("torch/utils/data.py(10): fetch", 2, 0, 100),  # another thread: its own frames only
        call("cudaFree", 2, 50, 6),
        call("cudaLaunchKernel", 1, 35, 1),  # not a blocking call
    ]}
    rows = _step_time().blocking_callers(trace, steps=2, depth=2)
    assert rows == [
        ("cudaEventSynchronize", "nanogpt_pl/optim/staging.py(50): push <- nanogpt_pl/module.py(690): run_step",
         0.5, 0.04),
        ("cudaEventSynchronize", "nanogpt_pl/capture.py(1029): step_done <- benchmarks/step_time.py(700): run_plain",
         1.0, 0.012),
        ("cudaFree", "torch/utils/data.py(10): fetch", 0.5, 0.003),
    ]


def test_stacks_without_a_profile_is_one_clear_error(capsys):
    status, _ = _run_main(["--stacks"], capsys)
    assert status == "step_time: --stacks names the callers in a profile: give --profile [DIR] too"


def test_a_profiled_loop_times_its_steps_unprofiled_then_profiles_as_many_again(tmp_path):
    """``--profile``: the loop's ms/step comes from its timed steps without the profiler (whose own host
    work, buffer flushes of tens of ms, would be in the wall), and the trace holds a second run of as
    many steps. On the CPU, in process: the trace's step phases count the profiled steps only."""
    mod = _step_time()
    narrow = ["model.gpt.num_layers=2", "model.gpt.long_window_layers=[1]", "model.gpt.value_embed_layers=[1]",
              "model.gpt.skip_from=null", "model.gpt.skip_to=null", "model.gpt.model_dim=32", "model.gpt.head_dim=16",
              "model.gpt.mlp_hidden=64"]
    steps = 2
    args, _ = mod._args_for(str(ROOT / "configs" / "quickstart.yaml"), 0, 1 + 2 * steps, True, narrow)
    here = os.getcwd()
    os.chdir(ROOT)
    try:
        result = mod.run_plain(args, 1, steps, profile=str(tmp_path))
    finally:
        os.chdir(here)
    assert result["seconds"] > 0 and result["profiled_seconds"] > 0
    trace = json.loads((tmp_path / "plain-trace.json").read_text())
    phases = [e for e in trace["traceEvents"] if e.get("name") == "step/schedule" and e.get("ph") == "X"]
    assert len(phases) == steps


def test_the_default_warmup_passes_the_fp8_mlp_bootstrap():
    """With the FP8 MLP, ``--warmup`` defaults past its exact-scale bootstrap (RECORD §7: exact
    weight scales for the first 16 refreshes) and the two refresh keys after it (the Adam groups
    step every 2nd step, RECORD §8), each captured on its second visit: 16 + 2 * 2 = 20."""
    mod = _step_time()
    speedrun, quickstart = str(ROOT / "configs" / "speedrun_1gpu.yaml"), str(ROOT / "configs" / "quickstart.yaml")
    assert mod.fp8_bootstrap_steps(speedrun, []) == (16, 20)
    assert mod.fp8_bootstrap_steps(speedrun, ["schedule.adam_every=3"]) == (16, 22)
    assert mod.fp8_bootstrap_steps(speedrun, ["model.gpt.fp8_mlp=false"]) is None
    assert mod.fp8_bootstrap_steps(quickstart, []) is None
    assert mod.resolve_warmup(None, 6, (16, 20)) == (20, None)
    assert mod.resolve_warmup(None, 6, None) == (5, None)
    # a given warmup stands; a note where the bootstrap's end falls among the timed steps
    warmup, note = mod.resolve_warmup(6, 12, (16, 20))  # --warmup 6 --steps 6 --profile: steps 6-17
    assert warmup == 6 and note.startswith("step_time: --warmup 6: the FP8 MLP's exact-scale bootstrap ends at step "
                                           "16") and "give --warmup 20 or more" in note
    assert mod.resolve_warmup(6, 10, (16, 20)) == (6, None)  # steps 6-15: all exact
    assert mod.resolve_warmup(19, 6, (16, 20))[1] is not None  # step 19's refresh graph is captured on the clock
    assert mod.resolve_warmup(20, 6, (16, 20)) == (20, None)
    assert mod.resolve_warmup(3, 4, None) == (3, None)


def test_the_fp8_mlps_scales_turn_lagged_at_the_bootstrap_step():
    """The step ``fp8_bootstrap_steps`` names is the MLP's own: a step a refresh (step 0's forward
    builds the first caches), the lagged-scale variant from step 16 on (reference backend, CPU)."""
    from nanogpt_pl.model.mlp import MLP

    seed = fresh_seed()
    torch.manual_seed(seed)
    mlp = MLP(32, 64, fp8=True, fp8_backend="reference").train()
    x = torch.randn(8, 32, dtype=torch.bfloat16)
    exact = []
    for _ in range(20):
        exact.append(mlp.fp8_state.refresh_variant() == (True,))
        mlp(x).float().sum().backward()
        with torch.no_grad():  # an optimizer step: the weights change, so the next forward refreshes
            for p in mlp.parameters():
                p.add_(torch.randn_like(p), alpha=1e-3)
    first, _ = _step_time().fp8_bootstrap_steps(str(ROOT / "configs" / "speedrun_1gpu.yaml"), [])
    assert exact == [True] * first + [False] * (20 - first), f"seed {seed}"
