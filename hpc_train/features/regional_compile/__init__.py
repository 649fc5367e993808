"""train.compile: torch.compile each block in place (and, without tp, the loss chunk), after tp and the
adapters and before FSDP, so every other transform sees the eager modules (torchtitan's regional compile).
The family's activation formula knows what inductor recomputes rather than keeps (ActivationShape.compiled).
Every step's record counts the graphs compiled after the run's first step (`recompiles`): a block whose
shapes or guards changed every step would count up every step."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch._dynamo.utils import counters

from hpc_train.distributed.hooks import StepHooks
from hpc_train.distributed.transforms import StagePlan
from hpc_train.features.feature import Feature
from hpc_train.models.spec import ActivationShape, StageModule


@dataclass
class CompileOptions:  # in the `train` section
    compile: bool = False  # torch.compile each block and, without tp, the loss chunk (regional compile)


def enabled(*, train: CompileOptions) -> bool:
    return train.compile


def compile_blocks(stage: StageModule, plan: StagePlan) -> None:
    stage.compile_regions()


def activation_shape(shape: ActivationShape) -> ActivationShape:
    return dataclasses.replace(shape, compiled=True)


class CountRecompiles(StepHooks):
    """The metrics record's `recompiles`: graphs dynamo compiled on this rank since the end of the run's first
    step (counted at each step's end, read with its record)."""

    name = "compile"

    def __init__(self):
        self.after_first_step: int | None = None

    def after_update(self, skipped: torch.Tensor) -> dict[str, torch.Tensor]:
        graphs = counters["stats"]["unique_graphs"]
        if self.after_first_step is None:
            self.after_first_step = graphs
        return {"recompiles": torch.tensor(graphs - self.after_first_step)}

    def record(self, figures: dict[str, torch.Tensor]) -> dict[str, Any]:
        return {"recompiles": int(figures["recompiles"])}


FEATURE = Feature(
    name="compile",
    options={"train": CompileOptions},
    enabled=enabled,
    transform=compile_blocks,
    hooks=lambda built: CountRecompiles(),
    activation_shape=activation_shape,
)
