"""What LoRA and QLoRA refuse before any rank starts, each problem with its fix."""

from __future__ import annotations

import importlib.util

import torch

from hpc_train.config import OptimConfig, ParallelConfig, TrainConfig
from hpc_train.config.fields import ConfigError
from hpc_train.features.lora.adapters import NF4_BLOCK, check_targets, nf4_scaler_block
from hpc_train.features.lora.options import FinetuneConfig
from hpc_train.models.spec import ModelSpec, projections
from hpc_train.optim import optimizer_class


def check(*, finetune: FinetuneConfig, model, train: TrainConfig, parallel: ParallelConfig, optim: OptimConfig,
          spec: ModelSpec) -> list[str]:  # fmt: skip
    """LoRA's targets are projections of the family, and it decides alone what trains."""
    if not finetune.adapters:
        return []
    if train.freeze:
        return [f"train.freeze is for finetune.method=full; {finetune.method} trains only its adapters "
                "(finetune.lora_targets picks where they go): drop train.freeze"]  # fmt: skip
    if finetune.lora_dropout and parallel.tp > 1:
        return ["finetune.lora_dropout with parallel.tp > 1 would draw another mask on each tp rank of a "
                "replicated input: set finetune.lora_dropout=0 or parallel.tp=1"]  # fmt: skip
    if optimizer_class(optim).shards_params:
        return [f"finetune.method={finetune.method} trains only small adapters, with nothing worth sharding by "
                "FSDP2: use optim.zero_stage=1 (or 0)"]  # fmt: skip
    with torch.device("meta"):
        stage = spec.build_stage(model)
    try:
        check_targets(stage, finetune.lora_targets)
    except ConfigError as err:
        return [str(err)]
    return _qlora_problems(finetune, train, parallel, stage) if finetune.quantized_base else []


def _qlora_problems(finetune: FinetuneConfig, train: TrainConfig, parallel: ParallelConfig, stage) -> list[str]:
    """What NF4 base weights (torchao's NF4Tensor, a plain tensor subclass) can be part of here."""
    problems = []
    if train.precision == "fp16":
        problems.append("finetune.method=qlora dequantizes its NF4 weights to bf16: set train.precision=bf16 (or fp32)")
    if importlib.util.find_spec("torchao") is None:
        problems.append("finetune.method=qlora needs torchao (its NF4 tensor): pip install 'hpc_train[finetune]'")
    if parallel.tp > 1:
        problems.append("finetune.method=qlora keeps whole NF4 weights per rank: use parallel.tp=1 (pp and dp work)")
    sizes = {name: m.weight.numel() for name, m in projections(stage).items()}
    odd = [name for name, numel in sizes.items() if nf4_scaler_block(numel) is None]
    if odd:
        name, numel = odd[0], sizes[odd[0]]
        problems.append(f"finetune.method=qlora quantizes blocks of {NF4_BLOCK} weights; {name} has {numel}: pick "
                        f"model sizes divisible by {NF4_BLOCK}")  # fmt: skip
    return problems
