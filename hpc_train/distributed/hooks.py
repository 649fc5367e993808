"""A feature's part in every training step, attached to the built model (`ParallelModel.hooks`) by the
builder: the step, evaluation and the loop call every attached hook at the same points and name none of
them. A feature subclasses `StepHooks` and overrides what it needs; each default does nothing."""

from __future__ import annotations

from typing import Any

import torch

from hpc_train.data.batch import Batch


class StepHooks:
    name = "feature"  # the key of its figures in a step's result and of its fields in metrics.jsonl

    def shard(self, batch: Batch) -> Batch:
        """This rank's part of a micro-batch (e.g. context parallelism's share of each sequence)."""
        return batch

    def before_forward(self, micro_batches: int, loss_scale: float | torch.Tensor, infers_shapes: bool) -> None:
        """Before a step's (or an evaluation's) forward passes over `micro_batches`; `infers_shapes`: a
        pipeline schedule runs one more forward first to infer its stages' shapes."""

    def after_update(self, skipped: torch.Tensor) -> dict[str, torch.Tensor]:
        """After the optimizer step (`skipped`: whether it dropped the update, a device flag): figures for
        the step's record, left on the device until the loop reads the step."""
        return {}

    def after_restore(self) -> None:
        """After the weights were put back in place outside an update (a resume, a spike rollback from the
        host copy or from disk, node-local checkpoints): what a feature derived from the weights at its last
        `after_update` belongs to weights that are gone."""

    def after_eval(self) -> None:
        """After forward passes without backward (evaluation)."""

    def record(self, figures: dict[str, torch.Tensor]) -> dict[str, Any]:
        """The step's `after_update` figures as metrics.jsonl fields (read from the device here)."""
        return {}
