"""Tensors laid out like a parameter: a full value cut to this rank's tensor-parallel shard, or a local
shard wrapped back into the parameter's DTensor. A leaf module: model code and checkpoints use it too."""

from __future__ import annotations

import inspect

import torch
from torch.distributed.tensor import DTensor, Partial, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of `t`: a DTensor's local shard, any other tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def origin_of(t: torch.Tensor) -> tuple[int, ...]:
    """Where this rank's part of `t` starts in the whole (a checkpoint stores a DTensor's shards there)."""
    if not isinstance(t, DTensor):
        return (0,) * t.dim()
    return tuple(compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)[1])


def local_summed(t: torch.Tensor) -> torch.Tensor:
    """`local(t)`, for a weight replicated over ranks that each see other tokens (an MoE layer's router and
    experts under sequence parallelism): its gradient comes back a partial sum over every mesh dimension `t`
    is replicated over, which the gradient reduction sums as it sums a norm weight's under sequence
    parallelism (distributed/grads.py)."""
    if not isinstance(t, DTensor):
        return t
    return t.to_local(grad_placements=[Partial() if pl.is_replicate() else pl for pl in t.placements])


def distribute_like(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A full-size value laid out as `like`: this rank's shard when `like` is a tensor-parallel DTensor
    (every rank holds the same full value, so nothing is sent where the installed torch lets us say so),
    on `like`'s device (distribute_tensor puts it on the mesh's; FSDP2's offloaded shards are in host memory)."""
    if not isinstance(like, DTensor):
        return full
    local_only = {"src_data_rank": None} if "src_data_rank" in inspect.signature(distribute_tensor).parameters else {}
    return distribute_tensor(full, like.device_mesh, like.placements, **local_only).to(like.device)


def gathered(t: torch.Tensor) -> torch.Tensor:
    """The whole of `t` (a DTensor gathered; any other as it is), gathered on its mesh's device: a shard
    held in host memory under a GPU mesh (FSDP2's CPU offload) is copied there first, as NCCL takes no
    host tensor. The result stays on the mesh's device."""
    if not isinstance(t, DTensor):
        return t
    return t.to(t.device_mesh.device_type).full_tensor()


def like_param(p: torch.Tensor, local_tensor: torch.Tensor) -> torch.Tensor:
    """`local_tensor` (this rank's part) as a tensor laid out like `p`: a DTensor when `p` is one."""
    if isinstance(p, DTensor):
        return DTensor.from_local(local_tensor, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
    return local_tensor
