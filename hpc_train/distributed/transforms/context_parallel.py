"""Context parallelism (parallel.cp, parallel.cp_mode): each sample's sequence is split over the cp group.
Every module but attention works on its own tokens unchanged; this gives the stage the positions its tokens
have (rotary tables and learned positions are indexed by them) and each attention the core that exchanges
keys and values with the other cp ranks (distributed/context_attention.py). The data loader cuts every
sample with the same `SequenceShard` (ParallelModel.sequence_shard); the loss is each rank's token mean and
gradients are averaged over dp x cp (mesh role dp_cp), which together are the global token mean."""

from __future__ import annotations

import functools

from hpc_train.data.batch import SequenceShard
from hpc_train.distributed.context_attention import ring_attention, ulysses_attention
from hpc_train.distributed.mesh import Mesh
from hpc_train.distributed.transforms.plan import StagePlan, Transform
from hpc_train.models.spec import StageModule

CORES = {"ring": ring_attention, "ulysses": ulysses_attention}


def sequence_shard(mesh: Mesh, mode: str) -> SequenceShard | None:
    """This rank's part of every sequence (None without context parallelism)."""
    if mesh.size("cp") == 1:
        return None
    return SequenceShard(mesh.size("cp"), mesh.rank("cp"), zigzag=mode == "ring")


def _apply(stage: StageModule, plan: StagePlan) -> None:
    mode = plan.cfg.parallel.cp_mode
    shard = sequence_shard(plan.mesh, mode)
    core = functools.partial(CORES[mode], group=plan.mesh.group("cp"))
    stage.shard = shard
    for block in stage.layers.values():
        block.attn.shard, block.attn.core = shard, core


TRANSFORM = Transform("context_parallel", lambda plan: plan.mesh.size("cp") > 1, _apply)
