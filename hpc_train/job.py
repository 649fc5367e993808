"""The registry: every feature of hpc_train (features/), one line each, in the order their transforms run on a
pipeline stage, and what composing them gives: the schema a run loads (the core sections with every
feature's keys mixed in, config/compose.py) and each feature's declared functions bound to a config's
sections. A new feature is a folder under features/ and one line in `FEATURES`; the layout check, the
planner and the builder (and through it parallelize, the step and the loop) loop over what this returns and
name no feature."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

from hpc_train.config import compose
from hpc_train.config import load_config as load_schema
from hpc_train.features import (
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

FEATURES: tuple[Feature, ...] = (
    float8.FEATURE,  # train.fp8: the block projections become Float8Linear, which tp then shards
    tensor_parallel.FEATURE,  # tp and sequence parallelism (or the family's own parallelize hook)
    context_parallel.FEATURE,  # the sequence split over cp: positions and the attention exchange
    moe.FEATURE,  # routed experts sharded over ep (carved from dp); the layers' statistics and bias update
    recompute.FEATURE,
    lora.FEATURE,  # adapters placed like their tp-sharded base
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
