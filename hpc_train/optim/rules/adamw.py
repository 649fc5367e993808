"""AdamW with Megatron's weight-decay grouping: torch's own fused kernel (CPU and GPU), which skips a step
on the device when told to (`found_inf`), so a non-finite step is dropped without a host read."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from hpc_train.config import OptimConfig
from hpc_train.optim.rules.protocol import Target, WholeMatrices, local_matrices
from hpc_train.placement import local

MOMENTS = ("exp_avg", "exp_avg_sq")


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


class AdamW:
    """Weight decay on the targets marked for it (matrices), none on norms and biases."""

    state_keys = MOMENTS
    gathers_matrices = False
    block_size = 1

    def __init__(self, targets: list[Target], cfg: OptimConfig, whole: WholeMatrices = local_matrices):
        # one group per (decay, DTensor or not): the fused kernel runs once per group, and DTensor refuses a
        # call that mixes DTensors with plain tensors (under tp, replicated parameters may be plain)
        groups = []
        for decay in (True, False):
            for distributed in (True, False):
                params = [t.tensor for t in targets if (t.decay, isinstance(t.tensor, DTensor)) == (decay, distributed)]
                if params:
                    groups.append({"params": params, "weight_decay": cfg.weight_decay if decay else 0.0})
        self.device = local(targets[0].tensor).device if targets else None  # where a skip flag must be
        self.optimizer = torch.optim.AdamW(groups or [{"params": []}], lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                                           eps=cfg.eps, fused=bool(targets) or None)  # fmt: skip

    @staticmethod
    def check(cfg: OptimConfig) -> None:
        pass

    @staticmethod
    def planned_state_bytes(matrix: bool, numel: int, param_numel: int) -> int:
        return 8 * numel  # two fp32 moments

    def keys(self, matrix: bool) -> tuple[str, ...]:
        return MOMENTS

    def step(self, lr: float, skip: torch.Tensor | None = None) -> None:
        set_lr(self.optimizer, lr)
        if skip is not None and self.device is not None:
            skip = skip.to(self.device, torch.float32)
        self.optimizer.found_inf = skip  # read by the fused kernel: nonzero leaves params, moments and step as they are
        self.optimizer.step()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def state(self, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        return {k: t for k, t in self.optimizer.state.get(tensor, {}).items() if k in MOMENTS}

    def load_state(self, tensor: torch.Tensor, state: dict[str, torch.Tensor], step: int) -> None:
        saved = all(k in state for k in MOMENTS)
        moments = {k: state[k] if saved else torch.zeros_like(tensor) for k in MOMENTS}
        self.optimizer.state[tensor] = {"step": self._step_tensor(step if saved else 0, tensor), **moments}

    def _step_tensor(self, step: int, tensor: torch.Tensor) -> torch.Tensor:
        """AdamW's per-parameter step counter as torch keeps it (fused: on the parameter's device)."""
        return torch.tensor(float(step), dtype=torch.float32, device=local(tensor).device)

    def state_bytes(self) -> int:
        return sum(local(t).nbytes for s in self.optimizer.state.values() for k, t in s.items() if k in MOMENTS)
