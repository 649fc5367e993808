"""The loss-spike guard (train.spike_guard): a finite spike (a bad batch, an unstable update) rolled back.

Each step the detector compares the step's global loss and gradient norm (the same on every rank) with the
medians of the last `window` clean steps, on the device: no host read. The loop reads the flag with the
step's other figures, once per log interval, and agrees on it over every rank in the all-reduce it already
makes there. A spike makes every rank reload the newest checkpoint (no save happens between a spike and
its read: a save reads the figures first) and read past the spiking step's global batch, or every batch
since that checkpoint (`skip`); the sampler keeps the skipped ranges in its state (data/sampler.py). More
than `max_rollbacks` rollbacks within `rollback_window` steps stop the run, naming them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from hpc_train.config.schema import SpikeGuardConfig
from hpc_train.errors import UserError

SPIKE_FACTOR = 1000.0  # what a poisoned batch (HPC_TRAIN_FAULT=batch@<n>@<rank>@spike) multiplies the loss by


class SpikeStop(UserError, RuntimeError):
    """More rollbacks than train.spike_guard allows: the data or the run needs a person."""


class SpikeDetector:
    """Running medians of the loss and the gradient norm over the last `window` clean steps, on the device
    (a checkpoint part, the same on every rank: a rollback restores them with the weights)."""

    def __init__(self, cfg: SpikeGuardConfig, device: torch.device):
        self.window = cfg.window
        ratios = [r if r > 0 else float("inf") for r in (cfg.loss_ratio, cfg.grad_norm_ratio)]  # 0: not watched
        self.ratios = torch.tensor(ratios, dtype=torch.float64, device=device)
        self.history = torch.full((2, cfg.window), float("nan"), dtype=torch.float64, device=device)
        self.kept = torch.zeros((), dtype=torch.int64, device=device)  # clean steps seen

    def observe(self, loss: torch.Tensor, grad_norm: torch.Tensor, skipped: torch.Tensor) -> torch.Tensor:
        """Whether this step spiked (a 0-dim bool on the device); a clean step joins the history."""
        values = torch.stack([loss, grad_norm]).to(torch.float64)
        medians = self.history.nanmedian(dim=1).values
        watching = self.kept >= self.window
        spike = watching & (values > self.ratios * medians).any() & ~skipped
        keep = ~(spike | skipped)
        slot = (self.kept % self.window).view(1)
        current = self.history.index_select(1, slot)
        self.history.index_copy_(1, slot, torch.where(keep, values.view(2, 1), current))
        self.kept += keep.to(torch.int64)
        return spike

    def medians(self) -> dict[str, float]:
        loss, grad_norm = self.history.nanmedian(dim=1).values.tolist()
        return {"loss_median": loss, "grad_norm_median": grad_norm}

    def state_dict(self) -> dict[str, Any]:
        return {"history": self.history.cpu(), "kept": int(self.kept)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        history = state["history"].to(self.history.device, torch.float64)
        size = min(self.window, history.shape[1])  # another window: the newest values that fit
        kept = int(state["kept"])
        order = [(kept - size + i) % history.shape[1] for i in range(size)]
        self.history.fill_(float("nan"))
        self.history[:, [(kept - size + i) % self.window for i in range(size)]] = history[:, order]
        self.kept.fill_(kept)


@dataclass
class Rollbacks:
    """The rollbacks of this run so far (host side): when they are too many, and what each skipped."""

    cfg: SpikeGuardConfig
    done: list[dict[str, Any]] = field(default_factory=list)  # what metrics.jsonl records of each

    def skipped_range(self, consumed_after: int, global_batch: int, checkpoint_consumed: int) -> tuple[int, int]:
        """The stream positions skipped for a spike whose step ended at `consumed_after`."""
        start = consumed_after - global_batch if self.cfg.skip == "step" else checkpoint_consumed
        return start, consumed_after

    def check(self, spike_step: int, samples: tuple[int, int]) -> None:
        """Before a rollback: raise SpikeStop when it is one too many within the window."""
        recent = [r for r in self.done if r["spike_step"] > spike_step - self.cfg.rollback_window]
        if len(recent) < self.cfg.max_rollbacks:
            return
        listed = "; ".join(f"step {r['spike_step']} (samples {r['skipped_samples'][0]}-{r['skipped_samples'][1]})"
                           for r in [*recent, {"spike_step": spike_step, "skipped_samples": samples}])  # fmt: skip
        raise SpikeStop(
            f"a loss spike at step {spike_step}: {len(recent) + 1} spikes within "
            f"train.spike_guard.rollback_window={self.cfg.rollback_window} steps, more than "
            f"train.spike_guard.max_rollbacks={self.cfg.max_rollbacks}: {listed}. Stopping (the newest checkpoint "
            "stays); look at those samples, lower optim.lr, or raise the thresholds (train.spike_guard.loss_ratio, "
            "grad_norm_ratio)"
        )
