"""Context parallelism's transform and its part in every step: each sample's sequence is split over the cp
group. Every module but attention works on its own tokens unchanged; the transform gives the stage the
positions its tokens have (rotary tables and learned positions are indexed by them) and each attention the
core that exchanges keys and values with the other cp ranks (exchange.py). Every micro-batch is cut with the
same `SequenceShard` (`ShardSequences`); the loss is each rank's token mean and gradients are averaged over
dp x cp (mesh role dp_cp), which together are the global token mean."""

from __future__ import annotations

import functools

from hpc_train.data.batch import Batch, SequenceShard
from hpc_train.distributed.hooks import StepHooks
from hpc_train.distributed.mesh import Mesh
from hpc_train.distributed.transforms import StagePlan
from hpc_train.errors import UserError
from hpc_train.features.context_parallel.exchange import ring_attention, ulysses_attention
from hpc_train.features.context_parallel.options import ContextParallelOptions
from hpc_train.models.spec import StageModule

CORES = {"ring": ring_attention, "ulysses": ulysses_attention}


def sequence_shard(mesh: Mesh, mode: str) -> SequenceShard:
    """This rank's part of every sequence."""
    return SequenceShard(mesh.size("cp"), mesh.rank("cp"), zigzag=mode == "ring")


# the one GPU run of tools/gpu_check.py's ring check (an H200, torch 2.11, CUDA 13.0): the per-block
# memory-efficient attention forward matched SDPA, its backward did not; the CPU kernels match exactly
RING_ON_CUDA = (
    "parallel.cp_mode=ring on CUDA: the ring's per-block memory-efficient attention backward failed its "
    "gradient parity check on an H200 (tools/gpu_check.py --only ring: gradients 1.5 off, relative to SDPA, "
    "outputs within 2.3e-3 in bf16), so it is refused until that check passes; use parallel.cp_mode=ulysses"
)


def split_attention(stage: StageModule, plan: StagePlan, *, parallel: ContextParallelOptions) -> None:
    """The transform: the stage's positions and every attention's exchanging core."""
    if parallel.cp_mode == "ring" and plan.device.type == "cuda":
        raise UserError(RING_ON_CUDA)
    shard = sequence_shard(plan.mesh, parallel.cp_mode)
    core = functools.partial(CORES[parallel.cp_mode], group=plan.mesh.group("cp"))
    stage.shard = shard
    for block in stage.layers.values():
        block.attn.core = core


class ShardSequences(StepHooks):
    """Every micro-batch (training and evaluation) cut to this rank's positions of each sample."""

    name = "context_parallel"

    def __init__(self, shard: SequenceShard):
        self.sequence_shard = shard

    def shard(self, batch: Batch) -> Batch:
        return batch.shard(self.sequence_shard)
