"""The composition root: (config, rank environment) -> a `Run` holding every part of a training run,
created in one explicit order. The train loop, the CLI's train and Slurm paths (through the loop) and
every tool under tools/ build runs here; nothing else wires parts by hand.

Order, and why: the model keys of `model.init_from` -> check the whole config -> mesh (needs the process
group) -> per-rank RNG -> data -> model family -> precision policy (needs the optimizer class: only an
optimizer with fp32 master weights lets the model hold bf16/fp16 weights) -> parallel model (meta build,
tp, adapters, local init, pipeline schedule) -> the weights of `model.init_from`, if any -> QLoRA's NF4
base -> optimizer (takes its fp32 master copy) -> cast the weights to the policy's dtype (LoRA's frozen
base to the compute dtype) -> loss scaler -> sampler -> spike detector -> metrics -> checkpointer, with every
part it saves registered.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from hpc_train.bootstrap import RankEnv
from hpc_train.checkpoint.checkpointer import Checkpointer
from hpc_train.checkpoint.init_from import base_fingerprint, load_base, with_source_model
from hpc_train.checkpoint.ownership import RunIdentity
from hpc_train.checkpoint.state import ModelState, OptimizerState, RNGState
from hpc_train.config import OptimConfig
from hpc_train.data.blend import BlendedSampler, BlendedSource
from hpc_train.data.indexed import IndexedDataset
from hpc_train.data.prepare import load_datasets, load_valid_sources
from hpc_train.data.sampler import ResumableSampler
from hpc_train.distributed.mesh import Mesh, ParallelDims
from hpc_train.distributed.parallelize import ParallelModel, parallelize
from hpc_train.distributed.transforms import StagePlan
from hpc_train.job import JobConfig, block_policy, check_run, declared
from hpc_train.models import get_spec
from hpc_train.observe.metrics import MetricsLog
from hpc_train.optim import build_optimizer, optimizer_class, precision_policy
from hpc_train.optim.loss_scale import LossScaler
from hpc_train.optim.precision import PrecisionPolicy
from hpc_train.optim.protocol import Optimizer
from hpc_train.planner import plans_memory_copy, stage_estimates
from hpc_train.resilience.spikes import SpikeDetector


@dataclass
class Run:
    cfg: JobConfig
    rank_env: RankEnv
    device: torch.device
    mesh: Mesh
    policy: PrecisionPolicy
    model: ParallelModel
    optimizer: Optimizer
    scaler: LossScaler | None  # fp16 only
    # None for a run built without data (tools feeding their own batches)
    train_set: IndexedDataset | BlendedSource | None
    valid_set: IndexedDataset | None
    sampler: ResumableSampler | BlendedSampler | None
    metrics: MetricsLog | None  # on the rank that logs (global rank 0)
    checkpointer: Checkpointer
    report: Callable[[str], None]  # events everyone should see: printed by rank 0 only
    valid_sources: dict[str, IndexedDataset] = field(default_factory=dict)  # data.valid_sources, by name
    spikes: SpikeDetector | None = None  # train.spike_guard's running medians, when on


def seed_everything(seed: int, rank: int) -> None:
    """Per-rank RNG streams (Python, numpy, torch); the model init uses its own generators."""
    random.seed(seed + rank)
    np.random.seed((seed + rank) % 2**32)
    torch.manual_seed(seed + rank)


def params_on_host(optim: OptimConfig) -> bool:
    """Whether the parameters are allocated in host memory: FSDP2's CPU offload (ZeRO-3 with optim.offload),
    whose first forward refuses parameters that report a GPU, whatever device computes."""
    return optimizer_class(optim).shards_params and optim.offload != "none"


def build_model(
    cfg: JobConfig, mesh: Mesh, device: torch.device, compute_dtype: torch.dtype | None = None
) -> ParallelModel:
    """This rank's part of the model (distributed/parallelize.py), with every feature that is on: its
    transforms and initializers in the registry's order, bound to the config sections each reads, and its
    hooks into every step."""
    o, given = cfg.optim, {"mesh": mesh, "block_policy": block_policy(cfg)}
    plan = StagePlan(cfg.model, cfg.parallel, cfg.train, get_spec(cfg.model.arch), mesh, device, compute_dtype,
                     params_on_host=params_on_host(o),
                     transforms=tuple(fn for _, fn in declared(cfg, "transform", **given)),
                     initializers=tuple(fn for _, fn in declared(cfg, "initialize", **given)))  # fmt: skip
    model = parallelize(plan)
    model.hooks = [hook for _, attach in declared(cfg, "hooks", **given) if (hook := attach(model)) is not None]
    return model


def available_memory_bytes() -> int:
    """The node's MemAvailable (free memory and the page cache it can reclaim)."""
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))


def keeps_memory_copy(cfg: JobConfig, dims: ParallelDims, ranks_here: int, device: torch.device,
                      report: Callable[[str], None]) -> bool:  # fmt: skip
    """train.spike_guard.memory_copy, or, unset, whether the planner's copy of a rank's state (the largest
    pipeline stage's) for each of this node's ranks fits in half of the node's available memory on every
    node (agreed: a rollback restores the copy on every rank or on none). Always, with node-local
    checkpoints: they are written from the copy."""
    guard = cfg.train.spike_guard
    if cfg.checkpoint.saves_locally:
        return True  # node-local checkpoints are written from the copy: it is there anyway
    if not plans_memory_copy(cfg) or guard.memory_copy is not None:
        return plans_memory_copy(cfg)
    need = ranks_here * max(plan.host_copy for plan in stage_estimates(cfg, dims))
    available = available_memory_bytes()
    fits = torch.tensor(float(need <= available // 2), device=device)
    dist.all_reduce(fits, op=dist.ReduceOp.MIN)
    report(f"train.spike_guard: an in-memory copy of the state takes {need / 2**30:.2f} GiB for the {ranks_here} "
           f"ranks of this node, {available / 2**30:.1f} GiB available here: rollbacks read "
           f"{'it' if fits else 'the checkpoint from disk (the copy does not fit in half on every node)'}")  # fmt: skip
    return bool(fits)


def build_run(cfg: JobConfig, rank_env: RankEnv, device: torch.device, with_data: bool = True) -> Run:
    """Every part of the run on this rank; the default process group must exist."""
    cfg = with_source_model(cfg)
    dims = check_run(cfg, rank_env.world_size, check_paths=with_data)
    mesh = Mesh(dims, device.type, cfg.parallel.ep)
    is_logger = rank_env.rank == 0
    report = functools.partial(print, flush=True) if is_logger else (lambda message: None)
    seed_everything(cfg.train.seed, rank_env.rank)
    train_set, valid_set = load_datasets(cfg.data, cfg.model, progress=is_logger) if with_data else (None, None)
    valid_sources = load_valid_sources(cfg.data, cfg.model, progress=is_logger) if with_data else {}

    policy = precision_policy(cfg.train, cfg.optim)
    model = build_model(cfg, mesh, device, policy.autocast_dtype)
    model.masked_loss = any(ds is not None and ds.loss_mask is not None
                            for ds in (train_set, valid_set, *valid_sources.values()))  # fmt: skip
    load_base(model, cfg.model.init_from, cfg.finetune.quantized_base, cfg.checkpoint.io_threads)
    adapters = cfg.finetune.adapters
    optimizer = build_optimizer(model, cfg.optim)
    # after the optimizer took its fp32 master copy; LoRA's frozen base in the compute dtype
    policy.cast_parameters(model.trainable_parameters if adapters else model.parameters)
    if adapters:  # (QLoRA's NF4 weights stay as they are)
        frozen = [p for name, p in model.named_parameters if not p.requires_grad and name not in model.quantized]
        policy.cast_parameters(frozen, policy.frozen_dtype)
    t = cfg.train
    scaler = LossScaler(t.initial_loss_scale, t.loss_scale_window, device=device) if policy.loss_scaling else None
    global_batch = t.micro_batch_size * t.grad_accum * dims.dp
    sampler = None
    if isinstance(train_set, BlendedSource):
        sampler = BlendedSampler(train_set, [s.weight for s in cfg.data.sources], global_batch, t.micro_batch_size,
                                 mesh.rank("dp"), dims.dp, t.seed, report, cfg.data.skip_samples)  # fmt: skip
    elif train_set is not None:
        sampler = ResumableSampler(len(train_set), global_batch, t.micro_batch_size, mesh.rank("dp"), dims.dp, t.seed,
                                   skipped=cfg.data.skip_samples)  # fmt: skip
    spikes = SpikeDetector(t.spike_guard, device) if t.spike_guard.enabled else None
    metrics = None
    if is_logger:
        wandb = cfg if cfg.logging.wandb.project else None  # observe/wandb_log.py
        metrics = MetricsLog(cfg.run_dir, t.steps, cfg.logging.progress, cfg.logging.tensorboard, wandb)

    layout = {**dims.as_dict(), "ep": cfg.parallel.ep, "world_size": dims.world_size,
              "zero_stage": cfg.optim.zero_stage, "precision": t.precision}  # fmt: skip
    shared = {"sampler": sampler, "loss_scaler": scaler, "metrics": metrics, "spike_guard": spikes}
    for note in train_set.identity_notes() if train_set else []:
        report(note)
    identity = RunIdentity(
        cfg,
        train_set.identity() if train_set else None,
        base_fingerprint(cfg.model.init_from, t.seed) if is_logger and model.quantized else None,
    )
    checkpointer = Checkpointer(
        cfg.checkpoint,
        t.steps,
        identity,
        layout,
        sharded={"model": ModelState(model), "optim": OptimizerState(model, optimizer)},
        shared={name: part for name, part in shared.items() if part is not None},
        per_rank={"rng": RNGState()},
        report=report,
        memory_copy=keeps_memory_copy(cfg, dims, rank_env.local_world_size, device, report),
        run_name=cfg.name,
        ranks_per_node=rank_env.local_world_size,
        hooks=model.hooks,
        # at ZeRO-0 a dp group's ranks hold the same tensors (with experts, each ep rank its own)
        replicas=mesh.group_of("dp") if cfg.optim.zero_stage == 0 and cfg.parallel.ep == 1 else None,
    )
    return Run(cfg, rank_env, device, mesh, policy, model, optimizer, scaler, train_set, valid_set,
               sampler, metrics, checkpointer, report, valid_sources, spikes)  # fmt: skip
