"""``nanogpt-pl generate``: sample text from a trained checkpoint.

The network is the one validation scores (RECORD §12): the checkpoint's weights, its
rotary (YaRN) state, and the schedule's validation windows, which the checkpoint
carries. When the checkpoint holds tail accumulators that were not shipped yet (a
checkpoint from inside the tail window, RECORD §10), they are shipped first, so the
samples come from the weights the final validation would have scored.

There is no key/value cache: each new token runs the whole sequence again. That keeps
the forward the validation forward (document-masked sliding-window attention over one
packed document) and costs nothing that matters at the lengths one samples by hand.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any, Optional

import torch

from ..averaging import record_tracks, ship_tail
from ..backends import Backends
from ..data.tokenizer import EOT_TOKEN, TOKENIZER_VOCAB, get_encoding
from ..distributed.side_files import RANK_LOCAL_KEY, load_rank_local
from ..model.gpt import GPTConfig
from ..module import AdamGroup, OptimConfig, SpeedrunModule
from ..ops.cross_entropy import softcap


def _config(cls: type, value: Any) -> Any:
    """A config dataclass from a checkpoint's hyperparameters (the CLI saves them as plain dicts)."""
    if dataclasses.is_dataclass(value):
        return value
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, v in dict(value).items():
        if key not in fields:
            continue  # an option of a newer or older version; the weights decide what loads
        kwargs[key] = AdamGroup(**v) if isinstance(v, dict) and cls is OptimConfig else v
    return cls(**kwargs)


def find_checkpoint(path: str | Path) -> Path:
    """``path`` itself, or ``last.ckpt`` (else the newest ``*.ckpt``) when ``path`` is a folder."""
    p = Path(path)
    if p.is_dir():
        if (p / "last.ckpt").is_file():
            return p / "last.ckpt"
        found = sorted(p.glob("*.ckpt"), key=lambda f: f.stat().st_mtime)
        if not found:
            raise FileNotFoundError(f"no .ckpt file in {p}; pass a checkpoint written by ModelCheckpoint "
                                    "(e.g. logs/quickstart/csv/version_0/checkpoints/last.ckpt)")
        return found[-1]
    if not p.is_file():
        raise FileNotFoundError(f"checkpoint {p} not found; pass a .ckpt written by ModelCheckpoint "
                                "(e.g. logs/quickstart/csv/version_0/checkpoints/last.ckpt)")
    return p


def _tail_state(checkpoint: dict[str, Any]) -> Optional[dict[str, Any]]:
    """The TailAveraging callback's state when it holds accumulators that were not shipped."""
    for key, state in checkpoint.get("callbacks", {}).items():
        if key.startswith("TailAveraging") and isinstance(state, dict) and state.get("acc") and \
                not state.get("shipped", False):
            return state
    return None


def _ship_tail(module: SpeedrunModule, state: dict[str, Any]) -> list[str]:
    # the ship rule (order, blends, decontraction) is the one TailAveraging uses (nanogpt_pl.averaging)
    tracks = [t for t in record_tracks() if t.name in state["acc"]]
    unknown = sorted(set(state["acc"]) - {t.name for t in tracks})
    if unknown:
        raise ValueError(f"the checkpoint's tail accumulators {unknown} are not the record's tracks, so their blend "
                         "is unknown here; pass --no-tail-average to sample from the live weights")
    acc = {k: [t.to(module.device) for t in v] for k, v in state["acc"].items()}
    ship_tail(module.model, tracks, acc)
    return [t.name for t in tracks]


def load_for_sampling(checkpoint_path: str | Path, device: str | torch.device = "cpu", tail_average: bool = True,
                      windows: Optional[tuple[int, int]] = None) -> tuple[SpeedrunModule, tuple[int, int], str]:
    """(module in eval mode, the windows to sample with, which weights were loaded) from a checkpoint.

    Args:
        checkpoint_path: a Lightning checkpoint, or a folder holding ``last.ckpt``.
        device: where to run.
        tail_average: ship unshipped tail accumulators into the weights (when the checkpoint has them).
        windows: (short, long) attention windows; default: the schedule's validation windows
            saved in the checkpoint.
    """
    path = find_checkpoint(checkpoint_path)
    device = torch.device(device)
    try:
        # a Lightning checkpoint also pickles loop and callback state, which weights_only refuses
        checkpoint = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:
        raise ValueError(f"could not read checkpoint {path} ({type(e).__name__}: {e}); pass a .ckpt written by "
                         "ModelCheckpoint") from e
    hp = checkpoint.get("hyper_parameters") if isinstance(checkpoint, dict) else None
    if not hp or "gpt" not in hp or "state_dict" not in checkpoint:
        raise ValueError(f"{path} is not a checkpoint of a nanogpt-pl training run (no model hyperparameters); "
                         "pass a .ckpt written by ModelCheckpoint during `nanogpt-pl fit`")
    entry = checkpoint.get(RANK_LOCAL_KEY)
    if isinstance(entry, dict) and entry.get("side_files") and entry.get("world_size", 1) > 1:
        raise ValueError(f"{path} keeps its n-gram table sharded over {entry['world_size']} ranks in side files; "
                         "generate reads single-rank checkpoints (train or save with --trainer.devices 1)")
    checkpoint = load_rank_local(checkpoint, path, 0, 1)
    # the validation forward: no FP8 (RECORD §12 "bf16, no fp8"), the device's attention kernel
    gpt = dataclasses.replace(_config(GPTConfig, hp["gpt"]), fp8_mlp=False, fp8_head=False, fp8_qkv=False)
    module = SpeedrunModule(gpt=gpt, optim=_config(OptimConfig, hp["optim"]), backends=Backends(attention="auto"),
                            param_dtype="float32" if device.type == "cpu" else "auto")
    module.prepare_for_training(device)
    module.to(device)
    state = {k: v for k, v in checkpoint["state_dict"].items()}
    missing, unexpected = module.load_state_dict(state, strict=False)
    # FP8 layers carry scale buffers this plain forward does not have; every weight must match
    missing = [k for k in missing if "fp8" not in k]
    if missing:
        raise ValueError(f"{path} lacks weights {missing[:4]} of its own model config; the checkpoint is damaged")
    module.on_load_checkpoint(checkpoint)
    which = "live weights"
    if tail_average:
        state = _tail_state(checkpoint)
        if state is not None:
            which = "tail-averaged weights (" + ", ".join(_ship_tail(module, state)) + ")"
    if windows is None:
        saved = checkpoint.get("speedrun", {}).get("val_windows")
        if saved is None:
            raise ValueError(f"{path} does not record the schedule's validation windows (an older checkpoint); "
                             "pass --windows SHORT LONG (schedule.val_window_short / val_window_long of its config)")
        windows = (int(saved[0]), int(saved[1]))
    module.eval()
    return module, windows, which


@torch.no_grad()
def next_token_logits(module: SpeedrunModule, tokens: torch.Tensor, windows: tuple[int, int]) -> torch.Tensor:
    """Softcapped logits [vocab] for the token after ``tokens`` (one document, starting with BOS)."""
    n = tokens.numel()
    cu = torch.tensor([0, n], dtype=torch.int32, device=tokens.device)
    sparse = module.sparse_channels.inputs(tokens, train=False) if module.sparse_channels else {}
    hidden = module.model(tokens, cu, n, windows, **sparse)
    head = module.model.lm_head
    return softcap(hidden[-1:] @ head.to(hidden.dtype).t())[0].float()


@torch.no_grad()
def sample(module: SpeedrunModule, prompt: list[int], windows: tuple[int, int], max_new_tokens: int = 100,
           temperature: float = 1.0, top_k: Optional[int] = None, seed: int = 1234,
           stop_at_eot: bool = True) -> list[int]:
    """Token ids sampled after ``prompt`` (which starts with BOS, as every training document).

    ``temperature`` 0 picks the most likely token; ``top_k`` keeps the k most likely tokens.
    The padded classes beyond the tokenizer's 50,257 are never sampled.
    """
    if temperature < 0:
        raise ValueError(f"--temperature must be >= 0, got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"--top-k must be >= 1, got {top_k}")
    device = module.model.lm_head.device
    gen = torch.Generator(device=device).manual_seed(seed)
    tokens = torch.tensor(prompt, dtype=torch.int64, device=device)
    out: list[int] = []
    for _ in range(max_new_tokens):
        logits = next_token_logits(module, tokens, windows)[:TOKENIZER_VOCAB]
        if temperature == 0:
            nxt = int(logits.argmax())
        else:
            logits = logits / temperature
            if top_k is not None and top_k < logits.numel():
                kth = torch.topk(logits, top_k).values[-1]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen))
        if stop_at_eot and nxt == EOT_TOKEN:
            break
        out.append(nxt)
        tokens = torch.cat([tokens, tokens.new_tensor([nxt])])
    return out


def generate_text(checkpoint: str | Path, prompt: str = "", max_new_tokens: int = 100, temperature: float = 1.0,
                  top_k: Optional[int] = 50, seed: int = 1234, device: str = "cpu", tail_average: bool = True,
                  windows: Optional[tuple[int, int]] = None) -> tuple[str, str]:
    """(prompt + sampled text, which weights were used)."""
    if max_new_tokens < 0:
        raise ValueError(f"--max-new-tokens must be >= 0, got {max_new_tokens}")
    enc = get_encoding()
    module, windows, which = load_for_sampling(checkpoint, device, tail_average, windows)
    ids = sample(module, [EOT_TOKEN] + enc.encode(prompt), windows, max_new_tokens, temperature, top_k, seed)
    return prompt + enc.decode(ids), which


def add_arguments(parser) -> None:
    parser.add_argument("checkpoint", help="a .ckpt written during training, or its folder (last.ckpt is used)")
    parser.add_argument("--prompt", default="", help="text to continue (default: start a new document)")
    parser.add_argument("--max-new-tokens", type=int, default=100, help="tokens to sample (default 100)")
    parser.add_argument("--temperature", type=float, default=1.0, help="softmax temperature; 0 = greedy (default 1)")
    parser.add_argument("--top-k", type=int, default=50, help="sample among the k most likely tokens (default 50; "
                        "0 = all)")
    parser.add_argument("--seed", type=int, default=1234, help="sampling seed (default 1234)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    parser.add_argument("--windows", type=int, nargs=2, metavar=("SHORT", "LONG"), default=None,
                        help="attention windows in tokens (default: the checkpoint's validation windows)")
    parser.add_argument("--no-tail-average", action="store_true",
                        help="use the live weights even when the checkpoint holds unshipped tail averages")


def run(args) -> int:
    text, which = generate_text(args.checkpoint, args.prompt, args.max_new_tokens, args.temperature,
                                args.top_k or None, args.seed, args.device, not args.no_tail_average,
                                tuple(args.windows) if args.windows else None)
    print(f"[{which}]", file=sys.stderr)
    print(text)
    return 0
