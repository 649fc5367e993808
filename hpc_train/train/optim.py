"""AdamW with Megatron's weight-decay grouping, and the warmup + cosine learning-rate schedule."""

from __future__ import annotations

import math

import torch
from torch import nn

from hpc_train.config import OptimConfig


def build_optimizer(params: list[nn.Parameter], cfg: OptimConfig, device: torch.device) -> torch.optim.AdamW:
    """Weight decay on matrices only; norms and biases (1-D parameters) are not decayed."""
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    fused = device.type == "cuda"  # PyTorch's fused AdamW on GPU; foreach on CPU
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=fused or None)


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
