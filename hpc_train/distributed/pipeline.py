"""Pipeline parallelism with `torch.distributed.pipelining`.

The model is cut into pp x virtual_stages stages by its family's `build_stage` (embeddings on the first
stage; final norm, head and loss on the last). Rank r of the pipeline holds stages r, r + pp, r + 2pp, ...
(the looped placement the interleaved 1F1B schedule expects). A schedule fixes its activation shapes on
its first step, so it is built for one (micro-batch size, sequence length) and rebuilt if they change.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from hpc_train.config import ParallelConfig


def stage_ids(pp_rank: int, pp: int, virtual_stages: int) -> list[int]:
    return [pp_rank + v * pp for v in range(virtual_stages)]


def bubble_fraction(parallel: ParallelConfig, micro_batches: int) -> float:
    """The idle share of a pipeline step relative to its compute: (pp - 1) / (m v)."""
    return (parallel.pp - 1) / (micro_batches * parallel.virtual_stages)


def build_schedule(
    chunks: list[nn.Module],
    stages: list[int],
    parallel: ParallelConfig,
    micro_batches: int,
    pp_mesh: DeviceMesh,
    device: torch.device,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
):
    """One PipelineStage per local chunk and the configured schedule over `micro_batches`. `loss_fn`
    divides by the micro-batch count itself, so the schedule must not rescale the gradients. Imported here:
    `torch.distributed.pipelining` costs about a second of CPU at import, which the CLI's checks and the
    planner, using `stage_ids`, do not need."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B

    num_stages = parallel.pp * parallel.virtual_stages
    group = pp_mesh.get_group()
    pipeline_stages = [
        PipelineStage(chunk, stage, num_stages, device, group=group)
        for chunk, stage in zip(chunks, stages, strict=True)
    ]
    schedule_cls = {"1f1b": Schedule1F1B, "interleaved_1f1b": ScheduleInterleaved1F1B}[parallel.schedule]
    options = {"n_microbatches": micro_batches, "loss_fn": loss_fn}
    if "scale_grads" in inspect.signature(schedule_cls).parameters:  # the releases that rescale by default
        options["scale_grads"] = False
    return schedule_cls(pipeline_stages[0] if schedule_cls is Schedule1F1B else pipeline_stages, **options)
