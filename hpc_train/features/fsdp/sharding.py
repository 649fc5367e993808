"""ZeRO-3 (optim.zero_stage=3): parameters sharded over the data-parallel group with PyTorch FSDP2 (`fully_shard`).

Each transformer block is its own FSDP unit (all-gathered just before it runs, freed after it unless
`reshard_after_forward` is off), the stage's embeddings, final norm and head the root unit. Applied on the
meta device after tensor parallelism, so a tp-sharded parameter becomes a 2D (dp, tp) DTensor and no rank
ever allocates more than its shard. The sharded fp32 parameters are the master weights; the mixed-precision
policy all-gathers them in the compute dtype and reduce-scatters gradients in fp32. With `offload` the
sharded parameters, their gradients and so the optimizer state live in host memory (parallelize.materialize
allocates the shards there, as FSDP2's CPU offload wants them: StagePlan.params_on_host).

Under expert parallelism each MoE layer's routed experts (DTensor shards over ep) are their own FSDP unit
over edp, the dp ranks holding the same experts (torchtitan's approach): their 2D (edp, ep) shards hold every
expert element once over dp, and their gradients are divided by dp x cp, not edp, as the rest are (an
expert's gradient already sums the tokens of its ep group).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from hpc_train.config import OptimConfig, ParallelConfig
from hpc_train.distributed.hooks import StepHooks
from hpc_train.distributed.transforms import StagePlan
from hpc_train.models.common.moe import MoE
from hpc_train.models.spec import StageModule


def reshards_after_forward(optim: OptimConfig, parallel: ParallelConfig) -> bool:
    """optim.reshard_after_forward, its default resolved: on without pipeline parallelism, off with it
    (torchtitan's choice: a stage runs a forward per micro-batch, and torch's schedules keep its
    parameters gathered until the step's last backward anyway)."""
    configured = optim.reshard_after_forward
    return parallel.pp == 1 if configured is None else configured


def all_gathers_per_step(optim: OptimConfig, parallel: ParallelConfig, micro_batches: int) -> int:
    """How often a block's parameters are all-gathered per step: for forward and again for backward per
    micro-batch when they are resharded after forward; else once per micro-batch, or once per step under
    pipeline parallelism (torch's schedules keep the stage gathered)."""
    if reshards_after_forward(optim, parallel):
        return 2 * micro_batches
    return 1 if parallel.pp > 1 else micro_batches


def apply_fsdp(
    chunk: StageModule,
    dp_mesh: DeviceMesh,
    compute_dtype: torch.dtype | None,
    reshard_after_forward: bool,
    offload: bool,
    device: torch.device,
    expert_mesh: DeviceMesh | None = None,
) -> None:
    """Shard `chunk` (a pipeline stage, on the meta device) over `dp_mesh`, block by block, in place; routed
    experts sharded over ep are sharded over `expert_mesh` (edp) first."""
    # the blocks' fp32 inputs (the RoPE tables) stay fp32: autocast decides each op's dtype, as in stages 0-2
    mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32, cast_forward_inputs=False)
    offload_policy = CPUOffloadPolicy(pin_memory=device.type == "cuda") if offload else OffloadPolicy()
    options = {"mesh": dp_mesh, "mp_policy": mp, "reshard_after_forward": reshard_after_forward,
               "offload_policy": offload_policy}  # fmt: skip
    blocks = list(chunk.layers.values())
    experts = [m.experts for m in chunk.modules() if isinstance(m, MoE)] if expert_mesh is not None else []
    for unit in experts:
        fully_shard(unit, **{**options, "mesh": expert_mesh})
        unit.set_gradient_divide_factor(float(dp_mesh.size()))  # the mean over dp x cp, as the rest
    for block in blocks:
        fully_shard(block, **options)
    fully_shard(chunk, **{**options, "reshard_after_forward": False})  # the root runs first and last anyway
    for previous, block in zip(blocks, blocks[1:], strict=False):  # all-gather the next block while one runs
        previous.set_modules_to_forward_prefetch([block])
        block.set_modules_to_backward_prefetch([previous])
    # gloo has neither AVG nor PREMUL_SUM: sum, then divide (on the CPU, and on CUDA with parallel.backend=gloo)
    if dist.get_backend(dp_mesh.get_group()) == "gloo":
        # not over a group of one (edp = 1), which no collective runs on and where torch 2.13 would divide a
        # custom factor's gradients twice (once on copying them, again after the skipped sum)
        summed = experts if expert_mesh is not None and expert_mesh.size() > 1 else []
        for unit in (*summed, *blocks, chunk):
            unit.set_force_sum_reduction_for_comms(True)


def shard(stage: StageModule, plan: StagePlan, *, optim: OptimConfig, parallel: ParallelConfig) -> None:
    """The transform: `stage` sharded over dp x cp (its routed experts, under expert parallelism, over edp)."""
    experts = plan.mesh.sub("edp") if plan.mesh.ep > 1 else None
    apply_fsdp(stage, plan.mesh.sub("dp_cp"), plan.compute_dtype, reshards_after_forward(optim, parallel),
               optim.offload != "none", plan.device, experts)  # fmt: skip


class Reshard(StepHooks):
    """After forward passes without backward (evaluation): every gathered parameter of the FSDP units freed
    (the units that do not reshard after forward stay gathered otherwise, and a checkpoint must read the
    shards)."""

    name = "fsdp"

    def __init__(self, chunks: list[nn.Module]):
        self.chunks = chunks

    def after_eval(self) -> None:
        for chunk in self.chunks:
            for module in chunk.modules():
                if isinstance(module, FSDPModule):
                    module.reshard()
