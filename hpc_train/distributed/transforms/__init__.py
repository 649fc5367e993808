"""Parallelism as an ordered list of transforms over a pipeline stage built on the meta device. Each is a
registered feature's (hpc_train/features): it says when it applies and how it changes the stage in place,
and the registry's order is the order they run in: float8 linears first (they replace nn.Linear before tp
shards it), context and expert parallelism beside tensor parallelism, compile on the sharded blocks, FSDP
last (it wraps what the others made). `distributed/parallelize.py` runs the plan's transforms, then
allocates the local shards."""

from __future__ import annotations

from hpc_train.distributed.transforms.plan import StagePlan

__all__ = ["StagePlan"]
