"""The sharded n-gram table and value-embedding channel: exchange, cadence, checkpoints, world sizes.

One small problem is used throughout: a hashed n-gram table (202 rows, so collisions
are frequent) and two value-embedding planes over a 37-token vocabulary (so ranks
touch the same rows), read by a fixed random readout with a squared-error loss. Every
step has ``MICRO`` micro-batches; W ranks take ``MICRO / W`` each and the world-size-1
run takes all of them, each scaled so that the objective is the mean over all
micro-batches. The schedule updates the channels at steps 1 and 3 (every 2nd step),
then every 4th step from step 4 (steps 7, 11), with betas squared and decay doubled.

Tolerance of the world-size comparison: the sharded run sums the same fp32 gradients
in a different order (per rank, then at the owner), so tables agree to ~1e-6.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from gloo_group import init_gloo, leave, spawn_ranks, store_path
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from nanogpt_pl.distributed.ngram_shard import GradientQueue, NgramShard
from nanogpt_pl.distributed.side_files import RANK_LOCAL_KEY, load_rank_local, rank_file, save_rank_local
from nanogpt_pl.distributed.sparse_channels import SparseChannels
from nanogpt_pl.distributed.value_embed_shard import ValueEmbedShard
from nanogpt_pl.model.embeddings import (
    HashedNgramEmbedding,
    dense_ngram_reference,
    make_sign_table,
    ngram_row_ids,
)
from nanogpt_pl.optim.sparse_adam import LazyRowAdam, SparseAdam, shard_adam_
from nanogpt_pl.schedule import Schedule, Stage

ROWS, DIM, VOCAB, PLANES = 202, 8, 37, 2
MICRO, TOKENS = 8, 24
STEPS, RESUME_AT = 12, 6


def schedule() -> Schedule:
    stage = Stage(steps=STEPS, batch_tokens=MICRO * TOKENS, seq_len=TOKENS, max_doc_len=TOKENS)
    return Schedule(stages=[stage], adam_every=2, sparse_cadence=4, sparse_cadence_start=4)


def lr_scale(step: int) -> float:
    return 1.0 - 0.04 * step


def initial_state() -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
    """Non-zero starting table (so decay matters), value-embedding planes, readout."""
    gen = torch.Generator().manual_seed(1)
    table = torch.randn(ROWS, DIM, generator=gen) * 0.1
    planes = [torch.randn(VOCAB, DIM, generator=gen) * 0.3 for _ in range(PLANES)]
    readout = torch.randn(DIM, 3, generator=gen)
    return table, planes, readout


def batch(step: int, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + i)
    return torch.randint(0, VOCAB, (TOKENS,), generator=gen), torch.randn(TOKENS, 3, generator=gen)


class Problem:
    """Channels, optimizer and readout of one rank of ``group`` (or of the single process)."""

    def __init__(self, group: Optional[dist.ProcessGroup] = None) -> None:
        self.group = group
        table, planes, self.readout = initial_state()
        self.shard = NgramShard(ROWS, DIM, process_group=group)
        with torch.no_grad():
            own = table[self.shard.start : self.shard.start + self.shard.rows_per_rank]
            self.shard.weight[: own.shape[0]] = own
        self.planes = [torch.nn.Parameter(p) for p in planes]
        self.ve = ValueEmbedShard(self.planes, process_group=group)
        self.channels = SparseChannels(self.shard, self.ve)
        self.opt = SparseAdam(self.channels.channels())
        self.embed = HashedNgramEmbedding(DIM)
        self.sched = schedule()
        self.world, self.rank = self.shard.world, self.shard.rank

    def micro_loss(self, ids: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, dict]:
        inputs = self.channels.inputs(ids, train=True)
        ve = inputs["value_rows"]
        x = self.embed(inputs["ngram"], torch.float32)
        x = x + F.embedding(ve.index, ve.values[0]) * F.embedding(ve.index, ve.values[1])
        return ((x @ self.readout - target) ** 2).mean(), inputs

    def run(self, steps: range) -> dict[tuple[int, int], float]:
        losses = {}
        per_rank = MICRO // self.world
        for step in steps:
            for i in range(self.rank, MICRO, self.world):
                loss, inputs = self.micro_loss(*batch(step, i))
                (loss / per_rank).backward()
                self.channels.push_grads(inputs)
                losses[(step, i)] = loss.item()
            if self.sched.sparse_step(step):
                for g in self.opt.param_groups:
                    g["lr"] = g["initial_lr"] * lr_scale(step)
                self.opt.set_cadence_engaged(self.sched.sparse_cadence_engaged(step))
                self.opt.step()
        return losses

    def results(self) -> dict:
        return {"table": self.shard.full_table(), "planes": [p.detach().clone() for p in self.planes]}

    def checkpoint(self, path: Path, inline_limit: int) -> None:
        ckpt = {RANK_LOCAL_KEY: {"channels": self.channels.state_dict(), "opt": self.opt.state_dict()},
                "planes": [p.detach().clone() for p in self.planes]}
        main = save_rank_local(ckpt, path, self.rank, self.world, inline_limit=inline_limit)
        if self.rank == 0:
            torch.save(main, path)
        if self.world > 1:
            dist.barrier(group=self.group)

    @classmethod
    def resume(cls, path: Path, group: Optional[dist.ProcessGroup] = None) -> "Problem":
        prob = cls(group)
        ckpt = load_rank_local(torch.load(path, weights_only=True), path, prob.rank, prob.world)
        with torch.no_grad():
            for p, saved in zip(prob.planes, ckpt["planes"]):
                p.copy_(saved)
        prob.channels.load_state_dict(ckpt[RANK_LOCAL_KEY]["channels"])
        prob.opt.load_state_dict(ckpt[RANK_LOCAL_KEY]["opt"])
        return prob


def _run_world(group: Optional[dist.ProcessGroup], out_dir: Path) -> dict:
    prob = Problem(group)
    losses = prob.run(range(RESUME_AT))
    ckpt = out_dir / "mid.ckpt"
    prob.checkpoint(ckpt, inline_limit=0)
    losses.update(prob.run(range(RESUME_AT, STEPS)))
    result = prob.results()
    resumed = Problem.resume(ckpt, group)
    resumed.run(range(RESUME_AT, STEPS))
    again = resumed.results()
    result["resume_exact"] = all(torch.equal(a, b) for a, b in
                                 zip([result["table"], *result["planes"]], [again["table"], *again["planes"]]))
    result["losses"] = losses
    result["side_file"] = os.path.exists(rank_file(ckpt, prob.rank))
    result["bytes_sent"] = dict(prob.shard.exchange.bytes_sent)
    return result


def _worker(rank: int, world: int, store: str, out_dir: str) -> None:
    """World 8 on the default group, and independent world-4 and world-2 runs on rank blocks (one spawn)."""
    torch.set_num_threads(1)
    init_gloo(rank, world, store)
    try:
        # every rank creates every subgroup, in the same order (new_group is collective)
        groups = {size: [dist.new_group(list(range(b, b + size))) for b in range(0, world, size)]
                  for size in (2, 4)}
        out = {}
        for size in (2, 4, world):
            group = None if size == world else groups[size][rank // size]
            run_dir = Path(out_dir) / f"world{size}-{rank // size}"
            run_dir.mkdir(exist_ok=True)
            out[size] = _run_world(group, run_dir)
        torch.save(out, Path(out_dir) / f"rank{rank}.pt")
        dist.barrier()  # no rank tears the group down while a peer still talks to it (gloo aborts)
    finally:
        dist.destroy_process_group()
    leave()  # only reached when the work above succeeded


@pytest.fixture(scope="module")
def single_process() -> dict:
    prob = Problem()
    losses = prob.run(range(STEPS))
    return {**prob.results(), "losses": losses}


@pytest.mark.slow
def test_sharded_ranks_equal_one_process(tmp_path: Path, single_process: dict) -> None:
    spawn_ranks(_worker, (8, store_path(tmp_path), str(tmp_path)), 8)
    per_process = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(8)]
    for world in (2, 4, 8):
        losses = {}
        for r, res in enumerate(p[world] for p in per_process):
            torch.testing.assert_close(res["table"], single_process["table"], rtol=1e-5, atol=2e-6)
            for got, want in zip(res["planes"], single_process["planes"]):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6)
            assert res["resume_exact"], f"world {world}, rank {r}: resuming from the per-rank side file diverged"
            assert res["side_file"]
            assert res["bytes_sent"]["pull_values"] > 0 and res["bytes_sent"]["push_values"] > 0
            if r < world:  # the first run of each size (ranks 0..world-1) covers every micro-batch
                losses.update(res["losses"])
        assert losses.keys() == single_process["losses"].keys()
        for key, want in single_process["losses"].items():
            assert losses[key] == pytest.approx(want, rel=1e-5, abs=1e-6), (world, key)
    assert not torch.equal(single_process["table"], initial_state()[0])


def test_world_size_one_checkpoint_round_trip(tmp_path: Path) -> None:
    for inline_limit, side in ((0, True), (1 << 30, False)):
        path = tmp_path / f"limit{inline_limit}.ckpt"
        prob = Problem()
        prob.run(range(RESUME_AT))
        assert prob.shard.pending_rows() > 0  # mid-cycle: the queued gradient must survive the checkpoint
        prob.checkpoint(path, inline_limit=inline_limit)
        assert os.path.exists(rank_file(path, 0)) == side
        prob.run(range(RESUME_AT, STEPS))
        resumed = Problem.resume(path)
        resumed.run(range(RESUME_AT, STEPS))
        assert torch.equal(prob.results()["table"], resumed.results()["table"])
        for a, b in zip(prob.planes, resumed.planes):
            assert torch.equal(a, b)


def test_side_file_errors_name_the_remedy(tmp_path: Path) -> None:
    path = tmp_path / "x.ckpt"
    main = save_rank_local({RANK_LOCAL_KEY: {"a": torch.ones(2)}}, path, 0, 2)
    with pytest.raises(ValueError, match="devices"):
        load_rank_local(main, path, 0, 4)
    os.remove(rank_file(path, 0))
    with pytest.raises(FileNotFoundError, match="ngram-rank0"):
        load_rank_local(main, path, 0, 2)
    shard = NgramShard(ROWS, DIM)
    with pytest.raises(ValueError, match="ngram_rows"):
        NgramShard(ROWS + 2, DIM).load_state_dict(shard.state_dict())


def dense_reference_run() -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The documented per-update equivalent, with a dense table and plain autograd.

    Each event applies ONE update whose gradient is the sum of the gradients of the
    cycle's steps (all computed at the table of the previous event, since the table only
    changes at events), using β₂² and 2·wd_mul once the cadence is engaged.
    """
    table, planes, readout = initial_state()
    table = table.double()
    planes = [p.double() for p in planes]
    readout = readout.double()
    signs = make_sign_table(DIM).double()
    sched = schedule()
    v = torch.zeros(ROWS, dtype=torch.float64)
    m_ve = [torch.zeros_like(p) for p in planes]
    v_ve = [torch.zeros_like(p) for p in planes]
    acc_t = torch.zeros_like(table)
    acc_ve = [torch.zeros_like(p) for p in planes]
    events = 0
    for step in range(STEPS):
        for i in range(MICRO):
            ids, target = batch(step, i)
            t = table.clone().requires_grad_()
            ps = [p.clone().requires_grad_() for p in planes]
            x = dense_ngram_reference(t, ids, signs) + ps[0][ids] * ps[1][ids]
            loss = ((x @ readout - target.double()) ** 2).mean() / MICRO
            loss.backward()
            acc_t += t.grad
            for a, p in zip(acc_ve, ps):
                a += p.grad
        if sched.sparse_step(step):
            events += 1
            engaged = sched.sparse_cadence_engaged(step)
            lr = 0.008 * lr_scale(step) * 70
            beta2 = 0.95**2 if engaged else 0.95
            wd = 0.005 * 5 * (2 if engaged else 1)
            v.mul_(beta2).add_((1 - beta2) * acc_t.square().mean(-1))
            u = acc_t / (v.sqrt() + 1e-10)[:, None] * (lr * (1 - beta2**events) ** 0.5)
            u += torch.where(u * table > 0, table * lr * lr * wd, torch.zeros_like(table))
            table = table - u
            b1 = 0.75**2 if engaged else 0.75
            for p, m, vv, g in zip(planes, m_ve, v_ve, acc_ve):
                rows = torch.arange(VOCAB)
                shard_adam_(p, m, vv, rows, g, events, lr, (b1, beta2), 1e-10, wd)
            acc_t.zero_()
            for a in acc_ve:
                a.zero_()
    return table, planes


def test_cadence_with_accumulated_gradients_equals_the_per_update_equivalent(single_process: dict) -> None:
    table, planes = dense_reference_run()
    torch.testing.assert_close(single_process["table"].double(), table, rtol=2e-5, atol=2e-6)
    for got, want in zip(single_process["planes"], planes):
        torch.testing.assert_close(got.double(), want, rtol=2e-5, atol=2e-6)


def test_cadence_of_the_schedule() -> None:
    sched = schedule()
    assert [s for s in range(STEPS) if sched.sparse_step(s)] == [1, 3, 7, 11]
    record = Schedule()  # RECORD §5: odd steps before 336, then step mod 4 == 3
    steps = [s for s in range(330, 348) if record.sparse_step(s)]
    assert steps == [331, 333, 335, 339, 343, 347]


class LargestTensor(TorchDispatchMode):
    """Records the largest new tensor storage any op allocates while active (views and aliases excluded)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        seen = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
                self.largest = max(self.largest, t.untyped_storage().nbytes() // t.element_size())
        return out


@pytest.mark.parametrize("seed", [0, 1])
def test_no_table_sized_tensor_is_ever_built(seed):
    rows, dim, vocab = 1 << 20, 4, 50304
    gen = torch.Generator().manual_seed(seed)
    shard = NgramShard(rows, dim)
    shard.weight.normal_(generator=gen)
    planes = [torch.nn.Parameter(torch.randn(vocab, dim, generator=gen)) for _ in range(2)]
    channels = SparseChannels(shard, ValueEmbedShard(planes))
    embed = HashedNgramEmbedding(dim)
    ids = torch.randint(0, vocab, (300,), generator=gen)
    spy = LargestTensor()
    with spy:
        inputs = channels.inputs(ids, train=True)
        ve = inputs["value_rows"]
        x = embed(inputs["ngram"], torch.float32) + F.embedding(ve.index, ve.values[0] + ve.values[1])
        x.square().sum().backward()
        channels.push_grads(inputs)
        rows_used, grads = shard.merged_gradient()
    assert spy.largest < vocab * dim // 10  # nothing near [vocab, D], let alone [rows, D]
    unique = torch.unique(ngram_row_ids(ids, rows))
    assert inputs["ngram"].values.grad.shape == (unique.numel(), dim)
    assert torch.equal(rows_used, unique) and grads.shape == (unique.numel(), dim)
    assert ve.values.grad.shape == (2, torch.unique(ids).numel(), dim)
    assert not isinstance(shard.weight, torch.nn.Parameter) and shard.weight.grad is None
    assert not shard.weight.requires_grad and all(p.grad is None for p in planes)


@pytest.mark.parametrize("seed", [2, 3])
def test_compact_gradient_equals_the_dense_table_gradient(seed):
    gen = torch.Generator().manual_seed(seed)
    shard = NgramShard(ROWS, DIM)
    shard.weight.normal_(generator=gen)
    embed = HashedNgramEmbedding(DIM)
    ids = torch.randint(0, VOCAB, (50,), generator=gen)
    w = torch.randn(DIM, generator=gen)
    inp = shard.prepare(ids)
    out = embed(inp, torch.float32)
    (out @ w).sin().sum().backward()
    table = shard.weight.clone().requires_grad_()
    ref = dense_ngram_reference(table, ids, embed.signs)
    (ref @ w).sin().sum().backward()
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(inp.values.grad, table.grad[inp.rows])
    untouched = torch.ones(ROWS, dtype=torch.bool)
    untouched[inp.rows] = False
    assert (table.grad[untouched] == 0).all()


def test_padded_leaves_give_the_same_result():
    gen = torch.Generator().manual_seed(4)
    shard = NgramShard(ROWS, DIM)
    shard.weight.normal_(generator=gen)
    embed = HashedNgramEmbedding(DIM)
    ids = torch.randint(0, VOCAB, (40,), generator=gen)
    exact, padded = shard.prepare(ids), shard.prepare(ids, pad_to=80)
    assert padded.values.shape[0] == 80 and padded.num_unique == exact.num_unique
    a, b = embed(exact, torch.float32), embed(padded, torch.float32)
    a.sum().backward()
    b.sum().backward()
    assert torch.equal(a, b)
    assert torch.equal(padded.values.grad[: exact.num_unique], exact.values.grad)
    assert (padded.values.grad[exact.num_unique :] == 0).all()


def test_lazy_adam_event_counter_advances_without_rows():
    adam = LazyRowAdam(4)
    table = torch.zeros(4, 2)
    adam.update_(table, torch.zeros(0, dtype=torch.int64), torch.zeros(0, 2), lr=0.1, beta2=0.9, eps=1e-10,
                 weight_decay=0.0)
    assert adam.event == 1


# -- the cycle's gradient queue (one buffer, no concatenation at the event) ----------------


def _pairs(gen: torch.Generator, sizes: list[int], dtype: torch.dtype = torch.float32) -> list:
    return [(torch.randint(0, ROWS, (n,), generator=gen), torch.randn(n, DIM, generator=gen).to(dtype))
            for n in sizes]


def test_gradient_queue_holds_copies_of_what_was_appended(random_seed: int) -> None:
    gen = torch.Generator().manual_seed(random_seed)
    q, pairs = GradientQueue(), _pairs(gen, [5, 17, 3, 40, 8, 1, 29])
    for i, (rows, grad) in enumerate(pairs):
        q.append(rows, grad)  # grows inside the cycle: earlier pairs are carried over
        got = list(q)
        assert len(got) == i + 1 and all(torch.equal(a, r) and torch.equal(b, g)
                                         for (a, b), (r, g) in zip(got, pairs)), f"seed {random_seed} after {i + 1}"
    want_rows, want_grads = torch.cat([r for r, _ in pairs]), torch.cat([g for _, g in pairs])
    rows, grads = q.whole()
    assert torch.equal(rows, want_rows) and torch.equal(grads, want_grads)
    for r, g in pairs:  # the caller's buffers are reused (a graph's next replay): the queue keeps its copy
        r.fill_(7)
        g.fill_(123.0)
    assert torch.equal(q.whole()[0], want_rows) and torch.equal(q.whole()[1], want_grads)


def test_gradient_queue_allocates_once_for_a_run_of_equal_cycles(random_seed: int) -> None:
    gen = torch.Generator().manual_seed(random_seed)
    q = GradientQueue()
    pointers = []
    for cycle in range(4):
        pairs = _pairs(gen, [16] * 6)
        for rows, grad in pairs:
            q.append(rows, grad)
        rows, grads = q.whole()
        assert torch.equal(grads, torch.cat([g for _, g in pairs])), f"seed {random_seed} cycle {cycle}"
        pointers.append(grads.data_ptr())
        q.clear()
        assert not q and q.capacity == 96  # the first cycle's growth is cut back to what it used
    assert len(set(pointers[1:])) == 1  # cycles 2-4 write into the same buffer
    for rows, grad in _pairs(gen, [16] * 3):  # a shorter cycle (a run's last): cut back to its size
        q.append(rows, grad)
    q.clear()
    assert q.capacity == 48
    q.append(*_pairs(gen, [8])[0])
    q.clear(trim=False)  # a reset keeps the buffer
    assert q.capacity == 48


def test_gradient_queue_promotes_dtypes_and_rejects_other_widths() -> None:
    gen = torch.Generator().manual_seed(3)
    q = GradientQueue()
    (r1, g1), (r2, g2) = _pairs(gen, [4], torch.bfloat16)[0], _pairs(gen, [6])[0]
    q.append(r1, g1)
    q.append(r2, g2)
    assert q.whole()[1].dtype == torch.float32
    assert torch.equal(q.whole()[1], torch.cat([g1.float(), g2]))  # the bf16 values carried over exactly
    with pytest.raises(ValueError, match="gradient rows of shape"):
        q.append(torch.zeros(2, dtype=torch.long), torch.zeros(2, DIM + 1))
    with pytest.raises(ValueError, match="gradient of 3 rows for 2 row ids"):
        q.append(torch.zeros(2, dtype=torch.long), torch.zeros(3, DIM))


def test_gradient_queue_replace() -> None:
    gen = torch.Generator().manual_seed(5)
    q = GradientQueue()
    for rows, grad in _pairs(gen, [5, 7]):
        q.append(rows, grad)
    rows, grads = q.whole()
    q.replace(rows, grads)  # its own contents: held as one pair, where they are
    assert len(q) == 1 and q.whole()[1].data_ptr() == grads.data_ptr() and torch.equal(q.whole()[0], rows)
    new_rows, new_grads = _pairs(gen, [3])[0]
    q.replace(new_rows, new_grads)
    assert len(q) == 1 and torch.equal(q.whole()[0], new_rows) and torch.equal(q.whole()[1], new_grads)
    q.replace(new_rows[:0], new_grads[:0])
    assert not q


def test_one_rank_event_reads_the_queue_without_concatenating_it(random_seed: int, monkeypatch) -> None:
    """The world-1 fixed event on micro-batches of different padded sizes (the buffer grows mid-cycle)
    updates the table exactly as the reference exchange does, and no concatenation of the queue runs."""
    gen = torch.Generator().manual_seed(random_seed)
    fixed, ref = NgramShard(ROWS, DIM, exchange="fixed"), NgramShard(ROWS, DIM, exchange="reference")
    start = torch.randn(ROWS, DIM, generator=gen) * 0.1
    for shard in (fixed, ref):
        shard.weight.copy_(start)
    real_cat = torch.cat
    queued_rows = []

    def guarded_cat(tensors, *args, **kwargs):
        out = real_cat(tensors, *args, **kwargs)
        assert out.shape[0] < sum(queued_rows) or out.dim() != 2, "the event concatenated the queue"
        return out

    for event in range(3):
        queued_rows.clear()
        for pad in (60, 90, 48, 120):  # the first cycle grows the buffer at every size change
            ids = torch.randint(0, VOCAB, (24,), generator=gen)
            a, b = ref.prepare(ids), fixed.prepare(ids, pad_to=pad)
            u = a.rows.numel()
            grad = torch.randn(u, DIM, generator=gen)
            ref.push(a.rows, grad)
            fixed.push(b.rows, torch.cat([grad, torch.zeros(pad - u, DIM)]))
            queued_rows.append(pad)
        monkeypatch.setattr(torch, "cat", guarded_cat)
        fixed.step(lr=0.01, betas=(0.0, 0.95), eps=1e-10, weight_decay=0.005)
        monkeypatch.setattr(torch, "cat", real_cat)
        ref.step(lr=0.01, betas=(0.0, 0.95), eps=1e-10, weight_decay=0.005)
        assert torch.equal(fixed.weight, ref.weight), f"seed {random_seed} event {event}"
        assert torch.equal(fixed.adam.v, ref.adam.v) and fixed.pending_rows() == 0
    assert not torch.equal(fixed.weight, start)
