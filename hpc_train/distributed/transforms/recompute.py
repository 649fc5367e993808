"""Activation recompute (model.recompute, recompute_every, recompute_first) as a transform: the model
family's blocks carry the switches, this sets them per block of the stage."""

from __future__ import annotations

from hpc_train.distributed.transforms.plan import StagePlan, Transform
from hpc_train.models.common.decoder import apply_recompute
from hpc_train.models.spec import StageModule


def _apply(stage: StageModule, plan: StagePlan) -> None:
    apply_recompute(stage, plan.cfg.model)


TRANSFORM = Transform("recompute", lambda plan: plan.cfg.model.recompute != "none", _apply)
