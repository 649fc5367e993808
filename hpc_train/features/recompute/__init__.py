"""Activation recompute (model.recompute, recompute_every, recompute_first): which blocks of each pipeline
stage recompute what in backward (torch.utils.checkpoint, non-reentrant): `selective` the attention core,
`full` whole blocks. The blocks carry the switches (models/common/decoder.py); this sets them per block, and
tells the planner each block's choice (the family's activation formula has a figure per choice)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass

from hpc_train.config import choice, non_negative, positive
from hpc_train.distributed.transforms import StagePlan
from hpc_train.features.feature import Feature
from hpc_train.models.common.regather import keep_gathered_inputs
from hpc_train.models.spec import ActivationShape, StageModule


@dataclass
class RecomputeOptions:  # in the `model` section
    recompute: str = choice("none", "selective", "full")  # selective: the attention core; full: whole layers
    recompute_every: int = positive(1)  # with a policy: recompute every k-th layer of each pipeline stage
    # with a policy: only the first M layers of each stage (None = all)
    recompute_first: int | None = non_negative(None)


def recompute_choice(model: RecomputeOptions, index_in_stage: int) -> str:
    """The recompute policy of a stage's `index_in_stage`-th block: none, selective or full. With
    `recompute_every=k` only every k-th block of the stage, with `recompute_first=M` only its first M."""
    chosen = model.recompute != "none" and index_in_stage % model.recompute_every == 0
    chosen = chosen and (model.recompute_first is None or index_in_stage < model.recompute_first)
    return model.recompute if chosen else "none"


def enabled(*, model: RecomputeOptions) -> bool:
    return model.recompute != "none"


def apply_recompute(stage: StageModule, plan: StagePlan, *, model: RecomputeOptions) -> None:
    """The transform: each block's switches, by its place in the stage. A block recomputed whole keeps
    nothing inside it, so its projections do not gather their input again in backward as well (tensor
    parallelism, an earlier transform, set `regather`: models/common/regather.py)."""
    for i, block in enumerate(stage.layers.values()):
        choice_ = recompute_choice(model, i)
        block.recompute_all = choice_ == "full"
        block.attn.recompute_core = choice_ == "selective"
        if block.recompute_all:
            keep_gathered_inputs(block)


def block_policy(*, model: RecomputeOptions) -> Callable[[int], str]:
    return functools.partial(recompute_choice, model)


def activation_shape(shape: ActivationShape, *, model: RecomputeOptions) -> ActivationShape:
    return dataclasses.replace(shape, first_block_recompute=recompute_choice(model, 0))


FEATURE = Feature(
    name="recompute",
    options={"model": RecomputeOptions},
    enabled=enabled,
    transform=apply_recompute,
    block_policy=block_policy,
    activation_shape=activation_shape,
)
