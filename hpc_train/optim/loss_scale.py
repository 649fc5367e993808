"""Dynamic loss scaling for fp16, agreed over every rank.

The loss is multiplied by `scale` before backward. After the gradients are reduced, any inf/nan on any
rank (tp, pp or dp) makes every rank skip the step and halve the scale, so no rank ever steps alone;
after `window` clean steps in a row the scale doubles.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist


@dataclass
class LossScaler:
    scale: float = 2.0**16
    window: int = 1000
    min_scale: float = 1.0
    clean_steps: int = 0
    skipped_steps: int = 0

    def found_inf(self, grads: list[torch.Tensor]) -> bool:
        """True on every rank when any rank's gradients hold an inf or nan (one all-reduce over the world)."""
        finite = [torch.isfinite(g).all() for g in grads]  # on the device: one host sync, at the end
        flag = (~torch.stack(finite)).any().float() if grads else torch.zeros(())
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def unscale(self, grads: list[torch.Tensor]) -> None:
        torch._foreach_mul_(grads, 1.0 / self.scale)

    def update(self, overflow: bool) -> None:
        if overflow:
            self.scale = max(self.min_scale, self.scale / 2)
            self.skipped_steps += 1
            self.clean_steps = 0
            return
        self.clean_steps += 1
        if self.clean_steps % self.window == 0:
            self.scale *= 2

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            setattr(self, key, value)
