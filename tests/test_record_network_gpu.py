"""The record's network on the GPU kernels (``auto``: triton for every layer kind; varlen for the
(64, 64) layers; and flex) against the masked-SDPA reference path, and its training step with FP8 on."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from nanogpt_pl.backends import Backends
from nanogpt_pl.model.gpt import GPT, GPTConfig

ROOT = Path(__file__).resolve().parents[1]
SPEEDRUN = yaml.safe_load((ROOT / "configs" / "speedrun.yaml").read_text())["model"]["gpt"]

pytestmark = pytest.mark.cuda  # skipped without a GPU (tests/conftest.py)


def build(backend: str, **kw) -> GPT:
    torch.manual_seed(0)
    cfg = GPTConfig(**{**SPEEDRUN, "vocab_size": 512, "ngram_rows": 0, "fp8_mlp": False, "fp8_head": False,
                       "fp8_qkv": False, **kw})
    model = GPT(cfg, Backends(attention=backend)).cuda()
    with torch.no_grad():  # leave the zero init so every attention layer matters
        for block in model.blocks:
            if block.attn is not None:
                block.attn.o_w.normal_(std=0.02)
            if block.mlp is not None:
                block.mlp.proj_w.normal_(std=0.02)
    return model


@pytest.mark.parametrize("seed", [0, 1])
def test_fast_kernels_match_the_reference_path(seed):
    gen = torch.Generator().manual_seed(seed)
    n = 2048
    ids = torch.randint(0, 512, (n,), generator=gen).cuda()
    cuts = torch.sort(torch.randperm(n - 1, generator=gen)[:7] + 1).values
    cu = torch.cat([torch.tensor([0]), cuts, torch.tensor([n, n])]).to(torch.int32).cuda()
    max_len = int((cu[1:] - cu[:-1]).max())
    outs = {}
    for backend in ("reference", "auto"):
        model = build(backend)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            outs[backend] = model(ids, cu, max_len, (128, 384)).float()
    err = (outs["auto"] - outs["reference"]).abs().max().item()
    assert err < 0.05, err


def test_training_step_with_fp8_on_the_gpu():
    model = build("auto", fp8_mlp=True, fp8_qkv=True, fp8_qkv_x_scale=8 / 448).bfloat16().train()
    ids = torch.randint(0, 512, (4096,)).cuda()
    cu = torch.tensor([0, 1000, 4096, 4096], dtype=torch.int32).cuda()
    h = model(ids, cu, 3096, (128, 384))
    (h.float() @ model.lm_head.float().t()).logsumexp(-1).mean().backward()
    assert torch.isfinite(h).all()
    narrow = model.blocks[0].attn
    assert not narrow.qk_w.grad.view(2, 6, 128, -1)[:, :, 64:].any()


@pytest.mark.parametrize("seed", [0, 1])
def test_layers_8_and_10_share_one_quantize_bit_for_bit_on_the_gpu(seed, monkeypatch):
    """RECORD §2/§7: norm(cache[7]) quantized once for layers 8 and 10 (the fast path: the Triton
    quantize pass and ``_scaled_mm``) gives the output of quantizing it per layer bit for bit, and
    the same gradients (to within the run-to-run order of the backward's atomic sums)."""
    model = build("auto", fp8_mlp=True, fp8_qkv=True).bfloat16().train()
    gen = torch.Generator().manual_seed(seed)
    n = 32768
    ids = torch.randint(0, 512, (n,), generator=gen).cuda()
    cu = torch.tensor([0, 1000, 17000, n], dtype=torch.int32).cuda()
    g = torch.randn(n, model.cfg.model_dim, generator=gen).cuda().bfloat16()
    got = []
    for shared in (True, False):
        if not shared:
            monkeypatch.setattr(GPT, "_cache_attn_input", lambda self, normed: normed)
        model.zero_grad(set_to_none=True)
        h = model(ids, cu, 16000, (128, 384))
        (h.float() * g.float()).sum().backward()
        got.append([h.detach()] + [p.grad for p in model.parameters() if p.grad is not None])
    assert torch.equal(got[0][0], got[1][0])
    for a, b in zip(got[0][1:], got[1][1:], strict=True):
        torch.testing.assert_close(a.float(), b.float(), rtol=1e-2, atol=1e-6)
