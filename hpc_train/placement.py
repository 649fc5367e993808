"""Tensors laid out like a parameter: a full value cut to this rank's tensor-parallel shard, or a local
shard wrapped back into the parameter's DTensor. A leaf module: model code and checkpoints use it too."""

from __future__ import annotations

import inspect

import torch
from torch.distributed.tensor import DTensor, distribute_tensor


def distribute_like(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A full-size value laid out as `like`: this rank's shard when `like` is a tensor-parallel DTensor
    (every rank holds the same full value, so nothing is sent where the installed torch lets us say so)."""
    if not isinstance(like, DTensor):
        return full
    local_only = {"src_data_rank": None} if "src_data_rank" in inspect.signature(distribute_tensor).parameters else {}
    return distribute_tensor(full.to(like.device), like.device_mesh, like.placements, **local_only)


def like_param(p: torch.Tensor, local_tensor: torch.Tensor) -> torch.Tensor:
    """`local_tensor` (this rank's part) as a tensor laid out like `p`: a DTensor when `p` is one."""
    if isinstance(p, DTensor):
        return DTensor.from_local(local_tensor, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
    return local_tensor
