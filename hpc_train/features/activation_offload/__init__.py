"""model.activation_offload: the tensors a block saves for backward kept in host memory between its forward
and its backward (offload.py), the last lever before recompute when activations do not fit. Its key
(options.py), what it refuses, which blocks it moves, and what it changes in the plan: the device's
activations drop by the bytes those blocks keep, host memory rises by the same, and the step adds their
transfer over PCIe both ways (overlapping compute where it can; the planner counts it whole)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from hpc_train.config import ParallelConfig, TrainConfig
from hpc_train.distributed.hooks import StepHooks
from hpc_train.distributed.pipeline import stage_ids
from hpc_train.distributed.transforms import StagePlan
from hpc_train.features.activation_offload.offload import OffloadedForward, StageOffload
from hpc_train.features.activation_offload.options import ActivationOffloadOptions
from hpc_train.features.feature import Feature, Links, Memory
from hpc_train.features.regional_compile import CompileOptions
from hpc_train.models.common.moe import is_moe_layer
from hpc_train.models.common.regather import keep_gathered_inputs
from hpc_train.models.spec import ActivationShape, StageActivations, StageModule


def enabled(*, model: ActivationOffloadOptions) -> bool:
    return model.activation_offload != "none"


def offloaded_blocks(mode: str, choices: list[str]) -> list[int]:
    """Which blocks of a stage (by index, given each one's recompute choice) offload: those that keep what
    they save (no recompute), all of them (`full`) or all but the stage's last (`selective`: its backward
    comes first, so its tensors would come straight back)."""
    last = len(choices) - 1
    return [i for i, choice in enumerate(choices) if choice == "none" and (mode == "full" or i != last)]


def check(*, model: ActivationOffloadOptions, train: CompileOptions, parallel: ParallelConfig,
          block_policy: Callable[[int], str]) -> list[str]:  # fmt: skip
    if not enabled(model=model):
        return []
    problems = []
    if train.compile:
        problems.append(f"model.activation_offload={model.activation_offload} with train.compile: saved-tensor hooks "
                        "inside compiled blocks are not tested yet; set train.compile=false or "
                        "model.activation_offload=none")  # fmt: skip
    per_stage = model.n_layers // (parallel.pp * parallel.virtual_stages)
    if not offloaded_blocks(model.activation_offload, [block_policy(i) for i in range(per_stage)]):
        fix = (
            "use activation_offload=full or recompute fewer blocks"
            if model.activation_offload == "selective"
            else (
                "recompute fewer blocks (model.recompute_every, model.recompute_first) or set activation_offload=none"
            )
        )
        problems.append(f"model.activation_offload={model.activation_offload} moves no block here: every block of a "
                        f"stage recomputes (model.recompute) or is its last; {fix}")  # fmt: skip
    return problems


def offload_blocks(stage: StageModule, plan: StagePlan, *, model: ActivationOffloadOptions,
                   block_policy: Callable[[int], str]) -> None:  # fmt: skip
    """The transform: the chosen blocks' forwards run under the stage's offload hooks."""
    offload = StageOffload(stage)
    stage.activation_offload = offload
    stage.register_forward_pre_hook(offload.new_pass)
    blocks = list(stage.layers.values())
    for i in offloaded_blocks(model.activation_offload, [block_policy(i) for i in range(len(blocks))]):
        blocks[i].forward = OffloadedForward(blocks[i].forward, offload)
    for block in blocks:  # (`activation_shape`)
        keep_gathered_inputs(block)


def activation_shape(shape: ActivationShape) -> ActivationShape:
    """No block gathers its projections' input again in backward: an offloaded block sends the gathered input
    to the host with the rest (and the stage's other blocks are planned alike)."""
    return dataclasses.replace(shape, regather=False)


class OffloadFigures(StepHooks):
    """What a step moved to host memory: bytes (each storage once) and tensors, and the groups brought back
    ahead of their backward, summed over this rank's stages (host counters: no device read)."""

    name = "activation_offload"

    def __init__(self, offloads: list[StageOffload]):
        self.offloads = offloads

    def after_update(self, skipped: torch.Tensor) -> dict[str, Any]:
        taken = [offload.take() for offload in self.offloads]
        return dict(zip(("bytes", "tensors", "prefetched"), map(sum, zip(*taken, strict=True)), strict=True))

    def record(self, figures: dict[str, Any]) -> dict[str, Any]:
        return {"activation_offload": figures}


def hooks(built) -> OffloadFigures:
    return OffloadFigures([chunk.activation_offload for chunk in built.chunks])


def offloaded_bytes(model: ActivationOffloadOptions, parallel: ParallelConfig, parts: StageActivations,
                    block_policy: Callable[[int], str], pp_rank: int) -> int:  # fmt: skip
    """Bytes one micro-batch's offloaded blocks keep, on a rank of pipeline rank `pp_rank`."""
    per_stage = model.n_layers // (parallel.pp * parallel.virtual_stages)
    choices = [block_policy(i) for i in range(per_stage)]
    return sum(parts.block("none", is_moe_layer(model, stage * per_stage + i))
               for stage in stage_ids(pp_rank, parallel.pp, parallel.virtual_stages, parallel.schedule)
               for i in offloaded_blocks(model.activation_offload, choices))  # fmt: skip


def activations(*, model: ActivationOffloadOptions, parallel: ParallelConfig, parts: StageActivations,
                block_policy: Callable[[int], str], pp_rank: int) -> int:  # fmt: skip
    """The device keeps none of what the offloaded blocks save."""
    return -offloaded_bytes(model, parallel, parts, block_policy, pp_rank)


def memory(*, model: ActivationOffloadOptions, parallel: ParallelConfig, parts: StageActivations,
           block_policy: Callable[[int], str], in_flight: float, pp_rank: int) -> Memory:  # fmt: skip
    """The host holds them, for every micro-batch the pipeline rank keeps in flight."""
    return Memory(host=int(offloaded_bytes(model, parallel, parts, block_policy, pp_rank) * in_flight))


def step_time(*, model: ActivationOffloadOptions, parallel: ParallelConfig, train: TrainConfig,
              parts: StageActivations, block_policy: Callable[[int], str], links: Links) -> float:  # fmt: skip
    """Each micro-batch's offloaded bytes cross PCIe twice (to the host and back), counted whole."""
    per_micro = offloaded_bytes(model, parallel, parts, block_policy, 0)
    return 2 * per_micro * train.grad_accum / (links.pcie_gbps * 1e9)


def describe(*, model: ActivationOffloadOptions, parallel: ParallelConfig, parts: StageActivations,
             block_policy: Callable[[int], str]) -> list[str]:  # fmt: skip
    per_micro = offloaded_bytes(model, parallel, parts, block_policy, 0)
    return [f"activation offload ({model.activation_offload}): {per_micro / 2**30:.3f} GiB per micro-batch of the "
            "activations in host memory (first pipeline stage)"]  # fmt: skip


FEATURE = Feature(
    name="activation_offload",
    options={"model": ActivationOffloadOptions},
    enabled=enabled,
    check=check,
    transform=offload_blocks,
    activation_shape=activation_shape,
    hooks=hooks,
    activations=activations,
    memory=memory,
    step_time=step_time,
    describe=describe,
)
