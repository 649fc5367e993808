"""Configuration: the core schema (schema.py: one dataclass per section, each field's rule beside it, fields.py),
its composition with the keys every registered feature declares (compose.py; the registry, hpc_train/job.py,
composes the schema a run loads), loading YAML (a path, or a preset by name) + `key=value` overrides over a
schema (load.py), and the checks omegaconf cannot express (checks.py). Every error is a `ConfigError` naming
the key and the fix, one line per problem; a `LayoutError` is one that the world size decides."""

from hpc_train.config.checks import (
    check_values,
    derive_dp,
    expand_on_node,
    has_control_chars,
    raise_all,
    time_limit_minutes,
    validate,
)
from hpc_train.config.compose import compose
from hpc_train.config.fields import ConfigError, LayoutError, choice, fraction, non_negative, positive
from hpc_train.config.load import config_path, load_config, parse_overrides, to_yaml
from hpc_train.config.schema import (
    BUILTIN_DATA,
    MEMORY_DIR,
    CheckpointConfig,
    DataConfig,
    DataSource,
    EvalConfig,
    JobConfig,
    LoggingConfig,
    ModelConfig,
    MoEConfig,
    OptimConfig,
    ParallelConfig,
    SlurmConfig,
    TrainConfig,
)

__all__ = [
    "BUILTIN_DATA", "MEMORY_DIR", "CheckpointConfig", "ConfigError", "DataConfig", "DataSource", "EvalConfig",
    "JobConfig", "LayoutError", "LoggingConfig", "ModelConfig", "MoEConfig", "OptimConfig", "ParallelConfig",
    "SlurmConfig", "TrainConfig", "check_values", "choice", "compose", "config_path", "expand_on_node", "fraction",
    "non_negative", "positive", "derive_dp", "has_control_chars", "load_config", "parse_overrides", "raise_all",
    "time_limit_minutes", "to_yaml", "validate",
]  # fmt: skip
