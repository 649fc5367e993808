"""One training step on this rank's micro-batches, and evaluation: the arithmetic the loop repeats."""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from hpc_train.config import DataConfig, TrainConfig
from hpc_train.data.batch import Source, collate
from hpc_train.distributed.grads import clip_grad_norm
from hpc_train.distributed.hooks import StepHooks
from hpc_train.distributed.parallelize import MicroBatches, ParallelModel, forward_backward, forward_only, reduce_loss
from hpc_train.errors import UserError
from hpc_train.observe.memory import SavedActivations, StepPeak, tensor_bytes
from hpc_train.observe.profiling import timed
from hpc_train.optim.loss_scale import LossScaler
from hpc_train.optim.protocol import Optimizer
from hpc_train.resilience import watchdog
from hpc_train.resilience.faults import fault_point
from hpc_train.resilience.spikes import SPIKE_FACTOR, SpikeDetector
from hpc_train.resilience.stragglers import ComputeClock


class NonFiniteStep(UserError, RuntimeError):
    """A step whose loss or gradients are not finite for a reason other than an fp16 overflow that the loss
    scale absorbs. Raised by the loop when it reads the step's figures (the same on every rank)."""


@dataclass
class StepOptions:
    """What a step takes besides the model, the optimizer, the batches and the learning rate."""

    grad_clip: float = 1.0  # 0: no clipping
    scaler: LossScaler | None = None  # fp16's dynamic loss scale
    step: int = 0  # its number, for the hang watchdog and planted faults
    timings: dict[str, float] | None = None  # when given, the seconds of each phase are added to it
    clock: ComputeClock | None = None  # times the compute (straggler report)
    before_update: Callable[[], None] | None = None  # runs before the weights change (an async save's copy)
    # profile the step for its peak of live tensor bytes (observe/memory.py StepPeak), leaving out the
    # storages (address, bytes) given: what the process held before the run; None: not measured
    measure_peak: frozenset[tuple[int, int]] | None = None
    # count the bytes by category (StepResult.memory): saved-tensor hooks on every saved tensor, whose detach
    # is a DTensor op under tp (8 steps at tp2 with SP took 20% more CPU time with them, dp2 3%), so the
    # loop asks on its first two steps only
    measure_memory: bool = True
    spikes: SpikeDetector | None = None  # train.spike_guard's running medians: the step's `spike` figure
    batch: int = 0  # the number of the global batch read (1 = the stream's first), for a planted poisoned batch
    rollbacks: int = 0  # train.spike_guard's so far, for the hang watchdog's order of ranks


# A step's figures, one small vector left on the device: the loss (global-batch mean), the gradient norm
# before clipping, fp16's overflow flag (the scale absorbed it: the update was skipped) and whether that
# happened at the smallest scale, the loss scale after the step, the steps skipped so far, and whether
# train.spike_guard saw a spike.
FIGURES = ("loss", "grad_norm", "overflow", "overflow_at_floor", "loss_scale", "skipped_steps", "spike")


@dataclass
class StepResult:
    figures: torch.Tensor  # FIGURES, on the device until `read_figures`
    memory: dict[str, int] = field(default_factory=dict)  # this rank's bytes by category
    # by step hook (ParallelModel.hooks), its figures after the update (on the device until the loop reads them)
    features: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)


def read_figures(results: list[StepResult]) -> list[dict[str, float]]:
    """Every given step's figures copied to the host at once: the training loop's one read of the device
    per log interval (a step itself reads nothing)."""
    if not results:
        return []
    return [dict(zip(FIGURES, row, strict=True)) for row in torch.stack([r.figures for r in results]).tolist()]


def skip_reason(figures: dict[str, float]) -> str | None:
    """Why a step's update was dropped as non-finite (it was, on the device), or None: a finite step, or an
    fp16 overflow that the loss scale absorbs (skipped too, but counted in `skipped_steps`, not here)."""
    if figures["overflow_at_floor"]:
        return f"the gradients are not finite even at the smallest fp16 loss scale ({figures['loss_scale']})"
    if figures["overflow"]:
        return None
    if not math.isfinite(figures["grad_norm"]):
        return f"the gradient norm is {figures['grad_norm']}"
    if not math.isfinite(figures["loss"]):
        return f"the loss is {figures['loss']}"
    return None


def apply_gradients(
    model: ParallelModel, optimizer: Optimizer, lr: float, options: StepOptions, loss: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reduce the gradients over dp, check fp16 overflow on every rank, clip by the global norm, step
    (`before_update` first: an async checkpoint's copy must be done). The update is dropped on the device,
    on every rank alike, when the gradients overflowed or the norm or the global `loss` is not finite: no
    host read decides it. Returns the step's FIGURES and that decision (a bool on the device). With
    `options.spikes` the step is compared with the recent ones (train.spike_guard), on the device too."""
    scaler, timings, device = options.scaler, options.timings, model.device
    with timed(timings, "grad_reduce", device):
        optimizer.reduce_gradients()
    grads = optimizer.grad_groups()
    overflow = at_floor = skipped = scale = torch.zeros((), device=device)
    if scaler is not None:
        overflow = scaler.unscale_and_check(grads.all)
        at_floor = overflow * (scaler.scale <= scaler.min_scale)
        scaler.update(overflow)
        scale, skipped = scaler.scale.clone(), scaler.skipped_steps.clone()
    with timed(timings, "optimizer", device):
        grad_norm = clip_grad_norm(grads, options.grad_clip, model.mesh, device)
        skip = overflow.bool() | ~torch.isfinite(grad_norm) | ~torch.isfinite(loss)
        if options.before_update is not None:
            options.before_update()
        optimizer.step(lr, skip)
        optimizer.zero_grad()
    spike = options.spikes.observe(loss, grad_norm, skip) if options.spikes else torch.zeros((), device=device)
    figures = [loss, grad_norm, overflow, at_floor, scale, skipped, spike]
    return torch.stack([t.to(device, torch.float64) for t in figures]), skip


def train_step(
    model: ParallelModel,
    optimizer: Optimizer,
    micro_batches: MicroBatches,
    lr: float,
    options: StepOptions | None = None,
) -> StepResult:
    """One optimizer step on this rank's micro-batches; the loss is the global-batch mean. Nothing is read
    to the host: the figures stay on the device (`read_figures`)."""
    options = options or StepOptions()
    if options.measure_peak is None:
        return _train_step(model, optimizer, micro_batches, lr, options)
    with StepPeak(micro_batches[0].tokens.device, options.measure_peak) as peak:
        result = _train_step(model, optimizer, micro_batches, lr, options)
    result.memory.update(step_peak=peak.peak_bytes, step_peak_min=peak.peak_min_bytes, step_start=peak.start_bytes)
    return result


def _train_step(
    model: ParallelModel, optimizer: Optimizer, micro_batches: MicroBatches, lr: float, options: StepOptions
) -> StepResult:
    scaler, step = options.scaler, options.step
    model.loss_scale = scaler.scale if scaler else 1.0
    params = model.parameters
    optimizer.begin_step(len(micro_batches))
    device = micro_batches[0].tokens.device
    poisoned = fault_point("batch", options.batch, dist.get_rank())  # a planted bad batch: loss x SPIKE_FACTOR
    if poisoned:  # its gradients too: the scale multiplies the loss before backward, and no one divides it out
        model.loss_scale = model.loss_scale * SPIKE_FACTOR
    saved = SavedActivations(params) if options.measure_memory else None
    with (
        saved or nullcontext(),
        timed(options.timings, "forward_backward", device),
        options.clock or nullcontext(),
    ):
        loss = forward_backward(model, micro_batches) * (SPIKE_FACTOR if poisoned else 1.0)
        fault_point("compute", step, dist.get_rank())
    if fault_point("loss", step, dist.get_rank()):  # a planted non-finite loss; the gradients stay finite
        loss = loss + float("nan")
    fault_point("mid_step", step, dist.get_rank())
    watchdog.record(step, 1, options.rollbacks)
    memory = {}
    if saved is not None:
        memory = {
            "params": tensor_bytes(params),
            "grads": tensor_bytes(p.grad for p in params) + optimizer.grad_buffer_bytes(),
            "activations_per_microbatch": saved.bytes // len(micro_batches),
            "activations_peak": saved.peak_bytes,
        }
    mean_loss = reduce_loss(model, loss)  # before the update: a non-finite loss drops it too
    figures, skipped = apply_gradients(model, optimizer, lr, options, mean_loss)
    if saved is not None:
        memory = by_place({**memory, "optimizer": optimizer.state_bytes()}, optimizer)
    by_hook = {hook.name: hook.after_update(skipped) for hook in model.hooks}  # the features' ends of the step
    return StepResult(figures, memory, {name: f for name, f in by_hook.items() if f})


def by_place(memory: dict[str, int], optimizer: Optimizer) -> dict[str, int]:
    """The bytes by category, with what optim.offload keeps in host memory under `host` (only then
    reported): the optimizer's offloaded categories, zero on the device, and its own host buffers (nvme's
    ring, its state being on disk)."""
    on_disk = optimizer.disk_bytes()  # nvme's state, on the node's disk
    disk = {"disk": on_disk} if on_disk else {}
    if not optimizer.offloaded and not optimizer.host_buffer_bytes():
        return {**memory, **disk}
    host = optimizer.host_buffer_bytes() + sum(memory[k] for k in optimizer.offloaded)
    return {**memory, **dict.fromkeys(optimizer.offloaded, 0), "host": host, **disk}


def rank_micro_batches(
    source: Source,
    indices: list[np.ndarray],
    device: torch.device,
    hooks: list[StepHooks] | tuple[()] = (),
    data: DataConfig | None = None,
) -> MicroBatches:
    """The samples at `indices`, on `device`, with `data`'s document positions and masks (if on), each cut to
    this rank's part by the step `hooks` (context parallelism: its positions of each sample)."""
    reset, mask = (False, False) if data is None else (data.reset_position_ids, data.document_mask)
    batches = [collate(source, idx, reset, mask) for idx in indices]
    for hook in hooks:
        batches = [hook.shard(batch) for batch in batches]
    return [batch.to(device) for batch in batches]


def evaluate(model: ParallelModel, dataset: Source, t: TrainConfig, data: DataConfig | None = None) -> float:
    """Mean loss over the first eval_batches global batches of the held-out set, read in order: the same
    samples, in the same micro-batch shapes as training (and `data`'s document options), whatever the layout."""
    model.train(False)
    dp, dp_rank = model.mesh.size("dp"), model.mesh.rank("dp")
    per_rank, device = t.micro_batch_size * t.grad_accum, model.device
    total = torch.zeros((), dtype=torch.float64, device=device)
    for b in range(t.eval_batches):
        start = (b * dp + dp_rank) * per_rank
        indices = np.arange(start, start + per_rank) % len(dataset)
        micro = rank_micro_batches(dataset, np.split(indices, t.grad_accum), device, model.hooks, data)
        total += reduce_loss(model, forward_only(model, micro))
    model.train(True)
    return total.item() / t.eval_batches
