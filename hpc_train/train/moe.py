"""The step's end for MoE layers: their statistics summed over the data-parallel batch (one all-reduce),
DeepSeek-V3's routing-bias update from those loads, and the per-layer figures of the metrics record
(models/common/moe.py STATS), left on the device until the loop reads the step."""

from __future__ import annotations

import torch
import torch.distributed as dist

from hpc_train.distributed.parallelize import ParallelModel
from hpc_train.models.common.moe import STATS, moe_layers, take_stats, update_expert_bias


def finish_moe_step(model: ParallelModel, micro_batches: int) -> dict[str, torch.Tensor]:
    """Per MoE layer of this rank's stages: (busiest expert's tokens / mean, aux loss per micro-batch,
    dropped assignments) over the global batch; with model.moe.bias_update_rate, each layer's routing bias
    updated from its global loads (the same on every data-parallel rank)."""
    stats = take_stats(model.chunks)
    if not stats:
        return {}
    names = list(stats)
    rows = torch.stack([stats[name] for name in names])  # (layers, experts + 2)
    dp = model.mesh.size("dp")
    if dp > 1:
        dist.all_reduce(rows, group=model.mesh.group("dp"))
    loads = rows[:, :-2]
    rate = model.model_cfg.moe.bias_update_rate
    if rate:
        layers = dict(moe_layers(model.chunks))
        for name, load in zip(names, loads, strict=True):
            update_expert_bias(layers[name], load, rate)
    figures = torch.stack(
        [loads.max(1).values / loads.mean(1).clamp(min=1e-9), rows[:, -2] / (micro_batches * dp), rows[:, -1]], 1
    )
    return dict(zip(names, figures, strict=True))


def moe_record(figures: dict[str, torch.Tensor]) -> dict[str, dict[str, float]]:
    """The metrics record's `moe` field: per layer name, STATS (one read of the device)."""
    if not figures:
        return {}
    values = torch.stack(list(figures.values())).tolist()
    return {name: dict(zip(STATS, row, strict=True)) for name, row in zip(figures, values, strict=True)}
