"""How MoE layers are laid out over the mesh. Expert parallelism (`parallel.ep`): each layer's routed experts
sharded over the mesh's ep dimension (carved from dp: distributed/mesh.py), as DTensors of placement Shard(0)
over the experts, so initialization and checkpoints see the whole stacked weights (DCP reshards an ep2
checkpoint to ep1 and back) while a rank allocates and computes only its 1/ep of the experts. The layer's
tokens reach them by all-to-all (models/common/moe.py `dispatch_to_experts`); their gradients are reduced over
edp (optim/experts.py; FSDP2 shards them over edp: features/fsdp).

Sequence and context parallelism: each rank routes and computes only its own tokens (no tp rank repeats
another's expert work). Under sequence parallelism the router's and the experts' weights are DTensors
replicated over tp, whose gradients come back as partial sums over tp, summed by the gradient reduction as a
norm weight's are; each layer's `token_group` (cp, and tp under SP) sums the aux loss's load counts."""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from hpc_train.config import ParallelConfig
from hpc_train.distributed.transforms import StagePlan
from hpc_train.models.common.moe import MoE
from hpc_train.models.spec import StageModule


def _distribute(module: nn.Module, name: str, mesh: DeviceMesh, placements: list) -> None:
    """`module`'s parameter `name` (on the meta device) laid out on `mesh`, in place."""
    p = getattr(module, name)
    setattr(module, name, nn.Parameter(distribute_tensor(p, mesh, placements, src_data_rank=None), p.requires_grad))


def shard_experts(stage: StageModule, plan: StagePlan, *, parallel: ParallelConfig) -> None:
    """The transform: every MoE layer of `stage` laid out for expert, sequence and context parallelism."""
    mesh = plan.mesh
    sequence_parallel = parallel.sequence_parallel and mesh.size("tp") > 1
    experts_mesh = mesh.experts_mesh(over_tp=sequence_parallel)
    placements = ([Shard(0)] if mesh.ep > 1 else []) + ([Replicate()] if sequence_parallel else [])
    split = sequence_parallel or mesh.size("cp") > 1
    for module in stage.modules():
        if not isinstance(module, MoE):
            continue
        if experts_mesh is not None:
            for name in ("w1", "w3", "w2"):
                _distribute(module.experts, name, experts_mesh, placements)
        if sequence_parallel:
            _distribute(module.router.gate, "weight", mesh.sub("tp"), [Replicate()])
        if mesh.ep > 1:
            module.ep_group = mesh.group("ep")
        if split:
            module.token_group = mesh.group("cp_tp" if sequence_parallel else "cp")
