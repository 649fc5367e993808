"""Parallelism as an ordered list of transforms over a pipeline stage built on the meta device. Each one
lives in its own module and says when it applies (from the config and what the optimizer needs, never a
stage number) and how it changes the stage in place; `distributed/parallelize.py` runs them in this order,
then allocates the local shards. A new parallelism is a module here and its place in `TRANSFORMS`:
float8 linears go first (they replace nn.Linear before tp shards it), context and expert parallelism
beside tensor parallelism, FSDP stays last (it wraps what the others made)."""

from __future__ import annotations

from hpc_train.distributed.transforms import (
    context_parallel,
    expert_parallel,
    float8,
    fsdp,
    lora,
    recompute,
    regional_compile,
    tensor_parallel,
)
from hpc_train.distributed.transforms.plan import StagePlan, Transform
from hpc_train.models.spec import StageModule

TRANSFORMS: tuple[Transform, ...] = (
    float8.TRANSFORM,  # train.fp8: the block projections become Float8Linear, which tp then shards
    tensor_parallel.TRANSFORM,  # tp and sequence parallelism (or the family's own parallelize hook)
    context_parallel.TRANSFORM,  # the sequence split over cp: positions and the attention exchange
    expert_parallel.TRANSFORM,  # routed experts sharded over ep (carved from dp)
    recompute.TRANSFORM,
    lora.TRANSFORM,  # adapters placed like their tp-sharded base
    regional_compile.TRANSFORM,  # on the eager, sharded blocks
    fsdp.TRANSFORM,  # ZeRO-3: wraps the result
)


def apply_transforms(stage: StageModule, plan: StagePlan) -> None:
    """Every transform that applies, in order."""
    for transform in TRANSFORMS:
        if transform.applies(plan):
            transform.apply(stage, plan)


__all__ = ["TRANSFORMS", "StagePlan", "Transform", "apply_transforms"]
