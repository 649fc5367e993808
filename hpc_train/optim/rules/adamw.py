"""AdamW with Megatron's weight-decay grouping: torch's own (fused on GPU, foreach on CPU)."""

from __future__ import annotations

import torch

from hpc_train.config import OptimConfig
from hpc_train.distributed.grads import local
from hpc_train.optim.rules.protocol import Target, WholeMatrices, local_matrices

MOMENTS = ("exp_avg", "exp_avg_sq")


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


class AdamW:
    """Weight decay on the targets marked for it (matrices), none on norms and biases."""

    state_keys = MOMENTS
    gathers_matrices = False

    def __init__(self, targets: list[Target], cfg: OptimConfig, whole: WholeMatrices = local_matrices):
        groups = [
            {"params": [t.tensor for t in targets if t.decay], "weight_decay": cfg.weight_decay},
            {"params": [t.tensor for t in targets if not t.decay], "weight_decay": 0.0},
        ]
        cuda = bool(targets) and local(targets[0].tensor).device.type == "cuda"
        self.optimizer = torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                                           fused=cuda or None)  # fmt: skip

    @staticmethod
    def check(cfg: OptimConfig) -> None:
        pass

    @staticmethod
    def planned_state_bytes(matrix: bool) -> int:
        return 8  # two fp32 moments

    def keys(self, matrix: bool) -> tuple[str, ...]:
        return MOMENTS

    def step(self, lr: float) -> None:
        set_lr(self.optimizer, lr)
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
        """AdamW's per-parameter step counter as torch keeps it (on the device when fused)."""
        fused = self.optimizer.param_groups[0].get("fused")
        return torch.tensor(float(step), dtype=torch.float32, device=local(tensor).device if fused else "cpu")

    def state_bytes(self) -> int:
        return sum(local(t).nbytes for s in self.optimizer.state.values() for k, t in s.items() if k in MOMENTS)
