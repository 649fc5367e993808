"""Update rules, selected by `optim.name`; each follows `UpdateRule` (rules/protocol.py) and works under
every data-parallel strategy. A new rule is a module here and a line in `RULES`."""

from __future__ import annotations

from torch import nn

from hpc_train.config import ConfigError, OptimConfig
from hpc_train.optim.rules.adamw import AdamW
from hpc_train.optim.rules.muon import Muon
from hpc_train.optim.rules.protocol import Target, UpdateRule, WholeMatrices, local_matrices

RULES: dict[str, type[UpdateRule]] = {"adamw": AdamW, "muon": Muon}


def choices(names: object) -> str:
    """A registry's keys as a sentence's list: `a, b or c`."""
    *most, last = map(str, names)
    return f"{', '.join(most)} or {last}" if most else last


def rule_class(cfg: OptimConfig) -> type[UpdateRule]:
    """The update rule `optim.name` names."""
    if cfg.name not in RULES:
        raise ConfigError(f"optim.name={cfg.name!r} is not an update rule; use {choices(RULES)}")
    RULES[cfg.name].check(cfg)
    return RULES[cfg.name]


def is_hidden_matrix(name: str, ndim: int) -> bool:
    """A 2-D weight inside a transformer block (by its whole-model name): what matrix rules (Muon) update;
    embeddings, the head, norms and biases are left to AdamW, as Muon's authors do."""
    return ndim == 2 and name.startswith("layers.")


def target(name: str, p: nn.Parameter, tensor: nn.Parameter | None = None) -> Target:
    """The rule's view of parameter `p` (named `name` in the whole model), updated through `tensor` (its
    ZeRO master slice) or itself."""
    return Target(p if tensor is None else tensor, p.ndim >= 2, p.shape if is_hidden_matrix(name, p.ndim) else None)


__all__ = ["RULES", "Target", "UpdateRule", "WholeMatrices", "choices", "is_hidden_matrix", "local_matrices",
           "rule_class", "target"]  # fmt: skip
