"""ZeRO-3 with FSDP2 (optim.zero_stage=3): the stage sharded over dp x cp (sharding.py), its options' rules,
the all-gather buffers and dp traffic it adds to the plan (plan.py). The update itself is the optimizer's
(optim/fsdp.py: the rule over FSDP2's sharded parameters)."""

from __future__ import annotations

from hpc_train.config import OptimConfig
from hpc_train.features.feature import Feature
from hpc_train.features.fsdp import plan
from hpc_train.features.fsdp.sharding import Reshard, shard
from hpc_train.optim import optimizer_class


def enabled(*, optim: OptimConfig) -> bool:
    return optimizer_class(optim).shards_params


def check(*, optim: OptimConfig, dims) -> list[str]:
    """Options that only one side of ZeRO-3 (FSDP2) has; it shards over dp x cp."""
    if not enabled(optim=optim):
        return ["optim.reshard_after_forward is for optim.zero_stage=3 (FSDP2): drop it"] * (
            optim.reshard_after_forward is not None
        )
    if dims.dp * dims.cp == 1:
        return ["optim.zero_stage=3 shards over dp x cp, and dp x cp=1 here: use optim.zero_stage=1 (or more ranks)"]
    if optim.overlap_grad_reduce:
        return ["optim.overlap_grad_reduce is for zero stages 0-2 (FSDP2 always reduces in backward): drop it with "
                "optim.zero_stage=3"]  # fmt: skip
    return []


FEATURE = Feature(
    name="fsdp",
    enabled=enabled,
    check=check,
    transform=shard,
    hooks=lambda built: Reshard(built.chunks),
    memory=plan.memory,
    traffic=plan.traffic,
)
