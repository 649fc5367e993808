"""The device mesh, described by the sizes of its dimensions and asked for by role.

Dimensions are ordered outermost first, tp innermost so that tensor-parallel ranks share a node. Code
never indexes the mesh directly: it asks for a role's size, rank, process group or sub-mesh. A role is
one dimension or several flattened into one, so new dimensions (dp_replicate / dp_shard for FSDP,
cp for context parallelism) are added here, with the roles that combine them, without touching the
call sites (e.g. `ROLES["dp"] = ("dp_replicate", "dp_shard")`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

DIMS = ("pp", "dp", "cp", "tp")  # outermost first
# dp_cp: the ranks that hold the same parameters and see different tokens (dp's samples, cp's sequence
# slices): gradients are averaged and ZeRO shards over it (torchtitan's dp_shard_cp)
ROLES: dict[str, tuple[str, ...]] = {"pp": ("pp",), "dp": ("dp",), "cp": ("cp",), "tp": ("tp",), "dp_cp": ("dp", "cp")}
# cp_tp: the ranks that split one sample's tokens under context and sequence parallelism (an MoE layer's
# load counts are summed over them); asked for by name, not listed with the roles every run reports
SPLIT_ROLES: dict[str, tuple[str, ...]] = {"cp_tp": ("cp", "tp")}


@dataclass(frozen=True)
class ParallelDims:
    """The size of every mesh dimension; their product is the world size."""

    pp: int = 1
    dp: int = 1
    cp: int = 1
    tp: int = 1

    @property
    def world_size(self) -> int:
        size = 1
        for value in asdict(self).values():
            size *= value
        return size

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


EXPERT_ROLES = ("ep", "edp")  # expert parallelism's split of dp: experts sharded over ep, replicated over edp


class Mesh:
    """The DeviceMesh of `dims` (needs the default process group; world size = dims.world_size). With expert
    parallelism (`ep` > 1, dividing dp) a second DeviceMesh splits dp into (edp, ep), ep innermost: the ranks
    of an ep group are consecutive dp ranks of the same cp and tp coordinates, each holding 1/ep of the routed
    experts; an edp group is every rank holding the same experts and seeing other tokens (the dp ranks holding
    them, times cp), over which their gradients are reduced (torchtitan's dp_shard_mod_ep x dp_shard_in_ep,
    with cp folded into the first as in its dp_shard_cp)."""

    def __init__(self, dims: ParallelDims, device_type: str, ep: int = 1):
        self.dims, self.ep = dims, ep
        sizes = dims.as_dict()
        self.device_mesh = init_device_mesh(device_type, tuple(sizes[d] for d in DIMS), mesh_dim_names=DIMS)
        self._roles: dict[str, DeviceMesh] = {}
        self._expert_mesh: DeviceMesh | None = None
        if ep > 1:
            assert dims.dp % ep == 0, f"ep={ep} must divide dp={dims.dp}"
            grid = self.device_mesh.mesh.reshape(dims.pp, dims.dp // ep, ep, dims.cp, dims.tp)
            self._expert_mesh = DeviceMesh(device_type, grid, mesh_dim_names=("pp", "edp", "ep", "cp", "tp"))
            edp = self._expert_mesh["edp", "cp"]._flatten("edp_cp") if dims.cp > 1 else self._expert_mesh["edp"]
            self._roles.update({"ep": self._expert_mesh["ep"], "edp": edp})

    def sub(self, role: str) -> DeviceMesh:
        """The one-dimensional mesh of `role` this rank belongs to (for DTensor and pipeline APIs). Without
        expert parallelism, edp is dp x cp (every rank with the same experts)."""
        if role in EXPERT_ROLES and self.ep == 1:
            assert role == "edp", "no ep mesh without expert parallelism"
            return self.sub("dp_cp")
        if role not in self._roles:
            sizes = self.dims.as_dict()
            names = ROLES.get(role) or SPLIT_ROLES[role]
            dims = tuple(d for d in names if sizes[d] > 1) or names[:1]  # cp=1: dp_cp is dp
            mesh = self.device_mesh[dims[0]] if len(dims) == 1 else self.device_mesh[dims]._flatten(role)
            self._roles[role] = mesh
        return self._roles[role]

    def experts_mesh(self, over_tp: bool) -> DeviceMesh | None:
        """The mesh the routed experts' weights are laid out on: ep (sharded over it), with tp (replicated over
        it) when `over_tp`; None when that is no dimension (ep = 1, without tp)."""
        if self.ep > 1:
            return self._expert_mesh["ep", "tp"] if over_tp else self.sub("ep")
        return self.sub("tp") if over_tp else None

    def size(self, role: str) -> int:
        return self.sub(role).size()

    def rank(self, role: str) -> int:
        return self.sub(role).get_local_rank()

    def group(self, role: str) -> dist.ProcessGroup:
        return self.sub(role).get_group()

    def coordinates(self) -> dict[str, int]:
        """This rank's place in every role (for rank_layout.json)."""
        return {role: self.rank(role) for role in ROLES}

    @property
    def is_first_stage(self) -> bool:
        return self.rank("pp") == 0

    @property
    def is_last_stage(self) -> bool:
        return self.rank("pp") == self.size("pp") - 1

    def group_of(self, role: str) -> list[int]:
        """The global ranks of this rank's `role` group."""
        return next(group for group in self.ranks_along(role) if dist.get_rank() in group)

    def ranks_along(self, role: str) -> list[list[int]]:
        """Every group of global ranks that `role` connects, one list per group (for custom subgroups)."""
        sizes = self.dims.as_dict()
        dims = [DIMS.index(dim) for dim in ROLES[role] if sizes[dim] > 1] or [DIMS.index(ROLES[role][0])]
        grid = self.device_mesh.mesh.movedim(dims, list(range(-len(dims), 0)))
        return grid.reshape(-1, self.size(role)).tolist()
