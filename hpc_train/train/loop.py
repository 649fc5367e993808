"""The training loop: one function per rank, from rank environment to trained model.

config -> rank bootstrap -> mesh -> data -> model -> optimizer -> steps (micro-batches, gradient
all-reduce over dp, clipping, AdamW) -> metrics.jsonl, eval, final weights.
"""

from __future__ import annotations

import contextlib
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from hpc_train.config import ConfigError, JobConfig, to_yaml, validate
from hpc_train.data.indexed import IndexedDataset
from hpc_train.data.prepare import dataset_prefixes
from hpc_train.data.sampler import ResumableSampler
from hpc_train.distributed.data_parallel import allreduce_gradients
from hpc_train.distributed.mesh import build_mesh
from hpc_train.launch.bootstrap import RankEnv, init_distributed, select_device
from hpc_train.model.gpt import GPT, count_params, flops_per_token, init_weights
from hpc_train.train.metrics import MetricsLog, device_peak_flops, peak_memory_bytes
from hpc_train.train.optim import build_optimizer, lr_at

AUTOCAST_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
FINAL_MODEL = "model_final.pt"


@dataclass
class StepResult:
    loss: float  # mean over the global batch
    grad_norm: float


@dataclass
class TrainResult:
    losses: list[float] = field(default_factory=list)
    eval_losses: dict[int, float] = field(default_factory=dict)


def autocast_context(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    dtype = AUTOCAST_DTYPES[precision]
    return torch.autocast(device.type, dtype=dtype) if dtype else contextlib.nullcontext()


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: list[tuple[torch.Tensor, torch.Tensor]],
    dp_group: dist.ProcessGroup,
    grad_clip: float,
    precision: str = "fp32",
    scaler: torch.amp.GradScaler | None = None,
) -> StepResult:
    """Accumulate gradients over the micro-batches, average them over dp, clip, step."""
    params = [p for p in model.parameters() if p.requires_grad]
    device = params[0].device
    loss_sum = torch.zeros((), device=device)
    for tokens, targets in micro_batches:
        with autocast_context(device, precision):
            loss = model(tokens, targets) / len(micro_batches)
        (scaler.scale(loss) if scaler else loss).backward()
        loss_sum += loss.detach()
    allreduce_gradients(params, dp_group)
    if scaler:
        scaler.unscale_(optimizer)
    grad_norm = torch.nn.utils.clip_grad_norm_(params, grad_clip if grad_clip > 0 else float("inf"))
    if scaler:  # skips the step when any gradient is inf/nan (identical on every dp rank after all-reduce)
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    dist.all_reduce(loss_sum, group=dp_group)
    return StepResult(loss_sum.item() / dist.get_world_size(dp_group), grad_norm.item())


@torch.no_grad()
def evaluate(
    model: nn.Module, dataset: IndexedDataset, cfg: JobConfig, dp_rank: int, dp_group: dist.ProcessGroup
) -> float:
    """Mean loss over the first eval_batches global batches of the held-out set (a fixed set each time)."""
    model.eval()
    device = next(model.parameters()).device
    dp = dist.get_world_size(dp_group)
    mbs = cfg.train.micro_batch_size
    total = torch.zeros((), device=device)
    for b in range(cfg.train.eval_batches):
        start = (b * dp + dp_rank) * mbs
        tokens, targets = dataset.batch(np.arange(start, start + mbs) % len(dataset))
        with autocast_context(device, cfg.train.precision):
            total += model(tokens.to(device), targets.to(device)).float()
    dist.all_reduce(total, group=dp_group)
    model.train()
    return total.item() / (cfg.train.eval_batches * dp)


def seed_everything(seed: int, rank: int) -> None:
    """Per-rank RNG streams (Python, numpy, torch); the model init uses its own generator."""
    random.seed(seed + rank)
    np.random.seed((seed + rank) % 2**32)
    torch.manual_seed(seed + rank)


def save_final_model(model: nn.Module, run_dir: Path) -> None:
    """Consolidated weights for export, written to a temporary name and renamed: never half-written."""
    tmp = run_dir / f".{FINAL_MODEL}.tmp"
    torch.save({k: v.detach().cpu() for k, v in model.state_dict().items()}, tmp)
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
    """The per-rank entry point: join the process group, train, leave it."""
    device = select_device(cfg.train.device, rank_env.local_rank)
    init_distributed(rank_env, device, cfg.parallel.backend, cfg.parallel.timeout_s)
    try:
        return _train(cfg, rank_env, device)
    finally:
        dist.destroy_process_group()


def _train(cfg: JobConfig, rank_env: RankEnv, device: torch.device) -> TrainResult:
    dp = validate(cfg, rank_env.world_size)
    mesh = build_mesh(device.type, cfg.parallel.pp, dp, cfg.parallel.tp)
    dp_group, dp_rank = mesh["dp"].get_group(), mesh["dp"].get_local_rank()
    is_logger = rank_env.rank == 0
    run_dir = Path(cfg.run_dir)
    seed_everything(cfg.train.seed, rank_env.rank)

    train_set, valid_set = load_datasets(cfg, show_progress=is_logger)
    model = GPT(cfg.model)
    init_weights(model, cfg.train.seed)
    model.to(device)
    optimizer = build_optimizer(model, cfg.optim, device)
    scaler = torch.amp.GradScaler(device.type) if cfg.train.precision == "fp16" else None
    t = cfg.train
    global_batch = t.micro_batch_size * t.grad_accum * dp
    sampler = ResumableSampler(len(train_set), global_batch, t.micro_batch_size, dp_rank, dp, t.seed)
    flops_token, peak_flops = flops_per_token(cfg.model), device_peak_flops(device)
    tokens_per_step = global_batch * cfg.model.seq_len

    log = None
    if is_logger:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(to_yaml(cfg))
        (run_dir / "metrics.jsonl").unlink(missing_ok=True)
        log = MetricsLog(run_dir, t.steps, cfg.logging.progress)
        log.message(
            f"hpc_train: {count_params(model) / 1e6:.2f}M params | world {rank_env.world_size} "
            f"(pp {cfg.parallel.pp}, dp {dp}, tp {cfg.parallel.tp}) on {device.type} | global batch "
            f"{global_batch} x {cfg.model.seq_len} tokens | {train_set.prefix} ({len(train_set):,} samples)"
        )

    result = TrainResult()
    for step in range(1, t.steps + 1):
        lr = lr_at(step - 1, cfg.optim, t.steps)
        for group in optimizer.param_groups:
            group["lr"] = lr
        start = time.perf_counter()
        micro_batches = [
            tuple(x.to(device, non_blocking=True) for x in train_set.batch(idx)) for idx in sampler.next_micro_batches()
        ]
        stats = train_step(model, optimizer, micro_batches, dp_group, cfg.optim.grad_clip, t.precision, scaler)
        elapsed = time.perf_counter() - start
        result.losses.append(stats.loss)

        record = {"step": step, "loss": stats.loss, "lr": lr, "grad_norm": stats.grad_norm}
        if valid_set is not None and t.eval_interval and (step % t.eval_interval == 0 or step == t.steps):
            record["eval_loss"] = result.eval_losses[step] = evaluate(model, valid_set, cfg, dp_rank, dp_group)
        memory = torch.tensor(float(peak_memory_bytes(device)), device=device)
        dist.all_reduce(memory, op=dist.ReduceOp.MAX)
        tokens_per_s = tokens_per_step / elapsed
        record.update(
            tokens_per_s=tokens_per_s,
            tflops=tokens_per_s * flops_token / rank_env.world_size / 1e12,
            mfu=tokens_per_s * flops_token / (rank_env.world_size * peak_flops),
            memory_gb=memory.item() / 1e9,
            step_time_s=elapsed,
            consumed_samples=sampler.consumed_samples,
        )
        if scaler:
            record["loss_scale"] = scaler.get_scale()
        if log:
            log.write(record, show=step % cfg.logging.log_interval == 0 or step == t.steps)

    if is_logger:
        if t.save_final_model:
            save_final_model(model, run_dir)
        log.message(f"done: final loss {result.losses[-1]:.4f}; metrics in {run_dir / 'metrics.jsonl'}")
        log.close()
    return result
