"""train.compile: torch.compile each block in place (and, without tp, the loss chunk), after tp and the
adapters and before FSDP, so every other transform sees the eager modules (torchtitan's order)."""

from __future__ import annotations

from hpc_train.distributed.transforms.plan import StagePlan, Transform
from hpc_train.models.spec import StageModule


def _apply(stage: StageModule, plan: StagePlan) -> None:
    stage.compile_regions()


TRANSFORM = Transform("compile", lambda plan: plan.cfg.train.compile, _apply)
