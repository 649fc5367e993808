"""Projections of a sequence-parallel input that keep the input sharded (Megatron's): under sequence
parallelism the column-parallel projections read the all-gathered sequence, and autograd would keep that
gathered tensor (t times the rank's slice) for their weight gradients. Inside a selectively checkpointed
region (torch.utils.checkpoint's policy) only the matmul outputs are kept; the region's input, this rank's
slice, is kept by the checkpoint, and backward all-gathers it again. The matmuls are not recomputed, only
the gather and what is as cheap (autocast's casts, views), so the numbers are the same to the bit."""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

# matmuls whose outputs the region keeps: plain, biased, batched and float8's scaled
MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
           torch.ops.aten._scaled_mm.default}  # fmt: skip


def _keep_matmul_outputs(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in MATMULS else CheckpointPolicy.PREFER_RECOMPUTE


def _regather_context():
    return create_selective_checkpoint_contexts(_keep_matmul_outputs)


def gathered_projections(module: nn.Module, x: torch.Tensor, names: tuple[str, ...]) -> tuple[torch.Tensor, ...]:
    """`module`'s projections `names` (its submodules) of `x` after `module.sequence_gather` (an identity the
    tensor-parallel plan makes the all-gather of a sequence-sharded input). With `module.regather` (set by
    the tensor-parallel transform under sequence parallelism) the gathered input is not kept for backward:
    it is gathered again there."""
    project = functools.partial(_project, module, names)
    if regathers(module, names):
        return checkpoint(project, x, use_reentrant=False, context_fn=_regather_context)
    return project(x)


def regathers(module: nn.Module, names: tuple[str, ...]) -> bool:
    """Whether the projections' region is checkpointed: in training, where every weight of the projections
    trains, and not inside torch.compile. A frozen projection keeps no input, and one with LoRA adapters
    would keep its base output besides what reads it (the region keeps every matmul's output); torch.compile
    fails to trace the region's policy over DTensors (torch 2.13). Those keep the gathered input, as the
    planner counts it."""
    return (
        getattr(module, "regather", False)
        and torch.is_grad_enabled()
        and not torch.compiler.is_compiling()
        and all(p.requires_grad for name in names for p in getattr(module, name).parameters())
    )


def keep_gathered_inputs(block: nn.Module) -> None:
    """Turn the regathering off inside `block`: a block recomputed whole keeps nothing inside it, and one whose
    saved tensors go to host memory would keep the region's matmul outputs on the device."""
    for module in block.modules():
        if hasattr(module, "regather"):
            module.regather = False


def _project(module: nn.Module, names: tuple[str, ...], x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    x = module.sequence_gather(x)
    return tuple(getattr(module, name)(x) for name in names)
