"""Update rules, selected by `optim.name`; each follows `UpdateRule` (rules/protocol.py) and works under
every data-parallel strategy. A new rule is a module here and a line in `RULES`."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from hpc_train.config import ConfigError, OptimConfig
from hpc_train.optim.rules.adamw import AdamW
from hpc_train.optim.rules.adamw4bit import AdamW4bit
from hpc_train.optim.rules.adamw8bit import AdamW8bit
from hpc_train.optim.rules.muon import Muon
from hpc_train.optim.rules.protocol import Target, UpdateRule, WholeMatrices, local_matrices

RULES: dict[str, type[UpdateRule]] = {"adamw": AdamW, "muon": Muon, "adamw8bit": AdamW8bit, "adamw4bit": AdamW4bit}


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


ROUTER_GATE = ".mlp.router.gate.weight"


def is_hidden_matrix(name: str, ndim: int) -> bool:
    """A 2-D weight inside a transformer block (by its whole-model name), or the routed experts' stack of
    them (3-D, one matrix per expert): what matrix rules (Muon) update. Embeddings, the head, norms and
    biases are left to AdamW, as Muon's authors do, and so is an MoE router's gate (issue 43's choice: its
    rows score the experts, like the head's score the vocabulary)."""
    if not name.startswith("layers.") or name.endswith(ROUTER_GATE):
        return False
    return ndim == 2 or (ndim == 3 and ".mlp.experts." in name)


def matrix_shape(p: nn.Parameter) -> torch.Size:
    """A hidden matrix's shape as nn.Linear stores it, (out, in): the routed experts' stacks hold (experts,
    in, out), so their last two dimensions are swapped (Muon's learning-rate adjustment reads rows, cols)."""
    return p.shape if p.ndim == 2 else torch.Size([*p.shape[:-2], p.shape[-1], p.shape[-2]])


def target(name: str, p: nn.Parameter, tensor: nn.Parameter | None = None) -> Target:
    """The rule's view of parameter `p` (named `name` in the whole model), updated through `tensor` (its
    ZeRO master slice) or itself."""
    shape = matrix_shape(p) if is_hidden_matrix(name, p.ndim) else None
    return Target(p if tensor is None else tensor, p.ndim >= 2, shape, tp_local_numel(p))


def tp_local_numel(p: nn.Parameter) -> int:
    """Elements of `p` on this rank before any dp sharding (its tp and ep shard): what zero_stage 0-2 hold of
    it whole, and what the planner counts per tensor (FSDP2's dp shards are left whole)."""
    if not isinstance(p, DTensor):
        return p.numel()
    mesh, numel = p.device_mesh, p.numel()
    for dim, placement in enumerate(p.placements):
        if placement.is_shard() and mesh.mesh_dim_names and mesh.mesh_dim_names[dim] in ("tp", "ep"):
            numel //= mesh.size(dim)
    return numel


__all__ = ["RULES", "Target", "UpdateRule", "WholeMatrices", "choices", "is_hidden_matrix", "local_matrices",
           "rule_class", "target"]  # fmt: skip
