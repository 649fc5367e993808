"""AdamW with Megatron's weight-decay grouping, and the warmup + cosine learning-rate schedule."""

from __future__ import annotations

import math

import torch
from torch import nn

from hpc_train.config import OptimConfig


def adamw(
    params: list[nn.Parameter], cfg: OptimConfig, device: torch.device, decay_params: set[int] | None = None
) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (norms and biases, the 1-D parameters, are not decayed),
    or on the parameters whose ids are in `decay_params`. Fused on GPU, foreach on CPU."""
    decays = (lambda p: id(p) in decay_params) if decay_params is not None else (lambda p: p.ndim >= 2)
    groups = [
        {"params": [p for p in params if decays(p)], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if not decays(p)], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(
        groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=(device.type == "cuda") or None
    )


def lr_at(step: int, cfg: OptimConfig, total_steps: int) -> float:
    """Learning rate for optimizer step `step` (0-based): linear warmup from lr/warmup to lr, then cosine
    decay to min_lr over decay_steps (default: the whole run), then min_lr."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    decay_steps = (cfg.decay_steps or total_steps) - cfg.warmup_steps
    if decay_steps <= 0:
        return cfg.lr
    progress = min(1.0, (step - cfg.warmup_steps) / decay_steps)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.lr - cfg.min_lr)
