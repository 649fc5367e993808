"""What a transform reads: the run's config, the model family, the mesh and what the optimizer and the
precision policy decided (decided once, by the builder, below which distributed/ does not look)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from hpc_train.config import JobConfig
from hpc_train.distributed.mesh import Mesh
from hpc_train.models.spec import ModelSpec, StageModule


@dataclass(frozen=True)
class StagePlan:
    cfg: JobConfig
    spec: ModelSpec
    mesh: Mesh
    device: torch.device
    compute_dtype: torch.dtype | None = None  # autocast's (FSDP gathers in it); None = fp32
    shards_params: bool = False  # the optimizer needs the parameters sharded over dp (FSDP2)


@dataclass(frozen=True)
class Transform:
    """One step of parallelizing a pipeline stage on the meta device, in place."""

    name: str
    applies: Callable[[StagePlan], bool]
    apply: Callable[[StageModule, StagePlan], None]
