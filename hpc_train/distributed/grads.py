"""Gradient reduction and clipping across the (pp, dp, tp) mesh.

Tensor-parallel gradients do not always come back in their parameter's placement (under sequence
parallelism the norm weights' gradients are Partial sums; the vocab-parallel embedding's can come back
full-size and Replicate), so every gradient is first redistributed to its parameter's placement; only
then are local shards flattened and averaged over the data-parallel group.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def fix_grad_placements(params: list[torch.nn.Parameter]) -> None:
    """Make every DTensor gradient carry its parameter's placement (reducing Partial sums over tp)."""
    for p in params:
        if isinstance(p.grad, DTensor) and p.grad.placements != p.placements:
            p.grad = p.grad.redistribute(p.device_mesh, p.placements)


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


def allreduce_gradients(params: list[torch.nn.Parameter], dp_group: dist.ProcessGroup, bucket_mb: int = 25) -> None:
    """Average the local gradient shards over the data-parallel group, one flat buffer per bucket
    (sum, then divide: gloo has no AVG)."""
    world = dist.get_world_size(dp_group)
    if world == 1:
        return
    grads = [local(p.grad) for p in params if p.grad is not None]
    for bucket in _buckets(grads, bucket_mb * 2**20):
        flat = torch.cat([g.reshape(-1) for g in bucket])
        dist.all_reduce(flat, group=dp_group)
        flat.div_(world)
        offset = 0
        for g in bucket:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()


def clip_grad_norm(
    params: list[torch.nn.Parameter], max_norm: float, tp_group: dist.ProcessGroup, pp_group: dist.ProcessGroup
) -> float:
    """Clip by the global L2 norm, every element counted once: sharded gradients are summed over tp,
    replicated ones counted once, pipeline stages summed. Gradients are identical across dp by now.
    Returns the norm before clipping (same formula as torch.nn.utils.clip_grad_norm_)."""
    grads = [p.grad for p in params if p.grad is not None]
    device = local(grads[0]).device
    sharded_sq = torch.zeros((), device=device, dtype=torch.float32)
    replicated_sq = torch.zeros((), device=device, dtype=torch.float32)
    for g in grads:
        sq = local(g).float().pow(2).sum()
        if isinstance(g, DTensor) and any(not isinstance(pl, Replicate) for pl in g.placements):
            sharded_sq += sq
        else:
            replicated_sq += sq
    if dist.get_world_size(tp_group) > 1:
        dist.all_reduce(sharded_sq, group=tp_group)
    total_sq = sharded_sq + replicated_sq
    if dist.get_world_size(pp_group) > 1:
        dist.all_reduce(total_sq, group=pp_group)
    norm = math.sqrt(total_sq.item())
    if max_norm > 0:
        coef = min(1.0, max_norm / (norm + 1e-6))
        if coef < 1.0:
            torch._foreach_mul_([local(g) for g in grads], coef)
    return norm
