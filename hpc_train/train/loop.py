"""The training loop: one function per rank, from rank environment to trained model.

config -> rank bootstrap -> mesh -> data -> parallel model (pipeline stages, tensor parallel) ->
optimizer -> steps (forward/backward, gradient placement fix + dp all-reduce, global-norm clipping,
AdamW) -> metrics.jsonl, eval, final weights.
"""

from __future__ import annotations

import functools
import json
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from hpc_train.checkpoint.checkpointer import Checkpointer
from hpc_train.config import ConfigError, JobConfig, to_yaml, validate
from hpc_train.data.indexed import IndexedDataset
from hpc_train.data.prepare import dataset_prefixes
from hpc_train.data.sampler import ResumableSampler
from hpc_train.distributed import watchdog
from hpc_train.distributed.grads import clip_grad_norm, local
from hpc_train.distributed.mesh import MESH_DIMS, build_mesh
from hpc_train.distributed.parallelize import (
    MicroBatches,
    ParallelModel,
    cast_parameters,
    forward_backward,
    forward_only,
    full_state_dict,
    parallelize,
    reduce_loss,
)
from hpc_train.distributed.zero import DataParallelOptimizer, ZeroOptimizer, build_optimizer
from hpc_train.faults import fault_point
from hpc_train.launch.bootstrap import RankEnv, describe_rank, init_distributed, select_device
from hpc_train.model.gpt import GPT, count_params, flops_per_token
from hpc_train.planner import estimate
from hpc_train.train.loss_scale import LossScaler
from hpc_train.train.memory import SavedActivations, tensor_bytes
from hpc_train.train.metrics import MetricsLog, device_peak_flops, peak_memory_bytes
from hpc_train.train.optim import lr_at
from hpc_train.train.preemption import StopRequest, requeue_slurm_job
from hpc_train.train.profiling import ProfileWindow, timed, write_oom_report

Optimizer = DataParallelOptimizer | ZeroOptimizer

FINAL_MODEL = "model_final.pt"


@dataclass
class StepResult:
    loss: float  # mean over the global batch
    grad_norm: float
    memory: dict[str, int] = field(default_factory=dict)  # this rank's bytes by category


@dataclass
class TrainResult:
    losses: list[float] = field(default_factory=list)  # of the steps this run trained (after a resume)
    eval_losses: dict[int, float] = field(default_factory=dict)
    requeued: bool = False


def apply_gradients(
    model: ParallelModel,
    optimizer: Optimizer,
    lr: float,
    grad_clip: float,
    scaler: LossScaler | None = None,
    timings: dict[str, float] | None = None,
) -> float | None:
    """Reduce the gradients over dp, check fp16 overflow on every rank, clip by the global norm, step.
    Returns the gradient norm, or None when the step was skipped for an overflow."""
    device = local(model.parameters[0]).device
    with timed(timings, "grad_reduce", device):
        optimizer.reduce_gradients()
    grads = optimizer.grad_groups()
    if scaler is not None:
        overflow = scaler.found_inf(grads.all)
        scaler.update(overflow)
        if overflow:
            optimizer.zero_grad()
            return None
        scaler.unscale(grads.all)
    with timed(timings, "optimizer", device):
        grad_norm = clip_grad_norm(grads, grad_clip, model.mesh)
        optimizer.step(lr)
        optimizer.zero_grad()
    return grad_norm


def train_step(
    model: ParallelModel,
    optimizer: Optimizer,
    micro_batches: MicroBatches,
    lr: float,
    grad_clip: float,
    scaler: LossScaler | None = None,
    step: int = 0,
    timings: dict[str, float] | None = None,
) -> StepResult:
    """One optimizer step on this rank's micro-batches; the loss is the global-batch mean. With
    `timings`, the seconds of each phase are added to it."""
    model.loss_scale = scaler.scale if scaler else 1.0
    params = model.parameters
    optimizer.begin_step(len(micro_batches))
    with SavedActivations(params) as saved, timed(timings, "forward_backward", micro_batches[0][0].device):
        loss = forward_backward(model, micro_batches)
    fault_point("mid_step", step, dist.get_rank())
    watchdog.record(step, 1)
    memory = {
        "params": tensor_bytes(params),
        "grads": tensor_bytes(p.grad for p in params) + optimizer.grad_buffer_bytes(),
        "activations_per_microbatch": saved.bytes // len(micro_batches),
        "activations_peak": saved.peak_bytes,
    }
    grad_norm = apply_gradients(model, optimizer, lr, grad_clip, scaler, timings)
    memory["optimizer"] = optimizer.state_bytes()
    return StepResult(reduce_loss(model, loss), grad_norm if grad_norm is not None else float("nan"), memory)


def rank_micro_batches(dataset: IndexedDataset, indices: list[np.ndarray], device: torch.device) -> MicroBatches:
    return [tuple(t.to(device, non_blocking=True) for t in dataset.batch(idx)) for idx in indices]


def evaluate(model: ParallelModel, dataset: IndexedDataset, cfg: JobConfig) -> float:
    """Mean loss over the first eval_batches global batches of the held-out set, read in order: the same
    samples, in the same micro-batch shapes as training, whatever the layout."""
    model.train(False)
    t = cfg.train
    dp, dp_rank = model.mesh["dp"].size(), model.rank("dp")
    per_rank = t.micro_batch_size * t.grad_accum
    device = model.parameters[0].device
    total = 0.0
    for b in range(t.eval_batches):
        start = (b * dp + dp_rank) * per_rank
        indices = np.arange(start, start + per_rank) % len(dataset)
        micro = rank_micro_batches(dataset, np.split(indices, t.grad_accum), device)
        total += reduce_loss(model, forward_only(model, micro))
    model.train(True)
    return total / t.eval_batches


def seed_everything(seed: int, rank: int) -> None:
    """Per-rank RNG streams (Python, numpy, torch); the model init uses its own generators."""
    random.seed(seed + rank)
    np.random.seed((seed + rank) % 2**32)
    torch.manual_seed(seed + rank)


def save_final_model(state: dict[str, torch.Tensor], run_dir: Path) -> None:
    """Consolidated weights for export, written to a temporary name and renamed: never half-written."""
    tmp = run_dir / f".{FINAL_MODEL}.tmp"
    torch.save(state, tmp)
    os.replace(tmp, run_dir / FINAL_MODEL)


def load_datasets(cfg: JobConfig, show_progress: bool) -> tuple[IndexedDataset, IndexedDataset | None]:
    train_prefix, valid_prefix = dataset_prefixes(
        cfg.data.train_path, cfg.data.valid_path, cfg.data.cache_dir, show_progress
    )
    train_set = IndexedDataset(train_prefix, cfg.model.seq_len)
    valid_set = IndexedDataset(valid_prefix, cfg.model.seq_len) if valid_prefix else None
    for ds in filter(None, (train_set, valid_set)):
        if ds.vocab_size > cfg.model.vocab_size:
            raise ConfigError(
                f"dataset {ds.prefix} has vocabulary size {ds.vocab_size} but model.vocab_size="
                f"{cfg.model.vocab_size}; set model.vocab_size={ds.vocab_size}"
            )
    return train_set, valid_set


def run_training(rank_env: RankEnv, cfg: JobConfig) -> TrainResult:
    """The per-rank entry point: join the process group, train (resuming from the newest valid
    checkpoint), leave it. A stop signal ends training early with a committed checkpoint."""
    device = select_device(cfg.train.device, rank_env.local_rank)
    init_distributed(rank_env, device, cfg.parallel.backend, cfg.parallel.timeout_s)
    stop = StopRequest().install()
    last_memory: dict[str, int] = {}  # the last step's measured bytes, for an out-of-memory report
    try:
        return _train(cfg, rank_env, device, stop, last_memory)
    except torch.OutOfMemoryError:
        path = write_oom_report(Path(cfg.run_dir), rank_env.rank, device, last_memory)
        print(f"rank {rank_env.rank}: out of memory; memory summary in {path}", flush=True)
        raise
    except RuntimeError as err:
        if not watchdog.is_timeout(err):
            raise
        raise RuntimeError(
            f"rank {rank_env.rank}: a collective timed out after parallel.timeout_s={cfg.parallel.timeout_s}s: "
            f"a peer stopped responding: {watchdog.stragglers(rank_env.world_size)}"
        ) from err
    finally:
        stop.uninstall()
        dist.destroy_process_group()


def keep_metrics_until(path: Path, step: int) -> None:
    """On resume: the records of steps after the checkpoint are re-run, so drop them (one record a step)."""
    if path.is_file():
        kept = [line for line in path.read_text().splitlines() if json.loads(line)["step"] <= step]
        path.write_text("".join(line + "\n" for line in kept))


def _train(
    cfg: JobConfig, rank_env: RankEnv, device: torch.device, stop: StopRequest, last_memory: dict[str, int]
) -> TrainResult:
    dp = validate(cfg, rank_env.world_size)
    p, t = cfg.parallel, cfg.train
    mesh = build_mesh(device.type, p.pp, dp, p.tp)
    is_logger = rank_env.rank == 0
    report = functools.partial(print, flush=True) if is_logger else (lambda message: None)  # events, always shown
    run_dir = Path(cfg.run_dir)
    seed_everything(t.seed, rank_env.rank)

    layout = [None] * rank_env.world_size  # every rank's place, checked once so a mismatch shows up early
    dist.all_gather_object(layout, {**describe_rank(rank_env), **{d: mesh[d].get_local_rank() for d in MESH_DIMS}})
    if is_logger:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "rank_layout.json").write_text(json.dumps(layout, indent=1))

    train_set, valid_set = load_datasets(cfg, show_progress=is_logger)
    model = parallelize(cfg, mesh, device)
    optimizer = build_optimizer(model.parameters, cfg.optim, model.group("dp"))
    cast_parameters(model)  # after the optimizer took its fp32 master copy
    scaler = LossScaler(t.initial_loss_scale, t.loss_scale_window) if t.precision == "fp16" else None
    global_batch = t.micro_batch_size * t.grad_accum * dp
    sampler = ResumableSampler(len(train_set), global_batch, t.micro_batch_size, model.rank("dp"), dp, t.seed)
    flops_token, peak_flops = flops_per_token(cfg.model), device_peak_flops(device)
    tokens_per_step = global_batch * cfg.model.seq_len

    checkpointer = Checkpointer(cfg, model, optimizer, report)
    start_step = 0
    progress = checkpointer.resume() if cfg.checkpoint.resume else None
    if progress is not None:
        start_step = progress["step"]
        sampler.load_state_dict(progress)
        if scaler is not None and progress.get("loss_scaler"):
            scaler.load_state_dict(progress["loss_scaler"])

    log = None
    if is_logger:
        (run_dir / "config.yaml").write_text(to_yaml(cfg))
        keep_metrics_until(run_dir / "metrics.jsonl", start_step)
        log = MetricsLog(run_dir, t.steps, cfg.logging.progress, start_step, cfg.logging.tensorboard)
        with torch.device("meta"):  # the whole model's size, without allocating it
            n_params = count_params(GPT(cfg.model))
        log.message(
            f"hpc_train: {n_params / 1e6:.2f}M params | "
            f"world {rank_env.world_size} (pp {p.pp}, dp {dp}, tp {p.tp}) on {device.type} | global batch "
            f"{global_batch} x {cfg.model.seq_len} tokens | {train_set.prefix} ({len(train_set):,} samples)"
        )

    predicted = estimate(cfg, dp)
    report(
        f"planner: {predicted.total / 2**30:.3f} GiB per rank (params {predicted.params / 2**30:.3f}, grads "
        f"{predicted.grads / 2**30:.3f}, optimizer {predicted.optimizer / 2**30:.3f}, activations "
        f"{predicted.activations / 2**30:.3f}); measured values follow in metrics.jsonl's memory_bytes"
    )
    profile = ProfileWindow(cfg.logging.profile_steps, run_dir, rank_env.rank, device)

    def save(step: int) -> None:
        loss_scaler = scaler.state_dict() if scaler else None
        checkpointer.save(
            step, {"step": step, "consumed_samples": sampler.consumed_samples, "loss_scaler": loss_scaler}
        )

    result = TrainResult()
    saved_step = start_step
    for step in range(start_step + 1, t.steps + 1):
        watchdog.record(step, 0)
        lr = lr_at(step - 1, cfg.optim, t.steps)
        start = time.perf_counter()
        micro_batches = rank_micro_batches(train_set, sampler.next_micro_batches(), device)
        profile.before_step(step)
        timings = {} if cfg.logging.breakdown else None
        stats = train_step(model, optimizer, micro_batches, lr, cfg.optim.grad_clip, scaler, step, timings)
        profile.after_step(step)
        last_memory.update(stats.memory)
        elapsed = time.perf_counter() - start
        result.losses.append(stats.loss)

        record = {"step": step, "loss": stats.loss, "lr": lr, "grad_norm": stats.grad_norm}
        if valid_set is not None and t.eval_interval and (step % t.eval_interval == 0 or step == t.steps):
            record["eval_loss"] = result.eval_losses[step] = evaluate(model, valid_set, cfg)
        # one MAX all-reduce for the peak memory over ranks and for a stop signal seen by any rank
        agreed = torch.tensor([*map(float, peak_memory_bytes(device)), float(stop.signum is not None)], device=device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
        tokens_per_s = tokens_per_step / elapsed
        record.update(
            tokens_per_s=tokens_per_s,
            tflops=tokens_per_s * flops_token / rank_env.world_size / 1e12,
            mfu=tokens_per_s * flops_token / (rank_env.world_size * peak_flops),
            memory_gb=agreed[0].item() / 1e9,
            memory_reserved_gb=agreed[1].item() / 1e9,
            step_time_s=elapsed,
            consumed_samples=sampler.consumed_samples,
            memory_bytes=stats.memory,  # rank 0's, by category
        )
        if scaler:
            record.update(loss_scale=scaler.scale, skipped_steps=scaler.skipped_steps)
        if progress is not None and step == start_step + 1:  # where this run picked up, for the record
            record["resumed_from"] = progress["resumed_from"]
        if step <= start_step + 2:  # the planner's prediction beside the first measurements
            record["memory_predicted_bytes"] = {
                "params": predicted.params, "grads": predicted.grads, "optimizer": predicted.optimizer,
                "activations_per_microbatch": predicted.activations_per_microbatch,
            }  # fmt: skip
        if timings is not None:
            bubble = (p.pp - 1) / (t.grad_accum * p.virtual_stages) * timings["forward_backward"] if p.pp > 1 else 0.0
            record["time_breakdown_s"] = {**timings, "pipeline_bubble_est": bubble, "total": elapsed}
        if log:
            log.write(record, show=step % cfg.logging.log_interval == 0 or step == t.steps)
        watchdog.record(step, 2)
        interval = cfg.checkpoint.interval
        stop_requested = bool(agreed[2].item())
        if stop_requested or (interval and (step % interval == 0 or step == t.steps)):
            save(step)
            saved_step = step
        if stop_requested:
            checkpointer.wait()
            report(f"stop signal received: checkpoint of step {step} committed, stopping")
            if is_logger:
                result.requeued = requeue_slurm_job(cfg.slurm.max_requeues, report)
                log.close()
            dist.barrier()
            return result
    checkpointer.wait()

    final_state = full_state_dict(model) if t.save_final_model else None
    if is_logger:
        if final_state is not None:
            save_final_model(final_state, run_dir)
        final = f"final loss {result.losses[-1]:.4f}" if result.losses else f"already at step {saved_step}"
        log.message(f"done: {final}; metrics in {run_dir / 'metrics.jsonl'}")
        log.close()
    return result
