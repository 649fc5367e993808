"""finetune.method=lora|qlora: low-rank adapters beside the (tp-sharded) projections, placed like them."""

from __future__ import annotations

from hpc_train.distributed.transforms.plan import StagePlan, Transform
from hpc_train.finetune.lora import apply_lora
from hpc_train.models.spec import StageModule


def _apply(stage: StageModule, plan: StagePlan) -> None:
    apply_lora(stage, plan.cfg.finetune)


TRANSFORM = Transform("lora", lambda plan: plan.cfg.finetune.adapters, _apply)
