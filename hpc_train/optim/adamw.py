"""AdamW with Megatron's weight-decay grouping, and its per-parameter state as checkpoints keep it."""

from __future__ import annotations

import torch
from torch import nn

from hpc_train.config import OptimConfig
from hpc_train.distributed.grads import local

MOMENTS = ("exp_avg", "exp_avg_sq")


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


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def moment_bytes(optimizer: torch.optim.AdamW) -> int:
    return sum(local(t).nbytes for s in optimizer.state.values() for k, t in s.items() if k in MOMENTS)


def adam_step_tensor(step: int, optimizer: torch.optim.AdamW, p: torch.Tensor) -> torch.Tensor:
    """AdamW's per-parameter step counter as torch keeps it (on the device when fused)."""
    fused = optimizer.param_groups[0].get("fused")
    return torch.tensor(float(step), dtype=torch.float32, device=local(p).device if fused else "cpu")
