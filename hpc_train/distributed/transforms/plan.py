"""What parallelizing a pipeline stage reads: the model's shape, the pipeline layout, the seed and
micro-batches, the model family, the mesh, and what the optimizer and the precision policy decided (decided
once, by the builder), with the ordered steps the registered features contribute (each bound to the config
sections it reads: distributed/ never sees the job's config)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from hpc_train.config import ModelConfig, ParallelConfig, TrainConfig
from hpc_train.distributed.mesh import Mesh
from hpc_train.models.spec import ModelSpec, StageModule


@dataclass(frozen=True)
class StagePlan:
    model: ModelConfig
    parallel: ParallelConfig
    train: TrainConfig  # the seed, micro-batches per step, frozen parameters
    spec: ModelSpec
    mesh: Mesh
    device: torch.device
    compute_dtype: torch.dtype | None = None  # autocast's (FSDP gathers in it); None = fp32
    params_on_host: bool = False  # the parameters are allocated in host memory (FSDP2's CPU offload)
    # (stage, plan) in order, on the meta device, in place: the features' transforms (tp, float8, FSDP...)
    transforms: tuple[Callable[[StageModule, StagePlan], None], ...] = ()
    # (stage) once it is allocated and initialized (LoRA's adapters, which parameters train)
    initializers: tuple[Callable[[StageModule], None], ...] = ()
