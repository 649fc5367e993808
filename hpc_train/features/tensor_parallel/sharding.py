"""Tensor (and sequence) parallelism with DTensor: a model family's plan (models/spec.py `tp_plan`)
applied to a model or pipeline stage, and what that plan shards, for the planner.

Attention runs on the local head shard with plain SDPA (no DTensor rule for it on CPU); the logits stay
vocab-sharded for `loss_parallel` (cross-entropy without gathering them).
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module

from hpc_train.config import ParallelConfig
from hpc_train.config.schema import SPLIT_BACKWARD
from hpc_train.distributed.transforms import StagePlan
from hpc_train.features.float8.linears import float8_tp_plan
from hpc_train.models.spec import ModelSpec, StageModule


def apply_tensor_parallel(model: nn.Module, spec: ModelSpec, tp_mesh: DeviceMesh, sequence_parallel: bool) -> None:
    """Shard `model` (a whole model or one pipeline stage) in place over `tp_mesh`: by the family's own hook
    where it has one, else by its TP plan (with torchao's float8 styles for tensorwise float8 projections)."""
    if spec.parallelize_fn is not None:
        spec.parallelize_fn(model, tp_mesh, sequence_parallel)
    else:
        plan = spec.tp_plan(model, sequence_parallel)
        # gloo cannot move float8 bytes: with sequence parallelism (an all-gather of the cast input) the plain
        # styles all-gather in the compute dtype and the float8 linears cast after it
        if not (sequence_parallel and dist.get_backend(tp_mesh.get_group()) == "gloo"):
            plan = float8_tp_plan(model, plan)
        parallelize_module(model, tp_mesh, plan)
    if getattr(model, "vocab_mask", None) is not None:  # the -inf padding mask is sharded like the logits
        model.vocab_mask = distribute_tensor(model.vocab_mask, tp_mesh, [Shard(0)])
    model.tie_weights()  # a tied head takes the embedding's (identically sharded) parameter again


def shard(stage: StageModule, plan: StagePlan, *, parallel: ParallelConfig) -> None:
    """The transform: `stage` sharded over the mesh's tp dimension (with sequence parallelism if asked, the
    projections reading an all-gathered input keep this rank's slice for backward and gather it again there:
    models/common/regather.py; not under a schedule that splits backward in two, where the gathered input
    would stay from one half to the other)."""
    apply_tensor_parallel(stage, plan.spec, plan.mesh.sub("tp"), parallel.sequence_parallel)
    if regathers_input(parallel):
        for module in stage.modules():
            if hasattr(module, "sequence_gather"):
                module.regather = True


def regathers_input(parallel: ParallelConfig) -> bool:
    """Whether the column-parallel projections gather their input again in backward."""
    split_backward = parallel.pp > 1 and parallel.schedule in SPLIT_BACKWARD
    return parallel.sequence_parallel and parallel.tp > 1 and not split_backward


def sharded_parameter_names(model: nn.Module, plan: dict[str, ParallelStyle]) -> set[str]:
    """Parameters the plan splits over tp: all of a column-parallel layer's, the weight of a row-parallel
    one (its bias is replicated); everything else is replicated."""
    sharded = set()
    for module_name, style in plan.items():
        if isinstance(style, ColwiseParallel | RowwiseParallel):
            for name, _ in model.get_submodule(module_name).named_parameters():
                if isinstance(style, ColwiseParallel) or name == "weight":
                    sharded.add(f"{module_name}.{name}")
    return sharded
