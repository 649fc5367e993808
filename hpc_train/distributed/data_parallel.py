"""Plain data parallelism: average gradients over the data-parallel group in flat buckets."""

from __future__ import annotations

import torch
import torch.distributed as dist


def _buckets(grads: list[torch.Tensor], bucket_bytes: int) -> list[list[torch.Tensor]]:
    buckets: list[list[torch.Tensor]] = [[]]
    size = 0
    for g in grads:
        if buckets[-1] and (size + g.numel() * g.element_size() > bucket_bytes or g.dtype != buckets[-1][0].dtype):
            buckets.append([])
            size = 0
        buckets[-1].append(g)
        size += g.numel() * g.element_size()
    return [b for b in buckets if b]


def allreduce_gradients(params: list[torch.nn.Parameter], group: dist.ProcessGroup, bucket_mb: int = 25) -> None:
    """Sum each bucket of gradients over `group` in one collective, then divide by the group size
    (gloo has no AVG). One flat buffer per bucket keeps the number of collectives small."""
    world = dist.get_world_size(group)
    if world == 1:
        return
    grads = [p.grad for p in params if p.grad is not None]
    for bucket in _buckets(grads, bucket_mb * 2**20):
        flat = torch.cat([g.reshape(-1) for g in bucket])
        dist.all_reduce(flat, group=group)
        flat.div_(world)
        offset = 0
        for g in bucket:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
