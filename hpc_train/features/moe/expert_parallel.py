"""Expert parallelism (`parallel.ep`): each MoE layer's routed experts sharded over the mesh's ep dimension
(carved from dp: distributed/mesh.py), as DTensors of placement Shard(0) over the experts, so initialization
and checkpoints see the whole stacked weights (DCP reshards an ep2 checkpoint to ep1 and back) while a rank
allocates and computes only its 1/ep of the experts. The layer's tokens reach them by all-to-all
(models/common/moe.py `dispatch_to_experts`); their gradients are reduced over edp (optim/experts.py; FSDP2
shards them over edp: features/fsdp)."""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor

from hpc_train.distributed.transforms import StagePlan
from hpc_train.models.common.moe import MoE
from hpc_train.models.spec import StageModule


def apply_expert_parallel(stage: nn.Module, ep_mesh: DeviceMesh) -> None:
    """Shard every MoE layer's routed experts of `stage` (on the meta device) over `ep_mesh`, in place."""
    for module in stage.modules():
        if isinstance(module, MoE):
            experts = module.experts
            for name, p in list(experts.named_parameters(recurse=False)):
                sharded = distribute_tensor(p, ep_mesh, [Shard(0)], src_data_rank=None)
                setattr(experts, name, nn.Parameter(sharded, requires_grad=p.requires_grad))
            module.ep_group = ep_mesh.get_group()


def shard_experts(stage: StageModule, plan: StagePlan) -> None:
    """The transform, under expert parallelism (the mesh carves ep from dp)."""
    if plan.mesh.ep > 1:
        apply_expert_parallel(stage, plan.mesh.sub("ep"))
