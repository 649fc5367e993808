"""The whole check of a run's config for a world size, before any process starts: the schema and the
parallel layout (config.py), the model family's shapes (models/), the optimizer's capabilities (optim/)
and the frozen-parameter patterns. The CLI, the Slurm submit path, the planner and the builder use it."""

from __future__ import annotations

import torch

from hpc_train.config import ConfigError, JobConfig, validate
from hpc_train.distributed.mesh import ParallelDims
from hpc_train.distributed.parallelize import is_frozen
from hpc_train.models import get_spec
from hpc_train.optim import optimizer_class


def check_run(cfg: JobConfig, world_size: int, check_paths: bool = True) -> ParallelDims:
    """Raise a ConfigError naming the problem and the fix; return the mesh's dimensions."""
    dp = validate(cfg, world_size, check_paths)
    spec = get_spec(cfg.model.arch)
    spec.validate(cfg.model, cfg.parallel.tp)
    optimizer_class(cfg.optim)
    if cfg.train.freeze:
        with torch.device("meta"):
            model = spec.build_stage(cfg.model)
        names = [name for name, _ in model.named_parameters()]
        for pattern in cfg.train.freeze:
            if not any(is_frozen(name, [pattern]) for name in names):
                raise ConfigError(
                    f"train.freeze pattern {pattern!r} matches no parameter of the {spec.name} model "
                    f"(e.g. {names[0]!r}, 'layers.0.*'); `hpc-train ckpt inspect` lists a checkpoint's names"
                )
        if all(is_frozen(name, cfg.train.freeze) for name in names):
            raise ConfigError("train.freeze holds every parameter fixed: nothing would train")
    return ParallelDims(pp=cfg.parallel.pp, dp=dp, tp=cfg.parallel.tp)
