"""The fixed-capacity row exchange: the same bits as the reference exchange, and no host sync.

Two copies of the sparse channels (n-gram shard + value embeddings) start from the same
state on the same ranks: one with the ``reference`` exchange (exact sizes, counts read
on the host), one with the ``fixed`` exchange (sentinel-padded buffers sized from the
batch). Every micro-batch gets fresh random tokens; the leaves, the loss, the leaf
gradients, the merged cycle gradients, the sums at the owners, the updated rows and Adam
state, and the mid-cycle checkpoints must agree bit for bit (``torch.equal``), at 1, 2,
4 and 8 gloo processes,
once with gradients on the wire in the table dtype and once in bf16 (where a rank's own
rows must skip the wire cast, as in the reference). Mid-cycle the fixed copy restarts
from the reference copy's checkpoint (different pending row counts per rank) and must
carry on identically.

The second part runs the fixed exchange under a guard that fails on anything that
reads device data on the host (``.item()``, ``.tolist()``, ``bool(t)``, ``torch.unique``,
``nonzero``, boolean-mask indexing, ``all_to_all`` with split sizes), and checks that
the guard does trip on the reference exchange.
"""

from __future__ import annotations

import contextlib
import copy
import math
import warnings
from pathlib import Path
from typing import Optional

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from gloo_group import init_gloo, leave, spawn_ranks, store_path
from seeds import fresh_seed
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from nanogpt_pl.distributed.ngram_shard import NgramShard
from nanogpt_pl.distributed.sparse_channels import SparseChannels
from nanogpt_pl.distributed.value_embed_shard import ValueEmbedShard
from nanogpt_pl.model.embeddings import HashedNgramEmbedding
from nanogpt_pl.optim.sparse_adam import SparseAdam

ROWS, DIM, VOCAB, PLANES = 202, 8, 37, 2  # a small table and vocabulary: ranks share rows
# 2 x 160 n-gram rows a pull: enough that at 2-8 ranks the fixed exchange's hashed slots per
# destination (row_exchange.slot_capacity) are smaller than the request
TOKENS, MICRO_PER_RANK, STEPS = 160, 2, 6
EVENTS = (1, 4, 5)  # cycles of 2, 3 and 1 steps: queues of 4, 6 and 2 micro-batches per rank
RESUME_AFTER = 2  # mid-cycle: the fixed copy restarts from the reference copy's checkpoint here
CHECKS_AT_RESUME = 5
WIRES = (None, torch.bfloat16)
CHECKS_PER_MICRO = 11
CHECKS_PER_EVENT = 14 + PLANES


class Channels:
    """One copy of the channels with its optimizer, built from the shared initial state."""

    def __init__(self, exchange: str, wire: Optional[torch.dtype], group, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        table = torch.randn(ROWS, DIM, generator=gen)
        planes = [torch.randn(VOCAB, DIM, generator=gen) for _ in range(PLANES)]
        self.readout = torch.randn(DIM, 3, generator=gen)
        self.shard = NgramShard(ROWS, DIM, process_group=group, grad_wire_dtype=wire, exchange=exchange)
        with torch.no_grad():
            own = table[self.shard.start : self.shard.start + self.shard.rows_per_rank]
            self.shard.weight[: own.shape[0]] = own
        self.planes = [torch.nn.Parameter(p) for p in planes]
        self.ve = ValueEmbedShard(self.planes, process_group=group, grad_wire_dtype=wire, exchange=exchange)
        self.channels = SparseChannels(self.shard, self.ve, fixed_shapes=exchange == "fixed")
        self.opt = SparseAdam(self.channels.channels())
        self.embed = HashedNgramEmbedding(DIM)

    def forward(self, ids: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, dict]:
        inputs = self.channels.inputs(ids, train=True)
        ve = inputs["value_rows"]
        x = self.embed(inputs["ngram"], torch.float32)
        x = x + F.embedding(ve.index, ve.values[0]) * F.embedding(ve.index, ve.values[1])
        loss = ((x @ self.readout - target) ** 2).mean()
        loss.backward()
        return loss.detach(), inputs


class Checker:
    def __init__(self) -> None:
        self.passed = 0
        self.failures: list[str] = []

    def __call__(self, ok: bool, what: str) -> None:
        if ok:
            self.passed += 1
        else:
            self.failures.append(what)


def compare(group, seed: int, wire: Optional[torch.dtype], check: Checker) -> None:
    """Run both exchanges side by side on ``group`` and compare everything bit for bit."""
    ref = Channels("reference", wire, group, seed)
    fix = Channels("fixed", wire, group, seed)
    world, rank = ref.shard.world, ref.shard.rank
    where = f"world {world} rank {rank} wire {wire} seed {seed}"
    for step in range(STEPS):
        for i in range(MICRO_PER_RANK):
            gen = torch.Generator().manual_seed(seed + 7919 * (1 + step * 64 + i * 8 + rank))
            ids = torch.randint(0, VOCAB, (TOKENS,), generator=gen)
            target = torch.randn(TOKENS, 3, generator=gen)
            loss_r, a = ref.forward(ids, target)
            loss_f, b = fix.forward(ids, target)
            at = f"{where} step {step} micro {i}"
            u, n = a["ngram"].rows.numel(), a["value_rows"].ids.numel()
            cap = b["ngram"].rows.numel()
            check((fix.shard.exchange.slots(cap) < cap) == (world > 1), f"{at}: pull slots below the request")
            check(torch.equal(b["ngram"].rows[:u], a["ngram"].rows), f"{at}: n-gram rows")
            check(bool((b["ngram"].rows[u:] == fix.shard.exchange.sentinel).all()), f"{at}: n-gram padding ids")
            check(torch.equal(b["ngram"].index, a["ngram"].index), f"{at}: n-gram index")
            check(torch.equal(b["ngram"].values[:u], a["ngram"].values), f"{at}: pulled n-gram rows")
            check(bool((b["ngram"].values[u:] == 0).all()), f"{at}: n-gram padding values")
            check(torch.equal(b["value_rows"].index, a["value_rows"].index), f"{at}: value-embedding index")
            check(torch.equal(b["value_rows"].values[:, :n], a["value_rows"].values), f"{at}: value-embedding rows")
            check(torch.equal(loss_f, loss_r), f"{at}: loss")
            check(torch.equal(b["ngram"].values.grad[:u], a["ngram"].values.grad), f"{at}: n-gram leaf gradient")
            check(torch.equal(b["value_rows"].values.grad[:, :n], a["value_rows"].values.grad),
                  f"{at}: value-embedding leaf gradient")
            ref.channels.push_grads(a)
            fix.channels.push_grads(b)
        if step == RESUME_AFTER:
            fix = resume(ref, fix, wire, group, seed, check, f"{where} resume after step {step}")
        if step not in EVENTS:
            continue
        at = f"{where} event at step {step}"
        rows_r, grads_r = ref.shard.merged_gradient()
        rows_f, grads_f = fix.shard.merged_gradient()
        u = rows_r.numel()
        check((fix.shard.exchange.slots(rows_f.numel()) < rows_f.numel()) == (world > 1),
              f"{at}: event slots below the request")
        check(torch.equal(rows_f[:u], rows_r) and bool((rows_f[u:] == fix.shard.exchange.sentinel).all()),
              f"{at}: merged n-gram rows")
        check(torch.equal(grads_f[:u], grads_r), f"{at}: merged n-gram gradient")
        ids_r, vgrads_r = ref.ve.merged_gradient()
        ids_f, vgrads_f = fix.ve.merged_gradient()
        n = ids_r.numel()
        check(torch.equal(ids_f[:n], ids_r) and bool((ids_f[n:] == fix.ve.sentinel).all()),
              f"{at}: merged value-embedding ids")
        check(torch.equal(vgrads_f[:, :n], vgrads_r), f"{at}: merged value-embedding gradient")
        local_r, sums_r = ref.shard.exchange.reduce_to_owners(rows_r, grads_r, wire)
        local_f, sums_f = fix.shard.exchange.reduce_to_owners_fixed(rows_f, grads_f, wire)
        k = local_r.numel()
        check(torch.equal(local_f[:k], local_r) and bool((local_f[k:] == fix.shard.exchange.scratch).all()),
              f"{at}: rows at the owner")
        check(torch.equal(sums_f[:k], sums_r), f"{at}: gradient sums at the owner")
        for c in (ref, fix):
            for g in c.opt.param_groups:
                g["lr"] = g["initial_lr"] * (1.0 - 0.05 * step)
            c.opt.set_cadence_engaged(step >= 4)
            c.opt.step()
        check(torch.equal(fix.shard.weight, ref.shard.weight), f"{at}: updated n-gram rows")
        check(torch.equal(fix.shard.adam.v, ref.shard.adam.v), f"{at}: row second moments")
        check(torch.equal(fix.shard.adam.last_event, ref.shard.adam.last_event), f"{at}: row last events")
        check(not torch.equal(ref.shard.weight, Channels("reference", wire, group, seed).shard.weight),
              f"{at}: the table moved")
        for p, q in zip(fix.planes, ref.planes):
            check(torch.equal(p, q), f"{at}: updated value-embedding plane")
        check(torch.equal(fix.ve.adam.exp_avg, ref.ve.adam.exp_avg), f"{at}: value-embedding exp_avg")
        check(torch.equal(fix.ve.adam.exp_avg_sq, ref.ve.adam.exp_avg_sq), f"{at}: value-embedding exp_avg_sq")
        check(fix.shard.pending_rows() == 0 and ref.shard.pending_rows() == 0, f"{at}: queues consumed")


def resume(ref: Channels, fix: Channels, wire, group, seed: int, check: Checker, at: str) -> Channels:
    """Both checkpoints must match; then a fresh fixed copy loads the reference copy's checkpoint.

    The pending rows differ in number across ranks, so loading must pad them to a common
    length for the fixed exchange.
    """
    want, got = ref.channels.state_dict(), fix.channels.state_dict()
    check(torch.equal(got["ngram"]["pending_rows"], want["ngram"]["pending_rows"]), f"{at}: pending n-gram rows")
    check(torch.equal(got["ngram"]["pending_grad"], want["ngram"]["pending_grad"]), f"{at}: pending n-gram grad")
    check(torch.equal(got["value_embeds"]["pending_ids"], want["value_embeds"]["pending_ids"]), f"{at}: pending ids")
    check(torch.equal(got["value_embeds"]["pending_grad"], want["value_embeds"]["pending_grad"]),
          f"{at}: pending value-embedding grad")
    check(torch.equal(got["value_embeds"]["exp_avg"], want["value_embeds"]["exp_avg"]), f"{at}: exp_avg")
    fresh = Channels("fixed", wire, group, seed)
    with torch.no_grad():
        for p, q in zip(fresh.planes, ref.planes):
            p.copy_(q)
    fresh.channels.load_state_dict(copy.deepcopy(want))
    fresh.opt.load_state_dict(ref.opt.state_dict())
    return fresh


def expected_checks() -> int:
    per_wire = STEPS * MICRO_PER_RANK * CHECKS_PER_MICRO + len(EVENTS) * CHECKS_PER_EVENT + CHECKS_AT_RESUME
    return len(WIRES) * per_wire


def _compare_worker(rank: int, world: int, store: str, out_dir: str, seed: int) -> None:
    """World 8 on the default group, and world-4 and world-2 runs on rank blocks (one spawn)."""
    torch.set_num_threads(1)
    init_gloo(rank, world, store)
    try:
        groups = {size: [dist.new_group(list(range(b, b + size))) for b in range(0, world, size)]
                  for size in (2, 4)}
        out = {}
        for size in (2, 4, world):
            group = None if size == world else groups[size][rank // size]
            check = Checker()
            for wire in WIRES:
                compare(group, seed + size, wire, check)
            out[size] = (check.passed, check.failures)
        torch.save(out, Path(out_dir) / f"rank{rank}.pt")
        dist.barrier()  # no rank tears the group down while a peer still talks to it (gloo aborts)
    finally:
        dist.destroy_process_group()
    leave()  # only reached when the work above succeeded


def test_fixed_exchange_equals_the_reference_in_one_process() -> None:
    seed = fresh_seed()
    check = Checker()
    for wire in WIRES:
        compare(None, seed, wire, check)
    assert not check.failures, check.failures[:5]
    assert check.passed == expected_checks(), f"seed {seed}"


@pytest.mark.slow
def test_fixed_exchange_equals_the_reference_at_2_4_8_ranks(tmp_path: Path) -> None:
    seed = fresh_seed()
    spawn_ranks(_compare_worker, (8, store_path(tmp_path), str(tmp_path), seed), 8)
    for rank in range(8):
        out = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        for world in (2, 4, 8):
            passed, failures = out[world]
            assert not failures, (seed, failures[:5])
            assert passed == expected_checks(), (seed, world, rank, passed)


# -- no host sync ----------------------------------------------------------------------
class HostSync(RuntimeError):
    pass


def _is_bool_index(args) -> bool:
    return any(isinstance(t, torch.Tensor) and t.dtype == torch.bool for t in tree_flatten(args[1:])[0])


class NoHostSync(TorchDispatchMode):
    """Fails on every op and call that needs device data on the host.

    Ops: reading a scalar (``_local_scalar_dense``: ``.item()``, ``int(t)``), outputs sized
    by data (``unique``, ``nonzero``, ``masked_select``, boolean-mask indexing,
    ``repeat_interleave`` by a tensor), copies to the CPU of a non-CPU tensor, tensors made
    from host data (``torch.tensor``: a blocking copy from pageable memory on CUDA). Python
    calls: ``Tensor.item/tolist/numpy/cpu/__bool__/__int__/__float__`` and ``all_to_all``
    with split sizes (sizes the host must have read).
    """

    # lift_fresh: a tensor built from host data (torch.tensor), on CUDA a synchronizing copy from pageable memory
    BANNED = ("_local_scalar_dense", "nonzero", "unique", "masked_select", "repeat_interleave.Tensor", "lift_fresh")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket.__name__) + "." + func._overloadname
        if any(b in name for b in self.BANNED):
            raise HostSync(f"{name} needs device data on the host")
        if func.overloadpacket.__name__ in ("index", "index_put", "index_put_") and _is_bool_index(args):
            raise HostSync(f"{name} with a boolean mask has a data-dependent size")
        to = (kwargs or {}).get("device")
        src = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if name.startswith("_to_copy") and to is not None and torch.device(to).type == "cpu" and src is not None \
                and src.device.type != "cpu":
            raise HostSync(f"{name} copies a {src.device.type} tensor to the host")
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        self._saved = {}

        def banned(what):
            def raise_(*a, **k):
                raise HostSync(f"Tensor.{what} reads device data on the host")
            return raise_

        for what in ("item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__"):
            self._saved[what] = getattr(torch.Tensor, what)
            setattr(torch.Tensor, what, banned(what))
        self._a2a = dist.all_to_all_single

        def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, **kw):
            if output_split_sizes is not None or input_split_sizes is not None:
                raise HostSync("all_to_all_single with split sizes read on the host")
            return self._a2a(output, input, **kw)

        dist.all_to_all_single = all_to_all_single
        return super().__enter__()

    def __exit__(self, *exc):
        for what, fn in self._saved.items():
            setattr(torch.Tensor, what, fn)
        dist.all_to_all_single = self._a2a
        return super().__exit__(*exc)


def guarded_steps(exchange: str, group, seed: int) -> None:
    """Two steps with an event, every exchange call under :class:`NoHostSync` (the model's math outside)."""
    c = Channels(exchange, None, group, seed)
    rank = c.shard.rank
    for step in range(2):
        gen = torch.Generator().manual_seed(seed + 31 * (step + 2 * rank))
        ids = torch.randint(0, VOCAB, (TOKENS,), generator=gen)
        target = torch.randn(TOKENS, 3, generator=gen)
        with NoHostSync():
            inputs = c.channels.inputs(ids, train=True)
        ve = inputs["value_rows"]
        x = c.embed(inputs["ngram"], torch.float32)
        x = x + F.embedding(ve.index, ve.values[0]) * F.embedding(ve.index, ve.values[1])
        ((x @ c.readout - target) ** 2).mean().backward()
        with NoHostSync():
            c.channels.push_grads(inputs)
    with NoHostSync():
        c.opt.step()
    assert c.ve.step_count == 1 and c.shard.adam.event == 1


def _sync_worker(rank: int, world: int, store: str, out_dir: str, seed: int) -> None:
    torch.set_num_threads(1)
    init_gloo(rank, world, store)
    result = {}
    try:
        result["capturable"] = capturable_cases(seed)
        guarded_steps("fixed", None, seed)
        result["fixed"] = "ok"
        try:
            guarded_steps("reference", None, seed)
            result["reference"] = "no sync seen"
        except HostSync as e:
            result["reference"] = f"caught: {e}"
            dist.barrier()  # the peer may be waiting in a collective the caught rank skipped
    finally:
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
        dist.destroy_process_group()
    leave()  # only reached when the work above succeeded


def test_guard_catches_host_reads() -> None:
    t = torch.arange(3)
    for read in (lambda: t.sum().item(), lambda: t.tolist(), lambda: bool(t[0]), lambda: torch.unique(t),
                 lambda: t[t > 0], lambda: t.nonzero(), lambda: torch.tensor([1, 2])):
        with pytest.raises(HostSync), NoHostSync():
            read()
    assert t.sum().item() == 3  # everything restored


def capturable_cases(seed: int) -> dict[str, bool]:
    """``SparseChannels.capturable`` of the channel sets a run can build, on the default group."""
    out = {name: Channels(name, None, None, seed).channels.capturable for name in ("fixed", "reference")}
    planes = [torch.nn.Parameter(torch.randn(VOCAB, DIM)) for _ in range(PLANES)]
    out["value_embeds_fixed"] = SparseChannels(None, ValueEmbedShard(planes, exchange="fixed"),
                                               fixed_shapes=True).capturable
    shard = NgramShard(ROWS, DIM, exchange="fixed")
    out["fixed_unpadded"] = SparseChannels(shard, None, fixed_shapes=False).capturable
    return out


def test_one_rank_fixed_pull_is_capturable() -> None:
    """``nanogpt_pl.capture.PullGraphs`` captures the pull only where it has no collective and fixed shapes."""
    assert capturable_cases(fresh_seed()) == {"fixed": True, "reference": False, "value_embeds_fixed": True,
                                              "fixed_unpadded": False}
    assert not SparseChannels(None, None, fixed_shapes=True).capturable  # nothing to pull


def test_fixed_exchange_makes_no_host_sync_in_one_process() -> None:
    seed = fresh_seed()
    guarded_steps("fixed", None, seed)
    with pytest.raises(HostSync):
        guarded_steps("reference", None, seed)


@pytest.mark.slow
def test_fixed_exchange_makes_no_host_sync_at_2_ranks(tmp_path: Path) -> None:
    spawn_ranks(_sync_worker, (2, store_path(tmp_path), str(tmp_path), fresh_seed()), 2)
    for rank in range(2):
        result = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        assert result["fixed"] == "ok"
        assert result["reference"].startswith("caught"), result
        # at 2 ranks the n-gram pull is an all-to-all: it stays eager; the value embeddings' is local
        assert result["capturable"] == {"fixed": False, "reference": False, "value_embeds_fixed": True,
                                        "fixed_unpadded": False}, result


# -- the padding's slots -------------------------------------------------------------------
def _padded_entries(gen: torch.Generator, fill: int, n_real: int, n_pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows = torch.randint(0, 40, (n_real,), generator=gen)
    rows = torch.cat([rows, torch.full((n_pad,), fill)])[torch.randperm(n_real + n_pad, generator=gen)]
    return rows, torch.randn(rows.numel(), 3, generator=gen, dtype=torch.float64)


@pytest.mark.parametrize("seed", [11, 12, 13])
def test_unique_fixed_gives_each_padding_entry_its_own_slot(seed: int) -> None:
    from nanogpt_pl.distributed.row_exchange import unique_fixed

    fill = 1000
    gen = torch.Generator().manual_seed(seed)
    rows, _ = _padded_entries(gen, fill, 30, 25)
    real = torch.unique(rows[rows != fill])
    unique, inverse = unique_fixed(rows, rows.numel(), fill)
    # the real values first, sorted, then padding; every entry's slot holds its value
    assert torch.equal(unique[: real.numel()], real) and bool((unique[real.numel():] == fill).all())
    assert torch.equal(unique[inverse], rows)
    # the padding entries' slots are distinct (no pile-up of index_add_ on one slot)
    pad_slots = inverse[rows == fill]
    assert pad_slots.unique().numel() == pad_slots.numel()
    assert bool((pad_slots >= real.numel()).all())
    # with less room the padding shares the slots left, never a real value's
    tight = real.numel() + 4
    unique_t, inverse_t = unique_fixed(rows, tight, fill)
    assert unique_t.numel() == tight and torch.equal(unique_t[inverse_t], rows)
    assert set(inverse_t[rows == fill].tolist()) == set(range(real.numel(), tight))
    # dealt in turn: no slot holds more than one padding entry above any other
    loads = torch.bincount(inverse_t[rows == fill])[real.numel():]
    assert int(loads.max() - loads.min()) <= 1


@pytest.mark.parametrize("seed", [21, 22])
def test_merge_compact_fixed_sums_equal_the_exact_merge(seed: int) -> None:
    from nanogpt_pl.distributed.row_exchange import merge_compact, merge_compact_fixed

    fill = 1000
    gen = torch.Generator().manual_seed(seed)
    entries = [_padded_entries(gen, fill, 12, 9) for _ in range(3)]
    exact_entries = [(r[r != fill], g[r != fill]) for r, g in entries]
    ids, sums = merge_compact(exact_entries, (0, 3), torch.device("cpu"))
    rows, merged = merge_compact_fixed(entries, fill)
    n = ids.numel()
    assert torch.equal(rows[:n], ids) and bool((rows[n:] == fill).all())
    torch.testing.assert_close(merged[:n].double(), sums.double(), rtol=1e-6, atol=1e-6)


def test_merge_compact_fixed_reads_a_single_entry_without_copying_it(random_seed: int, monkeypatch) -> None:
    """A queue read as one padded list (``NgramShard``'s kept buffer) is merged in place: the same
    result as the same rows given as several entries, and no concatenation of the one entry."""
    from nanogpt_pl.distributed.row_exchange import merge_compact_fixed

    fill = 1000
    gen = torch.Generator().manual_seed(random_seed)
    entries = [_padded_entries(gen, fill, 12, 9) for _ in range(3)]
    whole = (torch.cat([r for r, _ in entries]), torch.cat([g for _, g in entries]))
    want = merge_compact_fixed(entries, fill)
    real_cat = torch.cat

    def no_cat(*args, **kwargs):
        raise AssertionError("merge_compact_fixed concatenated a single entry")

    monkeypatch.setattr(torch, "cat", no_cat)
    got = merge_compact_fixed([whole], fill, force=True)
    monkeypatch.setattr(torch, "cat", real_cat)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), f"seed {random_seed}"


@pytest.mark.parametrize("seed", [31, 32])
def test_fixed_value_embeddings_add_each_micro_batch_into_one_cycle_buffer(seed: int) -> None:
    """The fixed exchange keeps no queue: each push adds its padded compact gradient into the cycle
    buffer. The pending ids are exactly the pushed ones, their sums the exact sums, no other row of the
    owners' block holds anything, and after an event the buffer is empty again."""
    gen = torch.Generator().manual_seed(seed)
    planes = [torch.nn.Parameter(torch.randn(VOCAB, DIM, generator=gen)) for _ in range(PLANES)]
    ve = ValueEmbedShard(planes, exchange="fixed")
    expected: dict[int, torch.Tensor] = {}
    micro = 5
    for _ in range(micro):
        ids = torch.randint(0, VOCAB - 3, (TOKENS,), generator=gen)  # the last ids stay untouched
        rows = ve.prepare(ids)
        assert rows.ids.numel() == min(TOKENS, VOCAB) and bool((rows.ids == ve.sentinel).any())
        grad = torch.randn(rows.values.shape, generator=gen, dtype=torch.float64)
        for slot, i in enumerate(rows.ids.tolist()):
            if i < VOCAB:
                expected[i] = expected.get(i, torch.zeros(PLANES, DIM, dtype=torch.float64)) + grad[:, slot]
        ve.push(rows.ids, grad.float())
        assert not ve._queue
    ids, merged = ve.merged_gradient()
    assert ids.tolist() == sorted(expected) and merged.shape == (PLANES, len(expected), DIM)
    for slot, i in enumerate(ids.tolist()):
        torch.testing.assert_close(merged[:, slot].double(), expected[i], rtol=1e-5, atol=1e-5)
    block = ve._grad[:, : ve.vocab]
    untouched = torch.ones(ve.vocab, dtype=torch.bool)
    untouched[ids] = False
    assert bool((block[:, untouched] == 0).all())
    assert not ve.pristine()
    SparseAdam({"value_embeds": ve}).step()
    assert ve.merged_gradient()[0].numel() == 0 and bool((ve._grad == 0).all()) and ve.step_count == 1


@pytest.mark.parametrize("exchange", ["reference", "fixed"])
def test_pushed_gradients_survive_the_caller_reusing_its_buffer(exchange: str) -> None:
    """Under CUDA graphs a leaf's gradient is the graph's static buffer, overwritten by the next
    replay; what the channels keep from a push must not change when that buffer does."""
    merged = []
    for overwrite in (False, True):
        gen = torch.Generator().manual_seed(41)
        c = Channels(exchange, None, None, seed=41)
        ids = torch.randint(0, VOCAB, (TOKENS,), generator=gen)
        _, inputs = c.forward(ids, torch.randn(TOKENS, 3, generator=gen))
        c.channels.push_grads(inputs)
        if overwrite:  # the next replay writes its gradient here
            inputs["ngram"].values.grad.fill_(123.0)
            inputs["value_rows"].values.grad.fill_(123.0)
        merged.append([c.channels.channels()[name].merged_gradient() for name in ("ngram", "value_embeds")])
    for (rows, grads), (got_rows, got_grads) in zip(*merged):
        assert torch.equal(got_rows, rows) and torch.equal(got_grads, grads)


# -- the hashed slots per destination ----------------------------------------------------------
def test_slot_capacity_is_a_binomial_bound_on_hashed_requests() -> None:
    from nanogpt_pl.distributed.row_exchange import SLOT_MARGIN, SLOT_SIGMAS, slot_capacity

    assert (SLOT_SIGMAS, SLOT_MARGIN) == (10.0, 64)
    # 8 equal owners of RECORD §3's 84,602,880 rows, a stage-2 pull of 2 x 49,152 rows (RECORD §9):
    # 12,288 expected a destination, 10 deviations 1,036.9, so 13,325 + 64 slots instead of 98,304
    record = [r * 10_575_360 for r in range(9)]
    assert slot_capacity(98_304, record) == 13_389
    assert slot_capacity(98_304, record, spread="any") == 98_304  # a rank may ask one owner for everything
    assert slot_capacity(98_304, [0, 84_602_880]) == 98_304  # one rank: the whole request
    assert slot_capacity(100, record) == 100  # small requests keep full slots
    assert slot_capacity(0, record) == 0
    # unequal blocks: the largest block's share sets the bound
    assert slot_capacity(10_000, [0, 100, 400]) == math.ceil(10_000 * 0.75 + 10 * math.sqrt(10_000 * 0.75 * 0.25)) + 64
    with pytest.raises(ValueError, match=r"row exchange spread='uniform': choose one of \('any', 'hashed'\)"):
        slot_capacity(10, record, spread="uniform")


def _overflow_worker(rank: int, world: int, store: str, out_dir: str) -> None:
    from nanogpt_pl.distributed.row_exchange import OVERFLOW_MESSAGE, RowExchange

    torch.set_num_threads(1)
    init_gloo(rank, world, store)
    result = {}
    try:
        exchange = RowExchange([0, 1000, 2000], spread="hashed")
        assert exchange.slots(1000) == 723  # 500 + 10 x 15.81 (rounded up) + 64
        other = torch.arange(1000) + 1000 * (1 - rank)  # the whole of the other rank's block: not hashes
        try:
            exchange.pull_fixed(other, lambda local: torch.zeros(local.numel(), 4))
            result["overflow"] = "no error"
        except RuntimeError as e:
            result["overflow"] = str(e)
        # a request that fits goes through with the same slots
        fits = torch.cat([torch.arange(300) + 1000 * (1 - rank), torch.full((700,), exchange.sentinel)])
        got = exchange.pull_fixed(fits, lambda local: (local + exchange.start).float()[:, None].expand(-1, 4))
        result["fits"] = torch.equal(got[:300, 0], fits[:300].float()) and bool((got[300:] == 0).all())
        result["message"] = OVERFLOW_MESSAGE
    finally:
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
        dist.destroy_process_group()
    leave()


@pytest.mark.slow
def test_a_request_past_its_slot_stops_the_run_with_the_fix(tmp_path: Path) -> None:
    spawn_ranks(_overflow_worker, (2, store_path(tmp_path), str(tmp_path)), 2)
    for rank in range(2):
        result = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        assert result["message"] in result["overflow"], result["overflow"]
        assert "model.optim.sparse_exchange: reference" in result["message"]
        assert result["fits"] is True


# -- the value-embedding leaf sized from the batch plan --------------------------------------
def _value_channels(exchange: str, planes: list[torch.Tensor]) -> tuple[SparseChannels, list, SparseAdam]:
    params = [torch.nn.Parameter(p.clone()) for p in planes]
    channels = SparseChannels(None, ValueEmbedShard(params, exchange=exchange), fixed_shapes=exchange == "fixed")
    return channels, params, SparseAdam(channels.channels())


def test_value_rows_come_from_the_reservation_and_fall_back_to_min_t_v_once():
    planes = [torch.nn.Parameter(torch.zeros(3000, DIM)) for _ in range(PLANES)]
    channels = SparseChannels(None, ValueEmbedShard(planes, exchange="fixed"), fixed_shapes=True)
    assert channels.value_rows(512, 100) == 512  # nothing reserved: min(T, V)
    channels.reserve_value_rows({512: 100, 4096: 4000, 256: 256})
    # rounded up to 64 rows, at most min(T, V): 4096 tokens of a 3,000-token vocabulary hold 3,000 ids at most
    assert [channels.value_rows(t, 1) for t in (512, 4096, 256)] == [128, 3000, 256]
    channels.reserve_value_rows({512: 10})  # a later reservation only grows it
    assert channels.value_rows(512, 128) == 128
    with pytest.warns(UserWarning, match=r"^value embeddings: a micro-batch of 512 tokens has 129 distinct token "
                                         r"ids, beyond the 128 rows reserved .*take 512 rows from now on$"):
        assert channels.value_rows(512, 129) == 512
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert channels.value_rows(512, 5) == 512 and channels.value_rows(512, None) == 512  # and it stays there
    channels.reserve_value_rows({1024: 50})
    with pytest.warns(UserWarning, match="has no distinct-token count"):
        assert channels.value_rows(1024, None) == 1024
    # only the fixed shapes have a capacity; without value embeddings there is nothing to size
    assert SparseChannels(None, ValueEmbedShard(planes), fixed_shapes=False).value_rows(512, 100) is None
    assert SparseChannels(NgramShard(ROWS, DIM, exchange="fixed"), None, fixed_shapes=True).value_rows(512, 9) is None
    with pytest.raises(ValueError, match=r"^pad_to=513: the fixed value-embedding leaf of a batch of 512 tokens"):
        channels.value_embeds.prepare(torch.zeros(512, dtype=torch.long), pad_to=513)


@pytest.mark.parametrize("run", [0, 1])
def test_plan_sized_value_rows_train_the_same_bits_as_min_t_v_and_the_reference(run):
    """The leaf sized from the plan's distinct tokens (a quarter of T here) gives the same losses,
    leaf gradients, merged gradient and updated planes and Adam state as the min(T, V) leaf and as
    the exact-size reference exchange; the reserved pull and push read nothing back from the device."""
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    vocab, tokens, steps, micro = 3000, 512, 3, 2
    planes = [torch.randn(vocab, DIM, generator=gen) for _ in range(PLANES)]
    readout = torch.randn(DIM, 3, generator=gen)
    pool = torch.randperm(vocab, generator=gen)[:120]  # each micro-batch reads at most 120 distinct ids
    batches = [[(pool[torch.randint(0, pool.numel(), (tokens,), generator=gen)], torch.randn(tokens, 3, generator=gen))
                for _ in range(micro)] for _ in range(steps)]
    most = max(torch.unique(ids).numel() for step in batches for ids, _ in step)
    runs = {name: _value_channels("reference" if name == "reference" else "fixed", planes)
            for name in ("reference", "min(T, V)", "plan")}
    runs["plan"][0].reserve_value_rows({tokens: most})
    want_rows = {"reference": None, "min(T, V)": tokens, "plan": -(-most // 64) * 64}
    assert want_rows["plan"] < tokens // 2
    seen = {name: [] for name in runs}
    for step in range(steps):
        for ids, target in batches[step]:
            for name, (channels, params, _) in runs.items():
                rows = channels.value_rows(tokens, torch.unique(ids).numel())
                assert rows == want_rows[name], (name, seed)
                guard = NoHostSync() if name == "plan" else contextlib.nullcontext()
                with guard:
                    inputs = channels.inputs(ids, train=True, value_rows=rows)
                ve = inputs["value_rows"]
                assert ve.values.shape[1] == (rows or torch.unique(ids).numel()), (name, seed)
                x = F.embedding(ve.index, ve.values[0]) * F.embedding(ve.index, ve.values[1])
                loss = ((x @ readout - target) ** 2).mean()
                loss.backward()
                n = torch.unique(ids).numel()
                seen[name].append((loss.detach(), ve.values.grad[:, :n].clone(), ve.values.detach()[:, :n].clone()))
                with guard:
                    channels.push_grads(inputs)
        merged = {name: channels.value_embeds.merged_gradient() for name, (channels, _, _) in runs.items()}
        for name, (channels, _, opt) in runs.items():
            assert torch.equal(merged[name][0], merged["reference"][0]), (name, seed)
            assert torch.equal(merged[name][1], merged["reference"][1]), (name, seed)
            for g in opt.param_groups:
                g["lr"] = g["initial_lr"] * (1.0 - 0.1 * step)
            with NoHostSync() if name == "plan" else contextlib.nullcontext():
                opt.step()
    for name in ("min(T, V)", "plan"):
        for got, want in zip(seen[name], seen["reference"]):
            assert all(torch.equal(a, b) for a, b in zip(got, want)), (name, seed)
        for p, q in zip(runs[name][1], runs["reference"][1]):
            assert torch.equal(p, q), (name, seed)
        ve, ref = runs[name][0].value_embeds, runs["reference"][0].value_embeds
        assert torch.equal(ve.adam.exp_avg, ref.adam.exp_avg) and torch.equal(ve.adam.exp_avg_sq, ref.adam.exp_avg_sq)
    assert runs["plan"][0].value_embeds.step_count == steps
    assert not torch.equal(runs["plan"][1][0], planes[0])  # the planes moved


@pytest.mark.parametrize("seed", [21, 22])
def test_fixed_dedup_sorts_int32_keys_to_the_int64_result(seed: int) -> None:
    """Row ids under 2**31 sort as int32 keys (half the radix passes on a GPU): the same unique
    rows, inverse and segments as the int64 sort, up to the largest int32 value."""
    from nanogpt_pl.distributed.row_exchange import INT32_MAX, segments_fixed, sort_values, unique_fixed

    gen = torch.Generator().manual_seed(seed)
    top = torch.tensor([INT32_MAX - 1, INT32_MAX - 2, 0, 1])
    rows = torch.cat([torch.randint(0, INT32_MAX, (300,), generator=gen), torch.randint(0, 50, (200,), generator=gen),
                      top])[torch.randperm(504, generator=gen)]
    keys, order = sort_values(rows, INT32_MAX)
    assert keys.dtype == torch.int32 and torch.equal(rows[order], torch.sort(rows, stable=True).values)
    assert sort_values(rows, INT32_MAX + 1)[0].dtype == torch.int64
    real = torch.unique(rows)
    for fill in (INT32_MAX, 2**40):  # int32 keys, then int64 keys
        padded = torch.cat([rows, torch.full((40,), fill)])
        unique, inverse = unique_fixed(padded, padded.numel(), fill)
        assert unique.dtype == torch.int64
        assert torch.equal(unique[: real.numel()], real) and torch.equal(unique[inverse], padded)
        seg = segments_fixed(padded, padded.numel(), fill)
        assert torch.equal(seg.unique[: real.numel()], real) and bool((seg.unique[real.numel():] == fill).all())
        assert torch.equal(padded[seg.order[: rows.numel()]], torch.sort(rows, stable=True).values)
        counts = seg.offsets[1:] - seg.offsets[:-1]
        assert torch.equal(counts[: real.numel()], torch.unique(rows, return_counts=True)[1])
