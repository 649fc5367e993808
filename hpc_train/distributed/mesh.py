"""The (pp, dp, tp) device mesh, tp innermost so that tensor-parallel ranks share a node."""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

MESH_DIMS = ("pp", "dp", "tp")


def build_mesh(device_type: str, pp: int, dp: int, tp: int) -> DeviceMesh:
    """Needs the default process group; world size must equal pp * dp * tp (validated with the config)."""
    return init_device_mesh(device_type, (pp, dp, tp), mesh_dim_names=MESH_DIMS)
