"""MoE layers' part in every step (`MoEStep`): before the forward passes, the aux loss's gradient scale and
which forward is a pipeline's shape inference (left out of the statistics); after the update, their
statistics summed over the data-parallel batch (one all-reduce over dp, one over the ranks that split its
samples' tokens under context and sequence parallelism), DeepSeek-V3's routing-bias update from those
loads, and the per-layer figures of the metrics record (models/common/moe.py STATS) for the whole model (one
all-reduce over pipeline stages), left on the device until the loop reads the step."""

from __future__ import annotations

import torch
import torch.distributed as dist

from hpc_train.distributed.hooks import StepHooks
from hpc_train.distributed.parallelize import ParallelModel
from hpc_train.models.common.moe import (
    STATS,
    is_moe_layer,
    moe_layers,
    set_aux_grad_scale,
    skip_shape_inference,
    take_stats,
    token_group,
    update_expert_bias,
)


def finish_moe_step(
    model: ParallelModel, micro_batches: int, skipped: torch.Tensor | None = None
) -> dict[str, torch.Tensor]:
    """Per MoE layer of the model: (busiest expert's tokens / mean, aux loss per micro-batch, dropped
    assignments) over the global batch; with model.moe.bias_update_rate, each layer's routing bias updated
    from its global loads (the same on every data-parallel rank) unless the step's update was `skipped`.
    Every rank gets every layer's figures."""
    cfg = model.model_cfg
    if not cfg.moe.num_experts:
        return {}
    stats = take_stats(model.chunks)
    figures = torch.zeros(cfg.n_layers, len(STATS), device=model.device)
    dp = model.mesh.size("dp")
    if stats:
        names = list(stats)
        rows = torch.stack([stats[name] for name in names])  # (layers held here, experts + 2)
        # over dp, then over the ranks holding the rest of the samples' tokens (cp, and tp under SP)
        for group in (model.mesh.group("dp") if dp > 1 else None, token_group(model.chunks)):
            if group is not None:
                dist.all_reduce(rows, group=group)
        loads = rows[:, :-2]
        if cfg.moe.bias_update_rate:
            layers = dict(moe_layers(model.chunks))
            for name, load in zip(names, loads, strict=True):
                update_expert_bias(layers[name], load, cfg.moe.bias_update_rate, skipped)
        held = torch.tensor([int(name.split(".")[1]) for name in names], device=model.device)
        figures[held] = torch.stack(
            [loads.max(1).values / loads.mean(1).clamp(min=1e-9), rows[:, -2] / (micro_batches * dp), rows[:, -1]], 1
        )
    if model.mesh.size("pp") > 1:  # each stage fills its own layers' rows
        dist.all_reduce(figures, group=model.mesh.group("pp"))
    return {f"layers.{i}": figures[i] for i in range(cfg.n_layers) if is_moe_layer(cfg, i)}


def moe_record(figures: dict[str, torch.Tensor]) -> dict[str, dict[str, float]]:
    """The metrics record's `moe` field: per layer name, STATS (one read of the device)."""
    if not figures:
        return {}
    values = torch.stack(list(figures.values())).tolist()
    return {name: dict(zip(STATS, row, strict=True)) for name, row in zip(figures, values, strict=True)}


class MoEStep(StepHooks):
    name = "moe"

    def __init__(self, model: ParallelModel):
        self.model, self.micro_batches = model, 1

    def before_forward(self, micro_batches: int, loss_scale: float | torch.Tensor, infers_shapes: bool) -> None:
        """The aux loss's gradient: the main loss's share of the batch (times cp: each cp rank's aux loss is its
        part of the micro-batch's, and gradients are averaged over cp); a shape-inferring forward unrecorded."""
        self.micro_batches = micro_batches
        set_aux_grad_scale(self.model.chunks, loss_scale * self.model.mesh.size("cp") / micro_batches)
        if infers_shapes:
            skip_shape_inference(self.model.chunks)

    def after_update(self, skipped: torch.Tensor) -> dict[str, torch.Tensor]:
        return finish_moe_step(self.model, self.micro_batches, skipped)

    def record(self, figures: dict[str, torch.Tensor]) -> dict[str, dict[str, dict[str, float]]]:
        return {"moe": moe_record(figures)} if figures else {}
