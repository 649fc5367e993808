"""finetune.method=lora|qlora: low-rank adapters beside the (tp-sharded) projections of a frozen base, placed
like them (adapters.py), QLoRA's base in NF4. Its section (options.py), its refusals (checks.py), its
transform and initializer (adapters at their init, everything else frozen), and what it changes in the plan:
the activations the family's formula counts (only adapted projections keep inputs), QLoRA's dequantization
working set, and a line of `hpc-train plan`'s report."""

from __future__ import annotations

import dataclasses

import torch

from hpc_train.config import TrainConfig
from hpc_train.distributed.transforms import StagePlan
from hpc_train.features.feature import Feature, Memory
from hpc_train.features.lora.adapters import apply_lora, init_adapters, is_adapter
from hpc_train.features.lora.checks import check
from hpc_train.features.lora.options import FinetuneConfig
from hpc_train.models.spec import ActivationShape, StageModule

GiB = 2**30
# per element of a projection while torchao dequantizes it: two int64 index arrays of half its elements,
# their bf16 lookups and scaled copies, the bf16 weight
NF4_DEQUANTIZE_BYTES = 14


def enabled(*, finetune: FinetuneConfig) -> bool:
    return finetune.adapters


def add_adapters(stage: StageModule, plan: StagePlan, *, finetune: FinetuneConfig) -> None:
    apply_lora(stage, finetune)


def initialize(stage: StageModule, *, train: TrainConfig) -> None:
    """The adapters at their init; only they train."""
    init_adapters(stage, train.seed)
    for name, p in stage.named_parameters():
        if not is_adapter(name):
            p.requires_grad_(False)


def activation_shape(shape: ActivationShape, *, finetune: FinetuneConfig, train: TrainConfig) -> ActivationShape:
    """Only the adapted projections keep their inputs; the frozen base computes in the compute dtype (no
    autocast casts of fp32 weights: it is held in that dtype)."""
    element = torch.float32.itemsize if train.precision == "fp32" else 2
    return dataclasses.replace(shape, lora_targets=tuple(finetune.lora_targets), lora_rank=finetune.lora_rank,
                               element_bytes=element, autocast_casts=False)  # fmt: skip


def memory(*, local) -> Memory:
    """QLoRA: a block's backward dequantizes one projection at a time."""
    return Memory(working=NF4_DEQUANTIZE_BYTES * local.largest_projection * bool(local.quantized))


def describe(*, finetune: FinetuneConfig, local) -> list[str]:
    frozen = (local.total - local.trainable) / 1e6
    line = f"{finetune.method} (a rank of the first stage): {local.trainable / 1e6:.1f}M trainable "
    line += f"adapter parameters beside {frozen:.0f}M frozen"
    if local.quantized:
        line += (f", the projections in NF4 ({local.quantized_bytes / GiB:.3f} GiB of the parameters; a "
                 "block's backward includes dequantizing one projection)")  # fmt: skip
    return [line]


FEATURE = Feature(
    name="lora",
    options={"finetune": FinetuneConfig},
    enabled=enabled,
    check=check,
    transform=add_adapters,
    initialize=initialize,
    memory=memory,
    describe=describe,
    activation_shape=activation_shape,
)
