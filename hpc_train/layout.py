"""The whole check of a run's config for a world size, before any process starts: the schema and the
parallel layout (config.py), the model family's shapes (models/), the optimizer's capabilities (optim/)
and the frozen-parameter patterns. The CLI, the Slurm submit path, the planner and the builder use it."""

from __future__ import annotations

import torch

from hpc_train.config import ConfigError, JobConfig, raise_all, validate
from hpc_train.distributed.mesh import ParallelDims
from hpc_train.distributed.pipeline import stage_ids
from hpc_train.models import get_spec
from hpc_train.models.spec import ModelSpec, is_frozen
from hpc_train.optim import optimizer_class


def check_run(cfg: JobConfig, world_size: int, check_paths: bool = True) -> ParallelDims:
    """Raise a ConfigError naming the problem and the fix; return the mesh's dimensions."""
    dp = validate(cfg, world_size, check_paths)
    spec = get_spec(cfg.model.arch)
    raise_all([lambda: spec.validate(cfg.model, cfg.parallel.tp), lambda: optimizer_class(cfg.optim),
               lambda: _check_zero(cfg, dp)])  # fmt: skip
    if cfg.train.freeze:
        _check_freeze(cfg, spec)
    return ParallelDims(pp=cfg.parallel.pp, dp=dp, tp=cfg.parallel.tp)


def _check_zero(cfg: JobConfig, dp: int) -> None:
    """Options that only one side of ZeRO-3 (FSDP2) has, and what it cannot do yet."""
    o = cfg.optim
    if o.zero_stage == 3:
        if dp == 1:
            raise ConfigError(
                "optim.zero_stage=3 shards over dp, and dp=1 here: use optim.zero_stage=1 (or more ranks)"
            )
        if o.overlap_grad_reduce:
            raise ConfigError("optim.overlap_grad_reduce is for zero stages 0-2 (FSDP2 always reduces in backward): "
                              "drop it with optim.zero_stage=3")  # fmt: skip
        gpu = cfg.train.device == "cuda" or (
            cfg.train.device == "auto" and (torch.cuda.is_available() or bool(cfg.slurm.gpus_per_node))
        )
        if o.offload == "cpu" and gpu:
            raise ConfigError("optim.offload=cpu with optim.zero_stage=3 runs on CPU only for now (its gradient "
                              "norm and loss-scale checks would meet NCCL with host tensors): use "
                              "optim.zero_stage=2 with offload")  # fmt: skip
    elif o.reshard_after_forward is not None:
        raise ConfigError("optim.reshard_after_forward is for optim.zero_stage=3 (FSDP2): drop it")


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
