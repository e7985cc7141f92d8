"""Whole-step CUDA graphs (nanogpt_pl/capture.py), the parts that run on a CPU.

The graphs themselves need a GPU (``tests/test_capture_gpu.py``); here: which changes of a
micro-batch or of the settings make a new configuration key, that the speedrun timer's warmup
visits every key twice, the CPU fallback (the option is a no-op there, with one warning), the
device-side MTP weights of the loss, the FP8 caches that refresh in place, the gradient
bookkeeping, the run-ahead throttle and the frozen garbage collector.
"""

from __future__ import annotations

import gc
import warnings
from typing import Any

import numpy as np
import pytest
import torch
from seeds import fresh_seed

from callbacks.speedrun_timer import default_warmup_steps
from nanogpt_pl.backends import Backends
from nanogpt_pl.capture import (
    CaptureKey,
    FrozenGC,
    ModuleGraphs,
    RunAhead,
    StepGraphs,
    _bytes_equal,
    _flatten,
    _static_copy,
    _tensor_pairs,
    backward_into_grads,
    capture_key,
    cuda_graphs_active,
    max_seqlen_bound,
    pad_cu_seqlens,
    schedule_key,
)
from nanogpt_pl.data.planning import max_num_docs
from nanogpt_pl.model.embeddings import CompactRows, NgramInput
from nanogpt_pl.model.gpt import GPTConfig
from nanogpt_pl.module import AdamGroup, OptimConfig, SpeedrunModule
from nanogpt_pl.ops.cross_entropy import lm_head_loss
from nanogpt_pl.ops.fp8 import Fp8LinearState, Fp8MLPState, fp8_linear, fp8_mlp
from nanogpt_pl.ops.fp8.cache import keys_match, weight_key
from nanogpt_pl.schedule import Schedule, Stage

BOS = 50256


# -- shared helpers (also used by test_capture_gpu.py) ------------------------------------------
def every_technique_gpt(**kw) -> GPTConfig:
    """A small GPT with every technique on: FP8 everywhere, n-gram table, value embeddings, smear, skip."""
    base = dict(vocab_size=50304, num_layers=4, model_dim=64, num_heads=2, head_dim=32, mlp_hidden=128,
                long_window_layers=[3], value_embed_layers=[1, 2], skip_from=1, skip_to=3,
                fp8_mlp=True, fp8_head=True, fp8_qkv=True, ngram_rows=4096, ngram_layers=[1, 2])
    base.update(kw)
    return GPTConfig(**base)


def every_technique_schedule(steps: int = 8, seq_len: int = 512, micro_batches: int = 2) -> Schedule:
    """Sampled softmax, three MTP weights falling to two, a prefix loss; ``micro_batches`` per step on one device."""
    stage = Stage(steps=steps, batch_tokens=micro_batches * seq_len, seq_len=seq_len, max_doc_len=256,
                  window_short=64, window_long=256, lr_mul=1.0, candidates=2048, prefix_weight=0.25,
                  mtp_start=[1.0, 0.5, 0.25], mtp_end=[1.0, 0.5, 0.0])
    return Schedule(stages=[stage], warmup_steps=0, cooldown_frac=0.5, adam_every=1, untie_step=None,
                    sparse_cadence_start=10**9, attention_cap=None, val_window_short=64, val_window_long=256)


def make_module(device: str, cuda_graphs: bool, schedule: Schedule, gpt: GPTConfig, seed: int = 0,
                matrix_optimizer: str = "adamw", **module_kw) -> SpeedrunModule:
    """A SpeedrunModule driven by a plain loop (no Trainer), with a synthetic prefix table."""
    torch.manual_seed(seed)
    flat = AdamGroup(1.0, (0.9, 0.95), 0.0)
    optim = OptimConfig(matrix_optimizer=matrix_optimizer, matrix_lr=3e-3, matrix_weight_decay=0.0, adam_lr=3e-3,
                        adam_weight_decay=0.0, embed=flat, lm_head=flat, value_embeds=flat, scalars=flat,
                        ngram=AdamGroup(1.0, (0.0, 0.95), 0.0))
    module = SpeedrunModule(gpt=gpt, optim=optim, schedule=schedule, cuda_graphs=cuda_graphs, **module_kw)
    dev = torch.device(device)
    module.prepare_for_training(dev)
    module.to(dev)
    module.use_plain_optimizer(module.configure_optimizers())
    module.train()
    # the prefix loss reads a token -> prefix-token table; its contents do not matter here
    table = np.full(gpt.vocab_size, -1, dtype=np.int64)
    table[1:1000] = np.arange(1, 1000) // 2
    module._prefix = table
    return module


def packed_micro_batch(seed: int, seq_len: int, step: int, max_doc_len: int = 256, vocab: int = 1000) -> dict:
    """One packed micro-batch of random documents (BOS-led, at most ``max_doc_len`` tokens each)."""
    gen = torch.Generator().manual_seed(seed)
    lengths, total = [], 0
    while total < seq_len:
        n = min(int(torch.randint(16, max_doc_len + 1, (), generator=gen)), seq_len - total)
        lengths.append(n)
        total += n
    toks = torch.randint(1, vocab, (seq_len + 1,), generator=gen)
    bounds = torch.tensor([0] + lengths).cumsum(0)
    toks[bounds[:-1]] = BOS
    cu = torch.full((max_num_docs(seq_len),), seq_len, dtype=torch.int32)
    cu[:len(bounds)] = bounds.to(torch.int32)
    return {"inputs": toks[:-1].to(torch.int32), "targets": toks[1:].to(torch.int64), "cu_seqlens": cu,
            "max_seqlen": max(lengths), "step": step}


def step_batch(module: SpeedrunModule, step: int, seed: int, micro_batches: int, seq_len: int) -> list[dict]:
    batch = [packed_micro_batch(1000 * seed + 10 * step + a, seq_len, step) for a in range(micro_batches)]
    batch = module.prepare_batch(batch, step)
    return module.transfer_batch_to_device(batch, module.device, 0)


def train_losses(module: SpeedrunModule, steps: int, micro_batches: int, seq_len: int, seed: int = 0) -> list[float]:
    losses = []
    for step in range(steps):
        batch = step_batch(module, step, seed, micro_batches, seq_len)
        module.apply_schedule(step)
        losses.append(float(module.run_step(batch)))
    return losses


# -- configuration keys ----------------------------------------------------------------------
def _mb(tokens: int = 512, docs: int = 128, max_seqlen: int = 256, candidates=2048, prefix: bool = True,
        seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    mb = {"inputs": torch.randint(0, 1000, (tokens,), generator=gen, dtype=torch.int32),
          "targets": torch.randint(0, 1000, (tokens,), generator=gen),
          "cu_seqlens": torch.zeros(docs, dtype=torch.int32), "max_seqlen": max_seqlen}
    if candidates is not None:
        mb["candidates"] = torch.arange(candidates)
    if prefix:
        mb["prefix_targets"] = torch.randint(-1, 1000, (tokens,), generator=gen)
    return mb


def _key(mb=None, sparse=None, windows=(64, 256), scales=(0.12, 0.12), mtp=3, prefix_weight=0.25, micro=2):
    return capture_key(mb if mb is not None else _mb(), sparse, windows=windows, attn_scales=scales,
                       mtp_terms=mtp, prefix_weight=prefix_weight, micro_batches=micro)


def test_key_holds_the_record_fields_as_literals():
    key = _key()
    assert (key.tokens, key.max_docs, key.max_seqlen, key.windows, key.candidates, key.mtp_terms,
            key.prefix_weight, key.micro_batches, key.attn_scales) == (512, 128, 256, (64, 256), 2048, 3, 0.25, 2,
                                                                       (0.12, 0.12))
    assert isinstance(key, CaptureKey) and hash(key) == hash(_key())


def test_tensor_values_do_not_change_the_key():
    # new token ids, targets, candidate ids and prefix targets are copied into the graph's buffers
    assert _key(_mb(seed=1)) == _key(_mb(seed=2))


@pytest.mark.parametrize("change", [
    dict(mb=_mb(tokens=1024)),          # T
    dict(mb=_mb(docs=256)),             # cu_seqlens length (max docs)
    dict(mb=_mb(max_seqlen=512)),       # the longest document the attention is sized for
    dict(mb=_mb(candidates=4096)),      # P
    dict(mb=_mb(candidates=None)),      # full softmax
    dict(mb=_mb(prefix=False)),         # no prefix targets
    dict(windows=(128, 256)),           # short window
    dict(windows=(64, 384)),            # long window
    dict(scales=(0.12, 0.13)),          # a YaRN-adjusted softmax scale
    dict(mtp=2),                        # MTP terms (their values are a tensor input)
    dict(prefix_weight=0.2),            # prefix weight: a constant of the graph (RECORD §11)
    dict(micro=4),                      # the loss is scaled by T / micro-batches
])
def test_each_setting_the_forward_reads_as_a_number_makes_a_new_key(change):
    assert _key(**change) != _key()


def test_key_differences_name_the_fields_and_inputs_that_vary():
    graphs = StepGraphs([])
    for key in (_key(), _key(_mb(docs=256)), _key(_mb(docs=256), windows=(128, 256)), _key(_mb(seed=5))):
        graphs.entries.setdefault(key, None)
    # docs=256 changes both max_docs and the cu_seqlens shape in the layout; seed changes nothing
    assert graphs.key_differences() == {"max_docs": 2, "windows": 2, "layout:mb.cu_seqlens": 2}
    assert StepGraphs([]).key_differences() == {}


def test_cu_seqlens_pad_to_powers_of_two_and_never_shrink():
    cu = torch.tensor([0, 5, 9, 16, 16], dtype=torch.int32)
    assert pad_cu_seqlens(cu).tolist() == [0, 5, 9, 16, 16, 16, 16, 16]
    assert pad_cu_seqlens(cu, at_least=16).tolist() == [0, 5, 9, 16] + [16] * 12
    full = torch.arange(0, 129, dtype=torch.int32)
    assert torch.equal(pad_cu_seqlens(full[:128]), full[:128])  # a power of two already
    assert pad_cu_seqlens(full).numel() == 256  # 129 entries -> 256


@pytest.mark.filterwarnings("ignore:model.gpt.fp8_qkv:UserWarning")
@pytest.mark.parametrize("seed", [2, 9])
def test_padded_cu_seqlens_leave_the_loss_and_gradients_unchanged(seed, one_thread):
    # zero-length segments at the end change nothing the model computes (the record network's
    # rotary positions, attention masks, paired doubling and MUDD read cu_seqlens)
    import yaml

    spec = yaml.safe_load(open("configs/speedrun.yaml"))["model"]["gpt"]
    gpt = GPTConfig(**{**spec, "vocab_size": 50304, "model_dim": 96, "head_dim": 16, "mlp_hidden": 64,
                       "ngram_rows": 4096})
    module = make_module("cpu", False, every_technique_schedule(steps=2, seq_len=256), gpt, seed=seed,
                         backends=Backends(fp8="reference"))
    module.apply_schedule(0)
    mb = step_batch(module, 0, seed=seed, micro_batches=1, seq_len=256)[0]
    out = []
    for cu in (mb["cu_seqlens"], pad_cu_seqlens(mb["cu_seqlens"], at_least=4 * mb["cu_seqlens"].numel())):
        module.model.zero_grad(set_to_none=True)
        sparse = module.sparse_channels.inputs(mb["inputs"], train=True)
        loss = module._micro_loss({**mb, "cu_seqlens": cu}, sparse)
        loss.backward()
        out.append((loss.detach(), [p.grad.clone() for p in module.model.parameters() if p.grad is not None]))
    assert out[0][0] == out[1][0]
    assert len(out[0][1]) == len(out[1][1]) and all(torch.equal(a, b) for a, b in zip(out[0][1], out[1][1]))


def check_state_copy_on_host(device: str, matrix_optimizer: str) -> None:
    """``capture_state`` (what the speedrun timer holds through its warmup) keeps its tensors in
    host memory, apart from the live ones, and ``restore_state`` puts them back exactly."""
    seq = 256
    module = make_module(device, False, every_technique_schedule(steps=4, seq_len=seq), every_technique_gpt(),
                         matrix_optimizer=matrix_optimizer, backends=Backends(fp8="reference" if device == "cpu"
                                                                              else "auto"))
    train_losses(module, 1, micro_batches=2, seq_len=seq)  # optimizer state exists
    live = {n: p.detach().clone() for n, p in module.model.named_parameters()}
    snap = module.capture_state()
    held = [t for part in ("model", "optimizer") for _, t in _flatten(snap[part]) if isinstance(t, torch.Tensor)]
    assert len(held) > len(live)
    assert all(t.device.type == "cpu" for t in held)
    ptrs = {p.data_ptr() for p in module.model.parameters()}
    assert not any(t.data_ptr() in ptrs for t in held)
    assert hasattr(snap["model"], "_metadata")
    after_one = train_losses(module, 2, micro_batches=2, seq_len=seq, seed=5)
    assert any(not torch.equal(p, live[n]) for n, p in module.model.named_parameters())
    table = module._prefix
    module.restore_state(snap)
    assert module._prefix is None  # RECORD §11: the timed run rebuilds it on the clock
    module._prefix = table  # make_module's synthetic table, not the tokenizer's
    for n, p in module.model.named_parameters():
        assert p.device.type == torch.device(device).type and torch.equal(p.detach(), live[n]), n
    # the restored run takes the same steps again
    assert train_losses(module, 2, micro_batches=2, seq_len=seq, seed=5) == after_one


@pytest.mark.parametrize("matrix_optimizer", ["anvil", "adamw"])
def test_the_timers_state_copy_is_on_the_host_and_restores_exactly(matrix_optimizer, one_thread):
    check_state_copy_on_host("cpu", matrix_optimizer)


def test_prefix_weight_zero_is_off_and_sparse_leaf_shapes_are_in_the_key():
    assert _key(prefix_weight=0.0).prefix_weight == 0.0
    values = torch.zeros(1024, 64, requires_grad=True)
    ngram = NgramInput(values=values, index=torch.zeros(2, 512, dtype=torch.long),
                       sign_rows=torch.zeros(2, 512, dtype=torch.long))
    a = _key(sparse={"ngram": ngram})
    b = _key(sparse={"ngram": NgramInput(values=torch.zeros(2048, 64, requires_grad=True), index=ngram.index,
                                         sign_rows=ngram.sign_rows)})
    assert a != b and a != _key() and a == _key(sparse={"ngram": ngram})


def test_max_seqlen_bound_is_the_stage_document_cap():
    sched = Schedule()  # the record's stages (RECORD §9): caps 896, 2048, 3072; attention split 2560 (§1)
    assert max_seqlen_bound(sched, {"inputs": torch.zeros(16384), "step": 0}) == 896
    assert max_seqlen_bound(sched, {"inputs": torch.zeros(32768), "step": 400}) == 2048
    assert max_seqlen_bound(sched, {"inputs": torch.zeros(49152), "step": 700}) == 2560
    assert max_seqlen_bound(sched, {"inputs": torch.zeros(512)}) == 512  # no step: at most T
    assert max_seqlen_bound(None, {"inputs": torch.zeros(512), "step": 3}) == 512


def test_warmup_visits_every_key_twice_within_the_budget():
    sched = Schedule()
    steps = default_warmup_steps(sched, limit=40)
    first: dict = {}
    for s in range(sched.total_steps):
        first.setdefault(schedule_key(sched, s), s)
    # RECORD §11: keys first seen at steps 0, 320, 411, 501, 591, 681, 965, 1107, 1174 (411, 501 and
    # 591 are the prefix-weight quarters); ours also drops an MTP weight at 319 and 680
    assert {0, 320, 411, 501, 591, 681, 965, 1107, 1174} <= set(first.values())
    for key, s in first.items():
        assert s in steps
        if s + 1 < sched.total_steps and schedule_key(sched, s + 1) == key:
            assert s + 1 in steps  # the second visit: capture, then self-check
    assert len(steps) <= 40  # RECORD §11: a budget of 40 untimed steps (the record uses 37)
    assert default_warmup_steps(sched, limit=40) == steps


# -- CPU fallback ----------------------------------------------------------------------------
def test_cuda_graphs_on_cpu_is_a_no_op_with_one_warning():
    with pytest.warns(UserWarning, match="model.cuda_graphs: true has no effect on cpu"):
        assert not cuda_graphs_active(True, torch.device("cpu"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not cuda_graphs_active(False, torch.device("cpu"))


@pytest.mark.filterwarnings("ignore:model.gpt.fp8_qkv:UserWarning")
def test_module_with_cuda_graphs_on_cpu_trains_exactly_like_eager(one_thread):
    sched = every_technique_schedule(steps=3, seq_len=256)
    gpt = every_technique_gpt()
    reference = Backends(fp8="reference")
    with pytest.warns(UserWarning, match="model.cuda_graphs"):
        on = make_module("cpu", True, sched, gpt, backends=reference)
    off = make_module("cpu", False, sched, gpt, backends=reference)
    assert on._step_graphs() is None and on.sparse_channels.fixed_shapes is False
    a = train_losses(on, 3, 2, 256)
    b = train_losses(off, 3, 2, 256)
    assert a == b
    for (name, p), q in zip(on.model.named_parameters(), off.model.parameters()):
        assert torch.equal(p, q), name


def _parameters_with_live_graphs(module) -> set[str]:
    """Names of the parameters whose AccumulateGrad node some live tensor's autograd graph reaches."""
    names = {id(p): n for n, p in module.named_parameters()}
    found, seen = set(), set()
    for obj in gc.get_objects():
        try:
            fn = obj.grad_fn if isinstance(obj, torch.Tensor) else None
        except RuntimeError:  # a view made with grad off whose base changed since: no graph of its own
            fn = None
        stack = [fn]
        while stack:
            fn = stack.pop()
            if fn is None or id(fn) in seen:
                continue
            seen.add(id(fn))
            if type(fn).__name__ == "AccumulateGrad" and id(fn.variable) in names:
                found.add(names[id(fn.variable)])
            stack.extend(f for f, _ in fn.next_functions)
    return found


@pytest.mark.filterwarnings("ignore:model.gpt.fp8_qkv:UserWarning")
def test_an_eager_step_leaves_no_autograd_graph_alive(one_thread):
    # A parameter's AccumulateGrad node belongs to the stream it was made on; one kept past the
    # step (the FP8 QKV state once held its row-block views, made with grad on) makes the next
    # capture on the graphs' side stream sync with that stream, and CUDA invalidates the capture.
    sched = every_technique_schedule(steps=2, seq_len=256)
    module = make_module("cpu", False, sched, every_technique_gpt(), backends=Backends(fp8="reference"))
    train_losses(module, 1, 2, 256)
    gc.collect()
    assert _parameters_with_live_graphs(module) == set()
    states = [m.fp8_state for m in module.model.modules() if hasattr(m, "fp8_state")]
    assert states and all(r.build().grad_fn is None for st in states for r in st._last_call[0])
    # the remade row blocks still identify the weights: the step's update makes the caches stale
    # once, and a second refresh without another update is a no-op
    for _ in range(2):  # as the CUDA graphs call it: before every micro-batch, caches held in place
        for st in states:
            st.hold_cache_addresses(True)
        assert all(st.refresh_cache() for st in states)
        assert not any(st.refresh_cache() for st in states)
        train_losses(module, 1, 2, 256)


# -- the engine's bookkeeping ------------------------------------------------------------------
def test_static_copies_keep_the_layout_and_leaves():
    ngram = NgramInput(values=torch.randn(6, 4).requires_grad_(), index=torch.arange(10).view(2, 5),
                       sign_rows=torch.ones(2, 5, dtype=torch.long), rows=torch.arange(6))
    ve = CompactRows(values=torch.randn(2, 3, 4).requires_grad_(), index=torch.arange(5), ids=torch.arange(3))
    live = {"mb": {"inputs": torch.arange(5), "max_seqlen": 5}, "sparse": {"ngram": ngram, "value_rows": ve}}
    static = _static_copy(live)
    names = [n for n, _ in _flatten(live)]
    assert names == [n for n, _ in _flatten(static)]
    pairs = _tensor_pairs(static, live)
    assert len(pairs) == 8  # inputs; values, index, sign_rows, rows; values, index, ids
    for s, v in pairs:
        assert s is not v and torch.equal(s, v) and s.requires_grad == v.requires_grad
        assert s.data_ptr() != v.data_ptr()
    assert static["sparse"]["ngram"].values.is_leaf and static["mb"]["max_seqlen"] == 5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graph_self_checks_compare_bytes_so_a_nan_matches_itself(dtype):
    """The capture self-checks (pull, refresh, Adam update) compare bytes: ``torch.equal`` calls a
    NaN unequal to itself, which would turn a bit-exact replay of a NaN into a failed check."""
    g = torch.Generator().manual_seed(int(torch.randint(1 << 30, ())))
    a = torch.randn(5, 7, generator=g).to(dtype)
    a[1, 3] = float("nan")
    b = a.clone()
    assert not torch.equal(a, b) and _bytes_equal(a, b)
    assert _bytes_equal(a.t(), b.t())  # a strided view compares by its elements
    b.view(torch.int16 if dtype == torch.bfloat16 else torch.int32)[1, 3] += 1  # another NaN payload
    assert b[1, 3].isnan() and not _bytes_equal(a, b)
    c = a.clone()
    c[0, 0] = 0.0
    d = c.clone()
    d[0, 0] = -0.0  # equal as numbers, different bits
    assert torch.equal(c.nan_to_num(), d.nan_to_num()) and not _bytes_equal(c, d)
    assert not _bytes_equal(a, a.float() if dtype != torch.float32 else a.double())


def test_gradient_buffers_follow_eager_none_semantics():
    a, b = torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(2))
    graphs = StepGraphs([a, b])
    graphs.grads = {id(a): torch.full((3,), 7.0), id(b): torch.full((2,), 7.0)}
    b.grad = torch.tensor([1.0, 2.0])  # accumulated by an eager micro-batch earlier in the step
    graphs._attach([a, b])
    assert a.grad is graphs.grads[id(a)] and torch.equal(a.grad, torch.zeros(3))  # first use: zeroed
    assert b.grad is graphs.grads[id(b)] and torch.equal(b.grad, torch.tensor([1.0, 2.0]))  # kept
    graphs.grads[id(a)].add_(1.0)
    graphs._attach([a])  # already attached this step: accumulated as it is
    assert torch.equal(a.grad, torch.ones(3))
    c = torch.nn.Parameter(torch.randn(1))
    assert c.grad is None  # a parameter no key used keeps None (optimizers skip it)


def test_fresh_gradient_buffers_are_zeroed_one_launch_per_dtype(monkeypatch, random_seed):
    # CUDA's _foreach_zero_ takes its one-kernel route only for a list of one dtype; a mixed list
    # falls back to a fill per tensor, so _attach groups the step's fresh buffers by dtype
    params = [torch.nn.Parameter(torch.randn(4, 3).to(dt)) for dt in (torch.bfloat16, torch.float32) * 3]
    graphs = StepGraphs(params)
    graphs.grads = {id(p): torch.randn_like(p) for p in params}
    params[2].grad = torch.randn_like(params[2])  # accumulated eagerly earlier in the step: copied, not zeroed
    kept = params[2].grad.clone()
    calls = []
    real = torch._foreach_zero_
    monkeypatch.setattr(torch, "_foreach_zero_", lambda ts: (calls.append(list(ts)), real(ts)))
    graphs._attach(params)
    assert sorted((len(c), c[0].dtype) for c in calls) == [(2, torch.bfloat16), (3, torch.float32)]
    assert all(len({t.dtype for t in c}) == 1 for c in calls)
    for i, p in enumerate(params):
        assert p.grad is graphs.grads[id(p)]
        assert torch.equal(p.grad, kept if i == 2 else torch.zeros_like(p))


def test_backward_into_grads_accumulates_autograds_bits_into_the_same_buffers(random_seed, one_thread):
    # the record network (every layer kind, FP8 reference layers, n-gram and value embeddings):
    # two micro-batches through autograd's own accumulation against the captured form, which
    # sets every .grad aside, runs the backward and folds the fresh gradients in with one add
    import yaml

    spec = yaml.safe_load(open("configs/speedrun.yaml"))["model"]["gpt"]
    gpt = GPTConfig(**{**spec, "vocab_size": 50304, "model_dim": 96, "head_dim": 16, "mlp_hidden": 64,
                       "ngram_rows": 4096})
    seed = random_seed
    module = make_module("cpu", False, every_technique_schedule(steps=2, seq_len=256), gpt, seed=seed % 1000,
                         backends=Backends(fp8="reference"))
    module.apply_schedule(0)
    mbs = step_batch(module, 0, seed=seed, micro_batches=2, seq_len=256)
    params = [p for p in module.model.parameters() if p.requires_grad]

    def micro(mb):
        sparse = module.sparse_channels.inputs(mb["inputs"], train=True)
        return module._micro_loss(mb, sparse)

    module.model.zero_grad(set_to_none=True)
    for mb in mbs:
        micro(mb).backward()
    reference = [None if p.grad is None else p.grad.clone() for p in params]
    assert sum(g is not None for g in reference) > 20

    module.model.zero_grad(set_to_none=True)
    # persistent buffers for every other parameter the backward reaches (as _attach gives them);
    # the rest start at None, and one unreached parameter holds a gradient it must keep
    buffers = {id(p): torch.zeros_like(p) for i, (p, g) in enumerate(zip(params, reference))
               if g is not None and i % 2 == 0}
    for p in params:
        p.grad = buffers.get(id(p))
    unreached = [p for p, g in zip(params, reference) if g is None]
    kept = {id(p): torch.full_like(p, 3.0) for p in unreached[:1]}
    for p in unreached[:1]:
        p.grad = kept[id(p)]
    for mb in mbs:
        backward_into_grads(lambda mb=mb: micro(mb).backward(), params)
    for p, ref in zip(params, reference):
        if id(p) in buffers:
            assert p.grad is buffers[id(p)]  # the graph's buffer, not a new tensor
        if id(p) in kept:
            assert p.grad is kept[id(p)] and torch.equal(p.grad, torch.full_like(p, 3.0))
        elif ref is None:
            assert p.grad is None
        else:
            assert torch.equal(p.grad, ref)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_backward_into_grads_matches_autograd_in_low_precision_and_for_sparse_gradients(dtype, monkeypatch):
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    w = torch.nn.Parameter(torch.randn(64, 48, generator=gen).to(dtype))
    v = torch.nn.Parameter(torch.randn(48, 64, generator=gen).to(dtype).t())  # a transposed parameter
    gain = torch.nn.Parameter(torch.randn(48, generator=gen))  # fp32 beside the others, as the scalars are
    emb = torch.nn.Embedding(100, 48, sparse=True).to(dtype)
    ids = [torch.randint(0, 100, (32,), generator=gen) for _ in range(3)]
    xs = [torch.randn(32, 64, generator=gen).to(dtype) for _ in range(3)]
    params = [w, v, gain, emb.weight]

    def loss(i):
        return ((xs[i] @ (w + v) * gain + emb(ids[i])).float() ** 2).mean()

    for p in params:
        p.grad = None
    for i in range(3):
        loss(i).backward()
    ref = [w.grad.clone(), v.grad.clone(), gain.grad.clone(), emb.weight.grad.coalesce().to_dense()]
    bufs = [torch.zeros_like(p) for p in (w, v, gain)]
    w.grad, v.grad, gain.grad, emb.weight.grad = *bufs, None
    calls = []
    foreach_add = torch._foreach_add_

    def recording(dst, src):
        calls.append({t.dtype for t in dst + src})
        return foreach_add(dst, src)

    monkeypatch.setattr(torch, "_foreach_add_", recording)
    for i in range(3):
        backward_into_grads(lambda i=i: loss(i).backward(), params)
    for p, buf, r in zip((w, v, gain), bufs, ref):
        assert p.grad is buf and torch.equal(buf, r), seed  # bit for bit, also in bf16
    assert v.grad.stride() == v.stride()
    assert emb.weight.grad.is_sparse and torch.equal(emb.weight.grad.coalesce().to_dense(), ref[3]), seed
    # one multi-tensor add per dtype and micro-batch (the kernels take one dtype a call)
    assert all(len(c) == 1 for c in calls) and len(calls) == (2 if dtype != torch.float32 else 1) * 3, calls
    buf = bufs[0]

    # a backward that fails puts every .grad back untouched
    held = buf.clone()
    sparse_grad = emb.weight.grad

    def failing():
        loss(0).backward()
        raise RuntimeError("backward failed")

    with pytest.raises(RuntimeError, match="backward failed"):
        backward_into_grads(failing, params)
    assert w.grad is buf and torch.equal(buf, held) and emb.weight.grad is sparse_grad


# -- the loss with device-side MTP weights ---------------------------------------------------------
@pytest.mark.parametrize("backend", ["reference", "chunked"])
@pytest.mark.parametrize("seed", [0, 5])
def test_mtp_weights_as_a_tensor_give_the_same_loss_and_gradients(backend, seed, one_thread):
    gen = torch.Generator().manual_seed(seed)
    n, d, v = 96, 16, 300
    hidden = torch.randn(n, d, generator=gen)
    weight = torch.randn(v, d, generator=gen) * 0.3
    targets = torch.randint(0, v, (n,), generator=gen)
    prefix = torch.randint(-1, v, (n,), generator=gen)
    cands = torch.unique(torch.cat([targets, torch.randint(0, v, (64,), generator=gen)]))
    weights = [1.0, 0.5 + 0.1 * seed, 0.125]
    out = []
    for w in (weights, torch.tensor(weights)):
        h = hidden.clone().requires_grad_()
        wt = weight.clone().requires_grad_()
        loss = lm_head_loss(h, wt, targets, candidates=cands, mtp_weights=w, prefix_targets=prefix,
                            prefix_weight=0.25, backend=backend)
        loss.backward()
        out.append((loss.detach(), h.grad, wt.grad))
    for x, y in zip(*out):
        assert torch.equal(x, y)


# -- FP8 caches that keep their addresses ----------------------------------------------------------
def test_fp8_linear_cache_refreshes_in_place_when_held(one_thread):
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(32, 16))
    x = torch.randn(8, 16)
    held, plain = Fp8LinearState(backend="reference"), Fp8LinearState(backend="reference")
    held.hold_cache_addresses(True)
    assert held.refresh_cache() is False  # nothing to refresh before the first call
    fp8_linear(x, w, held)
    fp8_linear(x, w, plain)
    ptrs = [t.data_ptr() for t in held.cache_tensors()]
    assert held.refresh_cache() is False  # fresh: nothing to do
    with torch.no_grad():
        w.add_(0.5 * torch.randn_like(w))  # an optimizer step (bumps the version)
    assert held.refresh_cache() is True
    assert [t.data_ptr() for t in held.cache_tensors()] == ptrs
    y_held, y_plain = fp8_linear(x, w, held), fp8_linear(x, w, plain)
    assert torch.equal(y_held, y_plain)
    assert torch.equal(held.cache_tensors()[0].float(), plain.cache_tensors()[0].float())


def test_fp8_mlp_caches_refresh_in_place_with_the_delayed_scales(one_thread):
    torch.manual_seed(1)
    w1, w2 = torch.nn.Parameter(torch.randn(64, 16) * 0.2), torch.nn.Parameter(torch.randn(64, 16) * 0.2)
    held, plain = Fp8MLPState(backend="reference"), Fp8MLPState(backend="reference")
    held.hold_cache_addresses(True)
    for step in range(3):
        x = torch.randn(8, 16)
        ptrs = [t.data_ptr() for t in held.cache_tensors()]
        held.refresh_cache()  # what the graphs do before a replay
        if step:
            assert [t.data_ptr() for t in held.cache_tensors()] == ptrs
        a, b = fp8_mlp(x, w1, w2, held), fp8_mlp(x, w1, w2, plain)
        assert torch.equal(a, b)
        a.square().sum().backward()
        b.square().sum().backward()
        with torch.no_grad():
            for p in (w1, w2):
                p.sub_(0.1 * p.grad.sign())
                p.grad = None
    for name in ("post_scale", "dpre_scale", "w1_scale", "w2_scale", "refresh_count"):
        assert torch.equal(getattr(held, name), getattr(plain, name)), name


# -- host side --------------------------------------------------------------------------------------
def test_run_ahead_is_a_no_op_off_cuda_and_rejects_a_zero_depth():
    r = RunAhead()
    assert r.depth == 2  # RECORD §11: host run-ahead is throttled to 2 steps
    for _ in range(5):
        r.step_done(torch.device("cpu"))
    assert r.pending() == 0
    with pytest.raises(ValueError, match="at least 1"):
        RunAhead(0)


def test_frozen_gc_pauses_and_restores_exactly():
    was = gc.isenabled()
    try:
        gc.enable()
        f = FrozenGC()
        f.pause()
        f.pause()  # idempotent
        assert not gc.isenabled() and gc.get_freeze_count() > 0 and f.paused
        f.resume()
        f.resume()
        assert gc.isenabled() and gc.get_freeze_count() == 0 and not f.paused
        gc.disable()  # a caller that had it off gets it back off
        f.pause()
        f.resume()
        assert not gc.isenabled()
    finally:
        gc.unfreeze()
        (gc.enable if was else gc.disable)()


# -- the Lightning side: GC frozen on the clock, the loss read on the host only when logged ----------
def test_timed_steps_run_without_gc_and_the_loss_is_logged_at_log_steps(tmp_path):
    import csv

    import lightning as L
    from lightning.pytorch.loggers import CSVLogger
    from train_helpers import LossRecorder, make_run, make_trainer, tiny_schedule, write_markov_shards

    from callbacks.speedrun_timer import SpeedrunTimer

    class Probe(L.Callback):
        def __init__(self) -> None:
            self.enabled: list[bool] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.enabled.append(gc.isenabled())

    files = write_markov_shards(tmp_path / "data", n_train=60_000, n_val=8_000)
    module, data = make_run(files, tiny_schedule(6))
    probe, rec = Probe(), LossRecorder()
    trainer = make_trainer(tmp_path, callbacks=[SpeedrunTimer(warmup_steps=[]), probe, rec],
                           logger=CSVLogger(tmp_path, name="csv"), log_every_n_steps=2)
    was = gc.isenabled()
    gc.enable()
    try:
        trainer.fit(module, data)
        assert probe.enabled == [False] * 6  # RECORD §11: the GC is disabled for the timed loop
        assert gc.isenabled() and gc.get_freeze_count() == 0  # and restored when the clock stops
    finally:
        (gc.enable if was else gc.disable)()
    rows = list(csv.DictReader(open(next((tmp_path / "csv").glob("*/metrics.csv")))))
    logged = {int(r["step"]): float(r["train/loss"]) for r in rows if r.get("train/loss")}
    assert sorted(logged) == [1, 3, 5]  # every log_every_n_steps (and the last step), not every step
    for step, value in logged.items():
        assert value == pytest.approx(rec.losses[step], rel=1e-6)
    assert all(r.get("schedule/lr_mul") and r.get("lr/matrix") for r in rows if r.get("train/loss"))


def counted_compiled_module(schedule: Schedule) -> tuple[SpeedrunModule, Any]:
    """A module with ``model.compile`` whose model compiles (as the module's own ``nn.Module.compile``,
    ``dynamic=False``) through a backend that counts the frames it compiles; dynamo starts fresh."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()  # no compiled code or per-code state from earlier tests
    gpt = every_technique_gpt(ngram_rows=0, ngram_layers=[])
    with torch._dynamo.config.patch(recompile_limit=torch._dynamo.config.recompile_limit):  # restored after
        module = make_module("cpu", False, schedule, gpt, compile=True)
    counter = CompileCounterWithBackend("aot_eager")
    module.model._compiled_call_impl = torch.compile(module.model._call_impl, backend=counter, dynamic=False)
    return module, counter


def test_model_compile_keeps_one_graph_as_the_padded_document_count_grows(one_thread):
    """cu_seqlens is padded to a power of two that grows with a micro-batch's documents; with
    ``model.compile`` each new length was a recompile of the whole model (the FP8 layers in the
    graph). The module marks its length dynamic: one frame for three lengths, same losses."""
    module, counter = counted_compiled_module(every_technique_schedule())
    module.apply_schedule(0)
    mb = step_batch(module, 0, 3, 1, 512)[0]
    base = mb["cu_seqlens"].numel()
    losses = []
    for extra in (0, base, 3 * base):
        padded = dict(mb, cu_seqlens=pad_cu_seqlens(mb["cu_seqlens"], base + extra))
        assert padded["cu_seqlens"].numel() >= base + extra
        module.model.zero_grad(set_to_none=True)
        loss = module._micro_loss(padded)
        loss.backward()
        losses.append(loss.detach())
    torch._dynamo.reset()  # dynamo keeps per-code state (dynamic dimensions seen) for later compiles
    assert counter.frame_count == 1
    assert losses[1] == pytest.approx(losses[0].item(), rel=1e-6)
    assert losses[2] == pytest.approx(losses[0].item(), rel=1e-6)


def test_model_compile_keeps_one_graph_whatever_a_batchs_longest_segment():
    """``max_seqlen`` is an int the compiled model specializes on. Each micro-batch's own longest
    segment was a recompile of the whole model in every eager step with ``model.compile`` (capture
    off: on an H100 a 330-step run spent its minutes recompiling), and in every validation batch.
    Training takes the stage's bound, as the CUDA graphs do; validation T. The bound changes
    nothing the model computes."""
    module, counter = counted_compiled_module(every_technique_schedule())
    module.apply_schedule(0)
    seed = fresh_seed()
    micro = [step_batch(module, 0, seed + i, 1, 512)[0] for i in range(3)]
    assert len({mb["max_seqlen"] for mb in micro}) > 1, seed
    for mb in micro:
        module._micro_loss(mb).backward()
    assert counter.frame_count == 1, seed
    # validation: batches whose longest documents differ share one graph (its windows are the validation's)
    module.log = lambda *a, **k: None  # no trainer here
    frames = counter.frame_count
    for n in (300, 400, 200):
        module.validation_step(dict(micro[0], max_seqlen=n), 0)
    assert counter.frame_count == frames + 1, seed
    torch._dynamo.reset()
    # the bound is the kernels' grid and the rotary table's reach: the same hidden states, bit for bit,
    # also past the rotary tables (built for the schedule's longest T, 512), where the rows are computed
    plain = make_module("cpu", False, every_technique_schedule(), every_technique_gpt(ngram_rows=0, ngram_layers=[]))
    plain.apply_schedule(0)
    # the micro-batch with the shortest longest segment: a draw's longest can reach the bound itself
    # (a seed gave 256 of 256), and the comparison needs one below it
    mb = min(micro, key=lambda m: m["max_seqlen"])
    bound = max_seqlen_bound(plain.schedule, mb)
    assert bound > mb["max_seqlen"], (bound, mb["max_seqlen"])
    assert max(rot.cos_table.shape[0] for rot in plain.model.rotaries.values()) < 2 * 4096
    with torch.no_grad():
        outs = [plain._forward(mb["inputs"], mb["cu_seqlens"], n, plain.settings.windows, {})
                for n in (mb["max_seqlen"], bound, 512, 4096)]
    assert all(torch.equal(outs[0], o) for o in outs[1:]), seed


def test_compiled_eager_steps_compile_the_model_once_per_stage(one_thread):
    """With ``model.compile`` and no CUDA graphs (capture off, or a CPU), whole training steps with
    fresh data, MTP weights that change every step and optimizer updates in between compile the
    model once: nothing a step feeds it besides the tensors changes its guards."""
    module, counter = counted_compiled_module(every_technique_schedule(steps=4))
    losses = train_losses(module, steps=4, micro_batches=2, seq_len=512, seed=fresh_seed())
    torch._dynamo.reset()
    assert counter.frame_count == 1 and all(np.isfinite(losses)), (counter.frame_count, losses)


def test_model_compile_raises_dynamos_recompile_limit_for_the_layer_kinds():
    """At dynamo's default of 8 recompiles per frame, one stage of the record network on the H200
    sent attention frames back to eager (``hit config.recompile_limit (8)``, BENCHMARKS.md)."""
    import torch._dynamo

    from nanogpt_pl.module import COMPILE_RECOMPILE_LIMIT

    before = torch._dynamo.config.recompile_limit  # 64 if an earlier test in this process compiled a module
    gpt = every_technique_gpt(fp8_mlp=False, fp8_head=False, fp8_qkv=False)
    # config.patch restores the setting afterwards (pytest's monkeypatch would delete, i.e.
    # hide, a torch config entry on undo)
    with torch._dynamo.config.patch(recompile_limit=8):
        module = make_module("cpu", False, every_technique_schedule(), gpt, compile=True)
        assert torch._dynamo.config.recompile_limit == COMPILE_RECOMPILE_LIMIT == 64
        assert module.model._compiled_call_impl is not None  # compiled in place (nn.Module.compile)
    with torch._dynamo.config.patch(recompile_limit=8):
        plain = make_module("cpu", False, every_technique_schedule(), gpt)
        assert plain.model._compiled_call_impl is None and torch._dynamo.config.recompile_limit == 8
    assert torch._dynamo.config.recompile_limit == before  # restored, as the other tests expect


def test_a_committed_refresh_leaves_the_host_record_a_real_refresh_leaves(one_thread):
    """After a refresh graph's replay, ``commit_refresh`` does a refresh's host side: for every layer
    an optimizer step made stale, the cache key, kernel, count and check record equal what
    ``refresh_now`` leaves, and the layer is no longer stale. ``RefreshGraphs`` keys its graphs by
    the stale layers and each one's variant: the MLP's exact-scale bootstrap, then lagged scales."""
    module = make_module("cpu", False, every_technique_schedule(steps=6, seq_len=256, micro_batches=2),
                         every_technique_gpt())
    module.apply_schedule(0)
    module.run_step(step_batch(module, 0, 1, 2, 256))
    graphs = ModuleGraphs(module)
    states = graphs.fp8_states
    mlps = [st for st in states if isinstance(st, Fp8MLPState)]
    assert mlps and len(mlps) < len(states)
    for st in mlps:
        st.exact_weight_refreshes = st._refreshes + 3  # three more exact refreshes, then lagged ones
    graphs._refresh_fp8()  # the step changed every weight: the first (exact) refresh
    module.run_step(step_batch(module, 1, 1, 2, 256))  # the optimizer changes every weight
    stale = [st for st in states if st.stale()]
    assert stale == states
    for st in stale:
        before = st.host_state()
        st.refresh_now()
        real = st.host_state()
        st.set_host_state(before)
        st.commit_refresh()
        got = st.host_state()
        assert keys_match(got[0], tuple(weight_key(r.build()) for r in st._last_call[0]))
        assert keys_match(real[0], tuple(weight_key(r.build()) for r in st._last_call[0]))
        assert got[1:3] == real[1:3] and real[2] == before[2] + 1
        assert got[3][0] is real[3][0] and got[3][2] == real[3][2]  # the same last call and weight versions
        assert not st.stale()
    refresh = graphs.refresh
    assert refresh is not None and refresh.eager_runs == 1  # the second refresh was the one above
    variants = []
    for step in range(2, 6):
        module.run_step(step_batch(module, step, 1, 2, 256))
        graphs._refresh_fp8()
        assert not any(st.stale() for st in states)
        variants.append({v for _, v in list(refresh.entries)[-1]})
    # off a GPU every refresh is eager; the keys name every layer and the bootstrap's end
    assert refresh.eager_runs == 5 and refresh.replays == 0
    assert variants == [{(), (True,)}, {(), (False,)}, {(), (False,)}, {(), (False,)}]
    assert [e.visits for e in refresh.entries.values()] == [2, 3]
    assert all(len(k) == len(states) for k in refresh.entries)


def test_fp8_staleness_checks_are_skipped_only_while_nothing_they_read_changed(one_thread):
    """Before a micro-batch, ``ModuleGraphs`` asks every FP8 layer to check its cache; a layer runs the
    check only when a weight it reads (its address or version), its last call or its cache key
    changed since its last check. After every call, no layer's cache is stale."""
    module = make_module("cpu", False, every_technique_schedule(steps=3, seq_len=256, micro_batches=2),
                         every_technique_gpt())
    module.apply_schedule(0)
    module.run_step(step_batch(module, 0, 1, 2, 256))  # every FP8 layer has run once (its last call)
    graphs = ModuleGraphs(module)
    # every layer's state: the eight matrix layers' and the head's (the fused loss runs its GEMMs)
    states = [st for st in graphs.fp8_states if st._last_call is not None]
    assert len(states) == len(graphs.fp8_states) == 9

    def stale(st) -> bool:  # the check itself, on the weights of the last call, without the skip
        return not keys_match(st._cache_key, tuple(weight_key(r.build()) for r in st._last_call[0]))

    def check(checked: set[int]) -> list[int]:
        """Run the graphs' refresh; exactly the states in ``checked`` run their check."""
        before = [st.checks_skipped for st in states]
        graphs._refresh_fp8()
        assert [st.checks_skipped - b for st, b in zip(states, before)] == [
            int(i not in checked) for i in range(len(states))]
        assert not any(stale(st) for st in states)  # nothing left stale
        return [st._refreshes for st in states]

    every = set(range(len(states)))
    base = check(every)  # the first call checks every layer
    assert check(set()) == base
    weight = states[0]._last_call[0][0].tensor
    with torch.no_grad():
        weight.add_(0.01)  # an optimizer's in-place update: the version moves
    after = check({0})
    assert after[0] == base[0] + 1 and after[1:] == base[1:]
    assert check(set()) == after
    states[1].invalidate()
    again = check({1})
    assert again[1] == after[1] + 1
    weight.data = weight.data.clone()  # same values and version, another address
    check({0})
    module.run_step(step_batch(module, 1, 1, 2, 256))  # a whole step, optimizer included
    check(every)
    check(set())


def test_reserved_cu_seqlens_give_every_micro_batch_of_a_length_one_shape_in_any_order(one_thread):
    """Padding only grows, so without a reservation the length a key is captured with depends on the
    micro-batches before it: a warmup that visits steps out of order captured keys at lengths the run
    had outgrown by then, and the run captured them again on the clock (on one H100, out of memory
    at step 965 of speedrun_1gpu.yaml). Reserved from the run's plan, the order no longer matters."""
    module = make_module("cpu", False, every_technique_schedule(steps=2, seq_len=256, micro_batches=2),
                         every_technique_gpt())
    torch.manual_seed(fresh_seed())
    counts = {256: [3, 40, 9, 130, 17, 66], 512: [5, 200, 33]}  # cu_seqlens entries per micro-batch

    def cu(n: int, tokens: int) -> torch.Tensor:
        inner = torch.randperm(tokens - 1)[: n - 2].add(1).sort().values.to(torch.int32)
        return torch.cat([torch.zeros(1, dtype=torch.int32), inner, torch.full((1,), tokens, dtype=torch.int32)])

    batches = [(tokens, cu(n, tokens)) for tokens, ns in counts.items() for n in ns]
    lengths = {tokens: max(ns) for tokens, ns in counts.items()}
    seen = []
    for order in (batches, batches[::-1], sorted(batches, key=lambda b: b[1].numel())):
        graphs = ModuleGraphs(module)
        graphs.reserve_cu_seqlens(lengths)
        got = {}
        for tokens, c in order:
            padded = graphs.padded_cu_seqlens(c, tokens)
            assert torch.equal(padded[: c.numel()], c) and bool((padded[c.numel():] == tokens).all())
            got[(tokens, c.numel())] = padded.numel()
        assert set(got.values()) == {256}  # 130 -> 256 for T=256, 200 -> 256 for T=512: one shape each
        seen.append(got)
    assert seen[0] == seen[1] == seen[2]
    # unreserved, the first micro-batches of a length get shorter shapes than the later ones
    graphs = ModuleGraphs(module)
    grown = [graphs.padded_cu_seqlens(c, t).numel() for t, c in sorted(batches, key=lambda b: b[1].numel())]
    assert grown[0] == 4 and grown[-1] == 256 and len(set(grown)) > 2
    # a micro-batch past the reservation grows the length for every later one of its T
    graphs = ModuleGraphs(module)
    graphs.reserve_cu_seqlens({256: 20})
    assert graphs.padded_cu_seqlens(cu(5, 256), 256).numel() == 32
    assert graphs.padded_cu_seqlens(cu(40, 256), 256).numel() == 64
    assert graphs.padded_cu_seqlens(cu(5, 256), 256).numel() == 64
