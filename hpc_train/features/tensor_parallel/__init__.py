"""Tensor (and sequence) parallelism with DTensor, as a registered transform: the model family's TP plan
applied to each stage (sharding.py). Its sizes are the mesh's, which the core layout checks."""

from __future__ import annotations

import dataclasses

from hpc_train.config import ParallelConfig
from hpc_train.features.feature import Feature
from hpc_train.features.tensor_parallel.sharding import regathers_input, shard
from hpc_train.models.spec import ActivationShape


def enabled(*, parallel: ParallelConfig) -> bool:
    return parallel.tp > 1


def activation_shape(shape: ActivationShape, *, parallel: ParallelConfig) -> ActivationShape:
    return dataclasses.replace(shape, regather=regathers_input(parallel))


FEATURE = Feature(name="tensor_parallel", enabled=enabled, transform=shard, activation_shape=activation_shape)
