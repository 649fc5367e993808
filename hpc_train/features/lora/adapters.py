"""LoRA (Hu et al. 2021, PEFT's layout): a frozen projection W gains low-rank adapters, y = W x + s B A drop(x)
with s = lora_alpha / lora_rank, A (rank, in) ~ U(+-1/sqrt(in)) and B (out, rank) zeros, so training starts
from the base model exactly.

The adapters are added in place to a built (and tensor-parallel) stage: the projection keeps its name and
weight and gains `lora_a` and `lora_b`; a forward hook adds the adapter's output before tensor parallelism's
output hook redistributes it. Under tp the adapters are DTensors sharded consistently with their base: beside
a column-parallel W (its rows sharded) B is row-sharded and A replicated; beside a row-parallel W (its columns
sharded) A is column-sharded and B replicated, so the adapter's partial sum joins the base's in the one
reduction the layer already does.

QLoRA (Dettmers et al. 2023) stores the frozen projections in torchao's NF4 (`quantize_projections`)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from hpc_train.config import ConfigError
from hpc_train.features.lora.options import FinetuneConfig
from hpc_train.models.spec import StageModule, param_generator, projections
from hpc_train.placement import distribute_like

ADAPTERS = ("lora_a", "lora_b")
NF4_BLOCK = 64  # weights per NF4 scale (QLoRA's)


def is_adapter(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in ADAPTERS


def check_targets(chunk: nn.Module, targets: list[str]) -> None:
    """Every target names a projection of the family (the last part of its name: wq, w1, fc ...)."""
    known = sorted({name.rsplit(".", 1)[-1] for name in projections(chunk)})
    if not targets:
        raise ConfigError(f"finetune.lora_targets is empty: name the projections to adapt, from {known}")
    if unknown := [t for t in targets if t not in known]:
        raise ConfigError(f"finetune.lora_targets {unknown} are not projections of this model; pick from {known}")


def apply_lora(chunk: StageModule, cfg: FinetuneConfig) -> None:
    """Add adapters to the targeted projections of `chunk` (on any device, meta included)."""
    for name, module in projections(chunk).items():
        if name.rsplit(".", 1)[-1] not in cfg.lora_targets:
            continue
        weight = module.weight
        out_features, in_features = weight.shape
        a = torch.empty(cfg.lora_rank, in_features, device=weight.device, dtype=weight.dtype)
        b = torch.empty(out_features, cfg.lora_rank, device=weight.device, dtype=weight.dtype)
        if isinstance(weight, DTensor):  # the tensor-parallel placement: rows (column-parallel) or columns
            column_parallel = weight.placements[0] == Shard(0)
            a_at, b_at = ([Replicate()], [Shard(0)]) if column_parallel else ([Shard(1)], [Replicate()])
            a, b = distribute_tensor(a, weight.device_mesh, a_at), distribute_tensor(b, weight.device_mesh, b_at)
        module.lora_a, module.lora_b = nn.Parameter(a), nn.Parameter(b)
        module.lora_scale, module.lora_dropout = cfg.lora_alpha / cfg.lora_rank, cfg.lora_dropout
        module.register_forward_hook(_add_adapter, prepend=True)


def _add_adapter(module: nn.Linear, args: tuple, output: torch.Tensor) -> torch.Tensor:
    x = args[0]
    if module.lora_dropout and module.training:
        if isinstance(x, DTensor):
            dropped = F.dropout(x.to_local(), module.lora_dropout)
            x = DTensor.from_local(dropped, x.device_mesh, x.placements, shape=x.shape, stride=x.stride())
        else:
            x = F.dropout(x, module.lora_dropout)
    return output + F.linear(F.linear(x, module.lora_a), module.lora_b) * module.lora_scale


@torch.no_grad()
def init_adapters(chunk: StageModule, seed: int) -> None:
    """A from its own generator (seeded by name, so every layout gets the single-process values), B zeros."""
    for name, p in chunk.named_parameters():
        if name.endswith("lora_b"):
            p.zero_()
        elif name.endswith("lora_a"):
            bound = 1 / math.sqrt(p.shape[1])
            full = torch.rand(p.shape, generator=param_generator(seed, name)).mul_(2 * bound).sub_(bound)
            p.copy_(distribute_like(full, p))


def merge_adapters(state: dict[str, torch.Tensor], cfg: FinetuneConfig) -> dict[str, torch.Tensor]:
    """Whole tensors with every adapter folded into its weight, W + s B A (in fp32), and the adapters gone."""
    merged = {name: t for name, t in state.items() if not is_adapter(name)}
    for name in [n for n in state if n.endswith(".lora_a")]:
        module = name.removesuffix(".lora_a")
        weight = merged[f"{module}.weight"]
        delta = state[f"{module}.lora_b"].float() @ state[name].float() * (cfg.lora_alpha / cfg.lora_rank)
        merged[f"{module}.weight"] = (weight.float() + delta).to(weight.dtype)
    return merged


def nf4_scaler_block(numel: int, block: int = NF4_BLOCK) -> int | None:
    """torchao's NF4 quantizes `block` weights per scale and the scales again in groups (double quantization):
    the largest group size up to QLoRA's 256 that divides the scale count; None if `block` does not divide."""
    if numel % block:
        return None
    scales = numel // block
    return next((size for size in (256, 128, 64, 32, 16, 8, 4, 2, 1) if scales % size == 0), None)


@torch.no_grad()
def quantize_projections(chunk: StageModule) -> list[str]:
    """QLoRA: every block projection's frozen weight replaced by torchao's NF4 tensor (4-bit NormalFloat with
    double quantization, from its bf16 value); `F.linear` dequantizes it per layer in the input's dtype.
    Returns their names within the stage."""
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

    names = []
    for name, module in projections(chunk).items():
        weight = module.weight
        quantized = to_nf4(weight.detach().to(torch.bfloat16), NF4_BLOCK, nf4_scaler_block(weight.numel()))
        module.weight = nn.Parameter(quantized, requires_grad=False)
        names.append(f"{name}.weight")
    return names
