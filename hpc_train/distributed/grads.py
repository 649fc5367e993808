"""Gradient placement and clipping across the mesh.

Tensor-parallel gradients do not always come back in their parameter's placement (under sequence
parallelism the norm weights' gradients are Partial sums; the vocab-parallel embedding's can come back
full-size and Replicate), so every gradient is first redistributed to its parameter's placement; only
then are local shards flattened and averaged over the data-parallel group (optim/buckets.py). ZeRO-1
adds a replicated parameter's Partial gradients into its fp32 buffer as they come and reduces the sum
over tp once per step (optim/zero.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

from hpc_train.distributed.mesh import Mesh


def fix_grad_placements(params: list[torch.nn.Parameter]) -> None:
    """Make every DTensor gradient carry its parameter's placement (reducing Partial sums over tp)."""
    for p in params:
        if isinstance(p.grad, DTensor) and p.grad.placements != p.placements:
            p.grad = p.grad.redistribute(p.device_mesh, p.placements)


def is_tp_sharded(t: torch.Tensor) -> bool:
    """Sharded over the tensor-parallel dimension (a ZeRO-3 parameter is also sharded over dp: not counted)."""
    if not isinstance(t, DTensor):
        return False
    names = t.device_mesh.mesh_dim_names or ("tp",) * t.device_mesh.ndim
    return any(not isinstance(pl, Replicate) for name, pl in zip(names, t.placements, strict=True) if name == "tp")


def is_ep_sharded(t: torch.Tensor) -> bool:
    """Split over the expert-parallel dimension (a routed expert's stacked weights under parallel.ep)."""
    return isinstance(t, DTensor) and "ep" in (t.device_mesh.mesh_dim_names or ())


@dataclass
class GradGroups:
    """The gradient elements this rank holds, for norms and overflow checks: split by whether they are
    sharded over tp (summed over tp) or replicated (counted once); `dp_sharded` when each dp rank holds
    a different part (ZeRO) rather than the same averaged copy. `uncounted` gradients are clipped and
    checked here but counted in the norm by another rank (a tied embedding's pipeline copy). `ep_sharded`:
    routed experts' gradients under expert parallelism (replicated over tp), each ep rank holding others
    (summed over ep unless `dp_sharded`, whose sum over dp x cp counts them once already)."""

    tp_sharded: list[torch.Tensor]
    tp_replicated: list[torch.Tensor]
    dp_sharded: bool
    uncounted: list[torch.Tensor] = field(default_factory=list)
    ep_sharded: list[torch.Tensor] = field(default_factory=list)

    @classmethod
    def of(cls, grads: list[tuple[torch.Tensor, bool, bool]], dp_sharded: bool) -> GradGroups:
        """From (local gradient, sharded over tp, counted in the norm here) for each gradient."""
        return cls(
            tp_sharded=[g for g, sharded, counted in grads if sharded and counted],
            tp_replicated=[g for g, sharded, counted in grads if not sharded and counted],
            dp_sharded=dp_sharded,
            uncounted=[g for g, _, counted in grads if not counted],
        )

    @property
    def all(self) -> list[torch.Tensor]:
        return self.tp_sharded + self.tp_replicated + self.uncounted + self.ep_sharded


def by_device(tensors: list[torch.Tensor]) -> dict[torch.device, list[torch.Tensor]]:
    """`tensors` grouped by the device they live on, in order (FSDP2's offloaded gradients are on the host)."""
    groups: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.device, []).append(t)
    return groups


def all_reduce_on(device: torch.device, tensor: torch.Tensor, **kwargs) -> None:
    """`dist.all_reduce(tensor, **kwargs)` in place, run on `device` (where the collectives run: NCCL takes
    no host tensor): a tensor held elsewhere is copied there and the result back."""
    if tensor.device == device:
        dist.all_reduce(tensor, **kwargs)
        return
    staged = tensor.to(device)
    dist.all_reduce(staged, **kwargs)
    tensor.copy_(staged)


def _sum_of_squares(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Σ t² in fp32, each device's part summed where its tensors are, the total on `device`."""
    total = torch.zeros((), device=device)
    for where, same in by_device(tensors).items():
        total += sum((t.float().pow(2).sum() for t in same), torch.zeros((), device=where)).to(device)
    return total


def clip_grad_norm(grads: GradGroups, max_norm: float, mesh: Mesh, device: torch.device) -> torch.Tensor:
    """Clip by the global L2 norm with every element counted once across tp, pp and dp; returns the norm
    before clipping, on `device`, where the collectives run (gradients held in host memory, under FSDP2's
    offload, are summed there and only their partial sums moved). torch.nn.utils.clip_grad_norm_'s formula,
    with its 1e-6 and its coefficient clamped at 1, so nothing is read to the host (but the coefficient
    is copied to host-held gradients)."""
    sharded_sq, total_sq = _sum_of_squares(grads.tp_sharded, device), _sum_of_squares(grads.tp_replicated, device)
    if mesh.size("tp") > 1:
        dist.all_reduce(sharded_sq, group=mesh.group("tp"))
    total_sq += sharded_sq
    if grads.ep_sharded:
        expert_sq = _sum_of_squares(grads.ep_sharded, device)
        if not grads.dp_sharded and mesh.ep > 1:
            dist.all_reduce(expert_sq, group=mesh.group("ep"))
        total_sq += expert_sq
    for role in ("pp", "dp_cp") if grads.dp_sharded else ("pp",):
        if mesh.size(role) > 1:
            dist.all_reduce(total_sq, group=mesh.group(role))
    norm = total_sq.double().sqrt()
    if max_norm > 0:
        coefficient = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for where, same in by_device(grads.all).items():
            for dtype in dict.fromkeys(t.dtype for t in same):  # a scalar of the tensors' own dtype: fused kernel
                torch._foreach_mul_([t for t in same if t.dtype == dtype], coefficient.to(where, dtype))
    return norm
