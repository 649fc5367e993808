"""Dynamic loss scaling for fp16, agreed over every rank and kept on the device.

The loss is multiplied by `scale` before backward. After the gradients are reduced, any inf/nan on any
rank (tp, pp or dp) makes every rank skip the step and halve the scale, so no rank ever steps alone;
after `window` clean steps in a row the scale doubles. The flag, the scale and the counters are device
tensors (torch's own AMP kernels: the check fused with the unscale, the update), so the step makes no host
read: the loop reads them with the step's other figures, once per log interval.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class LossScaler:
    def __init__(self, scale: float = 2.0**16, window: int = 1000, min_scale: float = 1.0, device: str = "cpu"):
        self.window, self.min_scale = window, min_scale
        self.scale = torch.full((), float(scale), device=device)
        self.clean_steps = torch.zeros((), dtype=torch.int32, device=device)  # since the last overflow or growth
        self.skipped_steps = torch.zeros((), device=device)

    def unscale_and_check(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """Divide the gradients by the scale; returns 1.0 on every rank when any rank's gradients hold an inf
        or nan, else 0.0 (one all-reduce over the world, no host read). Gradients on another device than the
        scale (in host memory, under FSDP2's offload) are checked there, with their own flag and a copy of the
        inverse scale (torch's kernel wants all three on one device); the flags meet on the scale's device,
        where the all-reduce runs."""
        found, inverse = torch.zeros((), device=self.scale.device), self.scale.reciprocal()
        flags, inverses = {found.device: found}, {found.device: inverse}
        groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for g in grads:
            groups.setdefault((g.device, g.dtype), []).append(g)
        for (device, _), same in groups.items():
            if device not in flags:
                flags[device], inverses[device] = torch.zeros((), device=device), inverse.to(device)
            torch._amp_foreach_non_finite_check_and_unscale_(same, flags[device], inverses[device])
        for device, flag in flags.items():
            if device != found.device:
                found = torch.maximum(found, flag.to(found.device))
        dist.all_reduce(found, op=dist.ReduceOp.MAX)
        return found

    def update(self, overflow: torch.Tensor) -> None:
        """Halve on an overflow (not below `min_scale`), double after `window` clean steps."""
        torch._amp_update_scale_(self.scale, self.clean_steps, overflow, 2.0, 0.5, self.window)
        self.scale.clamp_(min=self.min_scale)
        self.skipped_steps += overflow

    def state_dict(self) -> dict:
        counts = {"clean_steps": int(self.clean_steps.item()), "skipped_steps": int(self.skipped_steps.item())}
        return {"scale": self.scale.item(), "window": self.window, "min_scale": self.min_scale, **counts}

    def load_state_dict(self, state: dict) -> None:
        self.window, self.min_scale = state["window"], state["min_scale"]
        self.scale.fill_(state["scale"])
        self.clean_steps.fill_(state["clean_steps"] % self.window)  # older checkpoints counted past the window
        self.skipped_steps.fill_(state["skipped_steps"])
