"""callbacks/memory_cap.py: a GPU capped to a smaller card's memory (configs/speedrun_24gb.yaml)."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from callbacks.memory_cap import GIB, GpuMemoryCap, memory_fraction


@pytest.mark.parametrize("max_gib, total, want", [(22, 141 * 10**9, 22 * 2**30 / (141 * 10**9)),
                                                  (22, 80 * 2**30, 0.275), (40, 24 * 10**9, 1.0)])
def test_fraction_of_the_device(max_gib, total, want):
    assert memory_fraction(max_gib, total) == pytest.approx(want, rel=1e-12)


def test_a_cap_that_is_not_positive_is_refused():
    with pytest.raises(ValueError, match="GpuMemoryCap.max_gib must be positive"):
        GpuMemoryCap(0)


def test_on_cpu_it_says_once_that_it_has_no_effect():
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    cap = GpuMemoryCap(22)
    with pytest.warns(UserWarning, match=r"GpuMemoryCap\(max_gib=22.0\) has no effect on cpu"):
        cap.setup(trainer, L.LightningModule(), "fit")
    assert cap.fraction is None


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_an_allocation_past_the_cap_runs_out_of_memory():
    trainer = L.Trainer(accelerator="cuda", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    cap = GpuMemoryCap(2)
    try:
        cap.setup(trainer, L.LightningModule(), "fit")
        torch.cuda.empty_cache()
        ok = torch.empty(GIB, dtype=torch.uint8, device="cuda")  # 1 GiB fits under 2
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(2 * GIB, dtype=torch.uint8, device="cuda")
        del ok
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()


def test_the_24gb_config_keeps_the_record_schedule_with_smaller_micro_batches():
    from nanogpt_pl.config_files import load_config

    small, full = load_config("configs/speedrun_24gb.yaml"), load_config("configs/speedrun_1gpu.yaml")
    a, b = small["schedule"]["stages"], full["schedule"]["stages"]
    assert len(a) == len(b)
    for s, f in zip(a, b):
        assert {k: v for k, v in s.items() if k != "seq_len"} == {k: v for k, v in f.items() if k != "seq_len"}
        assert s["seq_len"] <= 24_576 and s["batch_tokens"] % s["seq_len"] == 0
    assert {k: v for k, v in small["schedule"].items() if k != "stages"} == \
        {k: v for k, v in full["schedule"].items() if k != "stages"}
    assert small["model"]["gpt"]["ngram_rows"] == 84_602_880 // 32  # RECORD §3 table / 32
    caps = [c for c in small["trainer"]["callbacks"] if c["class_path"] == "callbacks.memory_cap.GpuMemoryCap"]
    assert caps == [{"class_path": "callbacks.memory_cap.GpuMemoryCap", "init_args": {"max_gib": 22}}]
