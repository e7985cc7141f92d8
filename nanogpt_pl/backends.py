"""Which implementation each numerical part runs: the one ``model.backends`` section.

Every numerical trick has a plain PyTorch path, named ``reference`` in every section (it runs
anywhere), and fast paths; the choice of each lives here, so a run's YAML names all of them in
one place::

    model:
      backends: {attention: auto, fp8: auto, loss: auto, polar: auto, anvil: auto, adam: auto, ngram: auto,
                 ngram_rows: auto, value_rows: auto, qk_rotary: auto}

``auto`` picks the fast path on a CUDA GPU and the reference elsewhere, except where a fast path
has not been shown faster than its reference in the step on a GPU (``ngram_rows``): there ``auto``
is the reference and the fast path is chosen by name. The values are
handed unchanged to the parts that resolve them; each part's own check names the choices it
accepts (in one line naming ``model.backends.<part>``, with a pointer to ``reference`` for the
former names ``sdpa``, ``emulated`` and ``torch``) and rejects one the device cannot run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

import torch

# The choices of a part with one Triton path: ``ngram_rows`` takes it only when named
# (:func:`resolve_opt_in`); ``anvil``, ``adam``, ``ngram``, ``value_rows`` and ``qk_rotary`` also for ``auto`` on a GPU
# (:func:`resolve_fast_on_gpu`)
OPT_IN_CHOICES = ("auto", "reference", "triton")


def check_opt_in(part: str, backend: str) -> None:
    """Raise (one line naming ``model.backends.<part>``) unless ``backend`` is one of :data:`OPT_IN_CHOICES`."""
    if backend not in OPT_IN_CHOICES:
        raise ValueError(f"model.backends.{part}={backend!r}: choose one of {', '.join(OPT_IN_CHOICES)}")


def resolve_opt_in(part: str, backend: str, device: Union[torch.device, str], holder: str) -> str:
    """``reference`` or ``triton`` for ``model.backends.<part>``, a part whose Triton path is not yet
    timed against its reference on a GPU: ``auto`` is the reference, ``triton`` must be asked for
    by name and raises (one line) where it cannot run. ``holder`` names what lives on ``device``
    (e.g. "the parameters are")."""
    from .ops.triton import triton_usable

    check_opt_in(part, backend)
    if backend != "triton":
        return "reference"
    if not triton_usable(device):
        raise RuntimeError(
            f"model.backends.{part}='triton' needs a CUDA device with Triton installed (or TRITON_INTERPRET=1 to "
            f"debug on CPU); {holder} on {torch.device(device)}: use 'reference' or 'auto'"
        )
    return "triton"


def resolve_fast_on_gpu(part: str, backend: str, device: Union[torch.device, str], holder: str) -> str:
    """``reference`` or ``triton`` for ``model.backends.<part>``, a part whose Triton path was timed
    faster in the step: ``auto`` is ``triton`` on a CUDA device with Triton installed and the
    reference elsewhere (the interpreter included); ``triton`` and ``reference`` as in
    :func:`resolve_opt_in`."""
    from .ops.triton import triton_usable

    check_opt_in(part, backend)
    if backend == "auto":
        return "triton" if torch.device(device).type == "cuda" and triton_usable(device) else "reference"
    return resolve_opt_in(part, backend, device, holder)


@dataclass
class Backends:
    """Implementation choices; YAML keys under ``model.backends``.

    Args:
        attention: document-masked windowed attention (``nanogpt_pl.model.attention``): ``auto``
            (``triton`` on CUDA), ``reference`` (dense masked SDPA, the CPU path), or the CUDA kernels
            ``triton`` / ``varlen`` / ``flex``, and ``fa3`` / ``fa4`` where FlashAttention 3 / 4 is installed.
        fp8: the FP8 matmuls of the MLP, QKV and lm_head (``nanogpt_pl.ops.fp8``): ``auto``,
            ``reference`` (quantize, dequantize, fp32 matmul) or ``scaled_mm`` (CUDA, sm_89+).
        loss: the softcapped (sampled) cross-entropy of training (``nanogpt_pl.ops.cross_entropy``):
            ``auto`` (``triton_held`` on CUDA, ``chunked`` elsewhere), ``reference`` (autograd on
            fp32 logits), ``chunked`` (the fused algorithm in PyTorch), ``triton`` (the Triton
            kernel, reading a row twice) or ``triton_held`` (the Triton kernel keeping a sampled
            row's gradient factors in registers between its two passes; the full vocabulary
            streams).
        polar: ANVIL's polar cascade (``nanogpt_pl.optim.polar``): ``auto``, ``reference`` or
            ``triton``.
        anvil: ANVIL's elementwise update around the cascade (rails, lookahead, lanes, cautious decay
            and step; ``nanogpt_pl.optim.anvil``): ``auto`` (``triton`` on CUDA), ``reference`` or
            ``triton`` (four kernels a bank).
        adam: the dense Adam groups' update (moments, decay and step; ``nanogpt_pl.optim.adam``):
            ``auto`` (``triton`` on CUDA), ``reference`` or ``triton`` (one pass a parameter).
        ngram: the n-gram channel's hashes of a micro-batch's tokens (bigram and trigram rows and
            their sign rows; ``nanogpt_pl.model.embeddings.ngram_hashes``): ``auto`` (``triton`` on
            CUDA), ``reference`` or ``triton`` (one pass).
        ngram_rows: the gradient of the n-gram channel's compact leaf
            (``nanogpt_pl.model.embeddings.HashedNgramEmbedding``): ``auto``, ``reference`` (a zero
            fill and autograd's atomic scatter) or ``triton`` (sorted by row, every row stored once).
        value_rows: the gradient of the value-embedding planes' gather from a micro-batch's compact
            leaf (``nanogpt_pl.model.embeddings.gather_planes``): ``auto`` (``triton`` on CUDA),
            ``reference`` (autograd's atomic scatter) or ``triton`` (sorted by row, one atomic a run
            of equal rows).
        qk_rotary: the per-head RMS norm of queries and keys, their rotary rotation and the key
            offset (``nanogpt_pl.model.attention.qk_norm_rotary``): ``auto`` (``triton`` on CUDA),
            ``reference`` (the PyTorch expressions, which inductor fuses) or ``triton`` (one pass
            forward, one backward).
    """

    attention: str = "auto"
    fp8: str = "auto"
    loss: str = "auto"
    polar: str = "auto"
    anvil: str = "auto"
    adam: str = "auto"
    ngram: str = "auto"
    ngram_rows: str = "auto"
    value_rows: str = "auto"
    qk_rotary: str = "auto"
