"""train.compile: torch.compile each block in place (and, without tp, the loss chunk), after tp and the
adapters and before FSDP, so every other transform sees the eager modules (torchtitan's regional compile).
The family's activation formula knows what inductor recomputes rather than keeps (ActivationShape.compiled)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from hpc_train.config import ParallelConfig
from hpc_train.distributed.transforms import StagePlan
from hpc_train.features.feature import Feature
from hpc_train.models.spec import ActivationShape, StageModule


@dataclass
class CompileOptions:  # in the `train` section
    compile: bool = False  # torch.compile each block and, without tp, the loss chunk (regional compile)


def enabled(*, train: CompileOptions) -> bool:
    return train.compile


def check(*, train: CompileOptions, parallel: ParallelConfig) -> list[str]:
    """The exchanges' autograd Functions of context parallelism inside compiled blocks have no parity test."""
    if train.compile and parallel.cp > 1:
        return [f"train.compile with parallel.cp={parallel.cp} is not tested yet: set train.compile=false"]
    return []


def compile_blocks(stage: StageModule, plan: StagePlan) -> None:
    stage.compile_regions()


def activation_shape(shape: ActivationShape) -> ActivationShape:
    return dataclasses.replace(shape, compiled=True)


FEATURE = Feature(
    name="compile",
    options={"train": CompileOptions},
    enabled=enabled,
    check=check,
    transform=compile_blocks,
    activation_shape=activation_shape,
)
