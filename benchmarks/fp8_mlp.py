"""FP8 MLP block and lm_head GEMMs, forward + backward, against bf16, in one run.

Shapes (RECORD §2, §9): 49,152 tokens per rank (stage 2) × model dim 768; MLP hidden 2,816
with ReLU²; lm_head 768 → 50,304 classes. Inputs are RMSNorm outputs in bf16, weights bf16.

MLP rows (each: ``y = relu(x W1ᵀ)² W2`` forward, then backward to x, W1, W2):
- bf16: plain torch matmuls + relu().square() under autograd (the baseline);
- bf16 compiled: the same under ``torch.compile`` (with --compile);
- ours FP8 ``elementwise``: cuBLAS FP8 GEMMs (torch._scaled_mm) + fused Triton passes;
- ours FP8 ``gemm_epilogue``: the Triton FP8 GEMM with ReLU² / dpre in its epilogue;
  both with the weight cache rebuilt every iteration (one micro-batch per optimizer step,
  as the record at 8 GPUs) and, in a second row, reused (later micro-batches of a step);
- torchao float8 (dynamic tensorwise scaling), if torchao imports.

lm_head rows (GEMMs only, chunked 8,192 rows at a time as the fused loss runs them; the
loss kernel's gradient write is stood in for by a copy of a fixed random gradient):
- bf16: ``TorchHeadMatmul`` (logits, dx = G W, dW = Gᵀ x);
- ours FP8: ``Fp8Head`` (e4m3 x and W, e4m3 logits, e5m2 G, weight cache reused);
- torchao float8 ``nn.Linear(768, 50304)`` with a bf16 gradient, if torchao imports;
- and the full loss (lm_head + fused softcapped CE, Triton backend) with the bf16 head
  vs ``Fp8Head``, full softmax and sampled at P = 10,240.

Printed per row: median wall time (CUDA events), peak memory allocated above the inputs,
the relative error of the output against the bf16 row, and the speed ratio against the
bf16 row of its group. Target (issue 5): FP8 MLP >= 1.4x faster than bf16. With ``--graph``
the MLP rows are measured a second time as replays of a captured call (GPU time only, how a
run that captures its step executes them).

    python benchmarks/fp8_mlp.py            # about a minute on an H200
    python benchmarks/fp8_mlp.py --quick    # fewer repetitions
    python benchmarks/fp8_mlp.py --host     # host time of an eager FP8 layer call (any device)
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import traceback
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.gpu_timing import time_cuda, warm_on_side_stream  # noqa: E402
from nanogpt_pl.ops.fp8 import Fp8Head, Fp8MLPState, fp8_mlp  # noqa: E402
from nanogpt_pl.ops.lm_head import TorchHeadMatmul  # noqa: E402
from nanogpt_pl.ops.triton.fp8_mlp import dpre_quantize, relu2_quantize  # noqa: E402
from nanogpt_pl.ops.triton.fp8_quant import quantize_dual  # noqa: E402

N_TOKENS = 49152  # RECORD §9: stage-2 tokens per rank per step
DIM = 768  # RECORD §2
HIDDEN = 2816  # RECORD §2
VOCAB = 50304  # RECORD §2
HEAD_CHUNK = 8192  # rows per chunk of the fused loss on a GPU (ops.lm_head GPU_CHUNK_ELEMENTS)
SAMPLED_P = 10240  # RECORD §6: candidates in stages 0-1
FC_BOUND = math.sqrt(3) * 0.5 * DIM**-0.5  # RECORD §2 c_fc init
PROJ_STD = 0.02  # c_proj starts at zero (RECORD §2); a trained-looking scale instead
HEAD_STD = 0.02


def measure(step: Callable[[], Optional[torch.Tensor]], params: list[torch.Tensor], warmup: int, iters: int):
    """(median ms, peak MB above the resting allocation, first output) of ``step``."""
    t = time_cuda(step, warmup, iters, params)
    return t.median_ms, t.peak_bytes / 2**20, t.first


def measure_graph(step: Callable[[], Optional[torch.Tensor]], params: list[torch.Tensor], warmup: int, iters: int):
    """(median ms, peak MB) of replaying one captured call of ``step`` (forward + backward).

    GPU time only: the host work of the call (Python, autograd, launches) is paid once, at
    capture, as in a run that captures its step (RECORD §11); the isolated-call figures of
    :func:`measure` include it. The weight refresh of the "+weight refresh" rows is captured
    with the call, so it replays every time.
    """
    for _ in range(warmup):
        for p in params:
            p.grad = None
        step()
    torch.cuda.synchronize()
    warm_on_side_stream(step, params, 2)  # the capture stream too (cuBLAS workspaces are per stream)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    del graph
    for p in params:
        p.grad = None
    return statistics.median(times), peak


def profile(label: str, step: Callable[[], Optional[torch.Tensor]], params: list[torch.Tensor], iters: int = 3) -> None:
    """Print the GPU kernels of ``iters`` calls of ``step`` (after the timed runs warmed it up)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            for p in params:
                p.grad = None
            step()
        torch.cuda.synchronize()
    print(f"\n--- profile: {label} ({iters} calls; times are totals over the calls)")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=70))


def rel(a: Optional[torch.Tensor], b: Optional[torch.Tensor]) -> str:
    if a is None or b is None:
        return "-"
    return f"{((a - b).norm() / b.norm()).item():.4f}"


class Table:
    def __init__(self) -> None:
        self.rows: list[tuple] = []

    def add(self, group: str, name: str, ms: Optional[float], peak: Optional[float], err: str,
            base_ms: Optional[float], note: str = "") -> None:
        ratio = f"{base_ms / ms:.2f}x" if ms and base_ms else "-"
        self.rows.append((group, name, f"{ms:.3f}" if ms else "-", f"{peak:.0f}" if peak is not None else "-",
                          err, ratio, note))

    def print(self) -> None:
        head = ("group", "variant", "median ms", "peak MB", "rel err vs bf16", "speed vs bf16", "note")
        widths = [max(len(str(r[i])) for r in self.rows + [head]) for i in range(len(head))]
        line = lambda r: " | ".join(str(c).ljust(w) for c, w in zip(r, widths))  # noqa: E731
        print(line(head))
        print("-+-".join("-" * w for w in widths))
        for r in self.rows:
            print(line(r))


def try_torchao():
    try:
        from torchao.float8 import convert_to_float8_training

        return convert_to_float8_training
    except Exception as e:  # noqa: BLE001 - any import failure means "not available"
        print(f"torchao float8: not available ({type(e).__name__}: {e})")
        return None


class _Relu2(torch.nn.Module):
    def forward(self, x):
        return F.relu(x).square()


def mlp_rows(table: Table, n: int, warmup: int, iters: int, compile_baseline: bool, with_profile: bool,
             with_graph: bool) -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = F.rms_norm(torch.randn(n, DIM, device="cuda", generator=gen), (DIM,)).bfloat16().requires_grad_()
    w1 = torch.nn.Parameter(((torch.rand(HIDDEN, DIM, device="cuda", generator=gen) * 2 - 1) * FC_BOUND).bfloat16())
    w2 = torch.nn.Parameter((PROJ_STD * torch.randn(HIDDEN, DIM, device="cuda", generator=gen)).bfloat16())
    g = torch.randn(n, DIM, device="cuda", generator=gen).bfloat16()
    params = [x, w1, w2]

    def bf16_mlp(xx, a, b):
        return F.relu(xx @ a.t()).square() @ b

    def run(fn):
        def step():
            y = fn()
            y.backward(g)
            return y
        return step

    base_ms, peak, ref = measure(run(lambda: bf16_mlp(x, w1, w2)), params, warmup, iters)
    table.add("MLP", "bf16 (torch matmul + relu²)", base_ms, peak, "0", base_ms)
    if with_profile:
        profile("MLP bf16", run(lambda: bf16_mlp(x, w1, w2)), params)
    graph_base = None
    if with_graph:
        graph_base, gpeak = measure_graph(run(lambda: bf16_mlp(x, w1, w2)), params, warmup, iters)
        table.add("MLP [CUDA graph]", "bf16 (torch matmul + relu²)", graph_base, gpeak, "0", graph_base)
    if compile_baseline:
        compiled = torch.compile(bf16_mlp)
        ms, peak, out = measure(run(lambda: compiled(x, w1, w2)), params, warmup + 2, iters)
        table.add("MLP", "bf16 torch.compile", ms, peak, rel(out, ref), base_ms)

    for kernel in ("elementwise", "gemm_epilogue"):
        for refresh in (True, False):
            name = f"ours FP8 {kernel}" + (" (+weight refresh)" if refresh else " (cached weights)")
            try:
                state = Fp8MLPState(backend="scaled_mm", relu2_kernel=kernel).cuda()

                def fp8_step(state=state, refresh=refresh):
                    if refresh:
                        with torch.no_grad():  # a no-op update that bumps the version, as an optimizer step does
                            w1.mul_(1.0)
                            w2.mul_(1.0)
                    return fp8_mlp(x, w1, w2, state)

                ms, peak, out = measure(run(fp8_step), params, warmup, iters)
                table.add("MLP", name, ms, peak, rel(out, ref), base_ms)
                if with_profile:
                    profile(f"MLP {name}", run(fp8_step), params)
                if with_graph:
                    gms, gpeak = measure_graph(run(fp8_step), params, warmup, iters)
                    table.add("MLP [CUDA graph]", name, gms, gpeak, "-", graph_base)
            except Exception as e:  # noqa: BLE001 - report and keep measuring the other rows
                traceback.print_exc()
                table.add("MLP", name, None, None, "-", base_ms, f"failed: {type(e).__name__}")

    convert = try_torchao()
    if convert is not None:
        try:
            mod = torch.nn.Sequential(torch.nn.Linear(DIM, HIDDEN, bias=False), _Relu2(),
                                      torch.nn.Linear(HIDDEN, DIM, bias=False)).cuda().bfloat16()
            with torch.no_grad():
                mod[0].weight.copy_(w1)
                mod[2].weight.copy_(w2.t())
            mod = convert(mod)
            ms, peak, out = measure(run(lambda: mod(x)), params + list(mod.parameters()), warmup, iters)
            table.add("MLP", "torchao float8 (dynamic tensorwise)", ms, peak, rel(out, ref), base_ms)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            table.add("MLP", "torchao float8", None, None, "-", base_ms, f"failed: {type(e).__name__}")


def head_gemm_rows(table: Table, n: int, warmup: int, iters: int) -> None:
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = F.rms_norm(torch.randn(n, DIM, device="cuda", generator=gen), (DIM,)).bfloat16()
    w = (HEAD_STD * torch.randn(VOCAB, DIM, device="cuda", generator=gen)).bfloat16().requires_grad_()
    # A fixed softmax-gradient-like chunk: small positive values, one -1 per row.
    g_chunk = (torch.rand(HEAD_CHUNK, VOCAB, device="cuda", generator=gen) * 2e-5).bfloat16()
    g_chunk[torch.arange(HEAD_CHUNK, device="cuda"), torch.randint(0, VOCAB, (HEAD_CHUNK,), device="cuda")] = -1.0

    def gemm_loop(head, grad_src, weight):
        def step():
            ops = head.prepare(weight, None, torch.bfloat16)
            dx = torch.empty_like(x)
            dw = None
            first = None
            for r0 in range(0, n, HEAD_CHUNK):
                xc = x[r0:r0 + HEAD_CHUNK]
                logits, _ = head.logits(xc, ops)
                if first is None:
                    first = logits
                grad, div = head.grad_buffer(logits)
                grad.copy_(grad_src[: grad.shape[0]])  # stands in for the loss kernel's write
                head.grad_input(grad, div, ops, dx[r0:r0 + HEAD_CHUNK])
                dw = head.grad_weight(grad, div, xc, dw)
            return first[:, :4096]
        return step

    # detached: the GEMM loop must not build an autograd graph (the fused loss runs it under its own Function)
    base_ms, peak, ref = measure(gemm_loop(TorchHeadMatmul(), g_chunk, w.detach()), [w], warmup, iters)
    table.add("lm_head GEMMs", "bf16 (TorchHeadMatmul, 6 chunks)", base_ms, peak, "0", base_ms)
    try:
        head = Fp8Head(backend="scaled_mm").cuda()
        g8 = (g_chunk.float() / head.grad_s).clamp(-57344, 57344).to(torch.float8_e5m2)
        # the parameter itself, so the e4m3 weight cache is reused (it changes only on Adam steps)
        ms, peak, out = measure(gemm_loop(head, g8, w), [w], warmup, iters)
        table.add("lm_head GEMMs", "ours FP8 (Fp8Head, e4m3 logits)", ms, peak, rel(out, ref), base_ms,
                  "logits saturate at ±448")
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        table.add("lm_head GEMMs", "ours FP8 (Fp8Head)", None, None, "-", base_ms, f"failed: {type(e).__name__}")

    convert = try_torchao()
    if convert is not None:
        try:
            lin = torch.nn.Linear(DIM, VOCAB, bias=False).cuda().bfloat16()
            with torch.no_grad():
                lin.weight.copy_(w)
            lin = convert(lin)
            xr = x.clone().requires_grad_()
            g_full = g_chunk.repeat(n // HEAD_CHUNK + 1, 1)[:n]

            def ao_step():
                y = lin(xr)
                y.backward(g_full)
                return y[:HEAD_CHUNK, :4096]

            ms, peak, out = measure(ao_step, [xr] + list(lin.parameters()), warmup, iters)
            table.add("lm_head GEMMs", "torchao float8 nn.Linear", ms, peak, rel(out, ref), base_ms,
                      "unchunked, bf16 logits")
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            table.add("lm_head GEMMs", "torchao float8", None, None, "-", base_ms, f"failed: {type(e).__name__}")


def head_loss_rows(table: Table, n: int, warmup: int, iters: int) -> None:
    from nanogpt_pl.ops.cross_entropy import lm_head_loss
    from nanogpt_pl.ops.sampling import CandidateSampler

    gen = torch.Generator(device="cuda").manual_seed(2)
    x = F.rms_norm(torch.randn(n, DIM, device="cuda", generator=gen), (DIM,)).bfloat16().requires_grad_()
    w = (HEAD_STD * torch.randn(VOCAB, DIM, device="cuda", generator=gen)).bfloat16().requires_grad_()
    # text-like (Zipf 1.1) targets: ~9k distinct ids in 49,152 tokens, so P=10,240 candidates hold them
    ranks = torch.arange(1, 50258, dtype=torch.float64)
    targets = torch.multinomial((1.0 / ranks**1.1).float(), n, replacement=True,
                                generator=torch.Generator().manual_seed(2)).cuda()
    cand = CandidateSampler(vocab_size=VOCAB).build(targets.cpu(), SAMPLED_P).cuda()
    # The loss is a mean over n rows: the head divides its e5m2 gradient divisor by n to keep the record's range.
    fp8_head = Fp8Head(backend="scaled_mm", loss_rows=n).cuda()
    for label, candidates in (("full softmax", None), (f"sampled P={SAMPLED_P}", cand)):
        def step(head=None, candidates=candidates):
            loss = lm_head_loss(x, w, targets, candidates=candidates, backend="triton", head=head)
            loss.backward()
            return loss.reshape(1)

        try:
            base_ms, peak, ref = measure(step, [x, w], warmup, iters)
            table.add(f"lm_head + loss, {label}", "bf16 head, fused Triton CE", base_ms, peak, "0", base_ms)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            table.add(f"lm_head + loss, {label}", "bf16 head", None, None, "-", None, f"failed: {type(e).__name__}")
            continue
        try:
            ms, peak, out = measure(lambda: step(fp8_head), [x, w], warmup, iters)
            table.add(f"lm_head + loss, {label}", "Fp8Head, fused Triton CE", ms, peak, rel(out, ref), base_ms,
                      "err = loss value")
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            table.add(f"lm_head + loss, {label}", "Fp8Head", None, None, "-", base_ms, f"failed: {type(e).__name__}")


def tile_sweep(n: int, warmup: int, iters: int) -> None:
    """Time the elementwise FP8 passes at several tile shapes, checking each transposed copy's bytes.

    The tiles the kernels use (``_GPU_TILE``, ``_DPRE_BLOCK`` and ``_PROGRAMS_PER_SM`` in
    ``ops/triton/fp8_mlp.py``, ``_GPU_TILE`` in ``fp8_quant.py``) were picked from this table;
    "t == row.T" says whether the kernel's own
    transposed copy matches the row-major one byte for byte (the dpre rows include the separate
    byte transpose, ``transpose_bytes``).
    """
    def same_t(t: torch.Tensor, row: torch.Tensor) -> bool:
        return bool((t.view(torch.uint8) == row.t().contiguous().view(torch.uint8)).all())

    def ms(fn: Callable[[], object]) -> float:
        return time_cuda(fn, warmup, iters).median_ms

    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    one, amax, gscale = (torch.ones(1, device=dev), torch.zeros(1, device=dev), torch.tensor([64.0], device=dev))
    print(f"tile sweep: {n} rows; median ms of {iters} after {warmup}")
    pre = torch.randn(n, HIDDEN, device=dev, generator=g).bfloat16()
    for block in ((128, 128), (64, 128), (128, 64), (64, 64), (32, 128), (32, 64)):
        row, t = relu2_quantize(pre, one, amax, block=block)
        print(f"  relu2 {HIDDEN} wide {block}: {ms(lambda: relu2_quantize(pre, one, amax, block=block)):.3f} ms, "
              f"t == row.T {same_t(t, row)}")
    dpl = (torch.randn(n, HIDDEN, device=dev, generator=g) * 1e-2).bfloat16()
    post = (torch.rand(n, HIDDEN, device=dev, generator=g) * 100).to(torch.float8_e4m3fn)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    for block, per_sm in ((1024, 8), (2048, 4), (2048, 8), (4096, 4)):
        row, t = dpre_quantize(dpl, post, one, gscale, amax, block=block, programs=per_sm * sms)
        print(f"  dpre {HIDDEN} wide, blocks of {block}, {per_sm} programs per SM: "
              f"{ms(lambda: dpre_quantize(dpl, post, one, gscale, amax, block=block, programs=per_sm * sms)):.3f} ms, "
              f"t == row.T {same_t(t, row)}")
    x = F.rms_norm(torch.randn(n, DIM, device=dev, generator=g), (DIM,)).bfloat16()
    inv = torch.tensor([16.0], device=dev)
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        for block in ((128, 128), (64, 128), (64, 64), (32, 128)):
            row, t, _ = quantize_dual(x, inv, dtype, block=block)
            print(f"  quantize_dual {DIM} wide {str(dtype)[6:]} {block}: "
                  f"{ms(lambda: quantize_dual(x, inv, dtype, block=block)):.3f} ms, t == row.T {same_t(t, row)}")


def host_rows(iters: int) -> None:
    """Host time of one eager FP8 MLP and one FP8 linear call (forward + backward), through the
    ``torch.library`` operator (the dispatcher, as a compiled graph calls it) and through its eager
    twin (``_EagerMLP`` / ``_EagerLinear``, what an eager layer calls), same run. A tiny shape, so
    the kernels cost little next to the host; any device (the CPU runs the reference backend)."""
    import time

    from nanogpt_pl.ops.fp8 import Fp8LinearState
    from nanogpt_pl.ops.fp8 import ops as fp8_ops

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    backend = "auto" if device.type == "cuda" else "reference"
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = torch.Generator(device=device).manual_seed(0)
    n, d, h = (64, 64, 256) if device.type == "cuda" else (8, 16, 64)  # the CPU's reference GEMMs cost host time
    x0 = F.rms_norm(torch.randn(n, d, device=device, generator=gen), (d,)).to(dtype)
    w1 = (torch.randn(h, d, device=device, generator=gen) * 0.05).requires_grad_()
    w2 = (torch.randn(h, d, device=device, generator=gen) * 0.05).requires_grad_()
    wl = [(torch.randn(96, d, device=device, generator=gen) * 0.05).requires_grad_(),
          (torch.randn(32, d, device=device, generator=gen) * 0.05).requires_grad_()]
    mstate = Fp8MLPState(backend=backend).to(device)
    lstate = Fp8LinearState(backend=backend).to(device)
    margs = mstate.operator_args(w1, w2, *mstate.refresh(w1, w2))
    lrest = lstate.operator_args(lstate.refresh(wl))
    calls = {
        ("MLP", "operator"): lambda x: fp8_ops.fp8_mlp_op(x, *margs)[0],
        ("MLP", "eager twin"): lambda x: fp8_ops._EagerMLP.apply(x, *margs)[0],
        ("linear", "operator"): lambda x: fp8_ops.fp8_linear_op(x, wl, *lrest)[0],
        ("linear", "eager twin"): lambda x: fp8_ops._EagerLinear.apply(x, *lrest, *wl)[0],
    }
    results = {}
    for (layer, path), call in calls.items():
        def step():
            x = x0.detach().clone().requires_grad_()
            call(x).float().sum().backward()
        for _ in range(20):
            step()
        times = []
        for _ in range(5):
            if device.type == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(iters):
                step()
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append((time.perf_counter() - t) / iters * 1e6)
        results[(layer, path)] = statistics.median(times)
    print(f"host time per eager FP8 call, forward + backward, {n} x {d} (hidden {h}), {device.type}, "
          f"{backend} backend; median of 5 x {iters} calls")
    for layer in ("MLP", "linear"):
        op, twin = results[(layer, "operator")], results[(layer, "eager twin")]
        print(f"  {layer:<7} operator {op:7.0f} us   eager twin {twin:7.0f} us   operator/twin {op / twin:.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer repetitions")
    ap.add_argument("--tokens", type=int, default=N_TOKENS, help="tokens per micro-batch (multiple of 8192)")
    ap.add_argument("--compile", action="store_true", help="also time the bf16 MLP under torch.compile")
    ap.add_argument("--skip-head", action="store_true", help="MLP rows only")
    ap.add_argument("--profile", action="store_true", help="print the GPU kernels of each MLP variant")
    ap.add_argument("--graph", action="store_true",
                    help="also time the MLP rows as CUDA-graph replays (GPU time without the host's share)")
    ap.add_argument("--tile-sweep", action="store_true",
                    help="only time the FP8 elementwise passes at several tile shapes (and check their transposes)")
    ap.add_argument("--host", action="store_true",
                    help="only the host time of an eager FP8 layer call: operator vs eager twin (any device)")
    args = ap.parse_args()
    if args.host:
        host_rows(50 if args.quick else 200)
        return
    if not torch.cuda.is_available():
        sys.exit("benchmarks/fp8_mlp.py needs a CUDA GPU (FP8 GEMMs: compute capability >= 8.9)")
    if args.tokens % HEAD_CHUNK:
        sys.exit(f"--tokens must be a multiple of {HEAD_CHUNK}")
    warmup, iters = (3, 10) if args.quick else (5, 30)
    import triton

    props = torch.cuda.get_device_properties(0)
    print(f"device: {props.name} (sm_{props.major}{props.minor}, {props.total_memory / 2**30:.0f} GiB); "
          f"torch {torch.__version__}, triton {triton.__version__}")
    print(f"MLP: {args.tokens} x {DIM} -> {HIDDEN} -> {DIM}; lm_head: {args.tokens} x {DIM} -> {VOCAB}; "
          f"forward + backward; median of {iters} after {warmup} warmup\n")
    if args.tile_sweep:
        tile_sweep(args.tokens, warmup, iters)
        return
    torch.backends.cuda.matmul.allow_tf32 = True
    table = Table()
    sections = [lambda: mlp_rows(table, args.tokens, warmup, iters, args.compile, args.profile, args.graph)]
    if not args.skip_head:
        sections += [lambda: head_gemm_rows(table, args.tokens, warmup, iters),
                     lambda: head_loss_rows(table, args.tokens, warmup, iters)]
    for section in sections:
        try:
            section()
        except Exception:  # noqa: BLE001  (keep the rows measured so far)
            traceback.print_exc()
        torch.cuda.empty_cache()  # each section's tensors are freed when it returns
    print()
    table.print()
    for group in ("MLP", "MLP [CUDA graph]"):
        fp8 = [r for r in table.rows if r[0] == group and r[1].startswith("ours FP8") and r[5] != "-"]
        if fp8:
            best = max(fp8, key=lambda r: float(r[5][:-1]))
            verdict = "meets" if float(best[5][:-1]) >= 1.4 else "misses"
            print(f"best FP8 {group}: {best[1]} at {best[5]} of bf16: {verdict} the 1.4x target")


if __name__ == "__main__":
    main()
