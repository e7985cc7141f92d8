"""Whole-step CUDA graphs on a GPU (nanogpt_pl/capture.py): replay equals eager, keys, self-check.

The small GPT has every technique on: FP8 MLP, QKV and lm_head, the n-gram table and the
value embeddings through the (fixed) sparse exchange, sampled softmax, three MTP weights and
the prefix loss. Gradients are compared norm-wise per parameter: the attention backward
accumulates with atomics, so two eager runs of one micro-batch differ by an ulp of bf16 here and
there; the loss (RECORD §11's check) is held to 5e-4 relative.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from seeds import fresh_seed
from test_capture import (
    check_state_copy_on_host,
    every_technique_gpt,
    every_technique_schedule,
    make_module,
    packed_micro_batch,
    step_batch,
    train_losses,
)

from nanogpt_pl.capture import SELF_CHECK_RTOL, RunAhead, StepGraphs, _flatten, gpu_memory_gib

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.filterwarnings("ignore:model.gpt.fp8_qkv:UserWarning"),
]

GRAD_RTOL = 1e-2  # per parameter, norm-wise (see the module docstring)
SEQ = 512


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def _close(a: torch.Tensor, b: torch.Tensor, rtol: float = GRAD_RTOL, floor: float = 0.0) -> bool:
    """Norm-wise; ``floor`` keeps a parameter whose gradient nearly cancels (a scalar gate) from
    being held to the relative noise of its own tiny norm."""
    a, b = a.double(), b.double()
    return bool((a - b).norm() <= rtol * max(float(b.norm()), floor) + 1e-12)


def _global_rel(a: list, b: list) -> float:
    num = sum(float((x.double() - y.double()).square().sum()) for x, y in zip(a, b))
    den = sum(float(y.double().square().sum()) for y in b)
    return (num / max(den, 1e-300)) ** 0.5


def _module(seed: int = 0, cuda_graphs: bool = True, micro_batches: int = 2, steps: int = 6):
    module = make_module("cuda", cuda_graphs, every_technique_schedule(steps=steps, seq_len=SEQ,
                                                                      micro_batches=micro_batches),
                         every_technique_gpt(), seed=seed)
    # zero-initialized output projections make every block the identity at step 0, which
    # would leave most gradients zero; start from a trained-looking point instead
    gen = torch.Generator(device="cuda").manual_seed(seed + 1)
    with torch.no_grad():
        for p in module.model.matrix_params():
            p.add_(0.02 * torch.randn(p.shape, device="cuda", generator=gen).to(p.dtype))
    return module


def _visit(module, mb, micro_batches: int = 2):
    """One micro-batch through the module's graphs from zero gradients: (loss, grads, sparse leaf grads)."""
    graphs = module._step_graphs()
    for p in module.model.parameters():
        p.grad = None
    sparse = module.sparse_channels.inputs(mb["inputs"], train=True)
    loss = graphs.micro_step(mb, sparse, micro_batches)
    torch.cuda.synchronize()
    grads = {n: None if p.grad is None else p.grad.detach().clone() for n, p in module.model.named_parameters()}
    leaves = {k: v.values.grad.detach().clone() for k, v in sparse.items()}
    return float(loss), grads, leaves


def test_replay_equals_eager_with_every_technique_on():
    module = _module()
    module.apply_schedule(0)
    mb = step_batch(module, 0, seed=3, micro_batches=1, seq_len=SEQ)[0]
    eager, captured, replayed = (_visit(module, mb) for _ in range(3))
    graphs = module._step_graphs().graphs
    assert len(graphs.captured_keys()) == 1 and graphs.replays == 1
    check = next(iter(graphs.checks.values()))
    assert check.passed and check.loss_rel <= SELF_CHECK_RTOL, check
    total = sum(float(g.double().square().sum()) for g in eager[1].values() if g is not None) ** 0.5
    for got in (captured, replayed):
        assert _rel(got[0], eager[0]) <= SELF_CHECK_RTOL, (got[0], eager[0])
        assert got[1].keys() == eager[1].keys()
        for name, g in eager[1].items():
            if g is None:
                assert got[1][name] is None, name  # an eager None stays None (optimizers skip it)
            else:
                assert got[1][name] is not None and _close(got[1][name], g, floor=1e-3 * total), name
        assert got[2].keys() == eager[2].keys() == {"ngram", "value_rows"}
        for name, g in eager[2].items():
            assert _close(got[2][name], g), name
    assert any(g is not None and g.abs().sum() > 0 for g in eager[1].values())


def test_training_with_graphs_tracks_eager_training():
    steps = 6
    on, off = _module(cuda_graphs=True, steps=steps), _module(cuda_graphs=False, steps=steps)
    a = train_losses(on, steps, 2, SEQ, seed=7)
    b = train_losses(off, steps, 2, SEQ, seed=7)
    graphs = on._step_graphs().graphs
    assert graphs.replays >= steps - 1 and graphs.captured_keys()
    # the sparse pulls came from their graph from the second micro-batch on, and the micro-batch
    # graphs read the pull graph's outputs in place
    pulls = on._step_graphs().pulls
    assert pulls.replays == 2 * steps - 2
    kept = [t for st in graphs._statics.values() for _, t in _flatten(st) if isinstance(t, torch.Tensor)]
    assert sum(pulls.owns(t) for t in kept) >= 4  # the n-gram and value-embedding leaves and indices
    for x, y in zip(a, b):
        assert _rel(x, y) <= 2e-3, (a, b)
    # whole-model: Adam's first steps move a parameter by ±lr whatever its gradient's size, so a
    # near-zero scalar gradient that atomics flip in sign moves that one scalar; the matrices agree
    assert _global_rel([p.detach() for p in on.model.parameters()],
                       [q.detach() for q in off.model.parameters()]) <= 1e-2
    # the persistent gradient buffers are the ones the graphs were captured with
    ptrs = {k: t.data_ptr() for k, t in graphs.grads.items()}
    train_losses(on, 2, 2, SEQ, seed=8)
    assert {k: t.data_ptr() for k, t in graphs.grads.items()} == ptrs


def test_fp8_caches_follow_the_weights_anvil_graphs_write():
    """ANVIL replays its bank updates from CUDA graphs; a replay runs no ATen op, so the optimizer bumps
    the version counters of the matrices it wrote. Without that, the FP8 layers' caches (which see a
    changed weight by its counter) would keep the weights of the step ANVIL captured at."""
    steps = 5
    module = make_module("cuda", True, every_technique_schedule(steps=steps, seq_len=SEQ, micro_batches=2),
                         every_technique_gpt(), seed=0, matrix_optimizer="anvil")
    graphs = module._step_graphs()
    anvil = module._combined().parts["matrices"]
    states = graphs.fp8_states
    assert states
    counts = []
    for step in range(steps):
        module.apply_schedule(step)
        module.run_step(step_batch(module, step, 20, 2, SEQ))
        graphs._refresh_fp8()  # what the next micro-batch does first
        counts.append([st._refreshes for st in states])
    assert anvil.cuda_graph and all(b.graph is not None for b in anvil._banks if b.owned)
    # every step changed every matrix, so every matrix layer's cache was rebuilt after every step,
    # including the steps ANVIL only replayed
    for before, after in zip(counts, counts[1:]):
        assert all(b < a for b, a in zip(before, after)), counts


def test_the_fp8_refresh_replays_what_an_eager_refresh_computes():
    """RECORD §11's refresh graphs: after every optimizer step, the refresh from its graph (once the
    key is captured) writes the same bytes into every scale, amax, count and cache as an eager
    refresh from the same values, and leaves the same host record (count, nothing stale)."""
    steps = 6
    module = make_module("cuda", True, every_technique_schedule(steps=steps, seq_len=SEQ, micro_batches=2),
                         every_technique_gpt(), seed=0, matrix_optimizer="anvil")
    graphs = module._step_graphs()
    refresh, states = graphs.refresh, graphs.fp8_states
    assert refresh is not None and states
    for step in range(steps):
        module.apply_schedule(step)
        module.run_step(step_batch(module, step, 40, 2, SEQ))
        stale = [st for st in states if st.stale()]
        assert stale
        writes = [t for st in stale for t in st.refresh_writes()]
        start, hosts = [t.clone() for t in writes], [st.host_state() for st in stale]
        replays = refresh.replays
        graphs._refresh_fp8()  # eager, capture or replay
        torch.cuda.synchronize()
        got, got_counts = [t.clone() for t in writes], [st._refreshes for st in stale]
        assert not any(st.stale() for st in states)
        with torch.no_grad():
            for t, v in zip(writes, start):
                t.copy_(v)
        for st, h in zip(stale, hosts):
            st.set_host_state(h)
        for st in stale:
            st.refresh_now()
        torch.cuda.synchronize()
        for t, v in zip(writes, got):
            assert torch.equal(t.reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8)), step
        assert [st._refreshes for st in stale] == got_counts
        if step >= 2:  # the key's first visit ran eagerly and its second captured
            assert refresh.replays == replays + 1, step
    assert refresh.captured() >= 1


def test_a_captured_step_makes_no_host_sync():
    """Issue 13, no host syncs in the step: once its key is captured, a whole step (the pull graph,
    the micro-batch graphs, the sparse push and event with the fixed exchange, the FP8 refresh, ANVIL
    from its graphs, Adam) runs under torch's sync debug mode set to error. The batch is prepared
    and moved to the GPU before the check, as the loader does one step ahead; the run-ahead wait
    (an event synchronize, at most two steps back) is not an ATen sync."""
    steps = 5
    module = make_module("cuda", True, every_technique_schedule(steps=steps, seq_len=SEQ, micro_batches=2),
                         every_technique_gpt(), seed=0, matrix_optimizer="anvil")
    for step in range(3):  # visit, capture, replay
        module.apply_schedule(step)
        module.run_step(step_batch(module, step, 30, 2, SEQ))
    batch = step_batch(module, 2, 30, 2, SEQ)  # step 2's micro-batches again: the key captured above
    module.apply_schedule(3)
    graphs = module._step_graphs()
    adam = module._combined().parts["adam"]  # the default update: one Triton pass a parameter on a GPU
    assert adam.update_backend == "triton"
    adam_steps = {id(p): s["step"] for p, s in adam.state.items() if s}
    replays, pulls = graphs.graphs.replays, graphs.pulls.replays
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss = module.run_step(batch)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert graphs.graphs.replays == replays + 2 and graphs.pulls.replays == pulls + 2
    assert any(s.get("step", 0) == adam_steps.get(id(p), 0) + 1 for p, s in adam.state.items())  # Adam ran
    assert bool(torch.isfinite(loss))


def test_the_adam_update_replays_what_eager_adam_computes():
    """RECORD §11's optimizer tail: DistAdam's replicated update from its CUDA graphs writes the same
    bytes into every parameter and moment as the same update run eagerly, over steps with a changing
    lr, bf16 and fp32 parameters, cautious decay with the record's squared lr and a group without
    decay. A parameter that skips a step gets its own step count, so its own bucket: a new layout,
    captured in its turn. Replays bump the parameters' version counters (the FP8 caches' signal)."""
    from nanogpt_pl.optim.adam import DistAdam

    seed = fresh_seed()
    shapes = [(384, 256), (256,), (), (1000, 64), (50, 3)]
    dtypes = [torch.bfloat16, torch.float32, torch.float32, torch.bfloat16, torch.float32]
    gen = torch.Generator(device="cuda").manual_seed(seed)
    start = [(torch.randn(s, generator=gen, device="cuda") * 0.1).to(d) for s, d in zip(shapes, dtypes)]

    def build(graph: bool):
        ps = [torch.nn.Parameter(t.clone()) for t in start]
        for p in ps:  # persistent gradient buffers, as the step graphs keep them
            p.grad = torch.zeros_like(p)
        groups = [dict(params=ps[:3], lr_mul=5.0, wd_mul=150.0),
                  dict(params=ps[3:], weight_decay=0.0, betas=(0.8, 0.99))]
        # the PyTorch update, the one that replays from graphs (on a GPU ``auto`` is the Triton pass)
        return DistAdam(groups, lr=0.008, betas=(0.5, 0.95), eps=1e-10, weight_decay=0.005, cautious_wd=True,
                        decay_lr_power=2, cuda_graph=graph, update_backend="reference"), ps

    graphed, ps = build(True)
    eager, qs = build(False)
    assert graphed.graphs is not None and eager.graphs is None
    buffers = {id(p): p.grad for p in ps + qs}
    for step in range(9):
        for opt in (graphed, eager):
            for group in opt.param_groups:
                group["lr"] = group["initial_lr"] * (1.0 - 0.08 * step)
        new = [torch.randn(s, generator=gen, device="cuda").to(d) for s, d in zip(shapes, dtypes)]
        for params in (ps, qs):
            for p, g in zip(params, new):
                p.grad = buffers[id(p)]
                p.grad.copy_(g)
            if step == 3:
                params[4].grad = None  # skips this step: its own bucket from here on
        versions = [p._version for p in ps]
        replays = graphed.graphs.replays
        graphed.step()
        eager.step()
        torch.cuda.synchronize()
        for p, q in zip(ps, qs):
            assert torch.equal(p.reshape(-1).view(torch.uint8), q.reshape(-1).view(torch.uint8)), (seed, step)
            for name in ("exp_avg", "exp_avg_sq"):
                a, b = graphed.state[p][name], eager.state[q][name]
                assert torch.equal(a.view(torch.int32), b.view(torch.int32)), (seed, step, name)
        assert all(p._version > v for i, (p, v) in enumerate(zip(ps, versions)) if step != 3 or i != 4), step
        # layout A: eager at step 0, captured at 1, replayed at 2; step 3 is a layout of its own;
        # layout B (split buckets): eager at 4, captured at 5, replayed from 6 on
        assert graphed.graphs.replays == replays + (step in (2, 6, 7, 8)), step
    assert graphed.graphs.captured() == 2
    assert graphed.state[ps[4]]["step"] == 8 and graphed.state[ps[0]]["step"] == 9
    assert not torch.equal(ps[0], start[0])


def test_adam_graphs_that_never_replay_give_up_with_one_warning():
    """Layouts that come back once and never again (gradients at new addresses each time) would
    capture without end: after UpdateGraphs.GIVE_UP_CAPTURES such captures it warns once and runs
    the update eagerly, with the same result."""
    from nanogpt_pl.optim.adam import UpdateGraphs

    seed = fresh_seed()
    x = torch.randn(1000, generator=torch.Generator(device="cuda").manual_seed(seed), device="cuda")
    graphs = UpdateGraphs()

    def work():
        x.mul_(0.5).add_(1.0)

    want = x.clone()
    for key in range(UpdateGraphs.GIVE_UP_CAPTURES):
        for _ in range(2):  # eager, then captured (and never replayed: the next key differs)
            graphs.run((key,), work, [x], [])
            want.mul_(0.5).add_(1.0)
    assert graphs.captures == UpdateGraphs.GIVE_UP_CAPTURES and graphs.replays == 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            graphs.run((-1,), work, [x], [])
            want.mul_(0.5).add_(1.0)
    assert not graphs.enabled and graphs.captures == UpdateGraphs.GIVE_UP_CAPTURES
    assert [str(w.message) for w in caught if "runs eagerly from now on" in str(w.message)] != []
    assert len(caught) == 1
    assert torch.equal(x, want)


def _tensors(out) -> list:
    return [(name, t.detach().clone(), t.requires_grad) for name, t in _flatten(out) if isinstance(t, torch.Tensor)]


def test_the_sparse_pull_replays_what_an_eager_pull_reads_now():
    module = _module()
    module.apply_schedule(0)
    graphs, channels = module._step_graphs(), module.sparse_channels
    assert channels.capturable and graphs.pulls is not None
    ids = [mb["inputs"] for mb in step_batch(module, 0, seed=5, micro_batches=3, seq_len=SEQ)]
    for _ in range(2):  # eager, then eager + capture + a bitwise self-check
        graphs.pull(ids[0])
    assert graphs.pulls.captured() == 1 and graphs.pulls.replays == 0
    # the tables change between pulls (as the sparse events change them): a replay reads them as they are
    gen = torch.Generator(device="cuda").manual_seed(6)
    with torch.no_grad():
        for t in [channels.ngram.weight, *channels.value_embeds.params]:
            t.add_(torch.randn(t.shape, device="cuda", generator=gen).to(t.dtype))
    for x in (ids[1], ids[2], ids[0]):
        got = graphs.pull(x)
        assert all(v.grad is None for _, v in _flatten(got) if isinstance(v, torch.Tensor) and v.requires_grad)
        got = _tensors(got)
        want = _tensors(channels.inputs(x, train=True))
        assert [(n, r) for n, _, r in got] == [(n, r) for n, _, r in want]
        for (name, a, _), (_, b, _) in zip(got, want):
            assert torch.equal(a, b), name
        assert any(v.abs().sum() > 0 for n, v, _ in got if n.endswith("values"))
    assert graphs.pulls.replays == 3
    # a gradient left on a leaf by the last micro-batch is gone at the next pull
    out = graphs.pull(ids[1])
    out["ngram"].values.grad = torch.ones_like(out["ngram"].values)
    assert graphs.pull(ids[2])["ngram"].values.grad is None
    # a table that moves in memory drops the graph, which then captures again
    channels.ngram.weight = channels.ngram.weight.clone()
    with pytest.warns(UserWarning, match="tables moved"):
        graphs.begin_step()
    assert graphs.pulls.captured() == 0
    for _ in range(3):
        out = graphs.pull(ids[1])
    assert graphs.pulls.captured() == 1
    assert torch.equal(out["ngram"].values, channels.inputs(ids[1], train=True)["ngram"].values)


def test_a_new_key_is_captured_and_an_old_one_replayed():
    module = _module()
    module.apply_schedule(0)
    graphs = module._step_graphs().graphs
    mb = step_batch(module, 0, seed=4, micro_batches=1, seq_len=SEQ)[0]
    base = [_visit(module, mb) for _ in range(2)][0]
    assert len(graphs.captured_keys()) == 1
    module.set_windows(128, 256)  # new short window: a new key
    first = _visit(module, mb)
    assert len(graphs.captured_keys()) == 1
    again = _visit(module, mb)
    assert len(graphs.captured_keys()) == 2 and _rel(again[0], first[0]) <= SELF_CHECK_RTOL
    assert len(graphs._statics) == 1  # same T: the two keys share their input buffers
    long_mb = packed_micro_batch(5, 2 * SEQ, step=0)  # new T: another key
    long_mb = module.transfer_batch_to_device(module.prepare_batch([long_mb], 0), module.device, 0)[0]
    for _ in range(2):
        _visit(module, long_mb)
    assert len(graphs.captured_keys()) == 3 and len(graphs._statics) == 2
    module.set_windows(64, 256)
    replays = graphs.replays
    back = _visit(module, mb)
    assert graphs.replays == replays + 1 and len(graphs.captured_keys()) == 3
    # the first key's graph still writes its own sparse-leaf gradients, not the later keys'
    assert _rel(back[0], base[0]) <= SELF_CHECK_RTOL
    for name, g in base[2].items():
        assert _close(back[2][name], g), name
    module.set_windows(128, 256)
    assert _rel(_visit(module, mb)[0], first[0]) <= SELF_CHECK_RTOL
    assert back[0] != first[0]


def _linear_case():
    torch.manual_seed(0)
    lin = torch.nn.Linear(16, 16, device="cuda")
    x = torch.randn(8, 16, device="cuda")
    return lin, x


def _eager(lin, x, factor):
    lin.zero_grad(set_to_none=True)
    loss = (lin(x) * factor).square().mean()
    loss.backward()
    return float(loss), lin.weight.grad.clone()


def test_self_check_catches_a_forward_that_reads_a_number_outside_the_key():
    lin, x = _linear_case()
    graphs = StepGraphs(list(lin.parameters()))
    calls = [0]

    def forward(inp):
        calls[0] += 1  # a Python-side value the key does not hold: the graph bakes in one call's
        loss = (lin(inp["x"]) * float(calls[0])).square().mean()
        return loss, loss

    results = []
    for _ in range(4):
        lin.zero_grad(set_to_none=True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loss = float(graphs.run("k", {"x": x}, forward, lambda t: t.backward()))
        results.append((loss, lin.weight.grad.clone(), calls[0], [str(w.message) for w in caught]))
    check = graphs.checks["k"]
    assert not check.passed and graphs.entries["k"].eager_only and not graphs.captured_keys()
    assert any("differs from eager" in m for m in results[1][3])
    assert graphs.replays == 0
    # every result is an eager run's: visit 1 with factor 1, visit 2 the self-check's eager run
    # (factor 2; the capture took 3), then eager with 4 and 5
    for (loss, grad, _, _), factor in zip(results, (1.0, 2.0, 4.0, 5.0)):
        want_loss, want_grad = _eager(lin, x, factor)
        assert loss == pytest.approx(want_loss, rel=1e-6) and torch.allclose(grad, want_grad, rtol=1e-5, atol=1e-7)


def test_a_correct_forward_is_captured_and_replays_exactly():
    lin, x = _linear_case()
    graphs = StepGraphs(list(lin.parameters()))

    def forward(inp):
        loss = lin(inp["x"]).square().mean()
        return loss, loss

    want_loss, want_grad = _eager(lin, x, 1.0)
    for visit in range(4):
        lin.zero_grad(set_to_none=True)
        xv = x.clone()  # a new input tensor each time: the graph copies it into its buffer
        loss = float(graphs.run("k", {"x": xv}, forward, lambda t: t.backward()))
        assert loss == pytest.approx(want_loss, rel=1e-6)
        assert torch.allclose(lin.weight.grad, want_grad, rtol=1e-5, atol=1e-7)
    assert graphs.captured_keys() == ["k"] and graphs.replays == 2 and graphs.checks["k"].passed


def test_a_kept_input_is_read_in_place():
    """``keep_input``: a graph captured with a fixed buffer reads it where it is (no copy of its own);
    other inputs are still copied in before each replay."""
    lin, x = _linear_case()
    fixed = torch.randn(8, 16, device="cuda")
    graphs = StepGraphs(list(lin.parameters()), keep_input=lambda t: t is fixed)

    def forward(inp):
        loss = (lin(inp["x"]) * inp["w"]).square().mean()
        return loss, loss

    for visit in range(4):
        with torch.no_grad():
            fixed.copy_(torch.randn(8, 16, device="cuda"))  # new contents in the same buffer
        xv = x + visit  # a new tensor each visit: copied in
        lin.zero_grad(set_to_none=True)
        loss = float(graphs.run("k", {"x": xv, "w": fixed}, forward, lambda t: t.backward()))
        with torch.no_grad():  # a kept autograd graph would tie the next capture to this stream
            want = (lin(xv) * fixed).square().mean()
        assert loss == pytest.approx(float(want), rel=1e-5), visit
    static = graphs.entries["k"].static_inputs
    assert static["w"] is fixed and static["x"] is not x and graphs.replays == 2


def _raises_while_capturing(lin):
    def forward(inp):
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("not capturable")
        loss = lin(inp["x"]).square().mean()
        return loss, loss
    return forward


def _syncs(lin):
    def forward(inp):
        loss = lin(inp["x"]).square().mean()
        float(loss)  # a sync: not permitted while the stream captures; CUDA invalidates the capture
        return loss, loss
    return forward


@pytest.mark.parametrize("make_forward", [_raises_while_capturing, _syncs], ids=["raises", "syncs"])
def test_a_failing_capture_warns_and_stays_eager(make_forward):
    """A forward that raises while capturing, or one whose host sync makes CUDA invalidate the
    capture: one warning, eager from then on, and random ops still work (after an invalidated
    capture torch 2.11 leaves the CUDA generator in capture mode; ``close_failed_capture``)."""
    lin, x = _linear_case()
    graphs = StepGraphs(list(lin.parameters()))
    forward = make_forward(lin)
    want_loss, want_grad = _eager(lin, x, 1.0)
    with pytest.warns(UserWarning, match="capturing key 'k' failed"):
        for _ in range(3):
            lin.zero_grad(set_to_none=True)
            loss = float(graphs.run("k", {"x": x}, forward, lambda t: t.backward()))
            assert loss == pytest.approx(want_loss, rel=1e-6)
            assert torch.allclose(lin.weight.grad, want_grad, rtol=1e-5, atol=1e-7)
    assert graphs.entries["k"].eager_only and graphs.replays == 0
    torch.cuda.manual_seed(fresh_seed())
    state = torch.cuda.get_rng_state()
    a = torch.randn(1000, device="cuda")
    torch.cuda.set_rng_state(state)
    assert torch.equal(torch.randn(1000, device="cuda"), a) and a.std() > 0.5


def test_run_ahead_keeps_at_most_two_steps_in_flight():
    r = RunAhead(2)
    a = torch.randn(2048, 2048, device="cuda")
    for _ in range(6):
        for _ in range(5):
            a = a @ a
            a = a / a.norm()
        r.step_done(a.device)
        assert r.pending() <= 2
    torch.cuda.synchronize()


def test_memory_report_counts_what_a_graph_pool_holds():
    """``gpu_memory_gib`` (the speedrun timer's warmup line): a graph's output stays in its pool."""
    dev = torch.device("cuda")
    torch.cuda.synchronize()
    before = gpu_memory_gib(dev)
    x = torch.randn(1 << 20, device=dev)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        y = x * 2  # warm the kernel outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = torch.empty(64 << 20, device=dev).copy_(x.repeat(64))  # 256 MiB held by the graph's pool
    graph.replay()
    after = gpu_memory_gib(dev)
    assert after["graph_pools"] - before["graph_pools"] >= 0.25
    assert after["reserved"] >= after["graph_pools"] and after["peak_allocated"] >= 0.25
    assert torch.equal(y[: 1 << 20], x)
    del graph, y


def test_the_timers_state_copy_leaves_the_gpu_and_restores_exactly():
    check_state_copy_on_host("cuda", "anvil")


def test_the_timer_names_a_key_its_warmup_left_out_and_none_when_it_visits_them_all(toy_files, tmp_path):
    """A step that runs a micro-batch eagerly on the clock (a CUDA-graph key the warmup did not
    capture) is one warning and is listed in ``clock_eager_steps``; the default warmup visits every
    key, and the graphs' cu_seqlens and value-embedding rows are the sizes reserved from the run's plan."""
    from train_helpers import make_run, make_trainer, tiny_schedule

    from callbacks.speedrun_timer import SpeedrunTimer
    from nanogpt_pl.capture import graph_docs_length
    from nanogpt_pl.schedule import Stage

    def stage(steps: int, seq_len: int) -> Stage:
        return Stage(steps=steps, batch_tokens=1024, seq_len=seq_len, max_doc_len=256, window_short=64,
                     window_long=256, lr_mul=1.0, candidates=2048)

    sched = tiny_schedule(stages=[stage(4, 512), stage(4, 256)])
    for warmup, want in (([0, 1], [4]), (None, [])):
        module, data = make_run(toy_files, sched, cuda_graphs=True)
        timer = SpeedrunTimer(warmup_steps=warmup, target=0.0)
        trainer = make_trainer(tmp_path / str(warmup), callbacks=[timer], accelerator="gpu", limit_val_batches=0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(module, data)
        clock = [str(w.message) for w in caught if "eagerly on the clock" in str(w.message)]
        assert timer.clock_eager_steps == want
        assert len(clock) == len(want) and all(f"step {s} ran" in m and "T=256" in m for s, m in zip(want, clock))
        bounds = data.plan_bounds()
        docs = {key.tokens: key.max_docs for key in module._graphs.graphs.entries}
        assert docs == {T: graph_docs_length(n) for T, n in bounds.cu_seqlens.items()}
        # the value-embedding leaf of each T sized from the plan's distinct tokens, one pull graph each
        rows = {key[0][0]: key[3] for key in module._graphs.pulls.entries}
        assert rows == {T: -(-n // 64) * 64 for T, n in bounds.distinct_tokens.items()}
        # the toy chain's 512-token micro-batches hold at most 336 distinct ids: 384 rows, not 512
        assert rows[512] < 512 and module._graphs.pulls.captured() == len(rows)
