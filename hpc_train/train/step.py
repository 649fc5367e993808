"""One training step on this rank's micro-batches, and evaluation: the arithmetic the loop repeats."""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from hpc_train.config import TrainConfig
from hpc_train.data.batch import Source, collate
from hpc_train.distributed.grads import clip_grad_norm, local
from hpc_train.distributed.parallelize import MicroBatches, ParallelModel, forward_backward, forward_only, reduce_loss
from hpc_train.errors import UserError
from hpc_train.observe.memory import SavedActivations, tensor_bytes
from hpc_train.observe.profiling import timed
from hpc_train.optim.loss_scale import LossScaler
from hpc_train.optim.protocol import Optimizer
from hpc_train.resilience import watchdog
from hpc_train.resilience.faults import fault_point
from hpc_train.resilience.stragglers import ComputeClock


class NonFiniteStep(UserError, RuntimeError):
    """A step whose loss or gradients are not finite for a reason other than an fp16 overflow that the loss
    scale absorbs. Every rank raises it at the same point (the values it checks are global)."""


@dataclass
class StepOptions:
    """What a step takes besides the model, the optimizer, the batches and the learning rate."""

    grad_clip: float = 1.0  # 0: no clipping
    scaler: LossScaler | None = None  # fp16's dynamic loss scale
    step: int = 0  # its number, for the hang watchdog and planted faults
    timings: dict[str, float] | None = None  # when given, the seconds of each phase are added to it
    clock: ComputeClock | None = None  # times the compute (straggler report)
    before_update: Callable[[], None] | None = None  # runs before the weights change (an async save's copy)


@dataclass
class StepResult:
    loss: float  # mean over the global batch
    grad_norm: float
    memory: dict[str, int] = field(default_factory=dict)  # this rank's bytes by category


def apply_gradients(model: ParallelModel, optimizer: Optimizer, lr: float, options: StepOptions) -> float | None:
    """Reduce the gradients over dp, check fp16 overflow on every rank, clip by the global norm, step
    (`before_update` first: an async checkpoint's copy must be done). Returns the gradient norm, or None
    when the step was skipped for an overflow; raises NonFiniteStep (with the gradients dropped, nothing
    updated) for a non-finite norm, or an overflow at the smallest loss scale."""
    scaler, timings = options.scaler, options.timings
    device = local(model.parameters[0]).device
    with timed(timings, "grad_reduce", device):
        optimizer.reduce_gradients()
    grads = optimizer.grad_groups()
    if scaler is not None:
        overflow = scaler.found_inf(grads.all)
        at_floor = scaler.scale <= scaler.min_scale
        scaler.update(overflow)
        if overflow:
            optimizer.zero_grad()
            if at_floor:
                floor = scaler.min_scale
                raise NonFiniteStep(f"the gradients are not finite even at the smallest fp16 loss scale ({floor})")
            return None
        scaler.unscale(grads.all)
    with timed(timings, "optimizer", device):
        grad_norm = clip_grad_norm(grads, options.grad_clip, model.mesh)
        if not math.isfinite(grad_norm):
            optimizer.zero_grad()
            raise NonFiniteStep(f"the gradient norm is {grad_norm}")
        if options.before_update is not None:
            options.before_update()
        optimizer.step(lr)
        optimizer.zero_grad()
    return grad_norm


def train_step(
    model: ParallelModel,
    optimizer: Optimizer,
    micro_batches: MicroBatches,
    lr: float,
    options: StepOptions | None = None,
) -> StepResult:
    """One optimizer step on this rank's micro-batches; the loss is the global-batch mean."""
    options = options or StepOptions()
    scaler, step = options.scaler, options.step
    model.loss_scale = scaler.scale if scaler else 1.0
    params = model.parameters
    optimizer.begin_step(len(micro_batches))
    device = micro_batches[0].tokens.device
    with (
        SavedActivations(params) as saved,
        timed(options.timings, "forward_backward", device),
        options.clock or nullcontext(),
    ):
        loss = forward_backward(model, micro_batches)
        fault_point("compute", step, dist.get_rank())
    fault_point("mid_step", step, dist.get_rank())
    watchdog.record(step, 1)
    memory = {
        "params": tensor_bytes(params),
        "grads": tensor_bytes(p.grad for p in params) + optimizer.grad_buffer_bytes(),
        "activations_per_microbatch": saved.bytes // len(micro_batches),
        "activations_peak": saved.peak_bytes,
    }
    grad_norm = apply_gradients(model, optimizer, lr, options)
    memory["optimizer"] = optimizer.state_bytes()
    mean_loss = reduce_loss(model, loss)
    if grad_norm is not None and not math.isfinite(mean_loss):
        raise NonFiniteStep(f"the loss is {mean_loss}")
    return StepResult(mean_loss, grad_norm if grad_norm is not None else float("nan"), memory)


def rank_micro_batches(source: Source, indices: list[np.ndarray], device: torch.device) -> MicroBatches:
    return [collate(source, idx).to(device) for idx in indices]


def evaluate(model: ParallelModel, dataset: Source, t: TrainConfig) -> float:
    """Mean loss over the first eval_batches global batches of the held-out set, read in order: the same
    samples, in the same micro-batch shapes as training, whatever the layout."""
    model.train(False)
    dp, dp_rank = model.mesh.size("dp"), model.mesh.rank("dp")
    per_rank = t.micro_batch_size * t.grad_accum
    device = local(model.parameters[0]).device
    total = 0.0
    for b in range(t.eval_batches):
        start = (b * dp + dp_rank) * per_rank
        indices = np.arange(start, start + per_rank) % len(dataset)
        micro = rank_micro_batches(dataset, np.split(indices, t.grad_accum), device)
        total += reduce_loss(model, forward_only(model, micro))
    model.train(True)
    return total / t.eval_batches
