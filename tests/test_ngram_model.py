"""The n-gram channel and compact value-embedding rows inside the GPT, and in a Lightning run."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from train_helpers import LossRecorder, make_run, make_trainer, tiny_gpt, tiny_schedule, write_markov_shards

import nanogpt_pl.distributed.side_files as side_files
from nanogpt_pl.distributed.ngram_shard import NgramShard
from nanogpt_pl.distributed.side_files import RANK_LOCAL_KEY, load_rank_local, rank_file
from nanogpt_pl.distributed.value_embed_shard import ValueEmbedShard
from nanogpt_pl.model.embeddings import NgramInput, ngram_row_ids, ngram_sign_rows
from nanogpt_pl.model.gpt import GPT, GPTConfig

ROWS = 1 << 12


def tiny(**kw) -> GPTConfig:
    base = dict(vocab_size=384, num_layers=4, model_dim=64, num_heads=2, head_dim=32, mlp_hidden=96,
                long_window_layers=[3], value_embed_layers=[1, 2], skip_from=1, skip_to=3,
                ngram_rows=ROWS, ngram_layers=[1, 3])
    base.update(kw)
    return GPTConfig(**base)


def batch(seed: int, n: int = 80, vocab: int = 384):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (n,), generator=gen)
    cu = torch.tensor([0, n // 3, n, n], dtype=torch.int32)
    return ids, cu, gen


def model_and_shard(seed: int, **kw):
    torch.manual_seed(seed)
    model = GPT(tiny(**kw))
    shard = NgramShard(model.cfg.ngram_rows, model.cfg.model_dim)
    shard.weight.normal_(generator=torch.Generator().manual_seed(seed + 1))
    with torch.no_grad():  # non-trivial gates and output projections so every path carries signal
        model.ngram_gates.uniform_(0.5, 1.5)
        for block in model.blocks:
            if block.attn is not None:
                block.attn.o_w.normal_(std=0.05)
            if block.mlp is not None:
                block.mlp.proj_w.normal_(std=0.05)
    return model, shard


def full_table_input(shard: NgramShard, ids: torch.Tensor) -> NgramInput:
    """The whole table as the 'compact' leaf, indexed by raw row ids (the uncompacted reference)."""
    values = shard.weight[: shard.ngram_rows].clone().requires_grad_()
    return NgramInput(values=values, index=ngram_row_ids(ids, shard.ngram_rows), sign_rows=ngram_sign_rows(ids))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_compact_rows_equal_the_whole_table_in_the_gpt(seed):
    model, shard = model_and_shard(seed)
    ids, cu, gen = batch(seed)
    w = torch.randn(model.cfg.model_dim, generator=gen)
    compact = shard.prepare(ids)
    out = model(ids, cu, 40, (16, 64), ngram=compact)
    (out @ w).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    full = full_table_input(shard, ids)
    ref = model(ids, cu, 40, (16, 64), ngram=full)
    (ref @ w).sum().backward()
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(compact.values.grad, full.values.grad[compact.rows], rtol=1e-5, atol=1e-6)
    assert compact.values.grad.abs().sum() > 0
    for n, p in model.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(grads[n], p.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("seed", [3, 4])
def test_compact_value_embedding_rows_equal_the_dense_lookup(seed):
    model, shard = model_and_shard(seed)
    ids, cu, gen = batch(seed)
    w = torch.randn(model.cfg.model_dim, generator=gen)
    ng = shard.prepare(ids)
    ve = ValueEmbedShard(list(model.value_embeds)).prepare(ids)
    out = model(ids, cu, 40, (16, 64), ngram=ng, value_rows=ve)
    (out @ w).sum().backward()
    assert all(p.grad is None for p in model.value_embeds)  # no dense [vocab, D] gradient
    compact_grad = ve.values.grad
    assert compact_grad.shape == (2, torch.unique(ids).numel(), model.cfg.model_dim)
    model.zero_grad()
    ref = model(ids, cu, 40, (16, 64), ngram=shard.prepare(ids))
    (ref @ w).sum().backward()
    torch.testing.assert_close(out, ref)
    for p, plane in enumerate(model.value_embeds):
        torch.testing.assert_close(compact_grad[p], plane.grad[ve.ids], rtol=1e-5, atol=1e-6)
        assert compact_grad[p].abs().sum() > 0


def test_ngram_enters_at_the_start_and_at_the_configured_layers():
    model, shard = model_and_shard(5)
    ids, cu, _ = batch(5)
    base = model(ids, cu, 40, (16, 64), ngram=shard.prepare(ids)).detach()
    for k in range(3):  # the residual start, layer 1, layer 3
        with torch.no_grad():
            model.ngram_gates[k] += 0.5
        moved = model(ids, cu, 40, (16, 64), ngram=shard.prepare(ids)).detach()
        assert not torch.allclose(moved, base), k
        base = moved
    with torch.no_grad():
        model.ngram_gates.zero_()
    a = model(ids, cu, 40, (16, 64), ngram=shard.prepare(ids))
    shard.weight.mul_(3)
    b = model(ids, cu, 40, (16, 64), ngram=shard.prepare(ids))
    torch.testing.assert_close(a, b)  # with all gates at zero the table has no effect


def test_gate_init_and_errors():
    model = GPT(tiny())
    assert torch.equal(model.ngram_gates, torch.full((3,), 0.05))
    assert not any(n.startswith("ngram.") for n, _ in model.named_parameters())  # only the sign buffer
    ids, cu, _ = batch(0)
    with pytest.raises(ValueError, match="ngram_rows"):
        model(ids, cu, 40, (16, 64))
    with pytest.raises(ValueError, match="ngram_rows"):
        GPT(tiny(ngram_rows=0))(ids, cu, 40, (16, 64), ngram=NgramShard(ROWS, 64).prepare(ids))
    with pytest.raises(ValueError, match="ngram_rows"):
        tiny(ngram_rows=1001)
    with pytest.raises(ValueError, match="ngram_layers"):
        tiny(ngram_layers=[7])
    tiny(ngram_rows=0, ngram_layers=[7])  # the layers are ignored (and unchecked) when the table is off


# -- Lightning end to end ------------------------------------------------------------------
@pytest.fixture(scope="module")
def ngram_toy_files(tmp_path_factory):
    # smaller than the shared toy_files: these runs only need a few steps
    return write_markov_shards(tmp_path_factory.mktemp("toy"), n_train=150_000, n_val=20_000)


def ngram_run(files, steps: int):
    sched = tiny_schedule(steps, adam_every=2, sparse_cadence=4, sparse_cadence_start=2)
    return make_run(files, sched, gpt=tiny_gpt(ngram_rows=1 << 14, ngram_layers=[1]), val_tokens=2048)


@pytest.mark.slow
def test_lightning_run_trains_the_table_and_checkpoints_it_per_rank(ngram_toy_files, tmp_path, monkeypatch):
    monkeypatch.setattr(side_files, "INLINE_STATE_LIMIT_BYTES", 0)  # force the side file at one rank
    module, data = ngram_run(ngram_toy_files, 4)
    rec = LossRecorder()
    trainer = make_trainer(tmp_path, callbacks=[rec])
    trainer.fit(module, data)
    shard = module.sparse_channels.ngram
    assert sorted(rec.losses) == list(range(4)) and rec.val is not None
    # events at step 1 (every 2nd step) and step 3 (every 4th from step 2, cadence engaged)
    assert shard.adam.event == 2 and module.sparse_channels.value_embeds.step_count == 2
    assert shard.adam.beta2_segments == [(1, 0.95), (2, pytest.approx(0.95**2))]
    assert shard.weight.abs().sum() > 0 and "sparse" in module.optimizers().optimizer.parts
    assert all(p.grad is None for p in module.model.value_embeds)
    ckpt = tmp_path / "final.ckpt"
    trainer.save_checkpoint(ckpt)
    assert Path(rank_file(ckpt, 0)).exists()
    main = torch.load(ckpt, weights_only=False)
    assert main[RANK_LOCAL_KEY] == {"side_files": True, "world_size": 1}
    loaded = trainer.strategy.load_checkpoint(ckpt)
    state = loaded[RANK_LOCAL_KEY]["ngram"]
    assert torch.equal(state["weight"], shard.weight) and state["adam"]["event"] == 2
    trainer.strategy.remove_checkpoint(ckpt)
    assert not Path(rank_file(ckpt, 0)).exists()


@pytest.mark.slow
def test_two_gloo_processes_train_the_same_table_as_one_process(tmp_path, monkeypatch, run_cli, toy_config):
    """devices=2 (gloo, one micro-batch each) vs devices=1 (two micro-batches): same weights, same table."""
    # an earlier in-process Lightning run leaves its rendezvous variables in os.environ; a child
    # CLI that inherits LOCAL_RANK would take itself for a launched rank and wait for its peer
    for name in ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "WORLD_SIZE", "RANK", "PL_GLOBAL_SEED",
                 "PL_SEED_WORKERS"):
        monkeypatch.delenv(name, raising=False)

    files = write_markov_shards(tmp_path / "toy", n_train=150_000, n_val=20_000)
    rows = 1 << 14
    # sparse events every step until step 3, then every 2nd step (3, 5) with the cadence engaged;
    # the dense parts keep the config's cadence
    overrides = {"model.gpt.ngram_rows": rows, "model.gpt.ngram_layers": [1], "schedule.adam_every": 1,
                 "schedule.sparse_cadence": 2, "schedule.sparse_cadence_start": 3}
    results = {}
    for devices in (1, 2):
        work = tmp_path / f"d{devices}"
        work.mkdir()
        cfg = toy_config(work, files, **overrides)
        out = run_cli(["fit", "--config", str(cfg), "--trainer.devices", str(devices)], work)
        assert out.returncode == 0, out.stderr[-3000:]
        path = work / "ckpt" / "last.ckpt"
        main = torch.load(path, map_location="cpu", weights_only=False)
        tables = [load_rank_local(main, path, r, devices)[RANK_LOCAL_KEY]["ngram"]["weight"] for r in range(devices)]
        results[devices] = (main, torch.cat(tables)[:rows])
    (one, table1), (two, table2) = results[1], results[2]
    assert two[RANK_LOCAL_KEY] == {"side_files": True, "world_size": 2}  # each rank wrote its own shard
    assert one["global_step"] == two["global_step"] == 6
    for k, v in one["state_dict"].items():
        if isinstance(v, torch.Tensor) and torch.is_floating_point(v):
            torch.testing.assert_close(two["state_dict"][k], v, atol=2e-5, rtol=1e-4, msg=k)
    assert table1.abs().sum() > 0
    torch.testing.assert_close(table2, table1, atol=2e-5, rtol=1e-4)


@pytest.mark.slow
def test_resume_from_a_side_file_mid_cycle_gives_the_same_losses(ngram_toy_files, tmp_path, monkeypatch):
    """3 steps, checkpoint (with a queued gradient), resume for 3 more == 6 straight steps."""
    monkeypatch.setattr(side_files, "INLINE_STATE_LIMIT_BYTES", 0)  # the state goes through the side file

    def run():
        # sparse events at steps 0, 1 (every step), then 3, 5; step 2's gradient is queued at the checkpoint
        sched = tiny_schedule(6, adam_every=1, sparse_cadence=2, sparse_cadence_start=2)
        return make_run(ngram_toy_files, sched, gpt=tiny_gpt(ngram_rows=1 << 14, ngram_layers=[1]), val_tokens=2048)

    module, data = run()
    straight = LossRecorder()
    make_trainer(tmp_path / "straight", callbacks=[straight]).fit(module, data)
    table = module.sparse_channels.ngram.weight.clone()

    module, data = run()
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=3, save_top_k=-1)
    make_trainer(tmp_path / "first", max_steps=3, callbacks=[ckpt], enable_checkpointing=True).fit(module, data)
    assert module.sparse_channels.ngram.pending_rows() > 0
    saved = sorted((tmp_path / "ckpt").glob("*step=3*.ckpt"))
    assert saved and Path(rank_file(saved[0], 0)).exists()

    module, data = run()
    second = LossRecorder()
    make_trainer(tmp_path / "second", callbacks=[second]).fit(module, data, ckpt_path=str(saved[0]))
    assert sorted(second.losses) == [3, 4, 5]
    for step in (3, 4, 5):
        assert abs(second.losses[step] - straight.losses[step]) <= 1e-5, step
    torch.testing.assert_close(module.sparse_channels.ngram.weight, table, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_lightning_run_with_the_fixed_exchange_equals_the_reference(toy_files, tmp_path):
    """The module's training loop with fixed-capacity channels (as a compiled run builds them): same bits."""
    from train_helpers import LossRecorder, make_trainer

    from callbacks.speedrun_timer import SpeedrunTimer
    from nanogpt_pl.distributed.sparse_channels import build_sparse_channels

    runs = {}
    # the default channels; what prepare_for_training builds with model.compile on (without compiling);
    # the same with the value-embedding leaf sized from the batch plan (as the speedrun timer sizes it);
    # the same padded leaves with the exact-size exchange (model.optim.sparse_exchange: reference)
    for run, exchange in (("reference", None), ("fixed", "auto"), ("fixed, plan-sized", "auto"),
                          ("padded reference", "reference")):
        module, data = ngram_run(toy_files, 4)
        if exchange is not None:
            module.sparse_channels = build_sparse_channels(module.model, None, torch.device("cpu"), fixed_shapes=True,
                                                           exchange=exchange)
            fixed = run.startswith("fixed")
            assert module.sparse_channels.ngram.fixed is fixed and module.sparse_channels.value_embeds.fixed is fixed
            assert module.sparse_channels.fixed_shapes
        rec = LossRecorder()
        callbacks: list = [rec]
        if run == "fixed, plan-sized":
            # the speedrun timer sizes the leaf from the plan before its warmup, which it then undoes
            callbacks.append(SpeedrunTimer(warmup_steps=[2, 0], stop_at_target=False))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            make_trainer(tmp_path / run.replace(" ", "_"), callbacks=callbacks).fit(module, data)
        assert not [w for w in caught if "value embeddings:" in str(w.message)], run  # every batch fit its rows
        if run == "fixed, plan-sized":
            (T, most), = data.plan_bounds().distinct_tokens.items()
            assert module.sparse_channels.value_rows(T, most) == -(-most // 64) * 64 < T
        runs[run] = (rec, module.sparse_channels.state_dict(), module.model.state_dict())
    ref, ref_sparse, ref_model = runs.pop("reference")
    assert sorted(ref.losses) == list(range(4)) and ref_sparse["ngram"]["weight"].abs().sum() > 0
    for run, (rec, sparse, model) in runs.items():
        assert rec.losses == ref.losses and rec.val == ref.val, run
        assert torch.equal(sparse["ngram"]["weight"], ref_sparse["ngram"]["weight"]), run
        for name, value in ref_model.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(model[name], value), (run, name)


def test_the_hash_backend_reaches_the_shard_and_a_bad_one_fails_in_one_line():
    from nanogpt_pl.backends import Backends
    from nanogpt_pl.module import SpeedrunModule

    gpt = tiny_gpt(ngram_rows=1 << 14, ngram_layers=[1])
    module = SpeedrunModule(gpt=gpt, backends=Backends(ngram="reference"))
    module.prepare_for_training(torch.device("cpu"))
    assert module.sparse_channels.ngram.hash_backend == "reference"
    with pytest.raises(ValueError, match=r"^model.backends.ngram='fast': choose one of auto, reference, triton$"):
        SpeedrunModule(gpt=gpt, backends=Backends(ngram="fast"))
    module = SpeedrunModule(gpt=gpt, backends=Backends(ngram="triton"))
    one_line = r"^model.backends.ngram='triton' needs a CUDA device.*: use 'reference' or 'auto'$"
    with pytest.raises(RuntimeError, match=one_line):
        module.prepare_for_training(torch.device("cpu"))


def test_the_sparse_exchange_option_reaches_both_channels():
    from nanogpt_pl.module import OptimConfig, SpeedrunModule

    gpt = tiny_gpt(ngram_rows=1 << 14, ngram_layers=[1])
    # on the CPU without compile the leaves have exact shapes, so auto is the reference exchange
    for choice, fixed in (("auto", False), ("fixed", True), ("reference", False)):
        module = SpeedrunModule(gpt=gpt, optim=OptimConfig(sparse_exchange=choice))
        module.prepare_for_training(torch.device("cpu"))
        channels = module.sparse_channels
        assert channels.ngram.fixed is fixed and channels.value_embeds.fixed is fixed, choice
    one_line = r"^model.optim.sparse_exchange='exact': choose one of auto, reference, fixed$"
    with pytest.raises(ValueError, match=one_line):
        OptimConfig(sparse_exchange="exact")
