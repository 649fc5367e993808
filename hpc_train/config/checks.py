"""Checks on a loaded config that omegaconf's types cannot express: each field's own rule (declared beside
it in schema.py), finiteness, paths, and the quantities derived from the parallel layout. Every problem is
reported at once, one line each."""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import unicodedata
from pathlib import Path

from hpc_train.config.schema import BUILTIN_DATA, RANGES, ConfigError, JobConfig


def _get(cfg: JobConfig, key: str):
    """The value of a dotted key (`name`, `optim.lr`)."""
    return functools.reduce(getattr, key.split("."), cfg)


def has_control_chars(value: str) -> bool:
    """A newline (or any control character) would end the line of a script or log the value is written into."""
    return any(unicodedata.category(c) == "Cc" for c in value)


def derive_dp(cfg: JobConfig, world_size: int) -> int:
    """The data-parallel size: world / (tp * pp), checked against `parallel.dp` when that is given."""
    p = cfg.parallel
    model_parallel = p.tp * p.pp
    if world_size % model_parallel:
        raise ConfigError(
            f"world size {world_size} is not divisible by tp x pp = {p.tp} x {p.pp} = {model_parallel}; "
            f"use a world size that is a multiple of {model_parallel} or change parallel.tp / parallel.pp"
        )
    dp = world_size // model_parallel
    if p.dp is not None and p.dp != dp:
        raise ConfigError(
            f"parallel.dp={p.dp} but world size {world_size} / (tp x pp = {model_parallel}) gives dp={dp}; "
            f"set parallel.dp={dp}, leave it out to derive it, or change the number of processes"
        )
    return dp


def _fields(cfg: JobConfig) -> list[tuple[str, dataclasses.Field]]:
    """Every section's fields, by dotted key."""
    return [(f"{section.name}.{f.name}", f) for section in dataclasses.fields(cfg)
            if dataclasses.is_dataclass(getattr(cfg, section.name))
            for f in dataclasses.fields(getattr(cfg, section.name))]  # fmt: skip


def _value_problems(cfg: JobConfig) -> list[str]:
    """Every key's own rule (schema.py, beside the field): choices, signs, fractions; and finiteness. One line
    per problem."""
    fields = _fields(cfg)
    choices = {key: f.metadata["choices"] for key, f in fields if "choices" in f.metadata}
    problems = [f"{key}={_get(cfg, key)!r} is not one of {', '.join(allowed)}"
                for key, allowed in choices.items() if _get(cfg, key) not in allowed]  # fmt: skip
    floats = [key for key, _ in fields if isinstance(_get(cfg, key), float)]
    nonfinite = {key for key in floats if not math.isfinite(_get(cfg, key))}
    problems += [f"{key}={_get(cfg, key)} must be a finite number" for key in floats if key in nonfinite]
    for key, f in fields:
        value = _get(cfg, key)
        if "range" not in f.metadata or value is None or key in nonfinite:
            continue
        ok, rule = RANGES[f.metadata["range"]]
        if not ok(value):
            problems.append(f"{key}={value} must be {rule}{' (or left out)' if f.default is None else ''}")
    if not re.fullmatch(r"[A-Za-z0-9_.\-]+", cfg.name):
        problems.append(f"name={cfg.name!r} may hold only letters, digits, '.', '_' and '-'")
    if not problems and cfg.optim.min_lr > cfg.optim.lr:
        problems.append(f"optim.min_lr={cfg.optim.min_lr} is larger than optim.lr={cfg.optim.lr}")
    if cfg.parallel.max_restarts and not (cfg.checkpoint.interval and cfg.checkpoint.resume):
        problems.append(f"parallel.max_restarts={cfg.parallel.max_restarts} restarts the ranks from the newest "
                        "checkpoint: set checkpoint.interval (e.g. 100) and checkpoint.resume=true, or "
                        "parallel.max_restarts=0")  # fmt: skip
    steps = cfg.logging.profile_steps
    if steps and (len(steps) != 2 or not 1 <= steps[0] <= steps[1]):
        problems.append(f"logging.profile_steps={list(steps)} must be [first, last] steps, e.g. [10, 12]")
    elif steps and steps[0] <= cfg.logging.measure_peak_step <= steps[1]:  # one profiler at a time
        problems.append(f"logging.measure_peak_step={cfg.logging.measure_peak_step} profiles a step inside "
                        f"logging.profile_steps={list(steps)}: pick another step")  # fmt: skip
    for key in (
        "name",
        "run_dir",
        "checkpoint.dir",
        "data.train_path",
        "data.valid_path",
        "data.cache_dir",
        "model.init_from",
    ):
        value = _get(cfg, key)
        if value is not None and has_control_chars(value):
            problems.append(f"{key}={value!r} holds a control character (a newline?); remove it")
    return problems


def check_values(cfg: JobConfig) -> None:
    """Every key's own range, whatever the layout; one ConfigError holding all problems."""
    if problems := _value_problems(cfg):
        raise ConfigError("\n".join(problems))


def validate(cfg: JobConfig, world_size: int, check_paths: bool = True) -> int:
    """Check choices, ranges, paths and the parallel layout; return the data-parallel size. Every problem
    is reported at once, one line each. What depends on the model family or the optimizer is checked with
    them (`layout.check_run` runs everything)."""
    check_values(cfg)  # the layout checks below assume sane values
    m, p, t = cfg.model, cfg.parallel, cfg.train
    dp = 1

    def layout() -> None:
        nonlocal dp
        if m.n_layers % (p.pp * p.virtual_stages):
            raise ConfigError(
                f"model.n_layers={m.n_layers} is not divisible by parallel.pp x parallel.virtual_stages = "
                f"{p.pp} x {p.virtual_stages}; pick a layout whose stage count divides the layers"
            )
        dp = derive_dp(cfg, world_size)
        derived_gbs = t.micro_batch_size * t.grad_accum * dp
        if t.global_batch_size is not None and t.global_batch_size != derived_gbs:
            raise ConfigError(
                f"train.global_batch_size={t.global_batch_size} != micro_batch_size x grad_accum x dp = "
                f"{t.micro_batch_size} x {t.grad_accum} x {dp} = {derived_gbs}; "
                f"set train.grad_accum={t.global_batch_size // (t.micro_batch_size * dp) or 1} or leave "
                "global_batch_size out"
            )

    checks = [layout, lambda: check_pipeline(cfg)]
    if check_paths:
        data_keys = ("data.train_path", "data.valid_path")
        checks += [lambda key=key: check_data_path(key, _get(cfg, key)) for key in data_keys]
    raise_all(checks)
    return dp


def raise_all(checks) -> None:
    """Run every check; raise one ConfigError holding all their messages, one per line."""
    problems = []
    for check in checks:
        try:
            check()
        except ConfigError as err:
            problems.append(str(err))
    if problems:
        raise ConfigError("\n".join(problems))


def check_pipeline(cfg: JobConfig) -> None:
    """Schedules need at least as many micro-batches (train.grad_accum) as pipeline stages."""
    p, ga = cfg.parallel, cfg.train.grad_accum
    if p.schedule == "1f1b" and p.virtual_stages > 1:
        raise ConfigError(
            f"parallel.virtual_stages={p.virtual_stages} needs parallel.schedule=interleaved_1f1b "
            "(1f1b runs one stage per rank)"
        )
    if p.schedule == "interleaved_1f1b" and p.pp > 1 and p.virtual_stages < 2:
        raise ConfigError("parallel.schedule=interleaved_1f1b needs parallel.virtual_stages >= 2")
    if p.pp > 1 and ga < p.pp:
        raise ConfigError(
            f"train.grad_accum={ga} gives {ga} micro-batches per step, fewer than parallel.pp={p.pp} pipeline "
            f"stages; set train.grad_accum >= {p.pp} (more micro-batches also shrink the pipeline bubble)"
        )
    if p.schedule == "interleaved_1f1b" and p.pp > 1 and ga % p.pp:
        raise ConfigError(f"interleaved 1F1B needs train.grad_accum={ga} to be a multiple of parallel.pp={p.pp}")


def check_data_path(key: str, prefix: str | None) -> None:
    if prefix is None or prefix == BUILTIN_DATA:
        return
    for suffix in (".bin", ".idx"):
        if not Path(prefix + suffix).is_file():
            raise ConfigError(
                f"{key}={prefix!r}: '{prefix}{suffix}' does not exist; give the prefix of a dataset made by "
                f"`hpc-train prepare-data`, or {key}={BUILTIN_DATA} for the embedded corpus"
            )
