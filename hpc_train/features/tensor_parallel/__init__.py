"""Tensor (and sequence) parallelism with DTensor, as a registered transform: the model family's TP plan
applied to each stage (sharding.py). Its sizes are the mesh's, which the core layout checks."""

from __future__ import annotations

from hpc_train.config import ParallelConfig
from hpc_train.features.feature import Feature
from hpc_train.features.tensor_parallel.sharding import shard


def enabled(*, parallel: ParallelConfig) -> bool:
    return parallel.tp > 1


FEATURE = Feature(name="tensor_parallel", enabled=enabled, transform=shard)
