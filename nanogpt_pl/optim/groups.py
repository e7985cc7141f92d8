"""Which parameter gets which optimizer and settings, by parameter-name pattern.

The model names its parameters and knows nothing of optimizers; this module maps the
names to the record's optimizer groups (RECORD §8), torchtitan-style: each rule is an
``fnmatch`` pattern over ``named_parameters()`` names, and the first matching rule wins.

- :data:`MATRIX_RULES`: the hidden matrices for ANVIL, each with the block shape it is
  orthogonalized in and a per-matrix lr multiplier.
- :data:`ADAM_RULES`: every other parameter's Adam family; the settings of each family
  are the ``model.optim`` field of the same name (``OptimConfig``).
"""

from __future__ import annotations

from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Iterable, Optional

from torch import nn

# RECORD §8 "Hyperparameters": per-matrix lr multiplier of the MLP's c_proj.
PROJ_LR_MUL = 2.0


@dataclass(frozen=True)
class MatrixRule:
    """Matrices whose name matches ``pattern``.

    Args:
        pattern: ``fnmatch`` pattern over parameter names.
        block: ``head_pair``: (2·head_dim, model_dim) matrices, two heads of Q or K each
            (RECORD §8 qk_bank: 256×768); None: the parameter's last two dims.
        lr_mul: per-matrix lr multiplier.
    """

    pattern: str
    block: Optional[str] = None
    lr_mul: float = 1.0


MATRIX_RULES: tuple[MatrixRule, ...] = (
    MatrixRule("blocks.*.attn.qk_w", block="head_pair"),
    MatrixRule("blocks.*.attn.v_w"),
    MatrixRule("blocks.*.attn.o_w"),
    MatrixRule("blocks.*.mlp.fc_w"),
    MatrixRule("blocks.*.parallel_mlp.fc_w"),
    MatrixRule("blocks.*.mlp.proj_w", lr_mul=PROJ_LR_MUL),
    MatrixRule("blocks.*.parallel_mlp.proj_w", lr_mul=PROJ_LR_MUL),
)

# (pattern, family) for Adam, first match wins; RECORD §8 "Adam parameter groups".
ADAM_RULES: tuple[tuple[str, str], ...] = (
    ("embed", "embed"),
    ("lm_head", "lm_head"),
    ("value_embeds.*", "value_embeds"),
    ("smear_gate", "smear_gate"),
    ("blocks.*.attn.ve_gate", "ve_gate"),
    ("blocks.*.post_lambdas", "post_lambdas"),
    ("blocks.*.resid_lambdas", "resid_lambdas"),
    ("mudd.gate_scale", "mudd_gate_bias"),  # κ: RECORD §8 lists it with the gate biases
    ("mudd.pre_gate.b2", "mudd_gate_bias"),
    ("mudd.post_gate.b2", "mudd_gate_bias"),
    ("mudd.pre_gate.*", "mudd_gate"),
    ("mudd.post_gate.*", "mudd_gate"),
    ("mudd.*.b2", "mudd_bias"),
    ("mudd.*", "mudd"),
    ("*", "scalars"),  # λ₀/λ₁, smear λ, skip λ, static x0 / n-gram / attention gates, XSA α
)
ADAM_FAMILIES = tuple(dict.fromkeys(family for _, family in ADAM_RULES))


def matrix_rule(name: str, rules: Iterable[MatrixRule] = MATRIX_RULES) -> Optional[MatrixRule]:
    return next((r for r in rules if fnmatchcase(name, r.pattern)), None)


def adam_family(name: str, rules: Iterable[tuple[str, str]] = ADAM_RULES) -> str:
    for pattern, family in rules:
        if fnmatchcase(name, pattern):
            return family
    raise ValueError(f"no optimizer rule matches parameter {name!r}; add a pattern to nanogpt_pl.optim.groups")


def anvil_group(model: nn.Module, head_dim: int, rules: Iterable[MatrixRule] = MATRIX_RULES) -> dict:
    """One ANVIL param group of every matrix a rule matches, with per-parameter ``blocks``
    (``(rows, cols)``) and ``lr_muls`` aligned with ``params``."""
    rules = tuple(rules)
    params, blocks, lr_muls = [], [], []
    for name, p in model.named_parameters():
        rule = matrix_rule(name, rules)
        if rule is None:
            continue
        if rule.block == "head_pair":
            block = (2 * head_dim, p.shape[-1])
        elif rule.block is None:
            block = (p.shape[-2], p.shape[-1])
        else:
            raise ValueError(f"nanogpt_pl.optim.groups: unknown block {rule.block!r} for {rule.pattern}")
        params.append(p)
        blocks.append(tuple(int(b) for b in block))
        lr_muls.append(rule.lr_mul)
    return dict(params=params, name="matrices", blocks=blocks, lr_muls=lr_muls)


def matrix_names(model: nn.Module, rules: Iterable[MatrixRule] = MATRIX_RULES) -> set[str]:
    rules = tuple(rules)
    return {name for name, _ in model.named_parameters() if matrix_rule(name, rules) is not None}


def adam_families(model: nn.Module, exclude: Iterable[str] = ()) -> dict[str, list[nn.Parameter]]:
    """Every parameter that is not a matrix (nor in ``exclude``, names), by Adam family, in
    :data:`ADAM_FAMILIES` order; families without parameters are left out."""
    skip = matrix_names(model) | set(exclude)
    out: dict[str, list[nn.Parameter]] = {f: [] for f in ADAM_FAMILIES}
    for name, p in model.named_parameters():
        if name not in skip:
            out[adam_family(name)].append(p)
    return {f: ps for f, ps in out.items() if ps}
