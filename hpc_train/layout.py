"""The whole check of a run's config for a world size, before any process starts: the schema and the
parallel layout (config/checks.py), the model family's shapes (models/), the optimizer's capabilities (optim/),
the frozen-parameter patterns and every registered feature's own check (`check_run`: the builder and the
planner use it), and, for the CLI's commands, this machine's limits where the ranks start here (`check_job`)."""

from __future__ import annotations

import os

import torch

from hpc_train.config import ConfigError, check_values, raise_all, validate
from hpc_train.distributed.mesh import ParallelDims
from hpc_train.distributed.pipeline import stage_ids
from hpc_train.job import JobConfig, declared
from hpc_train.models import get_spec
from hpc_train.models.spec import ModelSpec, is_frozen
from hpc_train.optim import optimizer_class


def check_job(
    cfg: JobConfig, world_size: int, starts_here: bool, check_paths: bool = True, world_from: str = ""
) -> ParallelDims:
    """The one check every CLI command that resolves a config runs before it starts or submits anything
    (train, submit and its dry run, doctor, plan, config show, import-hf), so the same bad input gets the same
    error from each. Every key's own rule, the slurm section's included, holds wherever the command runs (a
    config is one document: what a local run records may be submitted later), and then `check_run`'s layout
    for `world_size` (`world_from` names where that came from, in the layout's errors). This machine's limits
    (`check_machine`) apply only where the ranks start here (`starts_here`): train and doctor --local started
    alone, import-hf, and `config show` outside a job, which reports what `train` here would refuse. A
    submitted job runs on the cluster's nodes, `plan` sizes a layout for any machine, and a rank started by
    srun or torchrun was placed by its launcher, so none of them is bound by this machine."""
    raise_all([lambda: check_values(cfg), *([lambda: check_machine(cfg)] if starts_here else [])])
    try:
        return check_run(cfg, world_size, check_paths, here=starts_here)
    except ConfigError as err:
        if not world_from:
            raise
        raise ConfigError(f"{err} (world size = {world_from} = {world_size})") from None


def check_machine(cfg: JobConfig) -> None:
    """A run launched here fits this machine: its device exists and one process per GPU (NCCL's rule), or a
    bounded number of CPU processes (each needs a core's share and its own memory). What a feature needs of
    the machine it checks itself (`check_run`'s `here`)."""
    problems = []
    cuda = cfg.train.device == "cuda" or (cfg.train.device == "auto" and torch.cuda.is_available())
    if cuda and not torch.cuda.is_available():
        problems.append("train.device=cuda but this machine has no CUDA device visible; use train.device=cpu")
    cores = len(os.sched_getaffinity(0))
    if cuda and torch.cuda.is_available():
        limit, what = torch.cuda.device_count(), f"one per GPU ({torch.cuda.device_count()} here)"
    else:
        limit, what = 4 * cores, f"4 per CPU core ({cores} here)"
    if cfg.parallel.nproc > limit:
        problems.append(f"parallel.nproc={cfg.parallel.nproc} local processes exceed {what}; use parallel.nproc <= "
                        f"{limit}, or `hpc-train submit` to run on a cluster")  # fmt: skip
    if problems:
        raise ConfigError("\n".join(problems))


def check_run(cfg: JobConfig, world_size: int, check_paths: bool = True, here: bool = False) -> ParallelDims:
    """Raise a ConfigError naming every problem and its fix; return the mesh's dimensions. `here`: the ranks
    start on this machine (a feature may need something of it: float8 tensor cores)."""
    dp = validate(cfg, world_size, check_paths)
    dims = ParallelDims(pp=cfg.parallel.pp, dp=dp, cp=cfg.parallel.cp, tp=cfg.parallel.tp)
    spec = get_spec(cfg.model.arch)
    checks = [lambda: spec.validate(cfg.model, cfg.parallel.tp), lambda: optimizer_class(cfg.optim)]
    if cfg.train.freeze:
        checks.append(lambda: _check_freeze(cfg, spec))
    raise_all(checks)
    problems = [problem for _, check in declared(cfg, "check", every=True, dims=dims, spec=spec, here=here)
                for problem in check()]  # fmt: skip
    if problems:
        raise ConfigError("\n".join(problems))
    return dims


def _check_freeze(cfg: JobConfig, spec: ModelSpec) -> None:
    """Every train.freeze pattern names a parameter, and every pipeline rank keeps one to train (an
    optimizer needs parameters; a stage with none would only forward what others learn)."""
    freeze, pp, stages = cfg.train.freeze, cfg.parallel.pp, cfg.parallel.pp * cfg.parallel.virtual_stages
    names_by_rank = []
    for pp_rank in range(pp):
        names = []
        for stage in stage_ids(pp_rank, pp, cfg.parallel.virtual_stages):
            with torch.device("meta"):
                chunk = spec.build_stage(cfg.model, stage, stages)
            names += [chunk.canonical_name(name) for name, _ in chunk.named_parameters()]
        names_by_rank.append(names)
    every = [name for names in names_by_rank for name in names]
    for pattern in freeze:
        if not any(is_frozen(name, [pattern]) for name in every):
            raise ConfigError(
                f"train.freeze pattern {pattern!r} matches no parameter of the {spec.name} model "
                f"(e.g. {every[0]!r}, 'layers.0.*'); `hpc-train ckpt inspect` lists a checkpoint's names"
            )
    if all(is_frozen(name, freeze) for name in every):
        raise ConfigError("train.freeze holds every parameter fixed: nothing would train")
    for pp_rank, names in enumerate(names_by_rank):
        if all(is_frozen(name, freeze) for name in names):
            raise ConfigError(
                f"train.freeze holds every parameter of pipeline rank {pp_rank} fixed ({len(names)} parameters): "
                f"unfreeze one there, or use a smaller parallel.pp"
            )
