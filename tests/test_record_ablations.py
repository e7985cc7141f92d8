"""The record's network and each of its ablation overlays build and train 3 steps on CPU.

Each run is configs/speedrun.yaml with one configs/ablations/*.yaml on top, shrunk to tiny
dims (6 heads, as MUDD's layout needs) on the embedded quickstart corpus.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch
import yaml

from nanogpt_pl.cli import cli_main

ROOT = Path(__file__).resolve().parents[1]

# the CLI is driven with explicit args from inside pytest (whose own argv it would otherwise see)
pytestmark = pytest.mark.filterwarnings("ignore:LightningCLI's args parameter")
ABLATIONS = ("no_mudd", "uniform_widths", "no_xsa", "no_attn_gate", "no_key_offset", "no_parallel_mlp",
             "plain_network")
TINY_GPT = dict(model_dim=96, head_dim=16, mlp_hidden=64, ngram_rows=4096, fp8_mlp=False, fp8_head=False,
                fp8_qkv=False)


def merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in over.items():
        out[key] = merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def tiny_run_config(tmp: Path, ablation: str | None) -> Path:
    cfg = yaml.safe_load((ROOT / "configs" / "speedrun.yaml").read_text())
    if ablation is not None:
        cfg = merge(cfg, yaml.safe_load((ROOT / "configs" / "ablations" / f"{ablation}.yaml").read_text()))
    cfg = merge(cfg, {
        "trainer": dict(accelerator="cpu", devices=1, logger=False, callbacks=[], enable_progress_bar=False,
                        enable_model_summary=False),
        "model": {"gpt": TINY_GPT, "compile": False},
        "schedule": dict(stages=[dict(steps=3, batch_tokens=2048, seq_len=1024, max_doc_len=512, window_short=128,
                                      window_long=256, lr_mul=1.0, candidates=4096)],
                         anvil_engage_step=1, untie_step=None, attention_cap=None, val_window_short=128,
                         val_window_long=256),
        "data": dict(corpus="quickstart", train_files=None, val_files=None, val_tokens=4096, val_seq_len=1024,
                     epochs=1),
    })
    out = tmp / "config.yaml"
    out.write_text(yaml.safe_dump(cfg))
    return out


@pytest.mark.parametrize("ablation", [None, *ABLATIONS])
def test_record_network_and_ablations_train_three_steps(tmp_path, ablation, one_thread):
    torch.manual_seed(0)
    cli = cli_main(["--config", str(tiny_run_config(tmp_path, ablation))], run=False, save_config=False)
    module, data = cli.model, cli.datamodule
    data.prepare_data()
    data.setup("fit")
    module.prepare_for_training(torch.device("cpu"))
    opt = module.configure_optimizers()
    module.use_plain_optimizer(opt)
    module.train()
    before = {n: p.detach().clone() for n, p in module.model.named_parameters()}
    it = iter(data.train_dataloader())
    losses = []
    for step in range(3):
        batch = module.prepare_batch(next(it), step)
        module.apply_schedule(step)
        losses.append(float(module.run_step(batch)))
    assert all(math.isfinite(v) for v in losses), losses
    cfg = module.gpt_config
    if ablation in ("no_mudd", "plain_network"):
        assert module.model.mudd is None and not cfg.mudd
    elif ablation == "uniform_widths":
        assert all(b.attn.spec.d_qk == b.attn.spec.d_v == cfg.head_dim for b in module.model.blocks if b.attn)
    elif ablation == "no_parallel_mlp":
        assert all(b.parallel_mlp is None for b in module.model.blocks)
    else:
        assert module.model.mudd is not None
    # the matrices moved (ANVIL) and MUDD's zero-initialized W₂ and its κ trained (Adam, every other step)
    moved = [n for n, p in module.model.named_parameters() if not torch.equal(p.detach(), before[n])]
    assert "blocks.0.attn.qk_w" in moved and "blocks.10.mlp.fc_w" in moved
    if ablation not in ("no_mudd", "plain_network"):
        assert {"mudd.pre_gate.w2", "mudd.post_gate.w2", "mudd.gate_scale", "mudd.final_mix.w2g"} <= set(moved)
