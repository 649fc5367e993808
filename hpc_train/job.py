"""The job: every feature of hpc_train (features/), registered one line each in the order their transforms
run on a pipeline stage, and what composing them gives: the schema a run loads (the core sections with
every feature's keys mixed in, config/compose.py), each feature's declared functions bound to a config's
sections (`declared`), and the whole check of a config for a world size before any process starts
(`check_run`). A new feature is a folder under features/ and one line in `FEATURES`; the check here, the
planner and the builder (and through it parallelize, the step and the loop) loop over what `declared`
returns and name no feature."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

import torch

from hpc_train.config import ConfigError, compose, raise_all, validate
from hpc_train.config import load_config as load_schema
from hpc_train.distributed.mesh import ParallelDims
from hpc_train.distributed.pipeline import SCHEDULES, schedule_class, stage_ids
from hpc_train.features import (
    activation_offload,
    context_parallel,
    float8,
    fsdp,
    lora,
    moe,
    recompute,
    regional_compile,
    tensor_parallel,
)
from hpc_train.features.feature import Feature, bind
from hpc_train.models import get_spec
from hpc_train.models.spec import ModelSpec, is_frozen
from hpc_train.optim import optimizer_class

FEATURES: tuple[Feature, ...] = (
    float8.FEATURE,  # train.fp8: the block projections become Float8Linear, which tp then shards
    tensor_parallel.FEATURE,  # tp and sequence parallelism (or the family's own parallelize hook)
    context_parallel.FEATURE,  # the sequence split over cp: positions and the attention exchange
    moe.FEATURE,  # routed experts sharded over ep (carved from dp); the layers' statistics and bias update
    recompute.FEATURE,
    lora.FEATURE,  # adapters placed like their tp-sharded base
    activation_offload.FEATURE,  # the blocks that keep what they save run under the offload hooks
    regional_compile.FEATURE,  # train.compile, on the eager, sharded blocks
    fsdp.FEATURE,  # ZeRO-3: wraps the result
)

JobConfig = compose([(section, cls) for f in FEATURES for section, cls in f.options.items()], __name__)


def load_config(
    path: str | os.PathLike | None = None, overrides: list[str] | None = None, saved: str | None = None
) -> JobConfig:
    """Defaults <- YAML file (or `saved`, the YAML a checkpoint recorded) <- `key=value` overrides, in the
    schema with every registered feature's keys (config/load.py)."""
    return load_schema(path, overrides, saved, schema=JobConfig)


def sections(cfg: Any) -> dict[str, Any]:
    """A config's sections by name: what the features' functions read."""
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}


def block_policy(cfg: Any) -> Callable[[int], str]:
    """The recompute choice (none, selective, full) of a pipeline stage's i-th block: what a feature that is
    on says (recompute), else none. Features that act on whole blocks read it (`block_policy`)."""
    policies = [policy() for _, policy in declared(cfg, "block_policy")]
    return policies[0] if policies else _no_recompute


def _no_recompute(index_in_stage: int) -> str:
    return "none"


def declared(cfg: Any, part: str, *, every: bool = False, **given: Any) -> list[tuple[str, Callable]]:
    """(feature name, its `part`) for every feature that declares one and is on for `cfg` (or, with `every`,
    registered: checks look at a feature's keys when it is off too), bound to `cfg`'s sections and `given`
    (`dims`, `spec`...); what is left open are the function's positional arguments."""
    available = {**sections(cfg), **given}
    out = []
    for feature in FEATURES:
        fn = getattr(feature, part)
        if fn is None or not (every or bind(feature.enabled, available, f"{feature.name}.enabled")()):
            continue
        out.append((feature.name, bind(fn, available, f"{feature.name}.{part}")))
    return out


def check_run(cfg: JobConfig, world_size: int, check_paths: bool = True, here: bool = False) -> ParallelDims:
    """Raise a ConfigError naming every problem and its fix; return the mesh's dimensions: the schema and the
    parallel layout (config/checks.py), the model family's shapes (models/), the optimizer's capabilities
    (optim/), the frozen-parameter patterns, then every registered feature's own check. `here`: the ranks
    start on this machine (a feature may need something of it: float8 tensor cores)."""
    dp = validate(cfg, world_size, check_paths)
    dims = ParallelDims(pp=cfg.parallel.pp, dp=dp, cp=cfg.parallel.cp, tp=cfg.parallel.tp)
    spec = get_spec(cfg.model.arch)
    checks = [lambda: spec.validate(cfg.model, cfg.parallel.tp), lambda: optimizer_class(cfg.optim)]
    if cfg.train.freeze:
        checks.append(lambda: _check_freeze(cfg, spec))
    if cfg.parallel.pp > 1 and cfg.parallel.schedule not in ("1f1b", "interleaved_1f1b"):
        checks.append(lambda: _check_schedule_in_torch(cfg.parallel.schedule))
    raise_all(checks)
    given = {"dims": dims, "spec": spec, "here": here, "block_policy": block_policy(cfg)}
    problems = [problem for _, check in declared(cfg, "check", every=True, **given) for problem in check()]
    if problems:
        raise ConfigError("\n".join(problems))
    return dims


def _check_schedule_in_torch(schedule: str) -> None:
    """The newer schedules came with later torch releases than the one pyproject.toml asks for."""
    try:
        schedule_class(schedule)
    except AttributeError:
        raise ConfigError(
            f"parallel.schedule={schedule} needs torch.distributed.pipelining's {SCHEDULES[schedule]}, which torch "
            f"{torch.__version__} does not have: upgrade torch, or use parallel.schedule=interleaved_1f1b"
        ) from None


def _check_freeze(cfg: JobConfig, spec: ModelSpec) -> None:
    """Every train.freeze pattern names a parameter, and every pipeline rank keeps one to train (an
    optimizer needs parameters; a stage with none would only forward what others learn)."""
    freeze, pp, stages = cfg.train.freeze, cfg.parallel.pp, cfg.parallel.pp * cfg.parallel.virtual_stages
    names_by_rank = []
    for pp_rank in range(pp):
        names = []
        for stage in stage_ids(pp_rank, pp, cfg.parallel.virtual_stages, cfg.parallel.schedule):
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
