"""What FSDP2 adds to the planner beside its shards (the planner counts those as the optimizer strategy's):
the parameters it gathers and the gradients it reduce-scatters, and their dp traffic."""

from __future__ import annotations

from hpc_train.config import OptimConfig, ParallelConfig, TrainConfig
from hpc_train.features.feature import Memory
from hpc_train.features.fsdp.sharding import all_gathers_per_step, reshards_after_forward


def memory(*, optim: OptimConfig, parallel: ParallelConfig, local, parts, compute: int) -> Memory:
    """Gathered in the compute dtype (`compute` bytes): the root unit and the running block with the next one
    prefetched (`static`), and, while a block's backward runs (`block`), the block it gathers and its
    gradients, growing in the compute dtype and then copied to fp32 for the reduce-scatter once the block's
    activations are freed; the running block then is the stage's last (`local.last_block`). Without
    reshard_after_forward every block stays gathered from its forward to its backward; under pipeline
    parallelism torch's schedules keep the whole stage gathered, its fp32 gradients whole, to the last
    backward."""
    if parallel.pp > 1:
        return Memory(static=(compute + 4) * local.total)
    reduced = max(compute * local.largest_block, (compute + 4) * local.largest_block - parts.layer["none"])
    if reshards_after_forward(optim, parallel):
        gathered = compute * local.largest_block  # the running block, and the next one prefetched
        # at backward's start the running block is the stage's last (an MoE block under ep gathers less than
        # a dense one: its experts are a unit of their own, not gathered at edp 1)
        last = compute * (local.last_block - local.largest_block)
        return Memory(static=compute * local.root + gathered, block=gathered + reduced + last)
    return Memory(static=compute * local.total, block=reduced)


def traffic(*, optim: OptimConfig, parallel: ParallelConfig, train: TrainConfig, local, dims, compute: int) -> dict:
    """Per micro-batch, an all-gather in the compute dtype for forward and one for backward (one per step
    without reshard_after_forward under pipeline parallelism, where torch's schedules keep the stage
    gathered) and an fp32 reduce-scatter (once per step under pipeline parallelism): three collectives where
    stage 0 has two, 1.5x its elements, ring collectives each sending (dp-1)/dp of the buffer."""
    dp = dims.dp * dims.cp
    if dp == 1:
        return {}
    ring = local.trainable * (dp - 1) / dp
    reduce_scatters = 1 if parallel.pp > 1 else train.grad_accum
    return {"dp": ring * (compute * all_gathers_per_step(optim, parallel, train.grad_accum) + 4 * reduce_scatters)}
