"""SpeedrunStrategy's SIGTERM agreement (nanogpt_pl/distributed/stop_signal.py) on gloo ranks."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from gloo_group import init_gloo, leave, spawn_ranks, store_path

from nanogpt_pl.distributed.stop_signal import StopSignal, agreement_group

STEPS = 8


def _trainer(rank: int) -> SimpleNamespace:
    return SimpleNamespace(_signal_connector=SimpleNamespace(received_sigterm=False), global_rank=rank,
                           strategy=SimpleNamespace(launcher=None))


def _worker(rank: int, world: int, store: str, out: str, asker: int, at: int) -> None:
    """Rank ``asker`` gets a real SIGTERM before step ``at``; every rank calls ``agree`` once a step,
    with a collective of the step's own between two agreements (as the training step has)."""
    init_gloo(rank, world, store)
    try:
        trainer = _trainer(rank)
        stop = StopSignal(trainer, agreement_group(world))
        previous = signal.signal(signal.SIGTERM, stop.on_sigterm)
        broadcasts = []
        real_broadcast = dist.broadcast
        dist.broadcast = lambda *a, **k: broadcasts.append(1) or real_broadcast(*a, **k)
        checks, decisions, flags_before = 0, [], []
        for step in range(STEPS):
            if rank == asker and step == at:
                os.kill(os.getpid(), signal.SIGTERM)  # the handler runs before the next bytecode
                # with several ranks the flag waits for the agreement: no rank stops this step alone
                flags_before.append(trainer._signal_connector.received_sigterm)
            decisions.append(stop.agree())
            dist.all_reduce(torch.ones(1))  # a collective of the step's own between two agreements
        dist.broadcast = real_broadcast
        signal.signal(signal.SIGTERM, previous)
        want = [step >= at for step in range(STEPS)]
        checks += decisions == want
        checks += trainer._signal_connector.received_sigterm is True
        checks += stop.requested is True
        checks += stop.agreements == STEPS
        checks += not broadcasts  # the handler broadcasts nothing; the agreement is an all-reduce
        checks += flags_before == ([False] if rank == asker else [])
        Path(out, f"rank{rank}.json").write_text(json.dumps({"checks": checks, "decisions": decisions}))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    leave()


CHECKS_PER_RANK = 6


@pytest.mark.parametrize("world, asker, at", [(2, 1, 3), (4, 0, 5), (3, 2, 0)])
def test_every_rank_stops_at_the_step_after_any_rank_got_sigterm(world, asker, at, tmp_path):
    spawn_ranks(_worker, (world, store_path(tmp_path), str(tmp_path), asker, at), world)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    assert [r["checks"] for r in results] == [CHECKS_PER_RANK] * world, results


def test_one_process_reads_its_flag_without_a_group():
    trainer = _trainer(0)
    stop = StopSignal(trainer, agreement_group(1))
    assert stop.group is None and stop.agree() is False
    stop.request()  # one process: Lightning's own end-of-step check stops the run after this step
    assert trainer._signal_connector.received_sigterm is True and stop.agree() is True and stop.agreements == 0


def test_install_replaces_lightnings_notifier_and_per_step_broadcast(tmp_path, toy_files):
    """Through a real Trainer: after the strategy's setup, SIGTERM's registered handler is the
    agreement's, and the training loop's per-step broadcast is its step-start check."""
    import lightning as L
    from train_helpers import make_run, make_trainer, tiny_schedule

    seen = {}

    class Probe(L.Callback):
        def on_train_start(self, trainer, pl_module):
            handler = signal.getsignal(signal.SIGTERM)
            seen["handlers"] = [getattr(h, "__func__", h) for h in getattr(handler, "signal_handlers", [])]
            seen["step_start"] = trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor
            seen["stop"] = trainer.strategy.stop_signal
            trainer.should_stop = True

    module, data = make_run(toy_files, tiny_schedule(2))
    make_trainer(tmp_path, callbacks=[Probe()]).fit(module, data)
    stop = seen["stop"]
    assert isinstance(stop, StopSignal)
    assert StopSignal.on_sigterm in seen["handlers"]
    assert seen["step_start"] == stop.at_step_start



def test_without_a_gloo_group_sigterm_stays_with_lightning_and_says_so(monkeypatch, caplog):
    """Several ranks whose gloo group cannot connect (a real failure needs a broken network; the
    error is raised in its place): one warning, and Lightning's handlers are left as they are."""
    from nanogpt_pl.distributed import stop_signal

    def no_gloo(world_size):
        raise RuntimeError("Gloo connectFullMesh failed")

    monkeypatch.setattr(stop_signal, "agreement_group", no_gloo)
    trainer = _trainer(0)
    notifier = object()
    trainer._signal_connector._sigterm_notifier_fn = notifier
    with caplog.at_level("WARNING", logger=stop_signal.__name__):
        assert stop_signal.install_stop_signal(trainer, 2) is None
    assert trainer._signal_connector._sigterm_notifier_fn is notifier
    assert [r.getMessage() for r in caplog.records] == [
        "SpeedrunStrategy: no gloo group for the SIGTERM agreement (Gloo connectFullMesh failed); SIGTERM is left "
        "to Lightning's own handling (set GLOO_SOCKET_IFNAME to the interface the ranks share)"]
